"""A run, resolved before the Trainer exists: its folder (`layout`), the one live job that owns it
(`lock`), the checkpoint it resumes (`resolution`) and what a resume may change (`resume`).

The CLI builds it (step35/commands/fit.py) and hands the result on: the checkpoint path to the
Trainer (`trainer.ckpt_path`), the check of the saved options to the module. The module and the
callbacks read what they were given through `checkpoint_to_load`, the one reader of that path.
"""

from __future__ import annotations

from pathlib import Path

from step35.run.layout import RunFolder, preempt_checkpoint, run_dir_of
from step35.run.lock import RunFolderBusy
from step35.run.resolution import ALLOW_UNVERIFIED, NoCheckpoint, Resume, checkpoint_of, is_lightning_value, resolve
from step35.run.resume import ResumeMismatchError, SavedRun, check_resume, read_saved_run

__all__ = [
    "ALLOW_UNVERIFIED",
    "NoCheckpoint",
    "Resume",
    "is_lightning_value",
    "ResumeMismatchError",
    "RunFolder",
    "RunFolderBusy",
    "SavedRun",
    "check_resume",
    "checkpoint_of",
    "checkpoint_to_load",
    "preempt_checkpoint",
    "read_saved_run",
    "resolve",
    "run_dir_of",
]


def checkpoint_to_load(trainer) -> Path | None:
    """The checkpoint this Trainer restores (set by the CLI before the run starts, or by
    `trainer.fit(ckpt_path=...)` once Lightning loads it); None for a fresh start."""
    path = trainer.ckpt_path
    return None if path is None else Path(str(path))
