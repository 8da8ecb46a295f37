"""Lightning training checkpoints (resume state): how step35 writes and reads them.

Two layouts, both published atomically (`publish`) with a manifest (`integrity`):
- a single file `x.ckpt` (one process, or Step35Strategy with save_distributed_checkpoint=False):
  torch.save of Lightning's dict; manifest in the sibling `x.ckpt.manifest.json`;
- a sharded folder `x.ckpt/` (Step35Strategy, DCP): `__<rank>_<i>.distcp` shards, DCP's
  `.metadata`, Lightning's `meta.pt`, and `step35.manifest.json`.

Reading verifies the manifest first (missing / truncated / damaged files named), unpickles only
through `safe_load`, and refuses NaN/Inf in the loaded weights and optimizer state.
`plugin.Step35CheckpointIO` (Lightning's side, apart so that export and generate read checkpoints
without importing Lightning) is the CheckpointIO plugin for trainers without Step35Strategy (the CLI
installs it); Step35Strategy calls the same functions.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch

from step35.checkpoint.errors import CheckpointError, raise_together
from step35.checkpoint.integrity import FILE_MANIFEST_SUFFIX, MANIFEST, damage_record, verify_for_load, write_manifest
from step35.checkpoint.publish import check_not_interrupted, partial_path, publish, remove_path
from step35.checkpoint.safe_load import check_bytes_items, check_finite, load_torch, safe_reader
from step35.checkpoint.training import keys


def disk_full(error: BaseException, folder: Path) -> bool:
    """Whether a failed save failed because the filesystem of `folder` is full: an OSError
    ENOSPC/EDQUOT (also inside DCP's CheckpointException text), or torch.save's own "[enforce fail
    ...] unexpected pos" (its C++ writer drops the errno) while that filesystem has no room left."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    if "No space left on device" in text or "Disk quota exceeded" in text:
        return True
    if "unexpected pos" in text:
        try:
            stat = os.statvfs(folder)
        except OSError:
            return False
        return stat.f_bavail * stat.f_frsize < 4 << 20
    return False


def file_size_limit(error: BaseException) -> str | None:
    """When a failed write hit the largest file this process may write: an OSError EFBIG (also in safetensors'
    or DCP's text), or torch.save's "unexpected pos" (its C++ writer drops the errno) under a file-size limit.
    Returns that limit in words ("this process's file-size limit, 1.0 MiB (ulimit -f 1024)", or the
    filesystem's largest file when no limit is set); None for another failure."""
    import resource

    seen: BaseException | None = error
    hit = False
    while seen is not None and not hit:
        hit = isinstance(seen, OSError) and seen.errno == errno.EFBIG
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    limited = limit != resource.RLIM_INFINITY
    if not (hit or "File too large" in text or ("unexpected pos" in text and limited)):
        return None
    if limited:
        return f"this process's file-size limit, {limit / 2**20:.1f} MiB (ulimit -f {limit // 1024})"
    return "the largest file its filesystem allows"


def no_space(path: Path) -> OSError:
    """The one-line error for a save that filled its filesystem (its partial files already removed)."""
    return OSError(
        errno.ENOSPC,
        f"{path}: no space left on device (ENOSPC) while saving this checkpoint; "
        f"the partial save was removed, the previous checkpoint (if any) is intact",
    )


def too_large(path: Path, limit: str) -> OSError:
    """The one-line error for a save with a file over the file-size limit (its partial files already removed)."""
    return OSError(
        errno.EFBIG,
        f"{path}: a file of this checkpoint would be larger than {limit} (EFBIG); raise the limit or save onto "
        f"a filesystem that allows larger files; the partial save was removed, the previous checkpoint (if any) "
        f"is intact",
    )


def write_failure(error: BaseException, path: Path) -> OSError | None:
    """The one-line error for the save of `path` that failed with `error` for want of room or over the
    file-size limit (see `disk_full`, `file_size_limit`); None for another failure."""
    if disk_full(error, path.parent):
        return no_space(path)
    limit = file_size_limit(error)
    return too_large(path, limit) if limit is not None else None


