"""Slow, independent per-token reference forward of the Step-3.5-Flash main model.

Written directly from docs/architecture.md §1-§3 (not from any
implementation): explicit loops over batch rows, tokens, heads and selected experts; clarity over
speed. Computes in float64 by default and is differentiable with respect to the state-dict tensors
(pass tensors with ``requires_grad=True``), so it can serve as a gradient reference too.

Semantics (the HF semantics of the released checkpoint, docs/architecture.md §7):
* zero-centred RMSNorm  y = x * rsqrt(mean(x^2) + eps) * (1 + w), eps = rms_norm_eps (1e-5);
* attention: q/k per-head RMSNorm before RoPE; NeoX rotate-half RoPE on the first
  r = head_dim * partial_rotary_factors[l] dims; llama3 frequency scaling on layers whose type is in
  ``yarn_only_types``; GQA head h -> KV head h // (n_q / n_kv); scale 1/sqrt(head_dim);
  sliding layers see ``sliding_window`` keys including the query itself (keys t-W+1 .. t);
  head-wise sigmoid gate on each head's output before o_proj;
* dense SwiGLU with clamp limit swiglu_limits_shared[l]; MoE: fp32/fp64 sigmoid router, top-k on
  (score + router_bias), weights = unbiased scores renormalised (+1e-20) times
  moe_router_scaling_factor; routed clamp swiglu_limits[l], shared clamp swiglu_limits_shared[l];
* logits = final_norm(h) @ lm_head.weight^T. MTP layers are not used.
"""

from __future__ import annotations

import math

import torch

from tests.helpers import hand_inv_freq

__all__ = ["reference_logits", "rope_inv_freq"]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean() + eps) * (1.0 + w)


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, limit: float):
    """y = W_down( min(SiLU(W_gate x), L) * clip(W_up x, -L, L) ); L == 0 disables the clamp."""
    gate = torch.nn.functional.silu(w_gate @ x)
    up = w_up @ x
    if limit:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return w_down @ (gate * up)


def _per_layer(value, i):
    return value[i] if isinstance(value, (list, tuple)) else value


def rope_inv_freq(config: dict, layer: int) -> list[float]:
    """Per-pair inverse frequencies (docs/architecture.md §2.4 step 3 and §2.5), as Python floats (float64)."""
    layer_type = config["layer_types"][layer]
    head_dim = _head_shape(config, layer)[2]
    r = int(head_dim * _per_layer(config.get("partial_rotary_factors", 1.0), layer))
    theta = float(_per_layer(config.get("rope_theta", 10000.0), layer))
    scaling = config.get("rope_scaling")
    if scaling and layer_type in config.get("yarn_only_types", ["full_attention"]):
        assert scaling.get("rope_type", scaling.get("type")) == "llama3"
        return hand_inv_freq(r, theta, scaling)
    return hand_inv_freq(r, theta, None)


def _head_shape(config: dict, layer: int) -> tuple[int, int, int]:
    """(n_q, n_kv, head_dim) of a layer; sliding layers take attention_other_setting."""
    n_q, n_kv, d = config["num_attention_heads"], config["num_attention_groups"], config["head_dim"]
    other = config.get("attention_other_setting") or {}
    if config["layer_types"][layer] == other.get("attention_type", "sliding_attention") and other:
        n_q = other.get("num_attention_heads", n_q)
        n_kv = other.get("num_attention_groups", n_kv)
        d = other.get("head_dim", d)
    return n_q, n_kv, d


def _apply_rope(x: torch.Tensor, pos: int, inv: list[float]) -> torch.Tensor:
    """NeoX rotate-half on the first r = 2 * len(inv) dims; dim j pairs with j + r/2."""
    half = len(inv)
    if half == 0:
        return x
    ang = torch.tensor([pos * f for f in inv], dtype=x.dtype)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[:half], x[half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[2 * half :]])


