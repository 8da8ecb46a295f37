"""Sanity tests of the transformers-based oracle (tests/hf_oracle.py) and of the independent
slow reference forward (tests/reference_forward.py) on a tiny random checkpoint in our layout."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.step3p7.modeling_step3p7 import Step3p7RotaryEmbedding

from tests.hf_oracle import (  # the repository root is on sys.path (pyproject: pythonpath)
    convert_state_dict_to_hf,
    hf_config_from_dict,
    hf_forward_logits,
    hf_grads_to_ours,
    hf_reference_logits,
    hf_reference_model,
    random_state_dict,
    tiny_config_dict,
)
from tests.reference_forward import reference_logits, rope_inv_freq

SEQ = 24
MATCH_ATOL = 2e-5  # fp32 oracle vs float64 reference; logits are O(1)-O(5)
CHANGE_MIN = 1e-2  # a feature switched off must move the logits by more than this


@pytest.fixture(scope="module")
def config() -> dict:
    return tiny_config_dict()


@pytest.fixture(scope="module")
def state_dict(config) -> dict[str, torch.Tensor]:
    return random_state_dict(config, seed=0)


@pytest.fixture(scope="module")
def input_ids(config) -> torch.Tensor:
    ids = torch.randint(0, config["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
    ids[0, 3] = 1  # token 1 = HF's default pad id; its embedding must still get a gradient
    return ids


@pytest.fixture(scope="module")
def base_logits(config, state_dict, input_ids) -> torch.Tensor:
    return hf_reference_logits(config, state_dict, input_ids)


# ------------------------------------------------------------------------------------------------
# (a) runs, strict loading, determinism
# ------------------------------------------------------------------------------------------------


def test_oracle_runs_and_is_deterministic(config, state_dict, input_ids, base_logits):
    assert base_logits.shape == (2, SEQ, config["vocab_size"])
    assert base_logits.dtype == torch.float32
    assert torch.isfinite(base_logits).all()
    assert base_logits.std() > 0.1
    again = hf_reference_logits(config, state_dict, input_ids)
    assert torch.equal(base_logits, again)
    model, lm_head = hf_reference_model(config, state_dict)
    with torch.no_grad():
        assert torch.equal(hf_forward_logits(model, lm_head, input_ids), base_logits)
        assert torch.equal(hf_forward_logits(model, lm_head, input_ids), base_logits)
    assert model.embed_tokens.padding_idx is None


def test_conversion_layout_and_strictness(config, state_dict):
    hf_sd, lm_head = convert_state_dict_to_hf(config, state_dict)
    assert torch.equal(lm_head, state_dict["lm_head.weight"])
    assert not any(k.startswith("layers.5.") for k in hf_sd)  # MTP layer dropped
    gate_up = hf_sd["layers.1.mlp.experts.gate_up_proj"]
    inter = config["moe_intermediate_size"]
    assert gate_up.shape == (config["moe_num_experts"], 2 * inter, config["hidden_size"])
    assert torch.equal(gate_up[:, :inter], state_dict["model.layers.1.moe.gate_proj.weight"])
    assert torch.equal(gate_up[:, inter:], state_dict["model.layers.1.moe.up_proj.weight"])
    assert torch.equal(hf_sd["layers.1.mlp.experts.down_proj"], state_dict["model.layers.1.moe.down_proj.weight"])
    assert torch.equal(hf_sd["layers.2.mlp.gate.e_score_correction_bias"], state_dict["model.layers.2.moe.router_bias"])
    assert "layers.0.mlp.gate_proj.weight" in hf_sd and "layers.1.mlp.shared_experts.up_proj.weight" in hf_sd

    with pytest.raises(KeyError):
        convert_state_dict_to_hf(config, {**state_dict, "model.bogus.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="bogus"):  # unknown per-layer names reach strict loading
        hf_reference_model(config, {**state_dict, "model.layers.1.moe.bogus": torch.zeros(1)})
    with pytest.raises(KeyError):  # beyond main + MTP layers
        convert_state_dict_to_hf(config, {**state_dict, "model.layers.6.input_layernorm.weight": torch.zeros(1)})
    missing = dict(state_dict)
    del missing["model.layers.3.self_attn.g_proj.weight"]
    with pytest.raises(RuntimeError, match="g_proj"):
        hf_reference_model(config, missing)
    no_bias = dict(state_dict)
    del no_bias["model.layers.3.moe.router_bias"]
    with pytest.raises(RuntimeError, match="e_score_correction_bias"):
        hf_reference_model(config, no_bias)


def test_config_mapping_tiny(config):
    hf = hf_config_from_dict(config)
    assert hf.num_hidden_layers == 5 and hf.num_nextn_predict_layers == 1
    assert hf.layer_types == config["layer_types"][:5]
    assert hf.mtp_layer_types == ["sliding_attention"]
    assert hf.mlp_layer_types == ["dense", "sparse", "sparse", "sparse", "sparse"]
    assert [c.num_attention_heads for c in hf.per_layer_config] == [4, 6, 6, 6, 4]
    assert hf.num_key_value_heads == 2 and hf.head_dim == 16
    assert hf.n_routed_experts == 8 and hf.num_local_experts == 8 and hf.num_experts_per_tok == 2
    assert hf.moe_router_scaling_factor == 3.0 and hf.rms_norm_eps == 1e-5
    assert hf.swiglu_limits == config["swiglu_limits"][:5]
    assert hf.swiglu_limits_shared == config["swiglu_limits_shared"][:5]
    assert hf._attn_implementation == "eager"


def _release_config() -> dict:
    """config.json of the release as described in docs/architecture.md §1 (48-entry per-layer lists)."""
    full = [i % 4 == 0 for i in range(48)]
    limits = [0.0] * 48
    limits[43] = limits[44] = 7.0
    shared = [0.0] * 48
    shared[44] = 16.0
    return {
        "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5", "hidden_size": 4096,
        "intermediate_size": 11264, "num_hidden_layers": 45, "max_seq_len": 262144,
        "max_position_embeddings": 262144, "vocab_size": 128896, "torch_dtype": "bfloat16",
        "use_qk_norm": True, "moe_layers_enum": ",".join(str(i) for i in range(3, 45)),
        "num_attention_heads": 64, "num_attention_groups": 8, "head_dim": 128, "use_moe": True,
        "moe_num_experts": 288, "moe_top_k": 8, "moe_intermediate_size": 1280, "share_expert_dim": 1280,
        "moe_layer_offset": 0, "moe_every_n_layer": 1, "norm_expert_weight": True,
        "moe_router_activation": "sigmoid", "moe_router_scaling_factor": 3.0, "att_impl_type": "GQA",
        "rope_theta": [5e6 if f else 1e4 for f in full],
        "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 131072,
                         "low_freq_factor": 1.0, "high_freq_factor": 32.0},
        "yarn_only_types": ["full_attention"], "use_head_wise_attn_gate": True, "sliding_window": 512,
        "use_moe_router_bias": True, "need_fp32_gate": True, "sink": False,
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "use_rope_layers": [], "num_nextn_predict_layers": 3,
        "partial_rotary_factors": [0.5 if f else 1.0 for f in full], "eos_token_id": [1, 2, 128007],
        "bos_token_id": 0,
        "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 96,
                                    "num_attention_groups": 8, "head_dim": 128, "true_head_dim": 128},
        "swiglu_limits": limits, "swiglu_limits_shared": shared, "zero_centered": True,
    }  # fmt: skip


def test_config_mapping_release_shapes():
    """48-entry lists with 45 layers + 3 MTP parse as the layer map of docs/architecture.md §1.3 (no weights built)."""
    cfg = _release_config()
    hf = hf_config_from_dict(cfg)
    assert len(hf.layer_types) == 45 and hf.mtp_layer_types == ["sliding_attention"] * 3
    assert hf.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 42
    assert hf.mtp_mlp_layer_types == ["dense"] * 3
    heads = [c.num_attention_heads for c in hf.per_layer_config]
    assert heads == [64 if i % 4 == 0 else 96 for i in range(45)]
    assert [i for i, v in enumerate(hf.swiglu_limits) if v] == [43, 44]
    assert [(i, v) for i, v in enumerate(hf.swiglu_limits_shared) if v] == [(44, 16.0)]
    assert hf.sliding_window == 512 and hf.num_key_value_heads == 8
    full = hf.rope_parameters["full_attention"]
    assert full["rope_type"] == "llama3" and full["rope_theta"] == 5e6 and full["partial_rotary_factor"] == 0.5
    sliding = hf.rope_parameters["sliding_attention"]
    assert sliding["rope_type"] == "default" and sliding["rope_theta"] == 1e4
    assert sliding.get("partial_rotary_factor", 1.0) == 1.0

    # RoPE frequencies: HF == reference == the multipliers of docs/architecture.md §2.5
    rot = Step3p7RotaryEmbedding(hf)
    hf_full = rot.full_attention_inv_freq.double()
    ref_full = torch.tensor(rope_inv_freq(cfg, 0), dtype=torch.float64)
    assert hf_full.shape == (32,)
    torch.testing.assert_close(hf_full, ref_full, rtol=1e-6, atol=0)
    base = torch.tensor([5e6 ** (-2 * j / 64) for j in range(32)], dtype=torch.float64)
    mult = (ref_full / base).tolist()
    assert all(abs(m - 1.0) < 1e-12 for m in mult[:14])
    # docs/architecture.md §2.5 lists x0.878, 0.728, ... (rounded; the first is 0.87845)
    spec = [0.878, 0.728, 0.634, 0.577, 0.541, 0.519, 0.506]
    assert all(abs(m - s) < 1e-3 for m, s in zip(mult[14:21], spec)), mult[14:21]
    assert all(abs(m - 0.5) < 1e-12 for m in mult[21:])
    hf_sliding = rot.sliding_attention_inv_freq.double()
    torch.testing.assert_close(hf_sliding, torch.tensor(rope_inv_freq(cfg, 1), dtype=torch.float64), rtol=1e-6, atol=0)
    assert hf_sliding.shape == (64,)


def test_unsupported_config_is_refused(config):
    for key, value in [
        ("use_rope_layers", [0]),
        ("zero_centered", False),
        ("yarn_only_types", ["sliding_attention"]),
        ("attention_other_setting", {**config["attention_other_setting"], "num_attention_groups": 1}),
    ]:
        with pytest.raises(NotImplementedError):
            hf_config_from_dict({**config, key: value})


# ------------------------------------------------------------------------------------------------
# (b) every feature is really implemented: switching it off moves the logits, and the slow
#     reference agrees with the oracle in every variant
# ------------------------------------------------------------------------------------------------


def _zero(pattern: str):
    def mutate(cfg, sd):
        for k in sd:
            if pattern in k and not k.startswith("model.layers.5."):
                sd[k] = torch.zeros_like(sd[k])

    return mutate


def _set(key, value):
    def mutate(cfg, sd):
        cfg[key] = value(cfg) if callable(value) else value

    return mutate


def _set_list_entry(key, index, value):
    def mutate(cfg, sd):
        cfg[key] = list(cfg[key])
        cfg[key][index] = value

    return mutate


VARIANTS = {
    "router_bias_zero": _zero("moe.router_bias"),
    "routed_clamp_off": _set("swiglu_limits", [0.0] * 6),
    "routed_clamp_off_layer3": _set_list_entry("swiglu_limits", 3, 0.0),
    "shared_clamp_off_layer4": _set_list_entry("swiglu_limits_shared", 4, 0.0),
    "dense_clamp_off_layer0": _set_list_entry("swiglu_limits_shared", 0, 0.0),
    "input_layernorm_zero": _zero("input_layernorm.weight"),
    "post_attention_layernorm_zero": _zero("post_attention_layernorm.weight"),
    "q_norm_zero": _zero("q_norm.weight"),
    "k_norm_zero": _zero("k_norm.weight"),
    "final_norm_zero": _zero("model.norm.weight"),
    "rope_scaling_off": _set("rope_scaling", None),
    "window_enlarged": _set("sliding_window", 64),
    "window_plus_one": _set("sliding_window", 9),
    "router_scale_1": _set("moe_router_scaling_factor", 1.0),
    "full_partial_rotary_1": _set("partial_rotary_factors", [1.0] * 6),
    "head_gate_neutral": _zero("g_proj.weight"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_feature_switched_off_changes_logits(variant, config, state_dict, input_ids, base_logits):
    cfg, sd = copy.deepcopy(config), dict(state_dict)
    VARIANTS[variant](cfg, sd)
    logits = hf_reference_logits(cfg, sd, input_ids)
    change = (logits - base_logits).abs().max().item()
    assert change > CHANGE_MIN, f"{variant}: logits moved by only {change:.2e}"
    ref = reference_logits(cfg, sd, input_ids)
    err = (logits.double() - ref).abs().max().item()
    assert err < MATCH_ATOL, f"{variant}: oracle vs reference {err:.2e}"


# ------------------------------------------------------------------------------------------------
# (c) independent slow reference == oracle; gradients too
# ------------------------------------------------------------------------------------------------


def test_reference_matches_oracle(config, state_dict, input_ids, base_logits):
    ref = reference_logits(config, state_dict, input_ids)
    assert ref.dtype == torch.float64
    err = (base_logits.double() - ref).abs().max().item()
    assert err < MATCH_ATOL, f"oracle vs reference max abs diff {err:.2e}"
    # the window must bite: a 9-key reference disagrees with the (8-key) oracle
    wider = reference_logits({**config, "sliding_window": 9}, state_dict, input_ids)
    assert (wider - base_logits.double()).abs().max() > CHANGE_MIN


def test_sdpa_matches_eager(config, state_dict, input_ids, base_logits):
    sdpa = hf_reference_logits(config, state_dict, input_ids, attn_implementation="sdpa")
    torch.testing.assert_close(sdpa, base_logits, rtol=0, atol=1e-5)


def test_gradients_match_reference(config, state_dict, input_ids):
    ids = input_ids[:1]
    targets = torch.roll(ids, -1, dims=1)

    model, lm_head = hf_reference_model(config, state_dict)
    logits = hf_forward_logits(model, lm_head, ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    hf_grads = hf_grads_to_ours(model, lm_head)

    n = config["num_hidden_layers"]
    trainable = {
        k
        for k in state_dict
        if not k.endswith("moe.router_bias") and not any(k.startswith(f"model.layers.{i}.") for i in range(n, 99))
    }
    assert set(hf_grads) == trainable
    for k, g in hf_grads.items():
        assert g.shape == state_dict[k].shape, k
    assert hf_grads["model.embed_tokens.weight"][1].abs().sum() > 0  # no padding_idx

    leaves = {k: v.detach().double().requires_grad_(k in trainable) for k, v in state_dict.items()}
    ref_logits = reference_logits(config, leaves, ids)
    loss = F.cross_entropy(ref_logits.reshape(-1, ref_logits.shape[-1]), targets.reshape(-1))
    names = sorted(trainable)
    ref_grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    for k, ref_g in zip(names, ref_grads):
        if ref_g is None:
            ref_g = torch.zeros_like(leaves[k])
        scale = max(ref_g.abs().max().item(), 1e-6)
        err = (hf_grads[k].double() - ref_g).abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, f"{k}: grad err {err:.2e} (scale {scale:.2e})"
    # gate and up halves of gate_up_proj really are different tensors with non-trivial grads
    assert hf_grads["model.layers.1.moe.gate_proj.weight"].abs().sum() > 0
    assert not torch.allclose(
        hf_grads["model.layers.1.moe.gate_proj.weight"], hf_grads["model.layers.1.moe.up_proj.weight"]
    )
    assert math.isfinite(loss.item())
