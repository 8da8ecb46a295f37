"""Each Step-3.5 model feature against an independent computation written here from
docs/architecture.md §2.2-§2.10: explicit loops in float64, never a call
to the step35 function under test for the reference side.

Tolerances: fp32 results against float64 hand computations use atol/rtol 1e-5 (inputs O(1),
accumulations over <= a few hundred terms); bf16 tolerances are stated where used.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from step35.config import preset
from step35.kernels.attention import attention
from step35.kernels.grouped_gemm import grouped_mm
from step35.kernels.masks import causal_mask
from step35.model import DecoderLayer, Step35ForCausalLM
from step35.model.attention import Attention
from step35.model.mlp import SwiGLU, clamped_swiglu
from step35.model.moe import MoE
from step35.model.norm import RMSNorm
from step35.model.rope import apply_rotary, inverse_frequencies, rotary_cos_sin
from tests.helpers import hand_inv_freq, randomize_, tiny_config, tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 vs float64 reference


# =================================================================================== hand math
def hand_rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Spec 2.2, float64: x * rsqrt(mean(x^2) + eps) * (1 + w) over the last dim."""
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w.double())


def hand_cos_sin(seq: int, inv: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, r] cos/sin tables in the layout Attention.forward takes (each frequency for both halves)."""
    ang = torch.tensor([[p * f for f in inv] for p in range(seq)], dtype=torch.float64)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def hand_rope(x: torch.Tensor, inv: list[float]) -> torch.Tensor:
    """x [B, H, S, D] float64; rotate dims 0..r-1 pairing i with i + r/2; positions 0..S-1."""
    r = 2 * len(inv)
    out = x.double().clone()
    for p in range(x.shape[2]):
        for i in range(r // 2):
            c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
            a, b = x[:, :, p, i].double(), x[:, :, p, i + r // 2].double()
            out[:, :, p, i] = a * c - b * s
            out[:, :, p, i + r // 2] = b * c + a * s
    return out


def hand_attention(q, k, v, window: int | None, scale: float) -> torch.Tensor:
    """Per-query softmax loop. q [B, Hq, S, D], k/v [B, Hkv, S, D]; query i sees keys
    max(0, i - window + 1) .. i; query head h reads KV head h // (Hq / Hkv)."""
    B, Hq, S, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(B, Hq, S, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // group
            for i in range(S):
                lo = 0 if window is None else max(0, i - window + 1)
                keys = k[b, kv, lo : i + 1].double()
                scores = keys @ q[b, h, i].double() * scale
                p = torch.softmax(scores, dim=0)
                out[b, h, i] = p @ v[b, kv, lo : i + 1].double()
    return out


def hand_swiglu(x, w_gate, w_up, w_down, limit: float) -> torch.Tensor:
    """Spec 2.7/2.8: W_down(min(SiLU(W_g x), L) * clip(W_u x, -L, L)); L == 0 is no clamp."""
    g = x.double() @ w_gate.double().T
    u = x.double() @ w_up.double().T
    act = g / (1 + torch.exp(-g))
    if limit:
        act = torch.minimum(act, torch.tensor(limit, dtype=torch.float64))
        u = torch.clamp(u, -limit, limit)
    return (act * u) @ w_down.double().T


def hand_route(x_t: torch.Tensor, w_router: torch.Tensor, bias, top_k: int, scale: float):
    """Spec 2.9 for one token: ids chosen by score + bias, weights from unbiased scores renormalised x scale."""
    s = torch.sigmoid(w_router.double() @ x_t.double())
    choice = s + (bias.double() if bias is not None else 0)
    ids = sorted(range(len(s)), key=lambda e: -float(choice[e].detach()))[:top_k]
    w = torch.stack([s[e] for e in ids])
    w = w / (w.sum() + 1e-20) * scale
    return ids, w


def hand_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Explicit per-token loop over the chosen experts. x [T, H] -> [T, H] float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        ids, w = hand_route(x[t], moe.gate.weight, moe.router_bias, moe.top_k, moe.scaling_factor)
        for e, we in zip(ids, w):
            out[t] += (
                we
                * hand_swiglu(
                    x[t : t + 1], moe.gate_proj.weight[e], moe.up_proj.weight[e], moe.down_proj.weight[e], moe.limit
                )[0]
            )
    return out


def hand_attention_module(attn: Attention, x: torch.Tensor, inv: list[float]) -> torch.Tensor:
    """Spec 2.4 steps 1-6 in float64 from the module's weights."""
    B, S, _ = x.shape
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    x64 = x.double()
    q = (x64 @ attn.q_proj.weight.double().T).view(B, S, Hq, D)
    k = (x64 @ attn.k_proj.weight.double().T).view(B, S, Hkv, D)
    v = (x64 @ attn.v_proj.weight.double().T).view(B, S, Hkv, D)
    q, k = hand_rms(q, attn.q_norm.weight), hand_rms(k, attn.k_norm.weight)  # before RoPE
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = hand_rope(q, inv), hand_rope(k, inv)
    o = hand_attention(q, k, v, attn.window, D**-0.5)  # [B, Hq, S, D]
    gate = torch.sigmoid(x64 @ attn.g_proj.weight.double().T)  # [B, S, Hq]: one scalar per head
    o = o.transpose(1, 2) * gate[..., None]
    return o.reshape(B, S, Hq * D) @ attn.o_proj.weight.double().T


# =================================================================================== RoPE
SPEC_MULTIPLIERS = [1.0] * 14 + [0.878, 0.728, 0.634, 0.577, 0.541, 0.519, 0.506] + [0.5] * 11


def test_llama3_inv_freq_of_release_full_layer_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = preset("flash-196b")
    with torch.device("meta"):
        model = Step35ForCausalLM(cfg, num_mtp_layers=0)
    key = model.model.rope_keys[0]  # layer 0: full attention
    ours = model.model._inv_freq[key].double()
    assert ours.device.type == "cpu" and ours.shape == (32,)

    hf_cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=64,
        head_dim=128,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e6,
            "partial_rotary_factor": 0.5,
            **{k: v for k, v in cfg.rope_scaling.items() if k != "rope_type"},
        },
    )
    hf_inv, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert attention_factor == 1.0 and hf_inv.shape == (32,)
    torch.testing.assert_close(ours, hf_inv.double(), rtol=1e-6, atol=0)  # HF computes in fp32: ~1 ulp

    base = torch.tensor([5e6 ** (-2 * j / 64) for j in range(32)], dtype=torch.float64)
    multipliers = (ours / base).tolist()
    # "to 3 decimals": within 1e-3 of the list in docs/architecture.md §2.5 (exact j=14 value 0.87845...;
    # the others round exactly).
    assert all(abs(m - want) <= 1e-3 for m, want in zip(multipliers, SPEC_MULTIPLIERS, strict=True)), multipliers
    assert [round(m, 3) for m in multipliers[15:21]] == SPEC_MULTIPLIERS[15:21]
    assert all(abs(m - 1.0) < 1e-6 for m in multipliers[:14])  # fp32 values / fp64 base
    assert all(abs(m - 0.5) < 1e-6 for m in multipliers[21:])
    # Same for every full layer of the release; the MTP layers and sliding layers are plain 1e4.
    for i in range(45):
        spec = cfg.layer(i)
        got = model.model._inv_freq[model.model.rope_keys[i]].double()
        want = hand_inv_freq(spec.rotary_dim, spec.rope_theta, cfg.rope_scaling if i % 4 == 0 else None)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
        assert len(want) == (32 if i % 4 == 0 else 64)


