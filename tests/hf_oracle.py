"""Outside oracle for the Step-3.5-Flash main model, built from `transformers` 5.24.

`transformers` 5.24 maps model_type ``step3p5`` to ``Step3p7TextConfig`` / ``Step3p7TextModel``
(``transformers/models/auto/auto_mappings.py``: ``("step3p5", "Step3p7TextConfig")``), which
computes the same main-model function as the Step-3.5 HF reference. That class has no LM head and
no MTP, and names the MoE tensors differently from the released checkpoint, so this module:

* turns OUR config dict (released ``config.json`` layout, docs/architecture.md §1) into a
  ``Step3p7TextConfig`` (checking the fields that transformers silently ignores or hard-codes);
* converts OUR HF-format state dict (docs/architecture.md §3) into the ``Step3p7TextModel`` layout and loads
  it with ``load_state_dict(strict=True)`` (a plain ``from_pretrained`` on a Step-3.5 folder leaves
  the MoE weights randomly initialised);
* multiplies the final normed hidden states by ``lm_head.weight`` to get logits;
* maps ``Step3p7TextModel`` gradients back to our names/layouts.

Layout facts, read in ``transformers/models/step3p7/modeling_step3p7.py`` and
``transformers/conversion_mapping.py`` (entry ``"step3p7"``), all fp32 here:

====================================================  ===================================================
ours (``model.layers.{i}.``)                          ``Step3p7TextModel`` (``layers.{i}.``)
====================================================  ===================================================
``moe.gate.weight`` [E, H]                            ``mlp.gate.weight`` [E, H]
``moe.router_bias`` [E] (fp32)                        ``mlp.gate.e_score_correction_bias`` [E] (buffer)
``moe.gate_proj.weight`` [E, I, H] +                  ``mlp.experts.gate_up_proj`` [E, 2I, H]
``moe.up_proj.weight`` [E, I, H]                      = cat([gate, up], dim=1); not transposed
``moe.down_proj.weight`` [E, H, I]                    ``mlp.experts.down_proj`` [E, H, I] (as is)
``share_expert.{gate,up,down}_proj.weight``           ``mlp.shared_experts.{gate,up,down}_proj.weight``
everything else (attention, norms, dense ``mlp.*``)   same name without the ``model.`` prefix
``model.layers.{n + j}.*`` (MTP)                      dropped (the text model has no MTP)
``lm_head.weight``                                    not a module weight; returned separately
====================================================  ===================================================
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

__all__ = [
    "hf_config_from_dict",
    "convert_state_dict_to_hf",
    "hf_name_to_ours",
    "hf_reference_model",
    "hf_forward_logits",
    "hf_reference_logits",
    "hf_grads_to_ours",
    "tiny_config_dict",
    "random_state_dict",
]

# Keys of our config dict that carry no information for the HF text model (or are handled here).
_DROP_CONFIG_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "pad_token_id",  # must stay an int for the strict HF config; we clear padding_idx instead
}


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def _per_layer(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, (list, tuple)) else value


def _check_supported(cfg: dict) -> None:
    """Refuse config values that Step3p7TextModel silently ignores or hard-codes differently."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise NotImplementedError(f"hf_oracle: Step3p7TextModel cannot represent {what}")

    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or ["full_attention"] * n
    need(set(layer_types) <= {"full_attention", "sliding_attention"}, f"layer_types {set(layer_types)}")
    need(cfg.get("use_qk_norm", True), "use_qk_norm=False (QK norm is always on)")
    need(cfg.get("use_head_wise_attn_gate", True), "use_head_wise_attn_gate=False (gate always on)")
    need(cfg.get("zero_centered", True), "zero_centered=False (norms are always 1 + w)")
    need(cfg.get("norm_expert_weight", True), "norm_expert_weight=False (top-k renorm always on)")
    need(cfg.get("moe_router_activation", "sigmoid") == "sigmoid", "a non-sigmoid router")
    need(not cfg.get("sink", False), "attention sinks")
    need(not cfg.get("use_rope_layers"), "a non-empty use_rope_layers (RoPE is on in every layer)")
    need(not cfg.get("attention_bias", False), "attention biases")
    need(cfg.get("hidden_act", "silu") == "silu", "a hidden_act other than silu")
    # HF applies rope_scaling to every "full_attention" layer and never to sliding ones.
    if cfg.get("rope_scaling"):
        need(
            list(cfg.get("yarn_only_types", ["full_attention"])) == ["full_attention"],
            f"yarn_only_types={cfg.get('yarn_only_types')} (scaling is hard-wired to full_attention)",
        )
        need(cfg["rope_scaling"].get("rope_type", cfg["rope_scaling"].get("type")) == "llama3", "non-llama3 scaling")
    # attention_other_setting: HF only reads num_attention_heads; KV heads and head_dim are global.
    aos = cfg.get("attention_other_setting") or {}
    need(
        aos.get("num_attention_groups", cfg["num_attention_groups"]) == cfg["num_attention_groups"],
        "a different KV-head count on sliding layers",
    )
    need(aos.get("head_dim", cfg["head_dim"]) == cfg["head_dim"], "a different head_dim on sliding layers")
    # HF keeps one (theta, partial factor) per layer type, taken from the first layer of that type.
    for key, default in (("rope_theta", 10000.0), ("partial_rotary_factors", 1.0)):
        value = cfg.get(key, default)
        for lt in set(layer_types):
            vals = {_per_layer(value, i) for i in range(n) if layer_types[i] == lt}
            need(len(vals) == 1, f"{key} varying within layer type {lt}: {vals}")
    if cfg.get("use_moe", True):
        need("moe_layers_enum" in cfg, "MoE layers given without moe_layers_enum")


