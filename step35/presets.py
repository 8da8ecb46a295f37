"""The named configs as raw config.json dicts: `flash-196b` (the released Step-3.5-Flash config.json, field for
field), `tiny` (every feature, a few MB), `tiny-vl` (a Step-3.7 config.json around `tiny`, with a small vision
encoder), and the key order of the released file. Data only: step35/config.py
validates them (`preset`, `load_config`)."""

from typing import Any

RELEASE_KEY_ORDER = (
    "architectures",
    "auto_map",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "max_seq_len",
    "vocab_size",
    "torch_dtype",
    "use_qk_norm",
    "moe_layers_enum",
    "num_attention_heads",
    "num_attention_groups",
    "head_dim",
    "use_moe",
    "moe_num_experts",
    "moe_top_k",
    "moe_intermediate_size",
    "share_expert_dim",
    "moe_layer_offset",
    "moe_every_n_layer",
    "norm_expert_weight",
    "moe_router_activation",
    "moe_router_scaling_factor",
    "att_impl_type",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "yarn_only_types",
    "use_head_wise_attn_gate",
    "sliding_window",
    "use_moe_router_bias",
    "need_fp32_gate",
    "sink",
    "layer_types",
    "use_rope_layers",
    "num_nextn_predict_layers",
    "partial_rotary_factors",
    "eos_token_id",
    "bos_token_id",
    "attention_other_setting",
    "swiglu_limits",
    "swiglu_limits_shared",
    "zero_centered",
    "max_position_embeddings",
)


def _flash_196b() -> dict[str, Any]:
    """The released Step-3.5-Flash config.json, field for field (docs/architecture.md §1.1)."""
    n = 48
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_step3p5.Step3p5Config",
            "AutoModelForCausalLM": "modeling_step3p5.Step3p5ForCausalLM",
        },
        "model_type": "step3p5",
        "hidden_size": 4096,
        "intermediate_size": 11264,
        "num_hidden_layers": 45,
        "max_seq_len": 262144,
        "vocab_size": 128896,
        "torch_dtype": "bfloat16",
        "use_qk_norm": True,
        "moe_layers_enum": ",".join(str(i) for i in range(3, 45)),
        "num_attention_heads": 64,
        "num_attention_groups": 8,
        "head_dim": 128,
        "use_moe": True,
        "moe_num_experts": 288,
        "moe_top_k": 8,
        "moe_intermediate_size": 1280,
        "share_expert_dim": 1280,
        "moe_layer_offset": 0,
        "moe_every_n_layer": 1,
        "norm_expert_weight": True,
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "att_impl_type": "GQA",
        "tie_word_embeddings": False,
        "rope_theta": [5000000.0, 10000.0, 10000.0, 10000.0] * 12,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 2.0,
            "original_max_position_embeddings": 131072,
            "low_freq_factor": 1.0,
            "high_freq_factor": 32.0,
        },
        "yarn_only_types": ["full_attention"],
        "use_head_wise_attn_gate": True,
        "sliding_window": 512,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "sink": False,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 12,
        "use_rope_layers": [],
        "num_nextn_predict_layers": 3,
        "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0] * 12,
        "eos_token_id": [1, 2, 128007],
        "bos_token_id": 0,
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 96,
            "num_attention_groups": 8,
            "head_dim": 128,
            "true_head_dim": 128,
        },
        "swiglu_limits": [0.0] * 43 + [7.0, 7.0] + [0.0] * (n - 45),
        "swiglu_limits_shared": [0.0] * 44 + [16.0] + [0.0] * (n - 45),
        "zero_centered": True,
        "max_position_embeddings": 262144,
    }


def _tiny() -> dict[str, Any]:
    """A model of a few MB with every Step-3.5 feature switched on.

    5 main layers (full, sliding x3, full) + 1 MTP layer; layer 0 dense, 1-4 MoE; partial RoPE and
    llama3 scaling on full layers; different head counts on sliding layers; routed clamps at the
    last two main layers and a shared clamp at the last one, as the release does at 43/44.
    """
    raw = _flash_196b()
    n = 6
    raw.update(
        {
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 5,
            "max_seq_len": 4096,
            "max_position_embeddings": 4096,
            "vocab_size": 1024,
            "torch_dtype": "float32",
            "moe_layers_enum": "1,2,3,4",
            "num_attention_heads": 4,
            "num_attention_groups": 2,
            "head_dim": 32,
            "moe_num_experts": 8,
            "moe_top_k": 2,
            "moe_intermediate_size": 64,
            "share_expert_dim": 64,
            "rope_theta": [5000000.0, 10000.0, 10000.0, 10000.0, 5000000.0, 10000.0],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 2.0,
                "original_max_position_embeddings": 1024,
                "low_freq_factor": 1.0,
                "high_freq_factor": 8.0,
            },
            "sliding_window": 64,
            "layer_types": ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"],
            "num_nextn_predict_layers": 1,
            "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 0.5, 1.0],
            "eos_token_id": [1],
            "bos_token_id": 0,
            "attention_other_setting": {
                "attention_type": "sliding_attention",
                "num_attention_heads": 6,
                "num_attention_groups": 2,
                "head_dim": 32,
                "true_head_dim": 32,
            },
            "swiglu_limits": [0.0, 0.0, 0.0, 7.0, 7.0, 0.0],
            "swiglu_limits_shared": [0.0, 0.0, 0.0, 0.0, 16.0, 0.0],
        }
    )
    assert len(raw["layer_types"]) == n
    return raw


def _tiny_vl() -> dict[str, Any]:
    """A tiny Step-3.7-Flash config.json: `tiny` as its language model (`text_config`) beside a vision encoder of
    the release's structure (patch 14, 2-D RoPE, LayerScale, two stride-2 3x3 downsamplers, the projector) with a
    few channels: a 112-pixel view is an 8 x 8 patch grid, 4 x 4 after the first downsampler, 4 image tokens."""
    text = _tiny()
    text.pop("auto_map")  # the remote code of Step-3.5's own folders: a Step-3.7 text_config has none
    return {
        "architectures": ["Step3p7ForConditionalGeneration"],
        "model_type": "step3p7",
        "image_token_id": 1000,  # below tiny's vocab_size
        "projector_bias": False,
        "text_config": text,
        "vision_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "mlp_ratio": 2.0,
            "image_size": 112,
            "patch_size": 14,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
            "model_type": "step3p5_vision",
        },
    }


PRESETS = {"flash-196b": _flash_196b, "tiny": _tiny, "tiny-vl": _tiny_vl}