def test_rope_scaling_switch_off():
    cfg = tiny_config(rope_scaling=None)
    model = Step35ForCausalLM(cfg)
    for i, key in enumerate(model.model.rope_keys):
        spec = cfg.layer(i)
        want = torch.tensor(hand_inv_freq(spec.rotary_dim, spec.rope_theta, None), dtype=torch.float64)
        torch.testing.assert_close(model.model._inv_freq[key].double(), want, rtol=1e-6, atol=0)
    # And switched on (the tiny preset), full layers are scaled.
    cfg = tiny_config()
    model = Step35ForCausalLM(cfg)
    full = model.model._inv_freq[model.model.rope_keys[0]].double()
    want = torch.tensor(hand_inv_freq(16, 5e6, cfg.rope_scaling), dtype=torch.float64)
    torch.testing.assert_close(full, want, rtol=1e-6, atol=0)
    assert not torch.allclose(full, torch.tensor(hand_inv_freq(16, 5e6, None), dtype=torch.float64))


@pytest.mark.parametrize("rotary_dim", [16, 32])
def test_rotate_half_partial_rope(rotary_dim):
    torch.manual_seed(0)
    D, S = 32, 7
    x = torch.randn(2, 3, S, D)
    inv = hand_inv_freq(rotary_dim, 10000.0, None)
    cos, sin = rotary_cos_sin(torch.arange(S), inverse_frequencies(rotary_dim, 10000.0))
    out = apply_rotary(x, cos, sin)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), hand_rope(x, inv), **TOL)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # pass-through dims untouched
    # bf16 input: rotated in fp32, cast back (tolerance: one bf16 rounding, 2^-8 relative).
    out16 = apply_rotary(x.bfloat16(), cos, sin)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), hand_rope(x.bfloat16(), inv), atol=1e-2, rtol=2**-8)