def save_file(checkpoint: dict, path: str | Path) -> None:
    """torch.save into a temporary sibling, manifest, then publish under `path`. A full disk raises
    OSError(ENOSPC) naming `path`; what the failed save wrote is removed before it propagates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    try:
        with open(tmp, "wb") as f:  # a file object: a full disk raises ENOSPC, not "unexpected pos"
            torch.save(checkpoint, f)
        finite = state_is_finite([checkpoint.get(keys.STATE_DICT, {}), checkpoint.get(keys.OPTIMIZER_STATES, [])])
        write_manifest(tmp, {**keys.manifest_extra(checkpoint, "file"), keys.MANIFEST_FINITE: finite})
        publish(tmp, path)
    except (OSError, RuntimeError) as e:
        mapped = write_failure(e, path)
        if mapped is None:
            raise
        raise mapped from None  # (after `finally` has removed the partial file)
    finally:  # only left when the save failed: remove what it wrote
        remove_leftovers(tmp)


def save_file_in_background(writer, checkpoint: dict, path: Path) -> bool:
    """`save_file` of a copy of `checkpoint` staged in host memory, on `writer`'s thread (a
    background.BackgroundWriter); False when staging failed (the caller saves synchronously)."""
    staged = writer.stage(checkpoint)
    if staged is None:
        return False
    path = Path(path)

    def write() -> int:
        save_file(staged, path)
        return path.stat().st_size

    writer.start(path, checkpoint.get(keys.GLOBAL_STEP, 0), write, collective=False)
    return True


def save_sharded(
    state: dict, meta: dict, tmp: Path, path: Path, extra: dict, rank: int, world_size: int, group=None
) -> int:
    """Write a sharded checkpoint: DCP shards of `state` (`state_dict`, `optimizer_<i>`) and rank 0's
    `meta.pt` into the empty partial folder `tmp`, each rank hashing its own shards; then every rank learns
    of a failure on any rank and whether every rank's state was finite (one gather on `group`, None: the
    world), and rank 0 writes the manifest and
    publishes `tmp` as `path`. A failure fails every rank together, after rank 0 removed `tmp` (a full disk:
    OSError ENOSPC naming `path`). Returns the bytes of the checkpoint on rank 0 (every file), 0 elsewhere. The callers
    (Step35Strategy, synchronous or in the background) end with a barrier of their own."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from step35.checkpoint.integrity import hash_files

    entries, failure, error = {}, None, None
    finite = state_is_finite(state)  # this rank's shards; agreed through the gather below, no collective of its own
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
        if rank == 0:
            torch.save(meta, tmp / keys.META_FILE)
        entries = hash_files(tmp, rank_files(tmp, rank))  # in parallel, while the pages are warm
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException); meta.pt fails on rank 0 alone
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        detail = next((ln for ln in reversed(lines) if "Error" in ln), lines[0])  # DCP: the last error line
        error = e
        known = write_failure(e, path)  # a full disk, the file-size limit: its errno and line, sent to every rank
        failure = (
            known and (known.errno, known.strerror),
            f"{path}: sharded save failed on rank {rank} ({detail[:300]})",
        )
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (entries, failure, finite), group=group)
    failures = [f for _, f, _ in gathered if f is not None]
    if failures:
        if rank == 0:
            remove_path(tmp)  # now, not at the next start
        dist.barrier(group=group)
        known = next((one_line for one_line, _ in failures if one_line), None)
        if known:
            raise OSError(*known) from error
        raise RuntimeError(failures[0][1]) from error
    size = 0
    if rank == 0:
        extra = {**extra, keys.MANIFEST_FINITE: all(ok for _, _, ok in gathered)}
        write_manifest(tmp, extra, {k: v for part, _, _ in gathered for k, v in part.items()})
        size = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
        publish(tmp, path)
    return size


def remove_leftovers(tmp: Path) -> None:
    """Delete a failed single-file save: the partial file and its manifest."""
    for leftover in (tmp, tmp.with_name(tmp.name + FILE_MANIFEST_SUFFIX)):
        leftover.unlink(missing_ok=True)


def remove(path: str | Path) -> None:
    """Delete a checkpoint (file or folder) and its own manifest. The manifest goes first: a kill
    half-way leaves an incomplete checkpoint (never picked), not a complete-looking one with files
    missing. A symlink (such as last.ckpt) goes alone: its target's manifest is not touched."""
    path = Path(path)
    folder = path.is_dir() and not path.is_symlink()
    (path / MANIFEST if folder else path.with_name(path.name + FILE_MANIFEST_SUFFIX)).unlink(missing_ok=True)
    remove_path(path)
    damage_record(path).unlink(missing_ok=True)


