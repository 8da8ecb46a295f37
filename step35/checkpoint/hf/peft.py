"""A LoRA run's adapters as a PEFT adapter folder, and our own loader of such a folder (docs/lora.md).

`write_peft_folder` writes `adapter_config.json` and `adapter_model.safetensors` in the layout of
PEFT 0.21.2 (the version checked), published atomically with a manifest. Module names are the HF
checkpoint's, under PEFT's `base_model.model.` prefix:
- a dense adapter of `X.weight` ([out, in]): `X.lora_A.weight` [r, in] and `X.lora_B.weight` [out, r],
  X listed in `target_modules`;
- the routed experts' stacked `X.weight` [E, out, in] (PEFT's `target_parameters`, read as
  (experts, out, in) since PEFT 0.20): `X.lora_A.weight` [E*re, in], rows grouped by expert (expert e's
  A_e^T at rows e*re .. e*re+re-1), and `X.lora_B.weight` [out, re*E], columns interleaved (column
  k*E + e is column k of expert e's B_e^T), so PEFT's delta of expert e is scale * B_e^T A_e^T, the
  (A_e B_e)^T our forward adds; `rank_pattern` / `alpha_pattern` give the expert rank when it differs;
- full-trained targets (router, lm_head, embed) as `modules_to_save`, stored under their own names.
The base's identity (hf/lora_base.py) is kept in the safetensors metadata (BASE_METADATA), so a loader
can refuse a different base. The router bias, a buffer that `moe_bias_update_rate` > 0 moves, has no
place in a PEFT folder: the export says so (use --merge for the exact model).

`apply_peft_folder` / `peft_model` read such a folder, ours or PEFT's, trusting none of it: the config's
types and ranges, pattern keys matched literally (never run as regexes), each tensor's exact name and
shape before anything merges, finite merged weights; each refusal is one line naming the file.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import lora_base
from step35.checkpoint.hf.materialize import ignored_mtp_tensors
from step35.checkpoint.integrity import write_manifest
from step35.checkpoint.publish import partial_path, publish
from step35.checkpoint.safe_load import check_finite
from step35.config import Step35Config
from step35.model.lora import LoraConfig

PEFT_VERSION = "0.21.2"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# The safetensors metadata of a step35 PEFT folder: the model config and the base's identity, under the
# names a training checkpoint gives them (training/keys.py: MODEL_CONFIG, LORA_BASE).
CONFIG_METADATA = "step35_config"
BASE_METADATA = "step35_lora_base"
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def to_peft(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our adapter pair -> PEFT's lora_A / lora_B weights (dense as they are; experts stacked)."""
    if A.dim() == 2:
        return A, B
    E, in_features, r = A.shape
    return A.transpose(1, 2).reshape(E * r, in_features), B.permute(2, 1, 0).reshape(B.shape[2], r * E)