# =================================================================================== attention
@pytest.mark.parametrize("seq,window", [(1, 1), (7, 1), (7, 3), (20, 5), (20, 20), (20, 64), (600, 512)])
def test_sliding_window_mask_bruteforce(seq, window):
    mask = causal_mask(seq, window)
    brute = [[(i - window < j <= i) for j in range(seq)] for i in range(seq)]
    assert mask.dtype == torch.bool and mask.tolist() == brute
    # Row i sees min(i + 1, window) keys, itself included.
    assert mask.sum(1).tolist() == [min(i + 1, window) for i in range(seq)]


def test_release_window_is_512_keys_including_query():
    mask = causal_mask(700, 512)
    i = 650
    assert mask[i, i] and mask[i, i - 511] and not mask[i, i - 512] and not mask[i, i + 1]


@pytest.mark.parametrize("seq,window", [(12, 4), (12, 1), (12, None), (12, 12), (12, 20), (9, 3)])
def test_attention_kernel_vs_bruteforce(seq, window):
    torch.manual_seed(1)
    B, Hq, Hkv, D = 2, 6, 2, 8
    q, k, v = torch.randn(B, Hq, seq, D), torch.randn(B, Hkv, seq, D), torch.randn(B, Hkv, seq, D)
    out = attention(q, k, v, window, scale=D**-0.5)
    torch.testing.assert_close(out.double(), hand_attention(q, k, v, window, D**-0.5), **TOL)


@pytest.mark.parametrize("window", [None, 3])
def test_gqa_head_mapping(window):
    # Each KV head carries a constant value vector (its index + 1): the output of query head h is
    # exactly that of KV head h // (Hq / Hkv). With Hq=6, Hkv=3: [0,0,1,1,2,2] (not h % Hkv).
    torch.manual_seed(2)
    B, Hq, Hkv, S, D = 1, 6, 3, 8, 4
    q, k = torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D)
    v = torch.arange(1.0, Hkv + 1)[None, :, None, None].expand(B, Hkv, S, D).contiguous()
    out = attention(q, k, v, window, scale=D**-0.5)
    for h in range(Hq):
        torch.testing.assert_close(out[0, h], torch.full((S, D), float(h // 2 + 1)), **TOL)


@pytest.mark.parametrize("layer_id,window", [(0, None), (1, 4), (1, 64)])
def test_attention_module_with_head_gate(layer_id, window):
    # Gated GQA attention, per-head q/k norm before partial RoPE (layer 0: full, 4/2 heads, 16 of
    # 32 dims rotate, llama3 inv freqs; layer 1: sliding, 6/2 heads, all 32 dims).
    cfg = tiny_config()
    spec = cfg.layer(layer_id)

    def attention_module(use_gate: bool) -> Attention:
        return Attention(
            cfg.hidden_size,
            spec,
            sliding_window=window or cfg.sliding_window,
            use_qk_norm=True,
            use_gate=use_gate,
            eps=1e-5,
            zero_centered=True,
        )

    torch.manual_seed(3)
    attn = attention_module(use_gate=True)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.rand(p.shape) - 0.5 if "norm" in name else torch.randn(p.shape) * 0.1)
    B, S = 2, 10
    x = torch.randn(B, S, cfg.hidden_size)
    inv = hand_inv_freq(spec.rotary_dim, spec.rope_theta, cfg.rope_scaling if spec.rope_scaled else None)
    cos, sin = hand_cos_sin(S, inv)
    out = attn(x, cos, sin)
    want = hand_attention_module(attn, x, inv)
    torch.testing.assert_close(out.double(), want, **TOL)
    # The gate matters: without it the result is different.
    ungated = attention_module(use_gate=False)
    ungated.load_state_dict({k: v for k, v in attn.state_dict().items() if "g_proj" not in k})
    assert not torch.allclose(ungated(x, cos, sin), out, atol=1e-3)


# =================================================================================== norm
def test_zero_centred_norm_fp32():
    torch.manual_seed(4)
    norm = RMSNorm(64, eps=1e-5, zero_centered=True)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) - 0.5)
    x = torch.randn(3, 5, 64) * 3
    torch.testing.assert_close(norm(x).double(), hand_rms(x, norm.weight), **TOL)
    # Stored w = 0 is the identity scale (1 + 0), not a zero output.
    with torch.no_grad():
        norm.weight.zero_()
    torch.testing.assert_close(norm(x).double(), hand_rms(x, torch.zeros(64)), **TOL)
    assert norm(x).abs().mean() > 0.5