def check_loadable(path: str | Path) -> Path:
    """The checkpoint exists (or a clear error naming what an interrupted save left)."""
    path = Path(path)
    check_not_interrupted(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    return path


def state_is_finite(state) -> bool:
    """Whether every floating-point tensor in `state` (nested dicts, lists and tuples; a DTensor's local
    shard) is finite. One read of each tensor (its max |value|, NaN if it holds one: no temporary of its size),
    flags kept on their devices, one host sync per device."""
    flags: dict[torch.device, torch.Tensor] = {}

    def visit(value) -> None:
        if isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.numel():
                ok = torch.isfinite(torch.linalg.vector_norm(local, float("inf")))
                flags[ok.device] = ok if ok.device not in flags else flags[ok.device] & ok

    visit(state)
    return all(bool(ok) for ok in flags.values())  # host sync


def finite_state(checkpoint: dict, path: Path) -> None:
    """NaN/Inf in the weights or optimizer state of a loaded single-file checkpoint is refused."""
    check_finite(checkpoint.get(keys.STATE_DICT, {}).items(), path)
    for i, optim in enumerate(checkpoint.get(keys.OPTIMIZER_STATES, [])):
        for param, values in (optim.get("state") or {}).items():
            check_finite(((f"optimizer {i} {k} of parameter {param}", v) for k, v in values.items()), path)


def load_file(path: str | Path, map_location: Any = "cpu") -> dict:
    """Verify, then load a single-file checkpoint without running any code from it."""
    path = check_loadable(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path}: a sharded (DCP) checkpoint folder; resume it with Step35Strategy "
            f"(--trainer.strategy step35.strategy.Step35Strategy)"
        )
    verify_for_load(path)
    checkpoint = load_torch(path, mmap=True, map_location=map_location)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict")
    finite_state(checkpoint, path)
    return checkpoint


def load_meta(folder: str | Path) -> dict:
    """Lightning's `meta.pt` of a sharded folder (no tensors of the model), read safely; the
    folder's non-tensor DCP items (optimizer param_groups) are checked too, so every reader of a
    sharded folder (resume, export, generate) refuses a crafted one before loading anything else."""
    meta = Path(folder) / keys.META_FILE
    if not meta.is_file():
        raise CheckpointError(f"{meta}: missing; {folder} is not a Lightning sharded checkpoint")
    checkpoint = load_torch(meta)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{meta}: holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict")
    check_bytes_items(folder)
    return checkpoint


def dcp_load(state: dict, folder: Path) -> None:
    """`torch.distributed.checkpoint.load` through the safe metadata reader; DCP's own failures
    (raised as BaseException subclasses, with every rank's traceback) become one line naming the folder."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=safe_reader(folder))
    except (KeyboardInterrupt, SystemExit, CheckpointError):
        raise
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException is a BaseException)
        for failure in (getattr(e, "failures", None) or {}).values():  # our own refusal, raised inside DCP
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause)) from None
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else type(e).__name__)
        raise CheckpointError(f"{folder}: DCP load failed ({detail[:300]})") from None


def load_sharded(folder: str | Path, module: torch.nn.Module, optimizers: list, strict: bool = True) -> dict:
    """Fill `module` (DTensor parameters) and `optimizers` from a DCP folder; returns the rest
    (Lightning's meta.pt dict). The caller has verified the folder's manifest."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    folder = Path(folder)
    meta = load_meta(folder)  # first: a crafted meta.pt is refused before any collective
    state = get_model_state_dict(module)
    lora = meta.get(keys.LORA_BASE) is not None  # a LoRA run's: the frozen base was read from its folder
    if lora:
        frozen = frozen_state_keys(module)
        state = {k: v for k, v in state.items() if k not in frozen}
    module_state = {keys.STATE_DICT: state}
    dcp_load(module_state, folder)  # every key of `state` must be in the folder
    module.load_state_dict(module_state[keys.STATE_DICT], strict=strict and not lora)
    for i, optimizer in enumerate(optimizers):
        key = keys.optimizer_key(i)
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_load(optim_state, folder)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
        )
    return meta


