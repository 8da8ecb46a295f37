"""Step35Config: the released `config.json` of Step-3.5-Flash, read and written as it is.

The per-layer lists (`layer_types`, `rope_theta`, `partial_rotary_factors`, `swiglu_limits`,
`swiglu_limits_shared`) hold one entry per *global* layer id: the `num_hidden_layers` main layers
followed by the `num_nextn_predict_layers` MTP layers (45 + 3 = 48 in the release).
Every field is described in docs/architecture.md §1.

A Step-3.7 config.json (WRAPPING_FAMILIES) is read as its `text_config`, the same language model. A
config.json of another model (its `model_type` / `architectures` not in MODEL_FAMILIES) is refused
before its fields are read; `from_json` warns, in one line each, about a file without model_type and
about the keys that no field uses (HF bookkeeping keys aside).
"""

from __future__ import annotations

import copy
import difflib
import json
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from step35.presets import PRESETS, RELEASE_KEY_ORDER

ATTENTION_TYPES = ("full_attention", "sliding_attention")
DEFAULT_RMS_NORM_EPS = 1e-5  # absent from the released config.json; the HF remote class default
FLOAT_DTYPE_NAMES = ("bfloat16", "float32", "float16", "float64")  # torch_dtype values (torch.<name>)

# The model families step35 trains: config.json `model_type` -> the `architectures` entries it accepts.
# The one place to add a family.
MODEL_FAMILIES: dict[str, tuple[str, ...]] = {
    "step3p5": ("Step3p5ForCausalLM",),
}
# Releases whose config.json wraps that language model: model_type -> (its architectures, the key holding the
# language model's fields). Step-3.7-Flash: the same language model as Step-3.5-Flash under `text_config`
# (model_type "step3p5"), beside a vision encoder (`vision_config`) that step35 carries through, untrained.
WRAPPING_FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    "step3p7": (("Step3p7ForConditionalGeneration",), "text_config"),
}
# Keys that transformers (or the hub) writes into any config.json and that mean nothing to step35's
# model: kept and written back, but not worth a warning. Any other key that is no field is named.
HF_BOOKKEEPING_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "use_cache",
        "pad_token_id",
        "initializer_range",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        # How the folder's weights are stored (an FP8 release's blocks): read by the checkpoint reader
        # (checkpoint/hf/fp8.py), not by the model; never written back (step35 writes no FP8 weights).
        "quantization_config",
    }
)


class ConfigError(ValueError):
    """A config.json (or preset) that cannot describe a working model; the message names the field."""

    step35_refusal = True  # said in one line, without a traceback (step35.faults)


class ConfigWarning(UserWarning):
    """A config.json that is read, but with something the user should know (keys step35 does not use)."""


@dataclass(frozen=True)
class LayerSpec:
    """Everything that differs between layers, resolved for one global layer id."""

    layer_id: int
    attention_type: str  # "full_attention" | "sliding_attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int  # first `rotary_dim` dims of each head rotate (partial RoPE)
    rope_scaled: bool  # llama3 frequency scaling applies to this layer
    uses_rope: bool
    is_moe: bool
    is_mtp: bool
    swiglu_limit: float  # routed-expert clamp (0 = off)
    swiglu_limit_shared: float  # shared-expert and dense-MLP clamp (0 = off)

    @property
    def sliding(self) -> bool:
        return self.attention_type == "sliding_attention"