def from_peft(A: torch.Tensor, B: torch.Tensor, num_experts: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's lora_A / lora_B weights -> our pair (`num_experts` None: a dense adapter)."""
    if num_experts is None:
        return A, B
    E, r = num_experts, A.shape[0] // num_experts
    return A.reshape(E, r, A.shape[1]).transpose(1, 2), B.reshape(B.shape[0], r, E).permute(2, 1, 0)


def write_peft_folder(
    out: str | Path,
    adapters: dict[str, torch.Tensor],
    full: dict[str, torch.Tensor],
    lora: LoraConfig,
    config: Step35Config,
    base: dict | None,
    base_folder: str | None,
    dtype: torch.dtype,
) -> list[str]:
    """Write a LoRA run's `adapters` (our layout, model/lora.py: `X.lora_A` / `X.lora_B` of the adapted
    module X) and its full-trained tensors `full` (by HF name) as a PEFT folder at `out`, in `dtype`.
    `lora`: the run's LoRA options; `config`: its model config and `base`: its base's identity
    (lora_base.base_identity), both kept in the safetensors metadata; `base_folder`: the base's HF folder
    (base_model_name_or_path; None for a base drawn from the init). Returns notes (one line each) on
    what the folder cannot hold."""
    from safetensors.torch import save_file

    tensors, modules, parameters = {}, [], []
    expert_rank = None
    for prefix in sorted({n.rsplit(".", 1)[0] for n in adapters}):
        A, B = adapters[f"{prefix}.lora_A"], adapters[f"{prefix}.lora_B"]
        if A.dim() == 3:
            parameters.append(f"{prefix}.weight")
            expert_rank = A.shape[2]
        else:
            modules.append(prefix)
        peft_A, peft_B = to_peft(A, B)
        tensors[f"{PREFIX}{prefix}.lora_A.weight"] = peft_A.to(dtype).contiguous()
        tensors[f"{PREFIX}{prefix}.lora_B.weight"] = peft_B.to(dtype).contiguous()
    for name, tensor in full.items():
        tensors[f"{PREFIX}{name}"] = tensor.to(dtype).contiguous()
    pattern = {}
    if expert_rank is not None and expert_rank != lora.rank:
        pattern = {f"moe.{p}.weight": expert_rank for p in _EXPERT_PROJECTIONS}
    notes = []
    dropout = lora.dropout
    if parameters and dropout:
        notes.append(
            f"lora_dropout written as 0 (the run trained with {dropout}): PEFT refuses dropout on 3-D expert parameters"
        )
        dropout = 0.0
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "peft_version": PEFT_VERSION,
        "base_model_name_or_path": base_folder,
        "inference_mode": True,
        "r": lora.rank,
        "lora_alpha": lora.scale_alpha,
        "lora_dropout": dropout,
        "target_modules": modules,
        "target_parameters": parameters or None,
        "rank_pattern": pattern,
        "alpha_pattern": {k: lora.scale_alpha for k in pattern},
        "modules_to_save": sorted(n.rsplit(".", 1)[0] for n in full) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    metadata = {"format": "pt", CONFIG_METADATA: json.dumps(config.to_dict()), BASE_METADATA: json.dumps(base)}
    out = Path(out)
    tmp = partial_path(out)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, tmp / WEIGHTS_FILE, metadata=metadata)
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
        write_manifest(tmp, {"kind": "peft"})
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return notes