def hf_config_from_dict(config_dict: dict, attn_implementation: str = "eager") -> Step3p7TextConfig:
    """Build a ``Step3p7TextConfig`` from OUR (released config.json layout) dict.

    How the fields arrive (configuration_step3p7.py ``Step3p7TextConfig.__post_init__``):

    * per-layer lists (``layer_types``, ``swiglu_limits``, ``swiglu_limits_shared``, ``rope_theta``,
      ``partial_rotary_factors``) of length ``num_hidden_layers + num_nextn_predict_layers`` are cut
      to ``num_hidden_layers`` (MTP entries go to ``mtp_layer_types``); they are indexed by global
      layer id, so 48-entry release lists with 45 layers + 3 MTP work;
    * ``moe_layers_enum`` (comma string) -> ``mlp_layer_types`` ("sparse"/"dense");
    * ``attention_other_setting["num_attention_heads"]`` -> ``num_sliding_attention_heads``, applied
      through ``per_layer_config`` to every ``sliding_attention`` layer;
    * ``rope_theta``/``partial_rotary_factors`` -> ``rope_parameters[layer_type]`` from the first
      layer of each type; ``rope_scaling`` is merged into ``rope_parameters["full_attention"]`` only;
    * aliases (``attribute_map``): num_attention_groups -> num_key_value_heads, moe_num_experts ->
      n_routed_experts, moe_top_k -> num_experts_per_tok, share_expert_dims -> share_expert_dim;
    * ``moe_router_scaling_factor`` defaults to 1.0 in HF (3.0 in the release config; we pass it);
      ``rms_norm_eps`` defaults to 1e-5 (absent from the release config).
    """
    _check_supported(config_dict)
    kwargs = {k: v for k, v in config_dict.items() if k not in _DROP_CONFIG_KEYS}
    if not config_dict.get("use_moe", True):
        kwargs["moe_layers_enum"] = ""
    if kwargs.get("rope_scaling") is None:
        kwargs.pop("rope_scaling", None)
    else:
        kwargs["rope_scaling"] = dict(kwargs["rope_scaling"])
    # Keep HF from warning about original_max_position_embeddings >= max_position_embeddings.
    kwargs.setdefault("max_position_embeddings", config_dict.get("max_seq_len", 4096))
    hf_cfg = Step3p7TextConfig(**kwargs, attn_implementation=attn_implementation)
    hf_cfg.use_cache = False
    return hf_cfg


# --------------------------------------------------------------------------------------------------
# State-dict conversion
# --------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# our per-layer suffix -> HF per-layer suffix (1:1 renames; gate/up are joined separately)
_OURS_TO_HF_SUFFIX = {
    "moe.gate.weight": "mlp.gate.weight",
    "moe.router_bias": "mlp.gate.e_score_correction_bias",
    "moe.down_proj.weight": "mlp.experts.down_proj",
    "share_expert.gate_proj.weight": "mlp.shared_experts.gate_proj.weight",
    "share_expert.up_proj.weight": "mlp.shared_experts.up_proj.weight",
    "share_expert.down_proj.weight": "mlp.shared_experts.down_proj.weight",
}
_HF_TO_OURS_SUFFIX = {v: k for k, v in _OURS_TO_HF_SUFFIX.items()}