def _attention(config, sd, layer, xs, eps, dtype):
    """xs: list over tokens of normed inputs [H]. Returns list over tokens of attention outputs."""
    p = f"model.layers.{layer}.self_attn."
    n_q, n_kv, d = _head_shape(config, layer)
    w_q, w_k, w_v = (sd[p + f"{m}_proj.weight"].to(dtype) for m in "qkv")
    w_o, w_g = sd[p + "o_proj.weight"].to(dtype), sd[p + "g_proj.weight"].to(dtype)
    q_norm, k_norm = sd[p + "q_norm.weight"].to(dtype), sd[p + "k_norm.weight"].to(dtype)
    inv = rope_inv_freq(config, layer)
    sliding = config["layer_types"][layer] == "sliding_attention"
    window = int(config["sliding_window"]) if sliding else None
    group = n_q // n_kv

    qs, ks, vs, gs = [], [], [], []
    for t, x in enumerate(xs):
        q = (w_q @ x).view(n_q, d)
        k = (w_k @ x).view(n_kv, d)
        qs.append([_apply_rope(_rms_norm(q[h], q_norm, eps), t, inv) for h in range(n_q)])
        ks.append([_apply_rope(_rms_norm(k[h], k_norm, eps), t, inv) for h in range(n_kv)])
        vs.append((w_v @ x).view(n_kv, d))
        gs.append(w_g @ x)

    outs = []
    for t in range(len(xs)):
        first = max(0, t - window + 1) if sliding else 0  # window keys including the query itself
        heads = []
        for h in range(n_q):
            kv = h // group
            keys = torch.stack([ks[s][kv] for s in range(first, t + 1)])
            vals = torch.stack([vs[s][kv] for s in range(first, t + 1)])
            probs = torch.softmax(keys @ qs[t][h] / math.sqrt(d), dim=0)
            heads.append((probs @ vals) * torch.sigmoid(gs[t][h]))
        outs.append(w_o @ torch.cat(heads))
    return outs


def _moe(config, sd, layer, x, dtype):
    p = f"model.layers.{layer}."
    w_r = sd[p + "moe.gate.weight"].to(dtype)
    bias = sd.get(p + "moe.router_bias")
    scores = torch.sigmoid(w_r @ x)
    choice = scores + bias.to(dtype) if bias is not None and config.get("use_moe_router_bias", True) else scores
    top_k = int(config["moe_top_k"])
    idx = torch.topk(choice, top_k).indices.tolist()
    weights = scores[idx]
    weights = weights / (weights.sum() + 1e-20)
    weights = weights * float(config.get("moe_router_scaling_factor", 1.0))
    limit = float(_per_layer(config.get("swiglu_limits") or 0.0, layer) or 0.0)
    w_gate, w_up, w_down = (sd[p + f"moe.{m}_proj.weight"] for m in ("gate", "up", "down"))
    out = torch.zeros_like(x)
    for k, e in enumerate(idx):
        out = out + weights[k] * _swiglu(x, w_gate[e].to(dtype), w_up[e].to(dtype), w_down[e].to(dtype), limit)
    shared_limit = float(_per_layer(config.get("swiglu_limits_shared") or 0.0, layer) or 0.0)
    shared = _swiglu(
        x,
        *(sd[p + f"share_expert.{m}_proj.weight"].to(dtype) for m in ("gate", "up", "down")),
        shared_limit,
    )
    return out + shared


def _dense(config, sd, layer, x, dtype):
    p = f"model.layers.{layer}.mlp."
    limit = float(_per_layer(config.get("swiglu_limits_shared") or 0.0, layer) or 0.0)
    return _swiglu(x, *(sd[p + f"{m}_proj.weight"].to(dtype) for m in ("gate", "up", "down")), limit)


def reference_logits(
    config_dict: dict,
    state_dict: dict[str, torch.Tensor],
    input_ids: torch.LongTensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Main-model logits [B, S, V] (in ``dtype``), positions 0..S-1 per row, causal attention."""
    cfg = config_dict
    if cfg.get("use_rope_layers"):
        raise NotImplementedError("use_rope_layers is non-empty")
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    n_layers = int(cfg["num_hidden_layers"])
    moe_layers = set()
    if cfg.get("use_moe", True):
        moe_layers = {int(x) for x in str(cfg["moe_layers_enum"]).split(",") if x.strip()}
    embed = state_dict["model.embed_tokens.weight"].to(dtype)
    lm_head = state_dict.get("lm_head.weight", embed if cfg.get("tie_word_embeddings") else None).to(dtype)

    rows = []
    for b in range(input_ids.shape[0]):
        hs = [embed[int(tok)] for tok in input_ids[b]]
        for layer in range(n_layers):
            p = f"model.layers.{layer}."
            w_in = state_dict[p + "input_layernorm.weight"].to(dtype)
            w_post = state_dict[p + "post_attention_layernorm.weight"].to(dtype)
            attn = _attention(cfg, state_dict, layer, [_rms_norm(h, w_in, eps) for h in hs], eps, dtype)
            hs = [h + a for h, a in zip(hs, attn)]
            ffn = _moe if layer in moe_layers else _dense
            hs = [h + ffn(cfg, state_dict, layer, _rms_norm(h, w_post, eps), dtype) for h in hs]
        w_final = state_dict["model.norm.weight"].to(dtype)
        rows.append(torch.stack([lm_head @ _rms_norm(h, w_final, eps) for h in hs]))
    return torch.stack(rows)
