"""Callbacks for tests/test_fail_fast.py: a slow (or stuck) backward, and a callback that raises in
on_train_batch_start, in real runs of the CLI."""

import time

import lightning.pytorch as pl


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
