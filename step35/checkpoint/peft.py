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
The base's identity (checkpoint/lora_base.py) is kept in the safetensors metadata, so a loader can
refuse a different base. The router bias, a buffer that `moe_bias_update_rate` > 0 moves, has no
place in a PEFT folder: the export says so (use --merge for the exact model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from step35.checkpoint import lora_base
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import write_manifest
from step35.checkpoint.materialize import ignored_mtp_tensors
from step35.checkpoint.publish import partial_path, publish
from step35.model.lora import is_adapter, is_full_target

PEFT_VERSION = "0.21.2"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
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


def write_peft_folder(trained, out: str | Path, dtype: torch.dtype) -> list[str]:
    """Write the adapters of the LoRA run checkpoint `trained` (a TrainedCheckpoint) as a PEFT folder at
    `out`, adapters in `dtype`; returns notes (one line each) on what the folder cannot hold."""
    from safetensors.torch import save_file

    lora = trained.lora
    config = trained.config
    targets = lora.expanded_targets()
    adapters = dict(trained.tensors(only=is_adapter))
    full = dict(trained.tensors(only=lambda n: is_full_target(n, targets)))
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
        notes.append(f"lora_dropout written as 0 (the run trained with {dropout}): PEFT refuses dropout on "
                     "3-D expert parameters")
        dropout = 0.0
    if (trained.hyper_parameters.get("moe_bias_update_rate") or 0) > 0:
        notes.append("the run moved the router bias (model.moe_bias_update_rate > 0), which a PEFT folder cannot "
                     "hold: serving base + adapters uses the base's bias; export with --merge for the exact model")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "peft_version": PEFT_VERSION,
        "base_model_name_or_path": trained.start_folder(), "inference_mode": True,
        "r": lora.rank, "lora_alpha": lora.scale_alpha, "lora_dropout": dropout,
        "target_modules": modules, "target_parameters": parameters or None,
        "rank_pattern": pattern, "alpha_pattern": {k: lora.scale_alpha for k in pattern},
        "modules_to_save": sorted(n.rsplit(".", 1)[0] for n in full) or None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
    }
    record = trained.meta.get(lora_base.RECORD_KEY)
    metadata = {"format": "pt", "step35_config": json.dumps(config.to_dict()),
                lora_base.RECORD_KEY: json.dumps(record)}
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


@torch.no_grad()
def apply_peft_folder(model: torch.nn.Module, adapter: str | Path, base: str | Path | None = None) -> None:
    """Merge the PEFT adapter folder `adapter` into `model` (a plain Step35ForCausalLM holding the base,
    loaded from the HF folder `base`): W += (lora_alpha / r) * B A per module, per expert for
    target_parameters, and modules_to_save copied in. When the folder records its base (a step35
    export), `base` must be that base (same fingerprint): else a CheckpointError names what differs."""
    from safetensors import safe_open

    from step35.model.lora import merged_weight

    adapter = Path(adapter)
    config = json.loads((adapter / CONFIG_FILE).read_text())
    with safe_open(adapter / WEIGHTS_FILE, framework="pt") as f:
        record = json.loads((f.metadata() or {}).get(lora_base.RECORD_KEY) or "null")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if record is not None and record.get("folder") is not None:
        if base is None:
            raise CheckpointError(f"{adapter}: an adapter of the base {record['folder']}; name that base folder")
        lora_base.check_base(record, lora_base.base_identity(base, 0), adapter)
    state = model.state_dict()
    alpha = float(config["lora_alpha"])
    experts = set(config.get("target_parameters") or [])
    unbuilt = ignored_mtp_tensors(model.config, model.num_mtp_layers,
                                  [f"{n}.weight" for n in config.get("target_modules") or []] + list(experts))
    for name in list(config.get("target_modules") or []) + [p[:-len(".weight")] for p in experts]:
        weight_name = f"{name}.weight"
        if weight_name in unbuilt:
            continue  # an MTP layer the model was built without
        if weight_name not in state:
            raise CheckpointError(f"{adapter}: adapts {name}, which the model has no weight of")
        A, B = tensors[f"{PREFIX}{name}.lora_A.weight"], tensors[f"{PREFIX}{name}.lora_B.weight"]
        weight = state[weight_name]
        A, B = from_peft(A, B, weight.shape[0] if weight_name in experts else None)
        merged = merged_weight(weight_name, weight, A, B, _alpha(config, weight_name, alpha))
        weight.copy_(merged)
    for name in config.get("modules_to_save") or []:
        for key in [k for k in tensors if k.startswith(f"{PREFIX}{name}.") and ".lora_" not in k]:
            if key[len(PREFIX):] in state:  # (not: an MTP layer the model was built without)
                state[key[len(PREFIX):]].copy_(tensors[key])


def peft_base(adapter: str | Path) -> str | None:
    """The base folder a PEFT adapter folder names (base_model_name_or_path), None if none."""
    return json.loads((Path(adapter) / CONFIG_FILE).read_text()).get("base_model_name_or_path") or None


def peft_model(adapter: str | Path, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, str | None]:
    """(the main model of a step35 PEFT folder's base with the adapters merged in, the base folder or
    None for a base drawn from the init). The base is the folder adapter_config.json names (its
    fingerprint checked), else the init of the seed recorded, with the model config recorded."""
    from safetensors import safe_open

    from step35.checkpoint.pretrained import load_pretrained
    from step35.config import Step35Config
    from step35.model import build_model

    adapter = Path(adapter)
    base = peft_base(adapter)
    if base:
        model = load_pretrained(base, dtype=torch.float32, num_mtp_layers=0)
    else:
        with safe_open(adapter / WEIGHTS_FILE, framework="pt") as f:
            metadata = f.metadata() or {}
        record = json.loads(metadata.get(lora_base.RECORD_KEY) or "null")
        if record is None or "step35_config" not in metadata:
            raise CheckpointError(f"{adapter}: names no base (base_model_name_or_path) and records no step35 base")
        from step35.checkpoint.materialize import materialize

        model = build_model(Step35Config.from_dict(json.loads(metadata["step35_config"])), 0)
        materialize(model, "cpu", seed=record["init_seed"])
    apply_peft_folder(model, adapter, base)  # merged in fp32, then cast
    return model.to(device=device, dtype=dtype), base


def _alpha(config: dict, key: str, alpha: float) -> float:
    """lora_alpha for `key` (alpha_pattern wins); merged_weight divides by the rank read from A."""
    import re

    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return float(value)
    return alpha