def is_peft_folder(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def check_not_adapter_folder(path: str | Path, option: str) -> None:
    """Refuse a PEFT adapter folder given as a model (`option`: model.checkpoint, --checkpoint), in one line that
    says what it is and what step35 does with one; any other path is left to its reader. An adapter folder
    holds no config.json nor base weights: read as a model it would fail on a missing file, naming neither."""
    path = Path(path).expanduser()
    if not (path / CONFIG_FILE).is_file() or (path / "config.json").is_file():
        return
    try:
        base = peft_base(path)
    except CheckpointError:
        base = None
    on = f"on its base {base}" if base else "on the base it names (base_model_name_or_path, unset here)"
    raise CheckpointError(
        f"{option} {path}: a PEFT adapter folder (LoRA adapters, {CONFIG_FILE}), not a model. `step35 generate "
        f"--checkpoint {path}` runs it merged {on}; to train or export, give the LoRA run it came from "
        "(`step35 export --checkpoint <run> --merge true` writes the merged HF folder) or train from the base "
        "(--model.checkpoint <base> with model.lora) (docs/lora.md)"
    )


# ------------------------------------------------------------------------------------------------ reading
# A PEFT folder comes from anywhere (a hub download): nothing in it is trusted. adapter_config.json is
# checked field by field; rank_pattern / alpha_pattern keys, which PEFT runs as regexes
# (`re.match(rf"(.*\.)?({key})$", name)`, first key in order wins), are matched literally instead: a key
# applies to a module name equal to it or ending in "." + key: PEFT's result for every key made of
# module-name characters, except that "." matches only "." (in PEFT's regex it matches any character,
# which no module name needs). A key with other characters is a regex this reader does not run (no
# catastrophic backtracking on attacker input), and a key that applies to nothing is refused too
# (PEFT would silently ignore it, and a silently ignored alpha changes the merged model). target_modules
# and modules_to_save are lists of names matched the same literal way (PEFT: `key.endswith(name)` for
# modules_to_save; this reader keeps the "." boundary); a regex target_modules string is refused. Every
# tensor of adapter_model.safetensors is checked for its name and exact shape against the model before
# anything merges, and every merged weight for finiteness.

_NEUTRAL = {
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None, []),
    "layers_pattern": (None, [], ""),
    "exclude_modules": (None, []),
    "lora_bias": (False, None),
    "trainable_token_indices": (None, {}, []),
}
_NAME_CHARS = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def read_adapter_config(adapter: str | Path) -> dict:
    """adapter_config.json of the PEFT folder `adapter`, checked (a CheckpointError names the file and field)."""
    path = Path(adapter) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(config).__name__}, not an object of PEFT settings")

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: {field}={_shown(config.get(field))}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", "only LoRA adapters can be merged")
    if not _is_int(config.get("r")) or config["r"] < 1:
        raise bad("r", "must be an integer >= 1")
    if not _is_positive(config.get("lora_alpha")):
        raise bad("lora_alpha", "must be a finite number > 0")
    for field, neutral in _NEUTRAL.items():
        if config.get(field) not in neutral:
            raise bad(field, f"not supported by step35's merge (use {neutral[0]!r})")
    if isinstance(config.get("target_modules"), str):
        raise bad("target_modules", "a regex (or 'all-linear'), which this reader does not run; list the module names")
    for field in ("target_modules", "target_parameters", "modules_to_save"):
        names = config.get(field)
        if names is not None and (not isinstance(names, list) or not all(_is_name(n) for n in names)):
            raise bad(field, "must be null or a list of module names (letters, digits, '_' and '.')")
    if not any(config.get(f) for f in ("target_modules", "target_parameters", "modules_to_save")):
        raise CheckpointError(
            f"{path}: adapts nothing (target_modules, target_parameters and modules_to_save are empty)"
        )
    for field, valid, need in (
        ("rank_pattern", _is_int_rank, "an integer >= 1"),
        ("alpha_pattern", _is_positive, "a finite number > 0"),
    ):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise bad(field, "must be an object of module name -> value")
        for key, value in pattern.items():
            if not _is_name(key):
                raise CheckpointError(
                    f"{path}: {field} key {_shown(key)} is a regex, which this reader does not run "
                    f"(keys match module names literally); spell the module name or its suffix"
                )
            if not valid(value):
                raise CheckpointError(f"{path}: {field}[{key!r}]={_shown(value)}: must be {need}")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise bad("base_model_name_or_path", "must be a folder path or null")
    return config


def _shown(value) -> str:
    """repr of a value read from an untrusted file, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_rank(value) -> bool:
    return _is_int(value) and value >= 1


def _is_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _is_name(value) -> bool:
    return isinstance(value, str) and len(value) <= 1000 and _NAME_CHARS.fullmatch(value) is not None


def _names_match(key: str, name: str) -> bool:
    r"""PEFT's `(.*\.)?({key})$` for a literal key: `name` is `key` or ends with "." + key."""
    return name == key or name.endswith("." + key)


