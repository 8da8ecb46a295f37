"""The learning-rate schedule: linear warmup, then cosine decay to a floor, with a length that a
resumed run keeps.

The schedule's length is fixed by the run that started it: a run resumed with another
`trainer.max_steps` (to train longer, or to stop sooner) continues the same curve instead of
bending it mid-run, and past the original length stays at the floor. `model.decay_steps`, when set,
is the length, also on resume: that is how a resumed run asks for a new curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear from 1/warmup to 1 over `warmup_steps`, then cosine to `min_ratio` at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """lr = base lr x warmup_cosine(step). Its state (in every checkpoint) holds `total_steps`, the
    length it was built with; loading it keeps that length unless this run's length came from
    `model.decay_steps` (`length_from_option`). Warmup and floor are taken from this run's options."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_ratio: float,
        length_from_option: bool = False,
    ):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio
        self.length_from_option = length_from_option
        super().__init__(optimizer)

    def lr_factor(self, step: int) -> float:
        """The multiplier of the base lr at `step` (after a restore: with the kept length)."""
        return warmup_cosine(self.warmup_steps, self.total_steps, self.min_ratio)(step)

    def get_lr(self) -> list[float]:
        factor = self.lr_factor(self.last_epoch)
        return [base * factor for base in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "total_steps" not in state_dict:
            raise ValueError(
                f"the checkpoint's LR scheduler state (keys {sorted(state_dict)}) is not step35's "
                "warmup-cosine schedule: it has no total_steps"
            )
        mine = (self.warmup_steps, self.total_steps, self.min_ratio, self.length_from_option)
        super().load_state_dict(state_dict)  # the position (last_epoch), base lrs, ...
        self.warmup_steps, self.total_steps, self.min_ratio, self.length_from_option = mine
        saved = state_dict["total_steps"]
        if saved != self.total_steps:
            # here, not at the top: export and generate import this module (through the resume rules) without
            # Lightning, which costs them ~2.5 s of start-up
            from lightning.pytorch.utilities import rank_zero_info

            if self.length_from_option:
                rank_zero_info(
                    f"LR schedule: model.decay_steps={self.total_steps} replaces the checkpoint's "
                    f"schedule length of {saved} steps"
                )
            else:
                rank_zero_info(
                    f"LR schedule: keeping the checkpoint's cosine length of {saved} steps (this run's "
                    f"trainer.max_steps is {self.total_steps}); set model.decay_steps to change it"
                )
                self.total_steps = saved
        # The optimizer state (restored before this) holds the lr of the saved schedule; the step about to
        # run must already use this run's (decay_steps, warmup, floor may differ).
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