def test_norm_computed_in_fp32_for_low_precision_input():
    # fp16 input whose squares overflow fp16 (500^2 > 65504): an fp16 computation gives 0 or nan.
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.zero_()
    x = torch.full((2, 8), 500.0, dtype=torch.float16)
    y = norm(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), torch.ones(2, 8), atol=1e-3, rtol=0)

    # bf16 input and bf16 weight w = 2^-8: (1 + w) in bf16 rounds to 1.0, in fp32 it is 1.00390625.
    # The output must be the fp64 value rounded once to bf16 (allow 1 bf16 ulp, and exact in >= 99%).
    torch.manual_seed(5)
    norm = RMSNorm(4096).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(2**-8)
    x = torch.randn(4, 4096).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    want = hand_rms(x, norm.weight)
    assert ((y.double() - want).abs() <= 2**-7 * want.abs() + 1e-30).all()
    exact = (y == want.to(torch.bfloat16)).double().mean()
    assert exact >= 0.99, exact


# =================================================================================== SwiGLU clamp
@pytest.mark.parametrize("limit", [0.0, 0.1, 7.0])
def test_clamped_swiglu_formula(limit):
    gate = torch.linspace(-20, 20, 401)
    up = torch.linspace(-30, 30, 401).flip(0)
    out = clamped_swiglu(gate, up, limit)
    g, u = gate.double(), up.double()
    act = g / (1 + torch.exp(-g))
    if limit:
        act = torch.minimum(act, torch.tensor(limit, dtype=torch.float64))
        u = u.clamp(-limit, limit)
    torch.testing.assert_close(out.double(), act * u, **TOL)


def test_clamp_bites_and_silu_not_clamped_below():
    # SiLU(-1) = -0.2689 stays below -L = -0.1 (only an upper clamp on the SiLU output).
    out = clamped_swiglu(torch.tensor([-1.0, 5.0, 5.0]), torch.tensor([0.05, 0.05, -3.0]), 0.1)
    silu_m1 = -1.0 / (1 + math.exp(1.0))
    torch.testing.assert_close(out, torch.tensor([silu_m1 * 0.05, 0.1 * 0.05, 0.1 * -0.1]), **TOL)
    # L = 0 means off.
    torch.testing.assert_close(
        clamped_swiglu(torch.tensor([50.0]), torch.tensor([40.0]), 0.0), torch.tensor([50.0 * 40.0]), **TOL
    )


@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_swiglu_module(limit):
    torch.manual_seed(6)
    mlp = SwiGLU(16, 24, limit=limit)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape))
    x = torch.randn(5, 16)
    want = hand_swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, limit)
    torch.testing.assert_close(mlp(x).double(), want, **TOL)


