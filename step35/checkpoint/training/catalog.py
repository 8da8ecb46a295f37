"""The checkpoints of one folder (a run's `checkpoints/`): which are complete, which is the newest,
the `last.ckpt` pointer to it, what killed saves left behind, and retention of the newest K.

A checkpoint is any `*.ckpt` entry of the folder (a single file or a sharded folder) that carries
its manifest (`step35.checkpoint.integrity`, written last by every save): without one, its save
did not finish and it is never picked. "Newest" is the highest global step (the manifest's
`extra.global_step`, keys.MANIFEST_GLOBAL_STEP, else the `step=N` in the name), whoever wrote it:
the periodic `RunCheckpoint` callback or a pre-emption save.

`last.ckpt` is a relative symlink to the newest complete checkpoint, switched by one rename of a
freshly made link (`publish`), so there is no moment without it and never one where it names a partial
save. It is a convenience for people and tools (`step35 export --checkpoint .../last.ckpt`);
`--ckpt_path last|auto` does not trust it and scans the folder.

A reader of a live run's checkpoint (`step35 export|generate`) holds it against retention while it reads
(`reading`): a marker `.<name>.reading-<pid>-<id>` beside it, flock'ed by the reader. `prune` passes over a
held checkpoint (the next save's prune deletes it) and deletes the markers of readers that died.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import FILE_MANIFEST_SUFFIX, is_complete, manifest_info, manifest_path
from step35.checkpoint.publish import (
    interrupted_publish,
    leftover_of,
    leftovers,
    partial_path,
    publish,
    remove_path,
    restore,
)
from step35.checkpoint.training import keys
from step35.checkpoint.training.trainer_io import remove

LAST = "last.ckpt"
SUFFIX = ".ckpt"
READING = ".reading-"  # `.<name>.reading-<pid>-<id>`: a reader's hold on checkpoint <name>
_STEP = re.compile(r"step=(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint of a folder and the global step it was saved at."""

    path: Path
    global_step: int
    saved_ns: int  # modification time of its manifest: orders checkpoints of the same step
    finite: bool | None = None  # weights and optimizer state finite when saved (None: not recorded)


def _is_candidate(path: Path) -> bool:
    name = path.name
    if name.startswith(".") or name.endswith(FILE_MANIFEST_SUFFIX) or not name.endswith(SUFFIX):
        return False
    return not (name == LAST and path.is_symlink())


def step_from_name(path: str | Path) -> int:
    """The N of `step=N` in a checkpoint's name (-1 when there is none)."""
    match = _STEP.search(Path(path).name)
    return int(match.group(1)) if match else -1


def _read(path: Path) -> Checkpoint:
    extra = manifest_info(path).get("extra", {})
    step = extra.get(keys.MANIFEST_GLOBAL_STEP)
    finite = extra.get(keys.MANIFEST_FINITE)
    return Checkpoint(
        path,
        step if isinstance(step, int) else step_from_name(path),
        manifest_path(path).stat().st_mtime_ns,
        finite if isinstance(finite, bool) else None,
    )


def complete_checkpoints(folder: str | Path) -> list[Checkpoint]:
    """The complete checkpoints of `folder`, oldest first (by global step, then modification time)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        if not _is_candidate(path):
            continue
        try:  # a checkpoint deleted meanwhile (retention in a running job) is simply not there
            found.append(_read(path))
        except (CheckpointError, OSError):
            continue
    return sorted(found, key=lambda c: (c.global_step, c.saved_ns, c.path.name))


def incomplete_checkpoints(folder: str | Path) -> list[Path]:
    """`*.ckpt` entries without a manifest: saves that did not finish (or that predate manifests)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _is_candidate(p) and not is_complete(p))


def _newest(found: list[Checkpoint], finite: bool = False) -> Checkpoint | None:
    """The checkpoint of `found` with the highest global step (with `finite`: of those not recorded as
    non-finite); None when there is none."""
    candidates = [c for c in found if c.finite is not False] if finite else found
    return max(candidates, key=lambda c: (c.global_step, c.saved_ns), default=None)


def _complete_in(folders: list[str | Path]) -> list[Checkpoint]:
    return [c for folder in dict.fromkeys(Path(f) for f in folders) for c in complete_checkpoints(folder)]


