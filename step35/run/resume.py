"""What a resumed run may change, one rule for single-file (.ckpt) and sharded checkpoints:

- the command line wins for everything that does not change the tensors a checkpoint holds:
  lr and its schedule, betas, eps, weight_decay, mtp_loss_weight (while it stays non-zero),
  moe_* rates, loss_chunk_size, and config fields that change no shape (e.g. rope_scaling,
  sliding_window). The optimizer's restored param groups and the LR scheduler's base lr are
  overwritten with the command line's values after the restore (training/optimizer.py's
  `apply_resumed_settings`; that room names what of the optimizer a resume may change, and refuses
  another `model.optimizer`, whose state would not fit). Another `model.objective` is refused too
  (training/objective.py `resume_refusals`); `model.dpo`'s options may change (reported).
- a different model shape (config / config_overrides fields that change a tensor, num_mtp_layers)
  or a different set of trained parameters (mtp_loss_weight 0 <-> non-zero: MTP layers are frozen
  at 0, so the optimizer state has no entries for them) is refused before anything is loaded,
  listing the fields.
- LoRA (`model.lora`): turning it on or off, another rank, expert rank (resolved) or set of targets
  changes the adapters' shapes or which parameters train, and another alpha (resolved: null is the
  rank) changes the function of the adapters the checkpoint trained: each is refused naming the
  option and both values. dropout and base_dtype may change (reported).

Every difference from the checkpoint's own settings is printed, so a resume never changes a
setting silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.safe_load import load_torch
from step35.checkpoint.training import keys
from step35.checkpoint.training.trainer_io import check_loadable, load_meta
from step35.config import Step35Config
from step35.model import build_model
from step35.model.lora import LoraConfig
from step35.training import objective, optimizer

# Module options a resume may change (the command line wins); each one is reported when it does.
RUN_SETTINGS = optimizer.RESUMABLE + objective.RESUMABLE + ("moe_bias_update_rate",)


class ResumeMismatchError(ValueError):
    """The run's model differs in shape from the checkpoint it is asked to resume."""


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint says about the run that wrote it."""

    path: Path
    hparams: dict[str, Any]
    model_config: dict[str, Any] | None


def read_saved_run(path: str | Path) -> SavedRun:
    """The saved module options and model config of a checkpoint (a `.ckpt` file, or a sharded
    folder's `meta.pt`), read through step35's safe loader (no code runs) without its tensors."""
    path = check_loadable(path)
    state = load_meta(path) if path.is_dir() else load_torch(path, mmap=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a Lightning checkpoint dict")
    return SavedRun(path, dict(state.get(keys.HYPER_PARAMETERS) or {}), state.get(keys.MODEL_CONFIG))


def _shapes(config: dict, num_mtp_layers: int | None) -> dict[str, tuple]:
    model = build_model(Step35Config.from_dict(config), num_mtp_layers)  # meta: shapes only
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _changes_shapes(config: dict, num_mtp_layers: int | None, key: str, value, shapes: dict) -> bool:
    """Whether changing only `key` of `config` changes a tensor (or makes the config inconsistent)."""
    try:
        return _shapes({**config, key: value}, num_mtp_layers) != shapes
    except (ValueError, TypeError, KeyError):
        return True


def _fmt(value) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def check_resume(saved: SavedRun, model_config: Step35Config, hparams: dict[str, Any]) -> list[str]:
    """Raise ResumeMismatchError when the run (its model config and module options) cannot resume
    `saved`; else return one line per setting that differs from the checkpoint's (the run's is used)."""
    notes, refused = [], []
    current = model_config.to_dict()
    changed_fields = []
    if saved.model_config is not None:
        keys = sorted(set(saved.model_config) | set(current))
        changed_fields = [k for k in keys if saved.model_config.get(k) != current.get(k)]
    saved_mtp, mtp = saved.hparams.get("num_mtp_layers"), hparams.get("num_mtp_layers")
    if saved.model_config is not None and (changed_fields or saved_mtp != mtp):
        before, after = _shapes(saved.model_config, saved_mtp), _shapes(current, mtp)
        if before != after:
            shape_fields = [
                k for k in changed_fields if _changes_shapes(saved.model_config, saved_mtp, k, current[k], before)
            ]
            notes += [
                f"model config {k}: {_fmt(saved.model_config.get(k))} -> {_fmt(current.get(k))}"
                for k in changed_fields
                if k not in shape_fields
            ]
            fields = [
                f"{k}: {_fmt(saved.model_config.get(k))} -> {_fmt(current.get(k))}"
                for k in shape_fields or changed_fields
            ]
            if saved_mtp != mtp:
                fields.append(f"num_mtp_layers: {_fmt(saved_mtp)} -> {_fmt(mtp)}")
            tensors = [
                f"{n} {list(before[n]) if n in before else 'absent'} -> {list(after[n]) if n in after else 'absent'}"
                for n in sorted(set(before) | set(after))
                if before.get(n) != after.get(n)
            ]
            more = f" (and {len(tensors) - 3} more)" if len(tensors) > 3 else ""
            refused.append(f"the model shape differs: {'; '.join(fields)} (tensors: {'; '.join(tensors[:3])}{more})")
        else:
            notes += [
                f"model config {k}: {_fmt(saved.model_config.get(k))} -> {_fmt(current.get(k))} (shapes unchanged)"
                for k in changed_fields
            ]
    saved_weight, weight = saved.hparams.get("mtp_loss_weight"), hparams.get("mtp_loss_weight")
    if saved_weight is not None and (saved_weight == 0) != (weight == 0) and _has_mtp(current, mtp):
        refused.append(
            f"mtp_loss_weight: {saved_weight} -> {weight} changes which parameters train (MTP layers "
            f"are frozen at 0), so the checkpoint's optimizer state does not fit"
        )
    refused += optimizer.resume_refusals(saved.hparams, hparams)
    refused += objective.resume_refusals(saved.hparams, hparams)
    lora_refused, lora_notes = _lora_changes(saved.hparams.get("lora"), hparams.get("lora"), model_config)
    refused += lora_refused
    notes += lora_notes
    if refused:
        raise ResumeMismatchError(
            f"cannot resume from {saved.path}: "
            + "; ".join(refused)
            + ". Resume with the checkpoint's model options, or start a new run (--run_dir)"
        )
    for key in RUN_SETTINGS:
        if key in saved.hparams and _differs(saved.hparams[key], hparams.get(key)):
            notes.append(f"{key}: {_fmt(saved.hparams[key])} -> {_fmt(hparams.get(key))}")
    return notes


def _lora_changes(saved_value, value, model_config: Step35Config) -> tuple[list[str], list[str]]:
    """(refusals, notes) for the LoRA options of a resume: `saved_value` the checkpoint's `lora`
    hyper-parameter, `value` this run's (a dict of LoraConfig's fields, or None)."""
    saved, lora = LoraConfig.of(saved_value), LoraConfig.of(value)
    if saved is None and lora is None:
        return [], []
    if saved is None or lora is None:
        return [
            f"model.lora: {_fmt(saved_value)} -> {_fmt(value)} changes which parameters train (the LoRA "
            f"checkpoint holds only the adapters; a full one has no adapters)"
        ], []
    refused = []
    if saved.rank != lora.rank:
        refused.append(
            f"model.lora.rank: {saved.rank} -> {lora.rank} changes the shape of every dense adapter "
            f"(lora_A [rank, in], lora_B [out, rank]); resume with model.lora.rank={saved.rank}"
        )
    targets, saved_targets = lora.expanded_targets(), saved.expanded_targets()
    if targets != saved_targets:
        refused.append(
            f"model.lora.targets: {sorted(saved_targets)} -> {sorted(targets)} changes which parameters "
            f"train; resume with the checkpoint's targets"
        )
    elif "experts" in targets:
        before, after = saved.resolved_expert_rank(model_config), lora.resolved_expert_rank(model_config)
        if before != after:
            refused.append(
                f"model.lora.expert_rank: {before} -> {after} (resolved; set {_fmt(saved.expert_rank)} -> "
                f"{_fmt(lora.expert_rank)}) changes the routed experts' adapter shapes; resume with "
                f"model.lora.expert_rank={before}"
            )
    # Refused, not reported: each adapter adds (alpha / rank) * B A, so another alpha rescales the trained
    # adapters' contribution from the resumed step on: the resumed run trains another model than the
    # checkpoint's (its loss jumps) and every later update is scaled with it. Reporting it would still
    # change the model behind a note; to change alpha, start a new run.
    if saved.scale_alpha != lora.scale_alpha:
        refused.append(
            f"model.lora.alpha: {saved.scale_alpha:g} -> {lora.scale_alpha:g} (resolved: null is the rank) "
            f"rescales the trained adapters, another model than the checkpoint's; resume with "
            f"model.lora.alpha={saved.scale_alpha:g}"
        )
    notes = []
    if saved.dropout != lora.dropout:
        notes.append(f"model.lora.dropout: {_fmt(saved.dropout)} -> {_fmt(lora.dropout)}")
    if saved.resolved_base_dtype(model_config) != lora.resolved_base_dtype(model_config):
        notes.append(
            f"model.lora.base_dtype: {_fmt(saved.base_dtype)} -> {_fmt(lora.base_dtype)} (the frozen base "
            f"is read again in it)"
        )
    return refused, notes


def _has_mtp(config: dict, num_mtp_layers: int | None) -> bool:
    return (num_mtp_layers if num_mtp_layers is not None else config.get("num_nextn_predict_layers", 0)) > 0


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) != list(b)
    return a != b