# =================================================================================== router / MoE
def _moe(hidden=16, experts=8, top_k=2, inter=12, limit=0.0, seed=7, std=0.5):
    torch.manual_seed(seed)
    moe = MoE(hidden, experts, top_k, inter, limit=limit, scaling_factor=3.0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * std)
        moe.router_bias.copy_(torch.randn(experts) * 0.3)
    return moe


def test_router_bias_selects_but_weights_are_unbiased():
    moe = _moe(hidden=8, experts=6, top_k=2)
    torch.manual_seed(8)
    x = torch.randn(4, 8)
    scores = torch.sigmoid(x.double() @ moe.gate.weight.double().T)
    lowest = int(scores[0].argmin())
    with torch.no_grad():
        moe.router_bias.zero_()
        moe.router_bias[lowest] = 10.0  # forces the lowest-scored expert of token 0 into its top-2
    got_scores, ids, weights = moe.route(x)
    assert got_scores.dtype == torch.float32 and weights.dtype == torch.float32
    torch.testing.assert_close(got_scores.double(), scores, **TOL)
    for t in range(4):
        want_ids, want_w = hand_route(x[t], moe.gate.weight, moe.router_bias, 2, 3.0)
        order = sorted(range(2), key=lambda k: int(ids[t, k]))
        want_order = sorted(range(2), key=lambda k: want_ids[k])
        assert [int(ids[t, k]) for k in order] == [want_ids[k] for k in want_order]
        torch.testing.assert_close(weights[t, order].double(), want_w[want_order], **TOL)
        torch.testing.assert_close(weights[t].sum().double(), torch.tensor(3.0, dtype=torch.float64), **TOL)
    # The bias changed token 0's set: without it the lowest expert is not chosen.
    assert lowest in ids[0].tolist()
    assert lowest not in torch.topk(scores[0], 2).indices.tolist()
    # Its weight is its own small unbiased score, renormalised (not score + 10).
    k = ids[0].tolist().index(lowest)
    other = ids[0, 1 - k]
    want = 3.0 * scores[0, lowest] / (scores[0, lowest] + scores[0, other])
    torch.testing.assert_close(weights[0, k].double(), want, **TOL)


def test_router_runs_in_fp32_for_bf16_input():
    moe = _moe().to(torch.bfloat16)
    assert moe.router_bias.dtype == torch.float32
    x = torch.randn(5, 16).bfloat16()
    scores, ids, weights = moe.route(x)
    assert scores.dtype == torch.float32 and weights.dtype == torch.float32
    want = torch.sigmoid(x.double() @ moe.gate.weight.double().T)  # bf16 values, fp64 math
    torch.testing.assert_close(scores.double(), want, atol=1e-6, rtol=1e-6)  # fp32 matmul of bf16 values


