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

A path given by name must carry its manifest unless the user opts in (`--allow_unverified_checkpoint`).
The checkpoint's saved options are read here once; `Resume.check` applies the resume rule
(step35/run/resume.py) to the run's model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import require_manifest, verify
from step35.checkpoint.training import catalog, keys
from step35.run.layout import RunFolder
from step35.run.resume import SavedRun, check_resume, read_saved_run

ALLOW_UNVERIFIED = "--allow_unverified_checkpoint"
# Values Lightning resolves itself; passed on untouched.
LIGHTNING_VALUES = ("best", "hpc", "registry")


class NoCheckpoint(ValueError):
    """`--ckpt_path last|auto` found nothing it may resume."""


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
    verify(path, sizes_only=True)
    return read_saved_run(path)


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
    unfinished = [str(p) for f in folders for p in catalog.incomplete_checkpoints(f)]
    found = [c for f in dict.fromkeys(folders) for c in catalog.complete_checkpoints(f)]
    skipped = []
    for candidate in sorted(found, key=lambda c: (c.global_step, c.saved_ns), reverse=True):
        try:
            saved = _intact(candidate.path)
        except (CheckpointError, OSError) as error:
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
        return Resume(saved, candidate.global_step, skipped)
    detail = f" (saves that did not finish, ignored: {', '.join(unfinished)})" if unfinished else ""
    if skipped:
        raise NoCheckpoint(
            f"--ckpt_path {value}: no intact checkpoint in {where}: every one is damaged "
            f"({'; '.join(skipped)}). Name one with --ckpt_path, or start a new run (--run_dir)"
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
    chosen = resolve("last", folders, say=lambda line: None)  # the command says which one it read
    for reason in chosen.skipped:
        say(f"{path}: skipped a damaged checkpoint, {reason}")
    return chosen.path
