"""Where everything of a run lives: the one spelling of the run folder's layout.

<run_dir>/config.yaml                 the resolved config of the latest attempt
<run_dir>/.step35.lock                who owns the folder now (step35.run.lock)
<run_dir>/checkpoints/                step=NNNNNN.ckpt (+ manifests), last.ckpt -> the newest,
                                      step=NNNNNN-preempt.ckpt (pre-emption saves)
<run_dir>/csv/version_N/              metrics of attempt N (loggers' save_dir is <run_dir>)
<run_dir>/wandb/                      when the wandb logger is on
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
LOCK = ".step35.lock"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class RunFolder:
    """The folder of one run, across all its attempts."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint folder (RunCheckpoint's when it names no dirpath, pre-emption saves)."""
        return self.root / CHECKPOINTS

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK

    @property
    def logs(self) -> Path:
        """The loggers' save_dir (each logger adds its own name/version_N below)."""
        return self.root

    def checkpoint_folders(self, extra: list[str | Path] = ()) -> list[Path]:
        """Where the run's checkpoints can be: `extra` (checkpoint callbacks' dirpaths) and checkpoints/."""
        return list(dict.fromkeys([*(Path(f) for f in extra), self.checkpoints]))


def preempt_checkpoint(folder: str | Path, step: int) -> Path:
    """The name of a pre-emption save at `step` in checkpoint folder `folder`."""
    return Path(folder) / f"step={step:06d}-preempt.ckpt"


def run_dir_of(run_dir: str | None, default_root_dir: str | None, config_files: list | None) -> Path:
    """The run folder: --run_dir, else trainer.default_root_dir, else runs/<stem of the last --config>,
    else runs/default."""
    if run_dir:
        return Path(run_dir)
    if default_root_dir:
        return Path(default_root_dir)
    if config_files:
        return Path("runs") / Path(str(config_files[-1])).stem
    return Path("runs/default")
