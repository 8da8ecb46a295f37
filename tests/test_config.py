"""Step35Config: the released config.json read and written as is, the derived per-layer map
(docs/architecture.md §1), the `tiny` preset, and validation errors that name the offending field."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from step35.config import PRESETS, ConfigError, Step35Config, load_config, preset
from step35.model import Step35ForCausalLM
from tests.helpers import flash_config_dict, state_numel, tiny_config_dict


# ----------------------------------------------------------------------------------- round trip
def test_release_dict_round_trips_with_key_order():
    raw = flash_config_dict()
    out = Step35Config.from_dict(raw).to_dict()
    assert list(out) == list(raw)  # same keys, same order
    assert out == raw
    assert json.dumps(out) == json.dumps(raw)  # also the same JSON types (int vs float, lists)
    assert "rms_norm_eps" not in out


def test_release_has_the_spec_fields():
    # Spot checks of the release values (docs/architecture.md §1.1, typed in from its table).
    raw = flash_config_dict()
    assert raw["hidden_size"] == 4096 and raw["vocab_size"] == 128896 and raw["num_hidden_layers"] == 45
    assert raw["moe_num_experts"] == 288 and raw["moe_top_k"] == 8 and raw["moe_router_scaling_factor"] == 3.0
    assert raw["moe_layers_enum"].split(",") == [str(i) for i in range(3, 45)]
    assert raw["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 2.0,
        "original_max_position_embeddings": 131072,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
    }
    assert len(raw["layer_types"]) == len(raw["rope_theta"]) == len(raw["swiglu_limits"]) == 48
    assert raw["eos_token_id"] == [1, 2, 128007] and raw["bos_token_id"] == 0


def test_other_key_order_is_preserved():
    raw = flash_config_dict()
    shuffled = dict(reversed(list(raw.items())))
    out = Step35Config.from_dict(shuffled).to_dict()
    assert list(out) == list(shuffled) and out == raw


def test_config_json_file_round_trip(tmp_path):
    raw = flash_config_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw, indent=2))
    for source in (tmp_path / "config.json", tmp_path):  # file or checkpoint folder
        cfg = Step35Config.from_json(source)
        assert cfg.to_dict() == raw and list(cfg.to_dict()) == list(raw)
    assert load_config(tmp_path).to_dict() == raw
    # Written back by save(): the same JSON object, same key order.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    Step35Config.from_json(tmp_path).save(out_dir)
    text = (out_dir / "config.json").read_text()
    back = json.loads(text)
    assert list(back) == list(raw) and back == raw


def test_unknown_keys_are_kept(tmp_path):
    raw = flash_config_dict()
    raw["transformers_version"] = "4.57.1"
    raw["some_future_field"] = {"a": [1, 2]}
    out = Step35Config.from_dict(raw).to_dict()
    assert out == raw and list(out) == list(raw)


def test_rms_norm_eps_default_and_explicit():
    raw = flash_config_dict()
    assert "rms_norm_eps" not in raw
    cfg = Step35Config.from_dict(raw)
    assert cfg.rms_norm_eps == 1e-5
    assert "rms_norm_eps" not in cfg.to_dict()
    raw["rms_norm_eps"] = 1e-6
    cfg = Step35Config.from_dict(raw)
    assert cfg.rms_norm_eps == 1e-6 and cfg.to_dict()["rms_norm_eps"] == 1e-6
    assert list(cfg.to_dict()) == list(raw)
    # Reaches the model's norms.
    cfg = Step35Config.from_dict(tiny_config_dict(rms_norm_eps=1e-6))
    with torch.device("meta"):
        model = Step35ForCausalLM(cfg)
    assert model.model.norm.eps == 1e-6
    assert model.model.layers[0].self_attn.q_norm.eps == 1e-6


def test_dtype_alias():
    raw = flash_config_dict()
    raw = {("dtype" if k == "torch_dtype" else k): v for k, v in raw.items()}
    cfg = Step35Config.from_dict(raw)
    assert cfg.torch_dtype == "bfloat16"
    out = cfg.to_dict()
    assert "torch_dtype" not in out and out == raw and list(out) == list(raw)
    raw["dtype"] = "float32"
    assert Step35Config.from_dict(raw).torch_dtype == "float32"
    # A changed torch_dtype (as save_pretrained does) is written back under the source's spelling,
    # not as a stale copy of the value read.
    cfg = Step35Config.from_dict(raw)
    cfg.torch_dtype = "bfloat16"
    out = cfg.to_dict()
    assert out["dtype"] == "bfloat16" and "torch_dtype" not in out and list(out) == list(raw)


def test_share_expert_dims_alias():
    raw = flash_config_dict()
    raw = {("share_expert_dims" if k == "share_expert_dim" else k): v for k, v in raw.items()}
    raw["share_expert_dims"] = 640
    cfg = Step35Config.from_dict(raw)
    assert cfg.share_expert_dim == 640
    out = cfg.to_dict()
    assert "share_expert_dim" not in out and out == raw and list(out) == list(raw)
    cfg.share_expert_dim = 320
    assert cfg.to_dict()["share_expert_dims"] == 320 and "share_expert_dim" not in cfg.to_dict()


# ----------------------------------------------------------------------------------- layer map
def test_release_layer_map():
    cfg = preset("flash-196b")
    assert cfg.num_total_layers == 48
    full_ids = [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44]  # docs/architecture.md §1.3 layer map
    main = [cfg.layer(i) for i in range(45)]
    assert [s.layer_id for s in main if not s.sliding] == full_ids
    assert sum(1 for s in main if s.sliding) == 33
    assert [s.layer_id for s in main if s.is_moe] == list(range(3, 45))
    for i in range(48):
        s = cfg.layer(i)
        full = i in full_ids
        assert s.attention_type == ("full_attention" if full else "sliding_attention"), i
        assert (s.num_heads, s.num_kv_heads, s.head_dim) == ((64, 8, 128) if full else (96, 8, 128)), i
        assert s.rotary_dim == (64 if full else 128), i
        assert s.rope_theta == (5e6 if full else 1e4), i
        assert s.rope_scaled is full, i
        assert s.uses_rope, i
        assert s.is_moe is (3 <= i <= 44), i
        assert s.is_mtp is (i >= 45), i
        assert s.swiglu_limit == (7.0 if i in (43, 44) else 0.0), i
        assert s.swiglu_limit_shared == (16.0 if i == 44 else 0.0), i
    for i in (45, 46, 47):  # MTP: sliding, dense
        s = cfg.layer(i)
        assert s.sliding and not s.is_moe and s.is_mtp


def test_release_model_layer_modules():
    with torch.device("meta"):
        model = Step35ForCausalLM(preset("flash-196b"))
    layers = model.model.layers
    assert len(layers) == 48
    assert layers[43].moe.limit == 7.0 and layers[44].moe.limit == 7.0 and layers[42].moe.limit == 0.0
    assert layers[44].share_expert.limit == 16.0 and layers[43].share_expert.limit == 0.0
    assert layers[0].mlp.limit == 0.0 and layers[45].mlp.limit == 0.0
    assert layers[0].self_attn.window is None and layers[1].self_attn.window == 512
    assert layers[45].self_attn.window == 512 and layers[45].self_attn.num_heads == 96


# ----------------------------------------------------------------------------------- tiny preset
def test_tiny_preset_has_every_feature():
    cfg = preset("tiny")
    specs = [cfg.layer(i) for i in range(cfg.num_total_layers)]
    main = specs[: cfg.num_hidden_layers]
    assert {s.attention_type for s in main} == {"full_attention", "sliding_attention"}
    assert any(s.is_moe for s in main) and any(not s.is_moe for s in main)
    assert any(s.swiglu_limit > 0 for s in main if s.is_moe)
    assert any(s.swiglu_limit_shared > 0 for s in main if s.is_moe)
    assert cfg.use_moe_router_bias and cfg.num_nextn_predict_layers >= 1
    assert any(s.rope_scaled and s.rotary_dim < s.head_dim for s in main)  # partial + llama3 scaling
    assert {s.num_heads for s in main if s.sliding} != {s.num_heads for s in main if not s.sliding}
    assert all(s.num_heads > s.num_kv_heads for s in main)  # GQA
    assert cfg.sliding_window < 512
    with torch.device("meta"):
        model = Step35ForCausalLM(cfg)
    nbytes = state_numel(model) * 4  # fp32
    assert 1e6 < nbytes < 20e6, nbytes  # a few MB


def test_presets_and_load_config():
    assert set(PRESETS) >= {"tiny", "flash-196b"}
    assert load_config("tiny").to_dict() == preset("tiny").to_dict()
    with pytest.raises(ConfigError, match="nope"):
        preset("nope")


# ----------------------------------------------------------------------------------- validation
def _mutate(base: str, **changes):
    raw = flash_config_dict() if base == "flash" else tiny_config_dict()
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            raw[outer] = copy.deepcopy(raw[outer])
            raw[outer][inner] = value
        else:
            raw[key] = value
    return raw


def _bad_cases():
    flash = flash_config_dict()
    cases = [
        ("layer_types", dict(layer_types=flash["layer_types"][:45])),
        ("rope_theta", dict(rope_theta=flash["rope_theta"][:47])),
        ("partial_rotary_factors", dict(partial_rotary_factors=flash["partial_rotary_factors"] + [1.0])),
        ("swiglu_limits", dict(swiglu_limits=flash["swiglu_limits"][:45])),
        ("swiglu_limits_shared", dict(swiglu_limits_shared=flash["swiglu_limits_shared"][:40])),
        ("use_rope_layers", dict(use_rope_layers=[True] * 45)),
        ("num_attention_heads", dict(num_attention_heads=60)),  # 60 % 8 groups
        ("num_attention_groups", dict(num_attention_groups=7)),  # 64 % 7 (full layers)
        ("attention_other_setting", {"attention_other_setting.num_attention_heads": 100}),  # sliding: 100 % 8
        ("attention_other_setting", {"attention_other_setting.num_attention_groups": 7}),  # sliding: 96 % 7
        ("moe_top_k", dict(moe_top_k=289)),
        ("moe_top_k", dict(moe_top_k=0)),
        (
            "layer_types",
            dict(layer_types=["full_attention", "global_attention", "sliding_attention", "sliding_attention"] * 12),
        ),
        ("moe_layers_enum", dict(moe_layers_enum="3,4,45")),
        ("moe_layers_enum", dict(moe_layers_enum="-1,3")),
        ("moe_layers_enum", dict(moe_layers_enum="3,four,5")),
        ("moe_layers_enum", dict(moe_layers_enum="3,3")),
        ("rope_type", {"rope_scaling.rope_type": "yarn"}),
        (
            "rope_scaling.factor",
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "original_max_position_embeddings": 131072,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 32.0,
                }
            ),
        ),
        ("swiglu_limits", dict(swiglu_limits=[-1.0] + flash["swiglu_limits"][1:])),
        ("partial_rotary_factors", dict(partial_rotary_factors=[1.5] + flash["partial_rotary_factors"][1:])),
        ("sliding_window", dict(sliding_window=0)),
        ("att_impl_type", dict(att_impl_type="MLA")),
        ("moe_router_activation", dict(moe_router_activation="softmax")),
        ("sink", dict(sink=True)),
        ("torch_dtype", dict(torch_dtype="bfloat17")),
        ("torch_dtype", dict(torch_dtype="Tensor")),
    ]
    return cases


@pytest.mark.parametrize("field,changes", _bad_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_inconsistent_config_names_the_field(field, changes):
    raw = _mutate("flash", **changes)
    with pytest.raises(ConfigError) as err:
        Step35Config.from_dict(raw)
    assert field in str(err.value)


def test_error_from_json_names_the_field(tmp_path):
    raw = _mutate("tiny", moe_top_k=99)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="moe_top_k"):
        Step35Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        Step35Config.from_json(tmp_path)
    with pytest.raises(ConfigError, match="config.json"):
        Step35Config.from_json(tmp_path / "missing")


def test_valid_variants_accepted():
    # The checks above must not reject what the release allows.
    Step35Config.from_dict(_mutate("flash", rope_scaling=None))
    Step35Config.from_dict(_mutate("flash", use_moe=False))
    cfg = Step35Config.from_dict(
        _mutate(
            "flash",
            num_nextn_predict_layers=0,
            layer_types=flash_config_dict()["layer_types"][:45],
            rope_theta=flash_config_dict()["rope_theta"][:45],
            partial_rotary_factors=flash_config_dict()["partial_rotary_factors"][:45],
            swiglu_limits=flash_config_dict()["swiglu_limits"][:45],
            swiglu_limits_shared=flash_config_dict()["swiglu_limits_shared"][:45],
        )
    )
    assert cfg.num_total_layers == 45