def newest_complete(folders: list[str | Path]) -> Checkpoint | None:
    """The complete checkpoint with the highest global step over `folders` (None when there is none)."""
    return _newest(_complete_in(folders))


def recorded_non_finite(path: str | Path) -> bool:
    """Whether the manifest of checkpoint `path` records NaN/Inf in its weights or optimizer state."""
    return manifest_info(Path(path)).get("extra", {}).get(keys.MANIFEST_FINITE) is False


def newest_finite(folders: list[str | Path]) -> Checkpoint | None:
    """The newest complete checkpoint not recorded as non-finite: what `last.ckpt` names and retention keeps."""
    return _newest(_complete_in(folders), finite=True)


def point_last_to_newest(folder: str | Path) -> Path | None:
    """`last.ckpt` to the newest finite checkpoint of `folder` (else the newest one), if there is any."""
    found = complete_checkpoints(folder)  # one listing for both
    chosen = _newest(found, finite=True) or _newest(found)
    return point_last(folder, chosen.path) if chosen is not None else None


def point_last(folder: str | Path, target: str | Path) -> Path | None:
    """Switch `folder/last.ckpt` to `target` (a checkpoint in `folder`) in one atomic step.
    A `last.ckpt` that is a real checkpoint (saved by Lightning's `save_last`) is left alone: None."""
    folder, target = Path(folder), Path(target)
    last = folder / LAST
    if (last.exists() or last.is_symlink()) and not last.is_symlink():
        return None
    # A fresh link in a temporary sibling (a kill before the switch leaves a leftover that
    # `clean_leftovers` recognises), switched in by the one atomic publish.
    tmp = partial_path(last)
    os.symlink(target.name, tmp)
    publish(tmp, last)
    return last


def clean_leftovers(folder: str | Path) -> list[str]:
    """Tidy what killed saves left in `folder` and say what was done, one line per entry:
    a checkpoint that an interrupted folder swap had moved aside (its final name missing) is
    renamed back; every other leftover (partial writes, retired copies) is deleted."""
    folder = Path(folder)
    done = []
    for path in leftovers(folder):
        name, kind = leftover_of(path)
        final = folder / name
        if kind == "old" and interrupted_publish(final) == path:
            restore(final)
            done.append(f"restored {final} (an interrupted save had moved it aside to {path.name})")
        elif path.exists() or path.is_symlink():
            remove_path(path)
            done.append(f"removed {path} (left by a save of {name} that was killed)")
    return done


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Hold checkpoint `path` against `prune` while it is read: a marker beside it, flock'ed by this process
    (the kernel drops the flock when the reader dies, however it dies). Best effort: where the marker cannot be
    made (a folder this process may not write), the checkpoint is read without a hold."""
    real = Path(os.path.realpath(path))
    marker = real.parent / f".{real.name}{READING}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            marker.unlink(missing_ok=True)
            os.close(fd)  # drops the flock


def held_for_reading(folder: str | Path) -> set[str]:
    """The names of `folder`'s checkpoints that a live reader holds (`reading`); the markers of readers that
    are gone are deleted."""
    held = set()
    for marker in Path(folder).glob(f".*{READING}*"):
        try:
            fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # deleted meanwhile: its reader is done
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            marker.unlink(missing_ok=True)  # nobody holds it: its reader died
        except BlockingIOError:
            held.add(marker.name[1 : marker.name.rindex(READING)])
        finally:
            os.close(fd)
    return held


def prune(folder: str | Path, keep: int, protect: list[str | Path] = ()) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints of `folder`; never the newest one, nor the
    newest finite one (a run whose weights turned NaN keeps the last checkpoint it can resume from), nor
    any path in `protect` (e.g. the checkpoint this run resumed from), nor one a reader holds (`reading`).
    Returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept")
    found = complete_checkpoints(folder)
    finite = _newest(found, finite=True)
    protected = {Path(p).resolve() for p in [*protect, finite.path if finite else None] if p}
    held = held_for_reading(folder)
    removed = []
    for checkpoint in found[:-keep]:
        if checkpoint.path.resolve() in protected or checkpoint.path.name in held:
            continue
        remove(checkpoint.path)
        removed.append(checkpoint.path)
    return removed