@dataclass
class Step35Config:
    """Hyper-parameters of Step-3.5-Flash, named exactly as in the released config.json."""

    hidden_size: int = 4096  # H, the residual stream width
    intermediate_size: int = 11264  # width of the dense MLP (the dense main layers and the MTP layers)
    num_hidden_layers: int = 45  # main decoder layers; the MTP layers come on top of these
    max_seq_len: int = 262144  # longest context as the release states it; not read by step35 (kept for the file)
    max_position_embeddings: int = 262144  # longest context; a longer data.seq_len is refused
    vocab_size: int = 128896  # V, rows of the embedding and of every output head
    torch_dtype: str = "bfloat16"  # dtype of the stored weights, a torch attribute name (some files spell it `dtype`)
    use_qk_norm: bool = True  # RMSNorm over each q and k head before RoPE
    # comma-separated ids of the MoE layers; None: placed by moe_layer_offset / moe_every_n_layer
    moe_layers_enum: str | None = None
    num_attention_heads: int = 64  # query heads (full-attention layers; see attention_other_setting)
    num_attention_groups: int = 8  # KV heads (GQA groups)
    head_dim: int = 128  # d, width of one attention head
    use_moe: bool = True  # False: no MoE layer at all (every layer dense)
    moe_num_experts: int = 288  # E, routed experts per MoE layer
    moe_top_k: int = 8  # K, routed experts per token
    moe_intermediate_size: int = 1280  # width of one routed expert
    share_expert_dim: int = 1280  # width of the shared expert (alias `share_expert_dims`)
    moe_layer_offset: int = 0  # first MoE layer, used only without moe_layers_enum
    moe_every_n_layer: int = 1  # MoE layer spacing, used only without moe_layers_enum
    norm_expert_weight: bool = True  # renormalise the K routing weights to sum to one
    moe_router_activation: str = "sigmoid"  # router score function; only "sigmoid" is implemented
    moe_router_scaling_factor: float = 3.0  # factor on the (renormalised) routing weights
    att_impl_type: str = "GQA"  # attention kind; only "GQA" is implemented
    tie_word_embeddings: bool = False  # share the embedding matrix with lm_head
    rope_theta: list[float] | float = 10000.0  # RoPE base, one per global layer id or one for all
    # llama3 frequency scaling (factor, original length, low/high factors); None: off
    rope_scaling: dict[str, Any] | None = None
    # layer kinds rope_scaling applies to
    yarn_only_types: list[str] = field(default_factory=lambda: ["full_attention"])
    use_head_wise_attn_gate: bool = True  # sigmoid gate per head on the attention output (g_proj)
    sliding_window: int = 512  # keys a sliding-layer query sees, itself included
    use_moe_router_bias: bool = True  # routers carry a bias used only to choose experts, not to weight them
    need_fp32_gate: bool = True  # router matmul in fp32
    sink: bool = False  # attention sinks; not implemented (must stay False)
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention" per global layer id
    # per global layer id, whether it rotates; empty: every layer does
    use_rope_layers: list[bool] = field(default_factory=list)
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint (global ids after the main layers)
    # share of each head that RoPE rotates, per global layer id; empty: all
    partial_rotary_factors: list[float] = field(default_factory=list)
    eos_token_id: list[int] | int | None = None  # end-of-sequence id(s)
    bos_token_id: int | None = None  # beginning-of-sequence id
    # heads, groups and head_dim of the layer kind its attention_type names
    attention_other_setting: dict[str, Any] | None = None
    swiglu_limits: list[float] = field(default_factory=list)  # routed-expert SwiGLU clamp per global layer id (0: off)
    # shared-expert and dense-MLP clamp per global layer id (0: off)
    swiglu_limits_shared: list[float] = field(default_factory=list)
    zero_centered: bool = True  # RMSNorms scale by (1 + w) instead of w
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS  # epsilon of every RMSNorm (not in the released file)
    # Keys of the source file that are not fields (architectures, auto_map, model_type, ...),
    # kept so that `to_dict` writes back exactly what was read.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    key_order: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------- reading/writing
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Step35Config:
        check_model_family(raw)  # before the fields: another model's config fails here, not on layer_types
        raw = copy.deepcopy(raw)
        key_order = list(raw.keys())  # the source's keys, aliases included, before they are resolved
        names = {f.name for f in fields(cls)} - {"extra", "key_order"}
        # Aliases are read into their field and written back (by to_dict) from the field's current
        # value under the source's spelling; they are not kept in `extra`, where a stale copy would
        # be written back after the field changed (e.g. torch_dtype set by save_pretrained).
        for alias, name in _ALIASES.items():
            if alias in raw:
                value = raw.pop(alias)
                raw.setdefault(name, value)
        known = {k: raw[k] for k in raw if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        return cls(**known, extra=extra, key_order=key_order)

    def with_overrides(self, overrides: dict[str, Any]) -> Step35Config:
        """A copy with `overrides` applied and validated. Unlike a config.json, which may carry keys
        for other tools (architectures, auto_map, model_type, ...), every override must name a field:
        a misspelt one would otherwise be kept as an extra key and change nothing."""
        unknown = [key for key in overrides if key not in FIELD_NAMES and key not in _ALIASES]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(FIELD_NAMES), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"unknown config field {', '.join(hints)}; the fields are: {', '.join(sorted(FIELD_NAMES))}"
            )
        # A field is changed under the spelling the source used (`dtype` or `torch_dtype`, ...), so that
        # the written config.json keeps that spelling, whichever one the override used.
        raw = self.to_dict()
        for key, value in overrides.items():
            name = _ALIASES.get(key, key)
            spellings = [name] + [alias for alias, target in _ALIASES.items() if target == name]
            raw[next((s for s in spellings if s in raw), name)] = value
        return Step35Config.from_dict(raw)

    @classmethod
    def from_json(cls, path: str | Path) -> Step35Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json there") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:  # json nests one Python call per level: a damaged or hostile file
            raise ConfigError(
                f"{path}: nested deeper than the JSON reader follows; a config.json is one object of "
                "fields: restore the folder's own"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: holds a JSON {type(raw).__name__}, not an object of config fields")
        try:
            raw = language_model_fields(raw)
            config = cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{path}: {e}") from None
        _warn_about_file(raw, path)
        return config

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "key_order")}
        out: dict[str, Any] = {}
        order = self.key_order or list(RELEASE_KEY_ORDER)
        for key in order:
            if key in values:
                out[key] = values[key]
            elif key in self.extra:
                out[key] = self.extra[key]
            elif key == "share_expert_dims":
                out[key] = self.share_expert_dim
            elif key == "dtype":
                out[key] = self.torch_dtype
        for key, value in self.extra.items():
            out.setdefault(key, value)
        # Fields the source did not have are written only when they differ from the default
        # (the release has no rms_norm_eps; writing one back would change the file).
        for f in fields(self):
            if f.name in ("extra", "key_order") or f.name in out:
                continue
            if f.name == "share_expert_dim" and "share_expert_dims" in out:
                continue
            if f.name == "torch_dtype" and "dtype" in out:
                continue
            default = f.default if f.default_factory is _MISSING else f.default_factory()  # type: ignore[misc]
            if values[f.name] != default:
                out[f.name] = values[f.name]
        return copy.deepcopy(out)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ----------------------------------------------------------------------------- derived facts
    @property
    def num_total_layers(self) -> int:
        """Main layers plus MTP layers: the length of every per-layer list."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        if not self.use_moe:
            return []
        if self.moe_layers_enum:
            return [int(x) for x in str(self.moe_layers_enum).split(",") if x.strip()]
        return [
            i
            for i in range(self.num_hidden_layers)
            if i >= self.moe_layer_offset and (i - self.moe_layer_offset) % self.moe_every_n_layer == 0
        ]

    def _moe_layer_set(self) -> frozenset[int]:
        """`moe_layer_ids` as a set, kept while the fields it is computed from stay the same: `layer(i)`
        is called for every layer (validate, the model, the planner), and computing the ids anew at each
        call made a config of N layers cost N^2 (minutes for a 20,000-layer typo before any refusal)."""
        key = (
            self.use_moe,
            self.moe_layers_enum,
            self.moe_layer_offset,
            self.moe_every_n_layer,
            self.num_hidden_layers,
        )
        cached = self.__dict__.get("_moe_cache")
        if cached is None or cached[0] != key:
            cached = (key, frozenset(self.moe_layer_ids))
            self.__dict__["_moe_cache"] = cached
        return cached[1]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def layer(self, layer_id: int) -> LayerSpec:
        """The resolved shape and behaviour of global layer `layer_id` (main or MTP)."""
        attention_type = self.layer_types[layer_id]
        heads, groups, head_dim = self.num_attention_heads, self.num_attention_groups, self.head_dim
        other = self.attention_other_setting
        if other and other.get("attention_type") == attention_type:
            heads = other.get("num_attention_heads", heads)
            groups = other.get("num_attention_groups", groups)
            head_dim = other.get("head_dim", head_dim)
        theta = self.rope_theta[layer_id] if isinstance(self.rope_theta, list) else self.rope_theta
        factor = self.partial_rotary_factors[layer_id] if self.partial_rotary_factors else 1.0
        uses_rope = bool(self.use_rope_layers[layer_id]) if self.use_rope_layers else True
        is_mtp = layer_id >= self.num_hidden_layers
        return LayerSpec(
            layer_id=layer_id,
            attention_type=attention_type,
            num_heads=heads,
            num_kv_heads=groups,
            head_dim=head_dim,
            rope_theta=float(theta),
            rotary_dim=int(head_dim * factor),
            rope_scaled=self.rope_scaling is not None and attention_type in self.yarn_only_types,
            uses_rope=uses_rope,
            is_moe=(not is_mtp) and layer_id in self._moe_layer_set(),
            is_mtp=is_mtp,
            swiglu_limit=float(self.swiglu_limits[layer_id]) if self.swiglu_limits else 0.0,
            swiglu_limit_shared=float(self.swiglu_limits_shared[layer_id]) if self.swiglu_limits_shared else 0.0,
        )

    # ----------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise a ConfigError naming the first field that is wrong: of the wrong type, out of range, a
        per-layer list of the wrong length, a feature step35 does not implement, or a layer whose shapes
        do not fit."""
        for f in fields(self):
            if f.name not in ("extra", "key_order"):
                _check_type(f.name, getattr(self, f.name), f.type)
        self._check_sizes()
        self._check_layer_lists()
        self._check_implemented()
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)
        if self.use_moe:
            self._check_moe()
        self._check_each_layer()

    def _check_sizes(self) -> None:
        _require(self.num_hidden_layers >= 1, "num_hidden_layers", f"must be >= 1, got {self.num_hidden_layers}")
        _require(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        for name in (
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "head_dim",
            "num_attention_heads",
            "num_attention_groups",
            "max_position_embeddings",
        ):
            _require(int(getattr(self, name)) >= 1, name, f"must be >= 1, got {getattr(self, name)}")

    def _check_layer_lists(self) -> None:
        """One entry per global layer in every per-layer list, and known attention types."""
        n = self.num_total_layers
        expected = f"expected num_hidden_layers + num_nextn_predict_layers = {n}"
        _require(len(self.layer_types) == n, "layer_types", f"has {len(self.layer_types)} entries; {expected}")
        for name in ("partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared", "use_rope_layers"):
            values = getattr(self, name)
            _require(not values or len(values) == n, name, f"has {len(values)} entries; {expected}")
        if isinstance(self.rope_theta, list):
            _require(len(self.rope_theta) == n, "rope_theta", f"has {len(self.rope_theta)} entries; {expected}")
        for i, t in enumerate(self.layer_types):
            _require(t in ATTENTION_TYPES, f"layer_types[{i}]", f"unknown layer type {t!r}; known: {ATTENTION_TYPES}")
        for t in self.yarn_only_types:
            _require(t in ATTENTION_TYPES, "yarn_only_types", f"unknown layer type {t!r}")
        other = self.attention_other_setting
        if other is not None:
            _require(
                other.get("attention_type") in ATTENTION_TYPES,
                "attention_other_setting.attention_type",
                f"unknown layer type {other.get('attention_type')!r}",
            )

    def _check_implemented(self) -> None:
        """The dtype and the variants of the release that step35 computes."""
        _require(
            self.torch_dtype in FLOAT_DTYPE_NAMES,
            "torch_dtype",
            f"{self.torch_dtype!r} is not one of {FLOAT_DTYPE_NAMES}",
        )
        _require(self.att_impl_type == "GQA", "att_impl_type", f"only 'GQA' is implemented, got {self.att_impl_type!r}")
        _require(
            self.moe_router_activation == "sigmoid",
            "moe_router_activation",
            f"only 'sigmoid' is implemented, got {self.moe_router_activation!r}",
        )
        _require(not self.sink, "sink", "attention sinks are not implemented (the release has sink=false)")
        _require(self.sliding_window >= 1, "sliding_window", f"must be >= 1, got {self.sliding_window}")

    @staticmethod
    def _check_rope_scaling(scaling: dict[str, Any]) -> None:
        kind = scaling.get("rope_type", scaling.get("type"))
        _require(kind == "llama3", "rope_scaling.rope_type", f"only 'llama3' is implemented, got {kind!r}")
        for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"):
            _require(key in scaling, f"rope_scaling.{key}", "missing")
        _require(
            scaling["high_freq_factor"] > scaling["low_freq_factor"],
            "rope_scaling.high_freq_factor",
            "must be larger than low_freq_factor",
        )

    def _check_moe(self) -> None:
        _require(self.moe_num_experts >= 1, "moe_num_experts", f"must be >= 1, got {self.moe_num_experts}")
        _require(
            1 <= self.moe_top_k <= self.moe_num_experts,
            "moe_top_k",
            f"must be between 1 and moe_num_experts={self.moe_num_experts}, got {self.moe_top_k}",
        )
        try:
            ids = self.moe_layer_ids
        except ValueError:
            raise ConfigError(
                f"moe_layers_enum: not a comma-separated list of layer ids: {self.moe_layers_enum!r}"
            ) from None
        for i in ids:
            _require(
                0 <= i < self.num_hidden_layers,
                "moe_layers_enum",
                f"layer id {i} outside the main layers 0..{self.num_hidden_layers - 1}",
            )
        _require(len(set(ids)) == len(ids), "moe_layers_enum", "repeats a layer id")

    def _check_each_layer(self) -> None:
        """Each layer's heads, rotary dims and SwiGLU limits, as `layer` resolves them."""
        other = self.attention_other_setting
        for i in range(self.num_total_layers):
            spec = self.layer(i)
            where = "attention_other_setting" if other and other.get("attention_type") == spec.attention_type else ""
            _require(
                spec.num_heads % spec.num_kv_heads == 0,
                where or "num_attention_heads",
                f"layer {i} ({spec.attention_type}): {spec.num_heads} heads are not divisible by "
                f"{spec.num_kv_heads} KV groups (num_attention_groups)",
            )
            _require(
                0 < spec.rotary_dim <= spec.head_dim and spec.rotary_dim % 2 == 0,
                f"partial_rotary_factors[{i}]",
                f"gives {spec.rotary_dim} rotary dims of head_dim {spec.head_dim}; needs an even number in 2..head_dim",
            )
            _require(spec.swiglu_limit >= 0 and spec.swiglu_limit_shared >= 0, f"swiglu_limits[{i}]", "must be >= 0")


_MISSING = fields(Step35Config)[0].default_factory  # dataclasses.MISSING, spelled without importing it
FIELD_NAMES = frozenset(f.name for f in fields(Step35Config)) - {"extra", "key_order"}
_ALIASES = {
    "share_expert_dims": "share_expert_dim",  # the HF config class accepts both spellings
    "dtype": "torch_dtype",  # some re-uploads write "dtype"
}


def _check_type(name: str, value: Any, annotation: str) -> None:
    """`value` fits the field's annotation (written as a string: `int`, `list[float] | float`, ...), so that
    `"64"` for an int or `"false"` for a bool is refused by name instead of misbehaving later. JSON
    has one number type for a float field: an int is a float there; a bool is never a number."""
    accepted = []
    for part in (p.strip() for p in annotation.split("|")):
        kind = part.split("[")[0]
        accepted.append(kind)
        if kind == "None" and value is None:
            return
        if kind == "bool" and isinstance(value, bool):
            return
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if kind == "str" and isinstance(value, str):
            return
        if kind in ("list", "dict") and isinstance(value, {"list": (list, tuple), "dict": dict}[kind]):
            return
    names = {"None": "null", "dict": "object (dict)"}
    expected = " or ".join(names.get(k, k) for k in accepted)
    raise ConfigError(f"config field {name}: must be {expected}, got {value!r} ({type(value).__name__})")


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config field {field_name}: {message}")


def _accepted_families() -> str:
    return "; ".join(f"model_type {name!r} with architectures {list(archs)}" for name, archs in MODEL_FAMILIES.items())


def check_model_family(raw: dict[str, Any]) -> None:
    """Refuse the config of another model (a llama config.json given by mistake) by its `model_type` /
    `architectures` (MODEL_FAMILIES), before its fields are read as Step-3.5's: they would otherwise
    fail on some unrelated field (layer_types), or build a wrong model. Absent (or null) keys are
    accepted: hand-written configs lack them, and `from_json` warns about the file."""
    model_type = raw.get("model_type")
    if model_type is not None and (not isinstance(model_type, str) or model_type not in MODEL_FAMILIES):
        raise ConfigError(
            f"model_type is {model_type!r}, not a model step35 trains (accepted: {_accepted_families()}); "
            "is this the config.json of another model?"
        )
    architectures = raw.get("architectures")
    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"architectures must be a list of class names, got {architectures!r}")
    allowed = MODEL_FAMILIES.get(model_type) or tuple(a for archs in MODEL_FAMILIES.values() for a in archs)
    foreign = [a for a in architectures if a not in allowed]
    if foreign:
        raise ConfigError(
            f"architectures {architectures} names {foreign[0]!r}, not a model step35 trains "
            f"(accepted: {_accepted_families()}); is this the config.json of another model?"
        )