def _num_main_layers(config_dict: dict) -> int:
    return int(config_dict["num_hidden_layers"])


def convert_state_dict_to_hf(
    config_dict: dict, state_dict: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """OUR HF-format state dict -> (``Step3p7TextModel`` state dict, lm_head weight), all fp32.

    MTP layers (``model.layers.{i}`` with ``i >= num_hidden_layers``) are dropped; any other key we
    do not know raises ``KeyError``.
    """
    n = _num_main_layers(config_dict)
    n_mtp = int(config_dict.get("num_nextn_predict_layers", 0) or 0)
    out: dict[str, torch.Tensor] = {}
    gate_up: dict[int, dict[str, torch.Tensor]] = {}
    lm_head = None
    for name, tensor in state_dict.items():
        t = tensor.detach().to(torch.float32)
        if name == "lm_head.weight":
            lm_head = t
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            out[name[len("model.") :]] = t
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            raise KeyError(f"hf_oracle: unexpected key {name!r}")
        i, suffix = int(m.group(1)), m.group(2)
        if i >= n:
            if i >= n + n_mtp:
                raise KeyError(f"hf_oracle: layer index {i} beyond main + MTP layers in {name!r}")
            continue  # MTP layer: not part of the main-model function
        if suffix in ("moe.gate_proj.weight", "moe.up_proj.weight"):
            gate_up.setdefault(i, {})[suffix.split(".")[1]] = t
            continue
        out[f"layers.{i}.{_OURS_TO_HF_SUFFIX.get(suffix, suffix)}"] = t
    for i, parts in gate_up.items():
        if set(parts) != {"gate_proj", "up_proj"}:
            raise KeyError(f"hf_oracle: layer {i} has only {sorted(parts)} of moe gate_proj/up_proj")
        # Step3p7Experts._apply_gate: gate, up = gate_up.chunk(2, dim=-1) on x @ gate_up_proj[e].T
        out[f"layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=1)
    if lm_head is None:
        if config_dict.get("tie_word_embeddings", False):
            lm_head = out["embed_tokens.weight"]
        else:
            raise KeyError("hf_oracle: lm_head.weight missing (and tie_word_embeddings is false)")
    if not config_dict.get("use_moe_router_bias", True):
        for i in gate_up:
            out.setdefault(
                f"layers.{i}.mlp.gate.e_score_correction_bias",
                torch.zeros(out[f"layers.{i}.mlp.gate.weight"].shape[0]),
            )
    return out, lm_head


def hf_name_to_ours(hf_name: str) -> list[tuple[str, Any]]:
    """Map one ``Step3p7TextModel`` tensor name to our name(s).

    Returns a list of ``(our_name, selector)``; ``selector`` is ``None`` (take the tensor as is) or
    ``("gate"|"up")`` for the two halves of ``gate_up_proj`` (split along dim 1).
    """
    if hf_name in ("embed_tokens.weight", "norm.weight"):
        return [("model." + hf_name, None)]
    m = re.match(r"^layers\.(\d+)\.(.+)$", hf_name)
    if m is None:
        raise KeyError(f"hf_oracle: unexpected HF name {hf_name!r}")
    i, suffix = m.group(1), m.group(2)
    prefix = f"model.layers.{i}."
    if suffix == "mlp.experts.gate_up_proj":
        return [(prefix + "moe.gate_proj.weight", "gate"), (prefix + "moe.up_proj.weight", "up")]
    return [(prefix + _HF_TO_OURS_SUFFIX.get(suffix, suffix), None)]


def _split(tensor: torch.Tensor, selector: Any) -> torch.Tensor:
    if selector is None:
        return tensor
    gate, up = tensor.chunk(2, dim=1)
    return gate if selector == "gate" else up


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def hf_reference_model(
    config_dict: dict,
    state_dict: dict[str, torch.Tensor],
    attn_implementation: str = "eager",
) -> tuple[Step3p7TextModel, torch.nn.Parameter]:
    """Build the fp32 ``Step3p7TextModel`` with our weights loaded strictly.

    Returns ``(model, lm_head_weight)``; ``lm_head_weight`` is a separate fp32 ``nn.Parameter``
    (requires grad) because the text model has no LM head. Use :func:`hf_forward_logits` to get
    logits with autograd and :func:`hf_grads_to_ours` to read gradients back in our names.
    """
    hf_cfg = hf_config_from_dict(config_dict, attn_implementation=attn_implementation)
    hf_sd, lm_head = convert_state_dict_to_hf(config_dict, state_dict)
    with torch.device("cpu"):
        model = Step3p7TextModel(hf_cfg)
    model = model.to(torch.float32)
    # HF's default pad_token_id=1 would give token 1 a zero embedding gradient; our model has no
    # padding_idx (it only affects gradients: the forward is a plain lookup).
    model.embed_tokens.padding_idx = None
    result = model.load_state_dict(hf_sd, strict=True)  # raises on any missing/unexpected key
    assert not result.missing_keys and not result.unexpected_keys, result
    model.eval()  # no dropout anywhere; eval only makes that explicit
    assert all(p.dtype == torch.float32 for p in model.parameters())
    lm_head_weight = torch.nn.Parameter(lm_head.clone(), requires_grad=True)
    return model, lm_head_weight


def hf_forward_logits(
    model: Step3p7TextModel,
    lm_head_weight: torch.Tensor,
    input_ids: torch.LongTensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, S, V] = final normed hidden states @ lm_head_weight.T (autograd enabled).

    ``Step3p7TextModel.forward`` already applies the final ``norm`` to ``last_hidden_state``.
    Positions are 0..S-1 and the mask is causal (+ sliding window on sliding layers).
    """
    out = model(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False)
    return F.linear(out.last_hidden_state, lm_head_weight)


def hf_reference_logits(
    config_dict: dict,
    state_dict: dict[str, torch.Tensor],
    input_ids: torch.LongTensor,
    attn_implementation: str = "eager",
) -> torch.Tensor:
    """fp32 reference logits [B, S, V] of the main model (MTP ignored)."""
    model, lm_head = hf_reference_model(config_dict, state_dict, attn_implementation=attn_implementation)
    with torch.no_grad():
        return hf_forward_logits(model, lm_head, input_ids=input_ids)


def hf_grads_to_ours(model: Step3p7TextModel, lm_head_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Gradients of the HF model's parameters, renamed/re-laid-out to our state-dict names.

    ``gate_up_proj.grad`` [E, 2I, H] is split into ``moe.gate_proj.weight`` / ``moe.up_proj.weight``.
    Router biases are buffers (no gradient) and MTP layers do not exist here, so neither appears.
    Parameters whose ``.grad`` is None are skipped. ``lm_head.weight`` is included if given.
    """
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        for ours, selector in hf_name_to_ours(name):
            grads[ours] = _split(param.grad, selector).detach().clone()
    if lm_head_weight is not None and lm_head_weight.grad is not None:
        grads["lm_head.weight"] = lm_head_weight.grad.detach().clone()
    return grads


# --------------------------------------------------------------------------------------------------
# Tiny random checkpoint in OUR layout (used by the oracle tests; reusable by model tests)
# --------------------------------------------------------------------------------------------------


def tiny_config_dict() -> dict:
    """The tests' tiny config (tests/helpers/models.py: 5 main layers, full, sliding, sliding, sliding, full;
    layer 0 dense, 1-4 MoE; 1 MTP layer; per-layer lists indexed by global layer id), narrowed so that
    every feature bites at S ~ 24 with random weights: an 8-key window; head_dim 16, so the full
    layers rotate 4 pairs, which llama3 scaling (L_orig 1024, low 1, high 8) puts in all three
    regimes (pair 0 unchanged, wavelength 6.3 < 128; pair 1 interpolated, wavelength 297, multiplier
    ~0.674; pairs 2-3 halved, wavelength > 1024); clamps small enough to clip."""
    from tests.helpers import tiny_config_dict as base

    return base(
        hidden_size=64,
        intermediate_size=96,
        vocab_size=128,
        torch_dtype="bfloat16",
        head_dim=16,
        moe_intermediate_size=32,
        share_expert_dim=32,
        sliding_window=8,
        eos_token_id=[1, 2],
        attention_other_setting={
            "attention_type": "sliding_attention",
            "num_attention_heads": 6,
            "num_attention_groups": 2,
            "head_dim": 16,
            "true_head_dim": 16,
        },
        # routed clamp on layers 3, 4; shared clamp on layer 4 (and the dense layer 0 via the
        # shared list), small enough to clamp with the random weights below
        swiglu_limits=[0.0, 0.0, 0.0, 1.0, 0.5, 0.0],
        swiglu_limits_shared=[0.7, 0.0, 0.0, 0.0, 0.5, 0.0],
    )


def _layer_shapes(config_dict: dict, i: int, mtp: bool) -> dict[str, tuple[int, ...]]:
    hsz = config_dict["hidden_size"]
    d = config_dict["head_dim"]
    n_kv = config_dict["num_attention_groups"]
    layer_types = config_dict.get("layer_types") or ["full_attention"] * (i + 1)
    n_q = config_dict["num_attention_heads"]
    if layer_types[i] == "sliding_attention" and config_dict.get("attention_other_setting"):
        n_q = config_dict["attention_other_setting"]["num_attention_heads"]
    shapes = {
        "input_layernorm.weight": (hsz,),
        "post_attention_layernorm.weight": (hsz,),
        "self_attn.q_proj.weight": (n_q * d, hsz),
        "self_attn.k_proj.weight": (n_kv * d, hsz),
        "self_attn.v_proj.weight": (n_kv * d, hsz),
        "self_attn.o_proj.weight": (hsz, n_q * d),
        "self_attn.g_proj.weight": (n_q, hsz),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
    }
    moe_layers = {int(x) for x in str(config_dict.get("moe_layers_enum", "")).split(",") if x.strip()}
    if config_dict.get("use_moe", True) and i in moe_layers and not mtp:
        e, inter, sh = (
            config_dict["moe_num_experts"],
            config_dict["moe_intermediate_size"],
            config_dict.get("share_expert_dim", config_dict.get("share_expert_dims")),
        )
        shapes.update(
            {
                "moe.gate.weight": (e, hsz),
                "moe.router_bias": (e,),
                "moe.gate_proj.weight": (e, inter, hsz),
                "moe.up_proj.weight": (e, inter, hsz),
                "moe.down_proj.weight": (e, hsz, inter),
                "share_expert.gate_proj.weight": (sh, hsz),
                "share_expert.up_proj.weight": (sh, hsz),
                "share_expert.down_proj.weight": (hsz, sh),
            }
        )
    else:
        inter = config_dict["intermediate_size"]
        shapes.update(
            {
                "mlp.gate_proj.weight": (inter, hsz),
                "mlp.up_proj.weight": (inter, hsz),
                "mlp.down_proj.weight": (hsz, inter),
            }
        )
    if mtp:
        shapes.update(
            {
                "enorm.weight": (hsz,),
                "hnorm.weight": (hsz,),
                "eh_proj.weight": (hsz, 2 * hsz),
                "transformer.shared_head.norm.weight": (hsz,),
                "transformer.shared_head.output.weight": (config_dict["vocab_size"], hsz),
            }
        )
    return shapes


def random_state_dict(config_dict: dict, seed: int = 0, gain: float = 1.5) -> dict[str, torch.Tensor]:
    """Random fp32 state dict in OUR HF-format layout (including MTP layers) for ``config_dict``.

    Linear weights ~ N(0, gain^2 / fan_in) so activations stay O(1) and the small swiglu limits
    clamp; norm weights ~ N(0, 0.5^2) (so ``1 + w`` matters); router biases ~ N(0, 0.5^2)
    (fp32, comparable to the sigmoid scores so they change the top-k choice).
    """
    g = torch.Generator().manual_seed(seed)
    hsz, vocab = config_dict["hidden_size"], config_dict["vocab_size"]
    n = config_dict["num_hidden_layers"]
    n_mtp = int(config_dict.get("num_nextn_predict_layers", 0) or 0)

    def rnd(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    sd = {
        "model.embed_tokens.weight": rnd((vocab, hsz), 1.0),
        "model.norm.weight": rnd((hsz,), 0.5),
        "lm_head.weight": rnd((vocab, hsz), 1.0 / math.sqrt(hsz)),
    }
    for i in range(n + n_mtp):
        for suffix, shape in _layer_shapes(config_dict, i, mtp=i >= n).items():
            if suffix.endswith("norm.weight") or suffix == "moe.router_bias":
                t = rnd(shape, 0.5)
            else:
                t = rnd(shape, gain / math.sqrt(shape[-1]))
            sd[f"model.layers.{i}.{suffix}"] = t
    return sd
