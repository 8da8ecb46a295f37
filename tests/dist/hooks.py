"""Callbacks and a logger that the tests' real runs load by their dotted path
(`--trainer.callbacks+=tests.dist.hooks.<name>`, `--trainer.logger=tests.dist.hooks.FullDiskLogger`): they slow a
step, a validation or a save down so that a test can signal in the middle of it, hold a run at a step, fail once or
raise in a named phase, or fill the disk under the logger. Each prints what it is doing, so that a test following
the run's output knows when to act."""

import errno
import os
import re
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger


class SlowBackward(pl.Callback):
    """Sleeps `sleep_s` after every backward (the watchdog's phase 'backward'), and `stuck_s` instead
    in the backward of step `stuck_at` (counted from 1; 0: never). Writes 'slow backward of step N'
    to stderr when each sleep starts, so a test can signal during one."""

    def __init__(self, sleep_s: float = 3.0, stuck_at: int = 0, stuck_s: float = 120.0):
        self.sleep_s, self.stuck_at, self.stuck_s = sleep_s, stuck_at, stuck_s

    def on_after_backward(self, trainer, pl_module) -> None:
        step = trainer.global_step + 1
        print(f"slow backward of step {step}", flush=True)
        time.sleep(self.stuck_s if step == self.stuck_at else self.sleep_s)


class RaiseAtBatchStart(pl.Callback):
    def __init__(self, at_step: int = 2):
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.at_step:
            raise RuntimeError(f"injected failure at the start of step {self.at_step}")


class FailOnce(pl.Callback):
    """Rank `rank` raises at the end of optimizer step `at_step`, in the first attempt of a torchrun job only
    (TORCHELASTIC_RESTART_COUNT 0), so that the restarted attempt runs through."""

    def __init__(self, at_step: int = 2, rank: int = 1):
        self.at_step, self.rank = at_step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt == 0 and trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            raise RuntimeError(f"injected failure on rank {self.rank} after step {self.at_step} (attempt {attempt})")


class Gate(pl.Callback):
    """Holds the run at `at_step` until `file` exists (so a test can act while it is surely alive)."""

    def __init__(self, file: str, at_step: int):
        self.file, self.at_step = Path(file), at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            (self.file.parent / "gate.reached").touch()
            deadline = time.monotonic() + 600
            while not self.file.exists() and time.monotonic() < deadline:
                time.sleep(0.1)


class SlowValidation(pl.Callback):
    """Sleeps `sleep_s` after every validation batch (outside the sanity check), printing
    'slow validation batch N after step S' first, so that a test can signal during a validation."""

    def __init__(self, sleep_s: float = 1.0):
        self.sleep_s = sleep_s

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking:
            return
        print(f"slow validation batch {batch_idx + 1} after step {trainer.global_step}", flush=True)
        time.sleep(self.sleep_s)


class SlowSave(pl.Callback):
    """Sleeps `sleep_s` in every full checkpoint save (Lightning calls on_save_checkpoint while it
    prepares the save, the write follows), printing 'slow save of step S' first."""

    def __init__(self, sleep_s: float = 3.0):
        self.sleep_s = sleep_s

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        print(f"slow save of step {trainer.global_step}", flush=True)
        time.sleep(self.sleep_s)


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


class SlowBackgroundWrites(pl.Callback):
    """Makes every checkpoint write on a background thread (RunCheckpoint(async_save=True)) take longer: it sleeps
    `before_s` before DCP writes the shards (the training loop goes on meanwhile, changing the parameters the save
    was taken from) and `after_s` after them (shards on disk, no manifest yet). Prints 'background write of
    <folder>: begins at step N' (the loop's step then) and '...: shards written' when the second sleep starts, so a
    test can kill or signal the job in the middle of a write. Synchronous saves (the main thread) and the saves of
    steps before `from_step` (read from the checkpoint's name) are untouched: a test that stops the job in the
    write of step 4 does not wait for a slowed write of step 2 first (one write is in flight at a time)."""

    def __init__(self, before_s: float = 1.0, after_s: float = 1.0, from_step: int = 0):
        self.before_s, self.after_s, self.from_step = before_s, after_s, from_step

    def setup(self, trainer, pl_module, stage: str) -> None:
        import threading

        import torch.distributed.checkpoint as dcp

        save = dcp.save
        if getattr(save, "slowed", False):
            return

        def slow_save(state, *args, checkpoint_id=None, **kwargs):
            named = re.search(r"step=(\d+)", str(checkpoint_id))
            if threading.current_thread() is threading.main_thread() or (named and int(named[1]) < self.from_step):
                return save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
            time.sleep(self.before_s)
            print(f"background write of {checkpoint_id}: begins at step {trainer.global_step}", flush=True)
            result = save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
            print(f"background write of {checkpoint_id}: shards written", flush=True)
            time.sleep(self.after_s)
            return result

        slow_save.slowed = True
        dcp.save, self._save = slow_save, save

    def teardown(self, trainer, pl_module, stage: str) -> None:  # (a test may run it in its own process)
        import torch.distributed.checkpoint as dcp

        if getattr(self, "_save", None) is not None:
            dcp.save, self._save = self._save, None

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.teardown(trainer, pl_module, "fit")


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard


class PlantNonFinite(pl.Callback):
    """Plants NaN on rank `rank` (0: also a one-process run): after backward of optimizer step `grad_at` (counted
    from 1) into one element of parameter `name`'s gradient; after optimizer step `weight_at` into one element of
    that parameter itself (as an overflowing update would). 0: never. Says what it planted."""

    def __init__(
        self, grad_at: int = 0, weight_at: int = 0, rank: int = 0, name: str = "model.layers.3.moe.gate.weight"
    ):
        self.grad_at, self.weight_at, self.rank, self.name = grad_at, weight_at, rank, name

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step + 1 == self.grad_at and trainer.global_rank == self.rank:
            _local(pl_module.model.get_parameter(self.name).grad).view(-1)[0] = float("nan")
            print(f"planted NaN in the gradient of {self.name} at step {self.grad_at}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.weight_at and trainer.global_rank == self.rank:
            with torch.no_grad():
                _local(pl_module.model.get_parameter(self.name)).view(-1)[0] = float("nan")
            print(f"planted NaN in {self.name} after step {self.weight_at}", flush=True)