def language_model_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields of a config.json: the file itself for Step-3.5's, the wrapped config for a
    release in WRAPPING_FAMILIES (Step-3.7's `text_config`). ConfigError when the wrapper lacks it."""
    model_type = raw.get("model_type")
    if model_type not in WRAPPING_FAMILIES:
        return raw
    architectures, key = WRAPPING_FAMILIES[model_type]
    named = raw.get("architectures") or []
    foreign = [a for a in named if a not in architectures] if isinstance(named, list) else [named]
    if foreign:
        raise ConfigError(
            f"model_type {model_type!r} with architectures {named}: {foreign[0]!r} is not {list(architectures)}"
        )
    text = raw.get(key)
    if not isinstance(text, dict):
        raise ConfigError(
            f"model_type {model_type!r} holds its language model's fields under {key!r}, which is "
            f"{'missing' if text is None else 'a ' + type(text).__name__}"
        )
    text = dict(text)
    text.setdefault("model_type", "step3p5")
    return text


def unused_keys(raw: dict[str, Any]) -> list[str]:
    """Keys of a config.json that are neither a field (nor an alias of one) nor HF bookkeeping: kept
    and written back, but nothing in step35 reads them, so a misspelt field would change nothing."""
    return [key for key in raw if key not in FIELD_NAMES and key not in _ALIASES and key not in HF_BOOKKEEPING_KEYS]


def _warn_about_file(raw: dict[str, Any], path: Path) -> None:
    """One warning line per thing a user should see in the config.json `path` that was read: no
    model_type (taken for Step-3.5's), and the keys no field uses, named (with the field meant, when
    one is close)."""
    if raw.get("model_type") is None:
        warnings.warn(f"{path}: no model_type; read as Step-3.5 ({_accepted_families()})", ConfigWarning, stacklevel=3)
    unused = unused_keys(raw)
    if unused:
        names = []
        for key in unused:
            close = difflib.get_close_matches(key, sorted(FIELD_NAMES), n=1)
            names.append(key + (f" (did you mean {close[0]}?)" if close else ""))
        warnings.warn(
            f"{path}: {len(unused)} key(s) that are no Step-3.5 config field, kept in the file but "
            f"not used: {', '.join(names)}",
            ConfigWarning,
            stacklevel=3,
        )


# ------------------------------------------------------------------------------------ vision (Step-3.7)
DEFAULT_VISION_MLP_RATIO = 8960 / 1536  # the release's MLP width over its width (transformers' default)
VISION_ACTIVATIONS = ("quick_gelu", "gelu")


@dataclass(frozen=True)
class VisionConfig:
    """Step-3.7-Flash's vision encoder and projector (step35/model/vision.py), read from a Step-3.7 config.json:
    its `vision_config` (the release spells widths `width`, `layers`, `heads`; transformers `hidden_size`,
    `num_hidden_layers`, `num_attention_heads`: both are read, the release's first, as transformers does) and the
    top-level `projector_bias` and `image_token_id`. The MLP width is int(width x mlp_ratio), as transformers
    computes it (its `intermediate_size` is not read). Defaults: the release's."""

    hidden_size: int = 1536  # D, the encoder's width; the downsamplers make it 2D then 4D
    num_hidden_layers: int = 47
    num_attention_heads: int = 16
    intermediate_size: int = 8960  # the encoder MLP's width
    image_size: int = 728  # the global view's side; its grid (side / patch_size)^2 is the position table's
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0  # the encoder's 2-D rotary base
    projector_bias: bool = False  # vit_large_projector.bias exists
    image_token_id: int = 151679  # the placeholder token the image features replace

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size"):
            _require(int(getattr(self, name)) >= 1, f"vision_config.{name}", f"must be >= 1, got {getattr(self, name)}")
        _require(
            self.hidden_size % (4 * self.num_attention_heads) == 0,
            "vision_config.hidden_size",
            f"{self.hidden_size} must split into {self.num_attention_heads} heads of a width divisible by 4 "
            "(the 2-D rotary embedding rotates a quarter of each head per axis pair)",
        )
        _require(
            self.image_size >= self.patch_size and self.image_size % self.patch_size == 0,
            "vision_config.image_size",
            f"{self.image_size} must be a multiple of patch_size {self.patch_size}",
        )
        _require(
            self.hidden_act in VISION_ACTIVATIONS,
            "vision_config.hidden_act",
            f"{self.hidden_act!r} is not one of {VISION_ACTIVATIONS}",
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_release(cls, raw: dict[str, Any]) -> VisionConfig:
        """The vision side of a Step-3.7 config.json `raw` (a dict); ConfigError without `vision_config`."""
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(
                f"model_type {raw.get('model_type')!r}: no 'vision_config' object, so no vision encoder to build "
                "(a Step-3.7-Flash config.json has one)"
            )
        width = vision.get("width", vision.get("hidden_size", cls.hidden_size))
        rope = vision.get("rope_parameters") or {}
        values = {
            "hidden_size": width,
            "num_hidden_layers": vision.get("layers", vision.get("num_hidden_layers", cls.num_hidden_layers)),
            "num_attention_heads": vision.get("heads", vision.get("num_attention_heads", cls.num_attention_heads)),
            "intermediate_size": int(width * vision.get("mlp_ratio", DEFAULT_VISION_MLP_RATIO)),
            "image_size": vision.get("image_size", cls.image_size),
            "patch_size": vision.get("patch_size", cls.patch_size),
            "num_channels": vision.get("num_channels", cls.num_channels),
            "layer_norm_eps": vision.get("layer_norm_eps", cls.layer_norm_eps),
            "hidden_act": vision.get("hidden_act", cls.hidden_act),
            "rope_theta": rope.get("rope_theta", vision.get("rope_theta", cls.rope_theta)),
            "projector_bias": raw.get("projector_bias", cls.projector_bias),
            "image_token_id": raw.get("image_token_id", cls.image_token_id),
        }
        for f in fields(cls):
            _check_type(f"vision_config.{f.name}", values[f.name], f.type)
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> VisionConfig:
        """The vision side of the config.json `path` (or of the folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"{path}: cannot read it as JSON ({type(e).__name__}: {e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: holds a JSON {type(raw).__name__}, not an object of config fields")
        try:
            return cls.from_release(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def load_vision_config(name_or_path: str | Path) -> VisionConfig:
    """The vision side of a preset (`tiny-vl`), a Step-3.7 config.json or a folder holding one."""
    name = str(name_or_path)
    if name in PRESETS:
        return VisionConfig.from_release(PRESETS[name]())
    return VisionConfig.from_json(Path(name).expanduser())


def preset(name: str) -> Step35Config:
    """A named config: `flash-196b` (the released model, exactly), `tiny`, or `tiny-vl` (read as its language
    model, `tiny`; its vision side: load_vision_config)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the presets are: {', '.join(sorted(PRESETS))}")
    return Step35Config.from_dict(language_model_fields(PRESETS[name]()))


def load_config(name_or_path: str | Path) -> Step35Config:
    """A preset name, a config.json file, or an HF checkpoint folder holding one."""
    name = str(name_or_path)
    if name in PRESETS:
        return preset(name)
    path = Path(name).expanduser()
    if not path.exists():
        presets = ", ".join(sorted(PRESETS))
        if _looks_like_path(name):
            raise ConfigError(
                f"{name}: no such file or folder (give a config.json, a checkpoint folder holding one, "
                f"or a preset: {presets})"
            )
        close = difflib.get_close_matches(name, sorted(PRESETS), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown preset {name!r}{hint}; the presets are: {presets} "
            "(or give a config.json file or a checkpoint folder holding one)"
        )
    return Step35Config.from_json(path)


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.startswith((".", "~")) or name.endswith(".json")