# Names that wrappers insert in named_parameters() but not in state-dict keys (activation
# checkpointing, torch.compile); the full state dicts of checkpoints use the bare names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _bare_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def frozen_state_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of `module`'s frozen parameters (requires_grad False, tied names included):
    what a LoRA run's checkpoints leave out (the base, read again from its folder)."""
    return {_bare_name(n) for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def check_lora_state(saved: dict, module: torch.nn.Module, where) -> None:
    """A LoRA checkpoint file must hold every state-dict key of `module` but the frozen base, and no other."""
    expected = {_bare_name(k) for k in module.state_dict()} - frozen_state_keys(module)
    missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: a LoRA checkpoint that does not fit this model: "
            + (f"lacks {missing[:3]} " if missing else "")
            + (f"holds unknown {unexpected[:3]}" if unexpected else "")
            + f" ({len(missing)} missing, {len(unexpected)} unknown; same model.lora options?)"
        )


def named_optimizer_state(saved: dict, module: torch.nn.Module, optimizer, path: Path, index: int = 0) -> dict:
    """A full (unsharded) optimizer state saved with integer parameter ids, re-keyed by parameter
    name for `set_optimizer_state_dict`.

    The ids differ by writer: a one-process run numbers the parameters in optimizer order (group
    by group), Lightning's ModelParallelStrategy full save numbers them in module order. Both keep
    each group's parameters in optimizer order, so the j-th id of group g is the j-th parameter of
    group g of `optimizer` (built by the same configure_optimizers); a different grouping is refused."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(f"{path}: optimizer {index} state is not a torch optimizer state dict")
    saved_sizes = [len(g.get("params", ())) for g in groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"{path}: optimizer {index} was saved with parameter groups of sizes {saved_sizes}, "
            f"this model's optimizer has {sizes}; the checkpoint belongs to another model or "
            f"optimizer setup"
        )
    if all(isinstance(k, str) for k in saved["state"]):  # already by name
        return saved
    names = {id(p): _bare_name(n) for n, p in module.named_parameters()}
    key = {
        old: names[id(param)]
        for saved_group, group in zip(groups, optimizer.param_groups)
        for old, param in zip(saved_group["params"], group["params"])
    }
    missing = [k for k in saved["state"] if k not in key]
    if missing:
        raise CheckpointError(
            f"{path}: optimizer {index} has state for parameter ids {missing[:5]} that no parameter group lists"
        )
    return {
        "state": {key[k]: v for k, v in saved["state"].items()},
        "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in groups],
    }


def load_full_optimizers(
    checkpoint: dict, path: Path, module: torch.nn.Module, optimizers: list, strict: bool = True
) -> None:
    """Fill sharded `optimizers` (DTensor parameters of `module`, any world size) from a single-file
    checkpoint's full `optimizer_states`: each rank keeps its slice of the full tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not optimizers:  # validate / test / predict: the weights alone
        return

    def named_states() -> list[dict]:
        saved = checkpoint.get(keys.OPTIMIZER_STATES) or []
        if len(saved) != len(optimizers):
            raise CheckpointError(
                f"{path}: holds {len(saved)} optimizer states, this run has {len(optimizers)} optimizers"
            )
        return [named_optimizer_state(s, module, o, path, i) for i, (s, o) in enumerate(zip(saved, optimizers))]

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    for optimizer, named in zip(optimizers, raise_together(named_states)):
        set_optimizer_state_dict(module, optimizer, optim_state_dict=named, options=options)


def finite_modules(module: torch.nn.Module, optimizers: list, path: Path) -> None:
    """NaN/Inf in a loaded model (local shards) or optimizer state is refused, naming the tensor."""
    check_finite(module.state_dict().items(), path)
    names = {id(p): n for n, p in module.named_parameters()}
    for i, optimizer in enumerate(optimizers):
        for param, values in optimizer.state.items():
            name = names.get(id(param), "?")
            check_finite(((f"optimizer {i} {k} of {name}", v) for k, v in values.items()), path)


def rank_files(folder: Path, rank: int) -> list[str]:
    """The DCP shard files rank `rank` wrote (`__<rank>_<i>.distcp`): the ones it hashes."""
    return sorted(f for f in os.listdir(folder) if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