@pytest.mark.parametrize("hidden,limit", [(16, 0.0), (16, 0.3), (10, 0.3)])  # 10: unaligned -> segment path
def test_moe_forward_and_backward_vs_token_loop(hidden, limit):
    moe = _moe(hidden=hidden, limit=limit)
    torch.manual_seed(9)
    x = torch.randn(2, 5, hidden, requires_grad=True)
    out = moe(x)
    assert out.shape == x.shape
    want = hand_moe(moe, x.detach().reshape(-1, hidden)).view(2, 5, hidden)
    torch.testing.assert_close(out.double(), want, **TOL)
    if limit:  # the clamp bites for some routed rows
        up = x.detach().reshape(-1, hidden).double() @ moe.up_proj.weight.double()[0].T
        assert (up.abs() > limit).any()
    # Backward against autograd through the float64 loop (same routing: the choice is discrete).
    g_out = torch.randn_like(out)
    (out * g_out).sum().backward()
    ref = MoE(hidden, 8, 2, 12, limit=limit).double()
    ref.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in moe.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    (hand_moe(ref, x64.reshape(-1, hidden)).view(2, 5, hidden) * g_out.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL)
    for name in ("gate.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        got = dict(moe.named_parameters())[name].grad
        torch.testing.assert_close(got.double(), dict(ref.named_parameters())[name].grad, **TOL)


def test_moe_decoder_layer_adds_shared_expert():
    # Tiny layer 4: MoE with routed clamp 7 and shared clamp 16; FFN = sum_k w_k E_k(x) + Shared(x).
    cfg = tiny_config()
    spec = cfg.layer(4)
    assert spec.is_moe and spec.swiglu_limit == 7.0 and spec.swiglu_limit_shared == 16.0
    layer = DecoderLayer(cfg, spec)
    randomize_(layer, seed=10, std=0.2)
    torch.manual_seed(10)
    h = torch.randn(1, 6, cfg.hidden_size)
    cos, sin = hand_cos_sin(6, hand_inv_freq(spec.rotary_dim, spec.rope_theta, cfg.rope_scaling))
    out = layer(h, cos, sin)
    with torch.no_grad():
        h1 = h.double() + layer.self_attn(layer.input_layernorm(h), cos, sin).double()
        x = hand_rms(h1, layer.post_attention_layernorm.weight)
        se = layer.share_expert
        ffn = hand_moe(layer.moe, x.view(-1, cfg.hidden_size).float()).view_as(x) + hand_swiglu(
            x, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, 16.0
        )
    torch.testing.assert_close(out.double(), h1 + ffn, **TOL)


# =================================================================================== grouped GEMM
@pytest.mark.parametrize(
    "in_dim,counts", [(16, [3, 0, 7]), (16, [0, 4, 6]), (16, [5, 5, 0]), (5, [3, 0, 7]), (5, [2, 6, 2])]
)
def test_grouped_mm_forward_backward(in_dim, counts, monkeypatch):
    out_dim = 8 if in_dim == 16 else 7
    aligned = in_dim == 16
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    torch.manual_seed(11)
    n = sum(counts)
    x = torch.randn(n, in_dim, requires_grad=True)
    w = torch.randn(len(counts), out_dim, in_dim, requires_grad=True)
    y = grouped_mm(x, w, torch.tensor(counts))
    assert bool(calls) == aligned  # aligned shapes take torch._grouped_mm, others the segment loop
    assert y.shape == (n, out_dim)
    # Per-expert loop reference in float64 with autograd.
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rows, start = [], 0
    for g, c in enumerate(counts):
        rows.append(x64[start : start + c] @ w64[g].T)
        start += c
    ref = torch.cat(rows)
    torch.testing.assert_close(y.double(), ref, **TOL)
    g_out = torch.randn(n, out_dim)
    (y * g_out).sum().backward()
    (ref * g_out.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL)
    torch.testing.assert_close(w.grad.double(), w64.grad, **TOL)


# =================================================================================== token counts
def _capture_moe_inputs(model):
    seen = {}
    hooks = [
        layer.moe.register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(i, []).append(args[0].detach()))
        for i, layer in enumerate(model.model.main_layers)
        if layer.spec.is_moe
    ]
    return seen, hooks


def test_tokens_per_expert_training_counts():
    model = tiny_model(seed=12).train()
    ids = torch.randint(0, 1024, (2, 10))
    seen, hooks = _capture_moe_inputs(model)
    model(ids)
    for h in hooks:
        h.remove()
    moe_layers = {i: l for i, l in enumerate(model.model.main_layers) if l.spec.is_moe}
    assert len(moe_layers) == 4
    top_k = model.config.moe_top_k
    for i, layer in moe_layers.items():
        counts = layer.moe.tokens_per_expert
        assert counts.dtype == torch.int64 and int(counts.sum()) == 2 * 10 * top_k
        x = seen[i][0].reshape(-1, model.config.hidden_size)
        want = torch.zeros(model.config.moe_num_experts, dtype=torch.int64)
        for t in range(x.shape[0]):
            for e in hand_route(x[t], layer.moe.gate.weight, layer.moe.router_bias, top_k, 3.0)[0]:
                want[e] += 1
        assert torch.equal(counts, want)
    model(ids)  # accumulates until a reader resets
    for layer in moe_layers.values():
        assert int(layer.moe.tokens_per_expert.sum()) == 2 * 2 * 10 * top_k


