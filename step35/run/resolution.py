"""Which checkpoint a run resumes, decided once before the Trainer exists.

`--ckpt_path last`: the newest *intact* checkpoint of the run's checkpoint folders (an error when
there is none); `auto`: the same, or a fresh start when the folders hold no checkpoint at all.
Newer checkpoints that are not intact are skipped, each said with the reason, so an automatic
restart recovers from a damaged newest save. Intact means: its manifest is there and parses, every
file it lists is present at its listed size, and the checkpoint's saved options read through the
safe loader. Checksums are not computed here: that would read the whole checkpoint once more on one
rank before training (terabytes for flash-196b); every loader checks them, split over the ranks, and
a mismatch there stops the run naming the file and records the damage beside the checkpoint
(`.<name>.damaged`, step35.checkpoint.integrity.record_damage): the next restart skips it like any
other damaged checkpoint, so a flipped byte costs one failed attempt, not every restart.

A checkpoint listed but gone when checked (a live run saving with keep_last prunes its older checkpoints
as it writes new ones; its removal deletes the manifest first) is not damaged: the folders are listed
again. `read_checkpoint` reads what `step35 export|generate --checkpoint` names the same way: the run's
newest checkpoint then when the one chosen is removed or replaced while it is read.

A path given by name must carry its manifest unless the user opts in (`--allow_unverified_checkpoint`).
The checkpoint's saved options are read here once; `Resume.check` applies the resume rule
(step35/run/resume.py) to the run's model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import manifest_path, require_manifest, verify
from step35.checkpoint.training import catalog, keys
from step35.run.layout import RunFolder
from step35.run.resume import SavedRun, check_resume, read_saved_run

ALLOW_UNVERIFIED = "--allow_unverified_checkpoint"
# How often the checkpoints are listed again when one vanished as it was checked: a live run saving
# with keep_last removes its older checkpoints as it writes new ones, and a new list finds the newest.
_RELISTS = 5
# How often a checkpoint a live run removed or replaced while it was read gives way to the newest one then.
ROTATION_RETRIES = 3
T = TypeVar("T")
# Values Lightning resolves itself; passed on untouched.
LIGHTNING_VALUES = ("best", "hpc", "registry")


class NoCheckpoint(ValueError):
    """`--ckpt_path last|auto` found nothing it may resume; `damaged`: why each complete one was passed over."""

    def __init__(self, message: str, damaged: list[str] = ()):
        super().__init__(message)
        self.damaged = list(damaged)


@dataclass
class Resume:
    """The checkpoint a run resumes and what it says about the run that wrote it."""

    saved: SavedRun
    global_step: int | None = None
    skipped: list[str] = field(default_factory=list)  # newer checkpoints passed over, with the reason

    @property
    def path(self) -> Path:
        return self.saved.path

    def check(self, model_config, hparams: dict) -> list[str]:
        """The resume rule: raise ResumeMismatchError for a different model shape; else one line per
        setting this run changes (the run's value is used)."""
        return check_resume(self.saved, model_config, hparams)


def is_lightning_value(value) -> bool:
    return value in LIGHTNING_VALUES or str(value).startswith("registry:")


def _intact(path: Path) -> SavedRun:
    manifest = verify(path, sizes_only=True)
    if manifest.get("extra", {}).get(keys.MANIFEST_FINITE) is False:
        raise CheckpointError(
            "its weights or optimizer state held NaN/Inf when it was saved (recorded in its manifest)"
        )
    return read_saved_run(path)


class _Vanished(Exception):
    """A checkpoint listed as complete was removed before it was checked (a live run's retention)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path


def _newest_intact(
    found: list[catalog.Checkpoint], value: str, where: str, say: Callable[[str], None]
) -> tuple[Resume | None, list[str]]:
    """The newest intact checkpoint of `found` (None when none is) and the newer damaged ones passed
    over, each said. Raises _Vanished for one removed meanwhile: its removal deletes the manifest first
    (trainer_io.remove), so a checkpoint still carrying its manifest and failing a check is damaged."""
    skipped = []
    for candidate in sorted(found, key=lambda c: (c.global_step, c.saved_ns), reverse=True):
        try:
            saved = _intact(candidate.path)
        except (CheckpointError, OSError) as error:
            if not manifest_path(candidate.path).exists():
                raise _Vanished(candidate.path) from None
            skipped.append(f"{candidate.path}: {error}")
            say(
                f"--ckpt_path {value}: skipping {candidate.path} (global step {candidate.global_step}), it is "
                f"damaged: {error}"
            )
            continue
        say(
            f"--ckpt_path {value}: resuming from {candidate.path} (global step {candidate.global_step}, the newest "
            f"intact checkpoint in {where})"
        )
        return Resume(saved, candidate.global_step, skipped), skipped
    return None, skipped


def resolve(
    value: str | None, folders: list[Path], allow_unverified: bool = False, say: Callable[[str], None] = print
) -> Resume | None:
    """`value` (the --ckpt_path) as a Resume, or None for a fresh start; raises NoCheckpoint or
    CheckpointError with one line naming the folder / file and what is wrong."""
    if value is None:
        return None
    if value not in ("last", "auto"):
        path = Path(value)
        if require_manifest(path, allow_unverified, ALLOW_UNVERIFIED):
            verify(path, sizes_only=True)  # checksums: at load, shared by the ranks
        return Resume(read_saved_run(path), catalog.step_from_name(path) if path.exists() else None)
    where = ", ".join(str(f) for f in folders)
    for attempt in range(_RELISTS + 1):
        unfinished = [str(p) for f in folders for p in catalog.incomplete_checkpoints(f)]
        found = [c for f in dict.fromkeys(folders) for c in catalog.complete_checkpoints(f)]
        try:
            chosen, skipped = _newest_intact(found, value, where, say)
            break
        except _Vanished as gone:
            if attempt == _RELISTS:
                raise CheckpointError(
                    f"--ckpt_path {value}: the checkpoints of {where} were removed as they were read, "
                    f"{_RELISTS + 1} times (the last {gone.path}): a live run pruning them (keep_last) faster "
                    "than they are checked? Try again, or name a checkpoint copied aside"
                ) from None
    if chosen is not None:
        return chosen
    detail = f" (saves that did not finish, ignored: {', '.join(unfinished)})" if unfinished else ""
    if skipped:
        raise NoCheckpoint(
            f"--ckpt_path {value}: no intact checkpoint in {where}: every one is damaged "
            f"({'; '.join(skipped)}). Name one with --ckpt_path, or start a new run (--run_dir)",
            skipped,
        )
    if value == "last":
        raise NoCheckpoint(
            f"--ckpt_path last: no complete checkpoint in {where}{detail}. Start without "
            f"--ckpt_path (or with --ckpt_path auto), or name a checkpoint file"
        )
    say(f"--ckpt_path auto: no complete checkpoint in {where}{detail}: starting from scratch")
    return None


def checkpoint_of(path: str | Path, say: Callable[[str], None] = print) -> Path:
    """What `step35 export|generate --checkpoint PATH` read: for a run folder (or its checkpoints/
    folder) the checkpoint `--ckpt_path last` would resume (the newest intact one; damaged newer ones
    are skipped and said); any other path as it is (a `.ckpt` file, a sharded checkpoint folder,
    `last.ckpt`), for the checkpoint readers to check."""
    path = Path(path)
    is_checkpoint = (
        path.is_file() or path.is_symlink() or (path / keys.META_FILE).is_file() or (path / ".metadata").is_file()
    )
    if is_checkpoint or not path.is_dir():
        return path
    run = RunFolder(path)
    folders = run.checkpoint_folders([path])
    if not any(catalog.complete_checkpoints(f) or catalog.incomplete_checkpoints(f) for f in folders):
        raise CheckpointError(
            f"{path}: neither a checkpoint (.ckpt file, sharded folder) nor a run folder with a "
            f"checkpoint in {run.checkpoints}"
        )
    try:
        chosen = resolve("last", folders, say=lambda line: None)  # the command says which one it read
    except NoCheckpoint as error:
        what = f"is damaged ({'; '.join(error.damaged)})" if error.damaged else "is a save that did not finish"
        raise CheckpointError(
            f"{path}: every checkpoint in {', '.join(map(str, folders))} {what}; name a checkpoint to read, "
            "or resume the run to save a new one"
        ) from None
    for reason in chosen.skipped:
        say(f"{path}: skipped a damaged checkpoint, {reason}")
    return chosen.path


def _stamp(checkpoint: Path) -> tuple | None:
    """Which save is at `checkpoint` (what it points at, its manifest's inode and time): another
    value after an error means a live run removed or replaced it meanwhile."""
    try:
        real = Path(os.path.realpath(checkpoint))
        manifest = manifest_path(real).stat()
        return real, real.stat().st_ino, manifest.st_ino, manifest.st_mtime_ns
    except OSError:
        return None


def read_checkpoint(given: str | Path, read: Callable[[Path], T], say: Callable[[str], None] = print) -> T:
    """`read(checkpoint_of(given))`, for `step35 export|generate --checkpoint given`. A run folder (or
    `last.ckpt`) names "the newest checkpoint", which a live run pruning with keep_last may remove or
    replace: the checkpoint is held against retention while it is read (catalog.reading), and one removed
    before the hold took is replaced by the run's newest intact checkpoint, said (at most ROTATION_RETRIES
    times). A checkpoint named by its path and removed meanwhile ends in one line; the
    error of a checkpoint still as it was is raised as it is."""
    given = Path(given)
    chosen = checkpoint_of(given, say)
    listed = given != chosen  # chosen from a run folder's list: it carried its manifest then
    for attempt in range(ROTATION_RETRIES + 1):
        stamp = _stamp(chosen)
        try:
            with catalog.reading(chosen):  # a live run's retention passes over it until it is read
                return read(chosen)
        except (CheckpointError, OSError):
            # without a stamp it was gone before it was read (when listed), or never carried a manifest
            as_it_was = _stamp(chosen) == stamp if stamp is not None else not listed
            if as_it_was:
                raise
            if not (listed or given.is_symlink()) or attempt == ROTATION_RETRIES:  # the loop ends here
                raise CheckpointError(
                    f"{chosen}: removed or replaced while it was being read (a live run pruning its "
                    "checkpoints, keep_last?); name the run folder to take its newest intact "
                    "checkpoint, or copy this one aside first"
                ) from None
            again = checkpoint_of(given, say)
            say(
                f"{chosen} was removed or replaced while it was being read (a live run pruning its checkpoints?): "
                f"reading {again}, the newest intact checkpoint now, instead"
            )
            chosen = again