def read_adapter_weights(adapter: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of adapter_model.safetensors; a damaged file is named in one line."""
    from safetensors import safe_open

    path = Path(adapter) / WEIGHTS_FILE
    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors' own error types (SafetensorError, OSError, ...): one line, the file named
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _recorded_base(adapter: Path, metadata: dict[str, str]) -> dict | None:
    """The base identity a step35 export keeps in the safetensors metadata (None: a PEFT folder from elsewhere)."""
    text = metadata.get(BASE_METADATA) or "null"
    try:
        record = json.loads(text)
    except ValueError:
        record = text
    if record is None or (isinstance(record, dict) and isinstance(record.get("folder"), str)):
        return record
    if isinstance(record, dict) and record.get("folder") is None and _is_int(record.get("init_seed")):
        return record
    raise CheckpointError(f"{adapter / WEIGHTS_FILE}: its metadata {BASE_METADATA} is not a base identity")


@dataclass
class _Merge:
    """One adapted weight: W += (alpha / rank) * B A (per expert for a routed experts' weight)."""

    weight: str  # the model's parameter name
    A: torch.Tensor  # in our layout (model/lora.py): [r, in], or [E, in, r]
    B: torch.Tensor  # [out, r], or [E, r, out]
    alpha: float
    rank: int


def _pattern_value(config: dict, field: str, name: str, default):
    """The value of the first `field` key (rank_pattern / alpha_pattern) that applies to `name`, PEFT's order."""
    for key, value in (config.get(field) or {}).items():
        if _names_match(key, name):
            return value
    return default


def _unbuilt_names(unbuilt: set[str]) -> set[str]:
    """The names a config key may match in MTP layers the model was built without, from their tensors'
    names: `M.lora_A.weight` stands for the module M (target_modules) and `M.weight` (target_parameters),
    a module to save's `M.p` for M."""
    names = set()
    for tensor in unbuilt:
        module, _, last = tensor.rpartition(".")
        if module.endswith((".lora_A", ".lora_B")):
            module = module.rsplit(".", 1)[0]
            names |= {module, f"{module}.weight"}
        else:
            names |= {module, tensor}
    return names


def _matched(keys, names) -> list[str]:
    return [n for n in names if any(_names_match(k, n) for k in keys or [])]


@dataclass(frozen=True)
class _Targets:
    """What adapter_config.json targets in a model, by the model's names."""

    dense: list[str]  # Linear modules adapted (target_modules)
    experts: list[str]  # routed experts' stacked [E, out, in] weights adapted (target_parameters)
    saved_roots: list[str]  # modules copied in whole (modules_to_save)


def _bare_tensors(tensors: dict[str, torch.Tensor], weights_file: Path) -> dict[str, torch.Tensor]:
    """The tensors by their names without PEFT's prefix, which every one must have."""
    outside = sorted(k for k in tensors if not k.startswith(PREFIX))
    if outside:
        raise CheckpointError(f"{weights_file}: holds {outside[0]}, not under PEFT's prefix {PREFIX!r}")
    return {k[len(PREFIX) :]: t for k, t in tensors.items()}


def _targets(
    config: dict,
    params: dict[str, torch.nn.Parameter],
    modules: dict[str, torch.nn.Module],
    unbuilt: set[str],
    config_file: Path,
) -> _Targets:
    """The config's keys matched in the model: every key must match a name of the model (or of its MTP layers not
    built: `unbuilt`), target_parameters only routed experts' weights, no module both adapted and saved, and every
    rank_pattern / alpha_pattern key an adapted one. A CheckpointError names `config_file` and the key."""
    linears = [m for m, mod in modules.items() if isinstance(mod, torch.nn.Linear)]
    targets = _Targets(
        _matched(config.get("target_modules"), linears),
        _matched(config.get("target_parameters"), params),
        _matched(config.get("modules_to_save"), modules),
    )
    for field, found in (
        ("target_modules", targets.dense),
        ("target_parameters", targets.experts),
        ("modules_to_save", targets.saved_roots),
    ):
        for key in config.get(field) or []:
            if not _matched([key], found) and not _matched([key], unbuilt):
                raise CheckpointError(f"{config_file}: {field} names {key!r}, which matches nothing in the model")
    for name in targets.experts:
        if params[name].dim() != 3 or not name.endswith(".weight"):
            raise CheckpointError(
                f"{config_file}: target_parameters matches {name} {list(params[name].shape)}, "
                f"not a routed experts' [E, out, in] weight"
            )
    overlap = [m for m in targets.dense if any(m == r or m.startswith(r + ".") for r in targets.saved_roots)]
    if overlap:
        raise CheckpointError(
            f"{config_file}: {overlap[0]} is both adapted (target_modules) and saved (modules_to_save)"
        )
    for field in ("rank_pattern", "alpha_pattern"):
        for key in config.get(field) or {}:
            if not _matched([key], targets.dense + targets.experts) and not _matched([key], unbuilt):
                raise CheckpointError(f"{config_file}: {field} key {key!r} applies to no adapted module")
    return targets


def _expected_tensors(
    config: dict, params: dict[str, torch.nn.Parameter], modules: dict[str, torch.nn.Module], targets: _Targets
) -> tuple[dict[str, tuple], list[tuple[str, float, int]]]:
    """({bare tensor name: the shape it must have}, [(weight name, alpha, rank)] per adapted weight)."""
    expected: dict[str, tuple] = {}
    settings = []
    for weight_name in [f"{m}.weight" for m in targets.dense] + targets.experts:
        is_experts = weight_name in targets.experts
        pattern_name = weight_name if is_experts else weight_name[: -len(".weight")]  # as PEFT matches
        rank = _pattern_value(config, "rank_pattern", pattern_name, config["r"])
        alpha = float(_pattern_value(config, "alpha_pattern", pattern_name, config["lora_alpha"]))
        weight = params[weight_name]
        num_experts = weight.shape[0] if is_experts else 1
        out_features, in_features = weight.shape[-2:]
        module = weight_name[: -len(".weight")]
        expected[f"{module}.lora_A.weight"] = (num_experts * rank, in_features)
        expected[f"{module}.lora_B.weight"] = (out_features, rank * num_experts)
        settings.append((weight_name, alpha, rank))
    for root in targets.saved_roots:
        for pname, param in modules[root].named_parameters(remove_duplicate=False):
            expected[f"{root}.{pname}"] = tuple(param.shape)
    return expected, settings


def _check_tensors(
    bare: dict[str, torch.Tensor], expected: dict[str, tuple], unbuilt: set[str], weights_file: Path
) -> None:
    """The tensors are exactly those `expected` (besides those of MTP layers not built: `unbuilt`), floating-point,
    of the expected shapes, and finite; else a CheckpointError names `weights_file` and the first tensor wrong."""
    missing = sorted(set(expected) - set(bare))
    if missing:
        raise CheckpointError(
            f"{weights_file}: lacks {PREFIX}{missing[0]} {list(expected[missing[0]])}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which {CONFIG_FILE} "
            f"asks for"
        )
    extra = sorted(set(bare) - set(expected) - unbuilt)
    if extra:
        raise CheckpointError(
            f"{weights_file}: holds {PREFIX}{extra[0]}{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}"
            f", which {CONFIG_FILE} does not target in this model"
        )
    for name, shape in expected.items():
        tensor = bare[name]
        if tuple(tensor.shape) != shape or not tensor.is_floating_point():
            raise CheckpointError(
                f"{weights_file}: {PREFIX}{name} is {str(tensor.dtype).removeprefix('torch.')} "
                f"{list(tensor.shape)}, the model needs a floating-point {list(shape)}"
            )
    check_finite(((PREFIX + n, bare[n]) for n in expected), weights_file)


def plan_merge(
    model: torch.nn.Module, config: dict, tensors: dict[str, torch.Tensor], adapter: Path
) -> tuple[list[_Merge], dict[str, torch.Tensor]]:
    """(the weights to merge, model parameter name -> tensor to copy in for modules_to_save), every name
    and shape checked against `model` first: a CheckpointError names adapter_config.json or the
    safetensors file and the key or tensor that is unmatched, missing, extra, mis-shaped or not finite."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    bare = _bare_tensors(tensors, adapter / WEIGHTS_FILE)
    unbuilt = ignored_mtp_tensors(model.config, model.num_mtp_layers, bare)  # of MTP layers not built: skipped
    targets = _targets(config, params, modules, _unbuilt_names(unbuilt), adapter / CONFIG_FILE)
    expected, settings = _expected_tensors(config, params, modules, targets)
    _check_tensors(bare, expected, unbuilt, adapter / WEIGHTS_FILE)
    merges = []
    for weight_name, alpha, rank in settings:
        module = weight_name[: -len(".weight")]
        A, B = from_peft(
            bare[f"{module}.lora_A.weight"],
            bare[f"{module}.lora_B.weight"],
            params[weight_name].shape[0] if weight_name in targets.experts else None,
        )
        merges.append(_Merge(weight_name, A, B, alpha, rank))
    copies = {name: bare[name] for name in expected if not name.endswith((".lora_A.weight", ".lora_B.weight"))}
    return merges, copies


@torch.no_grad()
def apply_peft_folder(model: torch.nn.Module, adapter: str | Path, base: str | Path | None = None) -> list[str]:
    """Merge the PEFT adapter folder `adapter` into `model` (a plain Step35ForCausalLM holding the base,
    loaded from the HF folder `base`): W += (alpha / r) * B A per module (alpha and r per module from
    alpha_pattern / rank_pattern), per expert for target_parameters, and modules_to_save copied in.
    Everything is checked before the model changes (`read_adapter_config`, `plan_merge`), except that a
    merged weight is finite: on that error the model is left part-merged (discard it). When the folder
    records its base (a step35 export), `base` must be that base (same fingerprint): else a
    CheckpointError names what differs. Returns the names of the weights merged into."""
    from step35.model.lora import merged_weight

    adapter = Path(adapter)
    config = read_adapter_config(adapter)
    tensors, metadata = read_adapter_weights(adapter)
    record = _recorded_base(adapter, metadata)
    if record is not None and record.get("folder") is not None:
        if base is None:
            raise CheckpointError(f"{adapter}: an adapter of the base {record['folder']}; name that base folder")
        lora_base.check_base(record, lora_base.base_identity(base, 0), adapter)
    merges, copies = plan_merge(model, config, tensors, adapter)
    state = model.state_dict()
    for merge in merges:
        weight = state[merge.weight]
        merged = merged_weight(merge.weight, weight, merge.A, merge.B, merge.alpha)
        if not bool(torch.isfinite(merged).all()):
            raise CheckpointError(
                f"{adapter / CONFIG_FILE}: alpha {merge.alpha:g} / r {merge.rank} merges "
                f"{merge.weight} into non-finite values (lora_alpha or alpha_pattern too large)"
            )
        weight.copy_(merged)
    for name, tensor in copies.items():
        state[name].copy_(tensor)
    return [merge.weight for merge in merges]


def peft_base(adapter: str | Path) -> str | None:
    """The base folder a PEFT adapter folder names (base_model_name_or_path), None if none."""
    return read_adapter_config(adapter).get("base_model_name_or_path") or None


def peft_model(adapter: str | Path, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, str | None]:
    """(the main model of a step35 PEFT folder's base with the adapters merged in, the base folder or
    None for a base drawn from the init). The base is the folder adapter_config.json names (its
    fingerprint checked), else the init of the seed recorded, with the model config recorded."""
    from step35.checkpoint.hf.pretrained import load_pretrained
    from step35.model import build_model

    adapter = Path(adapter)
    base = peft_base(adapter)
    if base:
        model = load_pretrained(base, dtype=torch.float32, num_mtp_layers=0)
    else:
        _, metadata = read_adapter_weights(adapter)
        record = _recorded_base(adapter, metadata)
        if record is None or record.get("folder") is not None or CONFIG_METADATA not in metadata:
            raise CheckpointError(f"{adapter}: names no base (base_model_name_or_path) and records no step35 base")
        from step35.checkpoint.hf.materialize import materialize

        try:
            model_config = Step35Config.from_dict(json.loads(metadata[CONFIG_METADATA]))
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(
                f"{adapter / WEIGHTS_FILE}: its metadata {CONFIG_METADATA} is not a model config "
                f"({type(e).__name__}: {e})"
            ) from None
        model = build_model(model_config, 0)
        materialize(model, "cpu", seed=record["init_seed"])
    merged = apply_peft_folder(model, adapter, base)  # merged in fp32, then cast
    model = model.to(device=device, dtype=dtype)
    for name in merged:  # finite in fp32 is not finite in float16
        if not bool(torch.isfinite(model.get_parameter(name)).all()):
            raise CheckpointError(
                f"{adapter / CONFIG_FILE}: the merged {name} overflows "
                f"{str(dtype).removeprefix('torch.')} (lora_alpha or alpha_pattern too large for it)"
            )
    return model, base
