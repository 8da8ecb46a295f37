"""What step35's callbacks share: noticing the end of an optimizer step, the world-wide all_reduce
(defined in step35/parallel/collectives.py, named here for the callbacks), and writing metrics to every
attached logger at Lightning's own step index.

Metrics go to the loggers directly (as Lightning's LearningRateMonitor does) so that each callback
keeps its own interval, independent of trainer.log_every_n_steps; `log_metrics` is rank-zero only
because the loggers are. Collectives (`all_reduce_`) run on every rank, never under rank_zero_only.
"""

from __future__ import annotations

import lightning.pytorch as pl

from step35 import lightning_private
from step35.parallel.collectives import all_reduce_, distributed

__all__ = ["StepEnds", "all_reduce_", "distributed", "every", "log_metrics", "metric_step"]


def metric_step(trainer: pl.Trainer) -> int:
    """The step index Lightning writes its own training metrics at (0-based optimizer steps)."""
    return lightning_private.batches_that_stepped(trainer)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send metrics to every logger (CSV, wandb, ...) at the current training step (rank 0 writes)."""
    if not metrics:
        return
    step = metric_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class StepEnds:
    """Tells, from on_train_batch_end, whether that batch finished an optimizer step: with gradient
    accumulation only the last micro-batch of each window does (trainer.global_step moves)."""

    def __init__(self) -> None:
        self.last: int | None = None

    def reset(self, trainer: pl.Trainer) -> None:
        self.last = trainer.global_step

    def __call__(self, trainer: pl.Trainer) -> bool:
        step = trainer.global_step
        ended = self.last is not None and step != self.last
        self.last = step
        return ended


def every(step: int, interval: int) -> bool:
    """True on steps 1x, 2x, ... the interval (steps counted from 1); interval <= 0 is never."""
    return interval > 0 and step > 0 and step % interval == 0