def test_tokens_per_expert_not_counted_in_eval():
    model = tiny_model(seed=13).eval()
    with torch.no_grad():
        model(torch.randint(0, 1024, (2, 10)))
    model(torch.randint(0, 1024, (1, 7)))  # eval with autograd on: still not counted
    for layer in model.model.main_layers:
        if layer.spec.is_moe:
            assert int(layer.moe.tokens_per_expert.sum()) == 0


def test_tokens_per_expert_counted_once_under_activation_checkpointing():
    model = tiny_model(seed=14).train()
    layer = model.model.layers[1]
    assert layer.spec.is_moe
    calls = []
    hook = layer.moe.register_forward_hook(lambda *a: calls.append(1))
    S = 9
    h = model.model.embed_tokens(torch.randint(0, 1024, (2, S))).detach().requires_grad_()
    cos, sin = model.model.rotary_tables(S, h.device)[model.model.rope_keys[1]]
    out = checkpoint(layer, h, cos, sin, use_reentrant=False)
    assert int(layer.moe.tokens_per_expert.sum()) == 2 * S * 2
    out.pow(2).sum().backward()
    hook.remove()
    assert len(calls) == 2  # the MoE forward really ran again in the backward (recompute)
    assert int(layer.moe.tokens_per_expert.sum()) == 2 * S * 2  # but was counted once
    assert layer.moe.gate_proj.weight.grad is not None and h.grad is not None


# =================================================================================== causality
def test_causality_across_the_sliding_window_edge():
    model = tiny_model(seed=15).eval()
    assert model.config.sliding_window == 64
    S = 150
    torch.manual_seed(15)
    ids = torch.randint(0, 1024, (1, S))
    with torch.no_grad():
        base = model(ids)
        for t in (0, 30, 62, 63, 64, 100, 147, 148):
            changed = ids.clone()
            changed[0, t + 1] = (ids[0, t + 1] + 1) % 1024
            logits = model(changed)
            # atol 1e-5: the grouped GEMM may regroup rows when routing of token t+1 changes.
            torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(logits[:, t + 1], base[:, t + 1], atol=1e-3)


