"""The edges of stopping and saving (issue 24).

- AsyncCheckpointIO broke every save (FileNotFoundError, a checkpoint without a manifest); it is
  refused at start, also for a Trainer built without the CLI.
- A disk filling up during a run ended the output in a bare traceback (the CSV logger failing again
  while Lightning ended the run after the reported failure); now every line that ends the output is
  a `step35:` line.

The callbacks and loggers below are loaded by the runs (`tests.test_stop_edges.<name>`)."""


from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import Logger

from step35.checkpoint import catalog
from step35.checkpoint.integrity import is_complete
from step35.faults import EXIT_FAILED, EXIT_PREEMPTED

ROOT = Path(__file__).parent.parent


# ----------------------------------------------------------------------------------- loggers of the runs
class FullDiskLogger(Logger):
    """A logger whose writes fail with ENOSPC from optimizer step `from_step` on, as a CSV file's do
    once its disk is full (a writer raising it, as in tests/test_strategy_save.py: a real full tmpfs
    does not fail a small append that fits into the file's last block)."""

    def __init__(self, from_step: int = 3):
        self.from_step = from_step
        self._step = 0

    @property
    def name(self) -> str:
        return "full-disk"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self._step = step if step is not None else self._step

    def save(self) -> None:  # Lightning calls it after every step's metrics, and when it ends a failed run
        if self._step + 1 >= self.from_step:
            raise OSError(errno.ENOSPC, "No space left on device")


# ----------------------------------------------------------------------------------- helpers
def run_args(run: Path, *extra: str) -> list[str]:
    from tests.test_resume import config_file

    run.mkdir(parents=True, exist_ok=True)
    return ["fit", "--config", str(config_file(run)), f"--run_dir={run}", *extra]


def run_cmd(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "step35", *run_args(run, *extra)]


def losses(run: Path) -> dict[int, float]:
    from tests.test_resume import metric_rows, steps_of

    (folder,) = {p.parent for p in run.glob("**/metrics.csv")}
    return steps_of(metric_rows(folder), "train/lm_loss")


def validation(batches: int, every: int) -> list[str]:
    return [f"--trainer.val_check_interval={every}", "--trainer.limit_val_batches=1.0",
            f"--data.val_batches={batches}"]


def printed(job, line: str) -> bool:
    return f"{line}\n" in job.output()


# ----------------------------------------------------------------------------------- 3. AsyncCheckpointIO
def async_plugins(kind: str) -> list:
    from lightning.pytorch.plugins import AsyncCheckpointIO

    from step35.checkpoint.trainer_io import Step35CheckpointIO

    return [AsyncCheckpointIO()] if kind == "plain" else [AsyncCheckpointIO(Step35CheckpointIO())]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("callback", ["RunCheckpoint", "FaultTolerance"])
@pytest.mark.parametrize("kind", ["plain", "wrapping_step35_io"])
def test_async_checkpoint_io_is_refused_at_start_without_the_cli(callback, kind, tmp_path, builtin_cache):
    """A Trainer built in Python with either callback that `step35 fit` always has. Before: with
    RunCheckpoint the first save failed (FileNotFoundError on step=000001.ckpt: its manifest was
    written before the asynchronous write had made the file); with FaultTolerance the pre-emption
    save was asynchronous. Now: refused before the model is built or anything is written."""
    from step35 import faults
    from step35.callbacks import FaultTolerance, RunCheckpoint
    from step35.checkpoint.errors import CheckpointError
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    callbacks = ([RunCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)] if callback == "RunCheckpoint"
                 else [FaultTolerance(watchdog=False)])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
                         plugins=async_plugins(kind), callbacks=callbacks)
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    try:
        with pytest.raises(CheckpointError) as refused:
            trainer.fit(module, datamodule=data)
    finally:
        faults._PHASE.failed_in = None  # FaultTolerance reported it: the next in-process report starts afresh
    assert str(refused.value) == ("asynchronous checkpointing is not supported yet: remove AsyncCheckpointIO "
                                  "from trainer.plugins")
    assert trainer.global_step == 0 and not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------- 4. a full disk
@pytest.mark.timeout(300)
def test_a_full_disk_mid_run_ends_in_step35_lines_not_a_traceback(tmp_path, builtin_cache, monkeypatch, capfd):
    """`step35 fit` in this process with a logger whose writes fail from step 3 on (a full disk): the
    failure is reported as a `step35:` line, then Lightning, ending the failed run, flushes the
    logger again, which fails again. Before: that second error escaped the entry point and the
    output ended in its bare traceback. Now: one more `step35:` line says it, exit code 1.
    (A checkpoint save onto a full disk: tests/test_strategy_save.py.)"""
    from step35 import faults
    from step35.cli import main

    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    args = run_args(tmp_path / "run", "--trainer.max_steps=6", "--trainer.logger=tests.test_stop_edges.FullDiskLogger",
                    # listed, so that `fit` adds no other: no watchdog thread left in this process
                    "--trainer.callbacks+=step35.callbacks.FaultTolerance", "--trainer.callbacks.watchdog=false")
    capfd.readouterr()
    try:
        with pytest.raises(SystemExit) as ended:
            main(args)
    finally:
        faults._PHASE.failed_in = None  # the next in-process report starts afresh
    err = capfd.readouterr().err
    assert ended.value.code == EXIT_FAILED, err[-3000:]
    assert "[rank 0] step35: run failed during " in err and "OSError: [Errno 28] No space left on device" in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last == ("[rank 0] step35: ending the run after that failure failed too: OSError: [Errno 28] No space "
                    "left on device"), err[-3000:]
