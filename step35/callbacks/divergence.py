"""Divergence guard: a non-finite loss or gradient is caught before the optimizer step; the step is
skipped (weights and optimizer state unchanged) or the run stops, and too many skips in a row stop it.

Why a callback, in `on_before_optimizer_step`: Lightning runs, per optimizer step,
    training_step -> backward (each micro-batch; callbacks' on_before_backward sees each loss)
    -> callbacks' on_before_optimizer_step -> the module's on_before_optimizer_step
    -> configure_gradient_clipping (the global grad norm) -> optimizer.step
(lightning/pytorch/plugins/precision/precision.py, `_after_closure`, called inside optimizer.step's
closure). This hook is the first point where all gradients of the step exist and the last before
anything uses them: clipping would turn a NaN norm into NaN gradients everywhere. It is a policy of
the training loop, not of the model, so it stays out of the LightningModule and is switched and
configured from YAML like the other callbacks.

Skipping sets every gradient to None (optimizer.zero_grad(set_to_none=True)): torch's AdamW then
passes over every parameter (no update, no weight decay, no moment or step-count change), the grad
norm sees no gradient on any rank (so its collective is skipped everywhere alike), and
Step35LightningModule drops the step's router counts instead of updating the router bias from
them. The LR schedule and trainer.global_step still advance: a skipped step is a step.

Agreement across ranks: one all_reduce (max) of a flag vector [loss non-finite, one flag per
parameter], so every rank takes the same decision and names the same parameter. Cost per step:
one pass over the local gradients (per-tensor norms), that all_reduce, and one host sync.

Weights that turn non-finite in the optimizer step itself (finite gradients, e.g. an overflowing update)
show as a non-finite loss at the next step; at the end of training, where no next step comes, the
weights and optimizer state are checked once: a run never ends successfully carrying NaN weights (and
its final checkpoint is not written). `step35 fit` adds the guard to every run unless one is configured.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from step35 import faults
from step35.callbacks.reporting import all_reduce_, log_metrics


class DivergenceError(faults.RunStopped):
    """Training stopped on non-finite losses, gradients or weights."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


class DivergenceGuard(pl.Callback):
    def __init__(self, action: Literal["skip", "stop"] = "skip", max_consecutive_skips: int = 5):
        """
        Args:
            action: on a non-finite loss or gradient: "skip" the optimizer step (weights and
                optimizer state stay as they were) or "stop" the run with an error at once.
            max_consecutive_skips: this many skipped steps in a row stop the run with an error.
        """
        if action not in ("skip", "stop"):
            raise ValueError(f"action must be 'skip' or 'stop', got {action!r}")
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be at least 1, got {max_consecutive_skips}")
        self.action = action
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_message: str | None = None
        self._loss_bad: torch.Tensor | None = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()  # stays on the device: no host sync per micro-batch
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        named = list(pl_module.named_parameters())  # same order on every rank
        with_grad = [(i, _local(p.grad)) for i, (_, p) in enumerate(named) if p.grad is not None]
        device = with_grad[0][1].device if with_grad else pl_module.device
        flags = torch.zeros(1 + len(named), dtype=torch.float32, device=device)
        if self._loss_bad is not None:
            flags[0] = self._loss_bad.to(device).float()
        self._loss_bad = None
        if with_grad:
            index = torch.tensor([1 + i for i, _ in with_grad], device=device)
            # Per-tensor norms: non-finite iff the tensor holds a NaN/inf (or its norm overflows).
            norms = torch._foreach_norm([g for _, g in with_grad])
            flags[index] = (~torch.isfinite(torch.stack([n.float() for n in norms]))).float()
        all_reduce_(flags, op="max")  # collective on every rank: one agreed decision
        flags = flags.cpu()  # host sync (every step)
        if not flags.any():
            self.consecutive_skips = 0
            return
        message = self._describe(trainer, flags, [name for name, _ in named])
        if self.action == "stop":
            raise DivergenceError(message + " (callback DivergenceGuard action=stop)")
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.last_message = message
        log_metrics(trainer, {"train/skipped_steps": float(self.skipped_steps)})
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise DivergenceError(
                f"{self.consecutive_skips} consecutive optimizer steps had non-finite values; stopping. Last: "
                f"{message}. Lower model.lr, set trainer.gradient_clip_val, or resume from an earlier checkpoint "
                f"(DivergenceGuard max_consecutive_skips={self.max_consecutive_skips})"
            )
        rank_zero_warn(
            f"{message}; step skipped, weights and optimizer state unchanged "
            f"({self.consecutive_skips} in a row, stopping at {self.max_consecutive_skips})"
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from step35.checkpoint.training.trainer_io import state_is_finite

        optimizer_states = [optimizer.state for optimizer in trainer.optimizers]
        finite = state_is_finite([pl_module.state_dict(), optimizer_states])
        if trainer.strategy.reduce_boolean_decision(finite, all=True):  # collective on every rank
            return
        first = next((n for n, p in pl_module.named_parameters() if not bool(torch.isfinite(_local(p)).all())), None)
        where = f"first in {_hf_name(first)}" if first else "in the optimizer state or on another rank"
        raise DivergenceError(
            f"step {trainer.global_step}: training ended with NaN/Inf in the weights or optimizer state ({where}); "
            f"the final checkpoint is not written. Resume the newest finite checkpoint with --ckpt_path last"
        )

    @staticmethod
    def _describe(trainer: pl.Trainer, flags: torch.Tensor, names: list[str]) -> str:
        parts = []
        if flags[0]:
            parts.append("non-finite loss")
        bad = [_hf_name(names[i]) for i in range(len(names)) if flags[1 + i]]
        if bad:
            # Backward runs from the loss towards the embedding, i.e. against model order: the last
            # parameter in model order is the first that received non-finite gradients.
            shown = ", ".join(bad[:6]) + (", ..." if len(bad) > 6 else "")
            parts.append(
                f"non-finite gradients in {len(bad)} of {len(names)} parameters, first in backward "
                f"order: {bad[-1]} (in model order: {shown})"
            )
        return f"step {trainer.global_step}: " + "; ".join(parts)


def _hf_name(name: str) -> str:
    """Step35LightningModule keeps the model under `.model`: drop that prefix to get the HF name."""
    return name[len("model.") :] if name.startswith("model.model.") or name.startswith("model.lm_head") else name