# =================================================================================== MTP
def _labels(ids: torch.Tensor, masked=()) -> torch.Tensor:
    """Next-token labels: labels[t] = ids[t + 1]; -100 at the end and at `masked` positions."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    for t in masked:
        labels[:, t] = -100
    return labels


def test_mtp_weight_zero_is_lm_loss_and_skips_mtp():
    model = tiny_model(seed=16)
    torch.manual_seed(16)
    ids = torch.randint(0, 1024, (2, 20))
    labels = _labels(ids, masked=(3, 4))
    calls = []
    hook = model.model.mtp_layers[0].register_forward_hook(lambda *a: calls.append(1))
    out = model.loss(ids, labels, mtp_loss_weight=0.0, loss_chunk_size=7)
    hook.remove()
    assert calls == [] and out.mtp_losses == []
    assert torch.equal(out.loss, out.lm_loss)
    logits = model(ids)
    want = F.cross_entropy(logits.double().reshape(-1, 1024), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.lm_loss.double(), want, **TOL)
    assert int(out.num_tokens) == 2 * (20 - 1 - 2)


def _two_mtp_overrides() -> dict:
    raw = tiny_config().to_dict()
    return dict(
        num_nextn_predict_layers=2,
        **{
            k: raw[k] + raw[k][-1:]
            for k in ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared")
        },
    )


@pytest.mark.parametrize("two_layers", [False, True], ids=["depth1", "depth1+2"])
def test_mtp_loss_matches_hand_computation(two_layers):
    model = tiny_model(seed=17, **(_two_mtp_overrides() if two_layers else {}))
    cfg = model.config
    torch.manual_seed(17)
    B, S = 2, 24
    ids = torch.randint(0, 1024, (B, S))
    labels = _labels(ids, masked=(5,))  # a masked label: MTP still reads the token itself
    weight = 0.3

    captured = {}
    last_main = model.model.layers[cfg.num_hidden_layers - 1]
    hook = last_main.register_forward_hook(lambda m, a, out: captured.setdefault("h", out.detach()))
    out = model.loss(ids, labels, mtp_loss_weight=weight, loss_chunk_size=5)
    hook.remove()
    assert len(out.mtp_losses) == len(model.model.mtp_layers) == (2 if two_layers else 1)

    # Hand, depth k = 1, 2 at positions t = 0..S-1-k:
    # u = eh_proj([enorm(E[x_{t+k}]), hnorm(h_t)]), with h = the main residual stream before the final
    # norm for k = 1 and the previous MTP block's output for k = 2; the MTP decoder block (sliding,
    # dense); shared_head.norm/output; target x_{t+k+1} (= labels[t + k], -100 where masked or past
    # the end). Run on the first S - k positions only (causality makes the rest irrelevant).
    wants = []
    with torch.no_grad():
        h = captured["h"]
        for k, mtp in enumerate(model.model.mtp_layers, start=1):
            n = S - k
            emb = model.model.embed_tokens.weight[ids[:, k:]]
            u = torch.cat([hand_rms(emb, mtp.enorm.weight), hand_rms(h[:, :n], mtp.hnorm.weight)], dim=-1)
            u = u @ mtp.eh_proj.weight.double().T
            spec = cfg.layer(cfg.num_hidden_layers + k - 1)
            assert spec.sliding and not spec.is_moe and spec.is_mtp
            cos, sin = hand_cos_sin(n, hand_inv_freq(spec.rotary_dim, spec.rope_theta, None))
            block = DecoderLayer.forward(mtp, u.float(), cos, sin)
            head = mtp.transformer["shared_head"]
            logits = hand_rms(block, head.norm.weight) @ head.output.weight.double().T
            target = labels[:, k:]
            wants.append(F.cross_entropy(logits.reshape(-1, 1024), target.reshape(-1), ignore_index=-100))
            h = block
    for got, want in zip(out.mtp_losses, wants, strict=True):
        torch.testing.assert_close(got.double(), want, **TOL)
    torch.testing.assert_close(out.loss.double(), out.lm_loss.double() + weight * torch.stack(wants).mean(), **TOL)


def test_mtp_gradients_reach_mtp_params_and_embeddings():
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(18))
    labels = _labels(ids)
    grads = {}
    for weight in (0.0, 0.5):
        model = tiny_model(seed=18)
        model.loss(ids, labels, mtp_loss_weight=weight).loss.backward()
        grads[weight] = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    mtp_prefix = f"model.layers.{tiny_config().num_hidden_layers}."
    mtp_names = [n for n in grads[0.5] if n.startswith(mtp_prefix)]
    assert len(mtp_names) == 17
    for n in mtp_names:
        assert grads[0.0][n] is None or grads[0.0][n].abs().sum() == 0, n
        assert grads[0.5][n] is not None and grads[0.5][n].abs().sum() > 0, n
    emb = "model.embed_tokens.weight"
    assert not torch.allclose(grads[0.5][emb], grads[0.0][emb])
    assert (grads[0.5][emb] - grads[0.0][emb]).abs().sum() > 0


# =================================================================================== bf16
def test_bf16_keeps_router_bias_fp32_and_trains():
    model = tiny_model(seed=19)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("router_bias")}
    assert len(biases) == 4 and all(b.dtype == torch.float32 for b in biases.values())
    assert any(not torch.equal(b, b.bfloat16().float()) for b in biases.values())  # not bf16-representable
    model = model.to(torch.bfloat16)
    for n, b in model.named_buffers():
        if n.endswith("router_bias"):
            assert b.dtype == torch.float32 and torch.equal(b, biases[n]), n
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(19))
    out = model.loss(ids, _labels(ids), mtp_loss_weight=0.5)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), n
    # bf16 loss close to the fp32 model's (tolerance 2e-2 absolute on a loss of ~7: bf16 weights/activations).
    ref = tiny_model(seed=19).loss(ids, _labels(ids), mtp_loss_weight=0.5)
    assert abs(out.loss.item() - ref.loss.item()) < 2e-2 * max(1.0, ref.loss.item())
    # Back to fp32: the bias is still the same fp32 values.
    model = model.float()
    for n, b in model.named_buffers():
        if n.endswith("router_bias"):
            assert torch.equal(b, biases[n])
