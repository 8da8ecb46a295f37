"""The training progress bar in optimizer steps: `step:  16%|█▌  | 64/400 [lm_loss=4.412, tok/s=8,192, mem=1.20 GiB]`.

Lightning's TQDMProgressBar counts batches of an epoch: on step35's endless stream (max_epochs=-1)
that shows `Epoch 0/-2`, and after a resume `64/3` (batches of this attempt against the steps left),
plus a logger `v_num`. This bar counts optimizer steps from the run's start to `trainer.max_steps`,
so a resumed run continues where it stopped, and shows the training loss, tokens/s and peak memory.
The loss shown is `train/lm_loss`, the next-token loss the README and the validation loss quote;
`train/loss`, which adds the weighted MTP losses (and the balance loss), is in the loggers.

Tokens/s and memory come from SpeedMonitor and MemoryMonitor when they are configured (window
averages with a device sync, max over ranks); without them the bar measures its own: tokens of this
rank's batches times the world size over the wall time between refreshes (no device sync, so a
rough figure on an accelerator), and this rank's peak memory. The CLI installs it unless a progress
bar is configured or `trainer.enable_progress_bar` is false.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

from step35.callbacks.memory import GiB, device_memory_stats
from step35.callbacks.throughput import rank_batch_tokens


class Step35ProgressBar(TQDMProgressBar):
    clock = staticmethod(time.perf_counter)

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        """
        Args:
            refresh_rate: optimizer steps between refreshes of the training bar (validation: batches).
            process_position: line of the bar, for several bars at once.
            leave: keep the finished bar on screen.
        """
        super().__init__(refresh_rate, process_position, leave)
        self._step: int | None = None
        self._tokens, self._since = 0, 0.0
        self._own_rate: float | None = None

    @property
    def train_description(self) -> str:
        return "step"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(trainer.max_steps if trainer.max_steps > 0 else None))
        bar.initial = bar.n = trainer.global_step  # a resumed run goes on from its step
        bar.unit = "step"
        self._step = trainer.global_step
        self._tokens, self._since, self._own_rate = 0, self.clock(), None

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """The stream has no epochs that mean anything: the bar is not reset."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tokens += rank_batch_tokens(trainer, batch)[0]  # a cp rank computes its share
        step = trainer.global_step
        if step == self._step:  # within gradient accumulation: the step has not ended
            return
        self._step = step
        if self.is_disabled or (step % self.refresh_rate and step != trainer.max_steps):
            return
        now = self.clock()
        self._own_rate = self._tokens * trainer.world_size / max(now - self._since, 1e-9)
        self._tokens, self._since = 0, now
        bar = self.train_progress_bar
        bar.n = step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """lm_loss (`loss` for a module that logs no train/lm_loss), val_loss, tok/s, mfu and mem, formatted;
        no logger version number."""
        found = trainer.progress_bar_metrics
        shown: dict[str, Any] = {}
        lm_loss = trainer.callback_metrics.get("train/lm_loss")  # logged each step, not as a bar metric
        if lm_loss is not None:
            shown["lm_loss"] = f"{float(lm_loss):.3f}"
        elif "train/loss" in found:
            shown["loss"] = f"{found['train/loss']:.3f}"
        if "val/loss" in found:
            shown["val_loss"] = f"{found['val/loss']:.3f}"
        rate = found.get("tok/s", self._own_rate)
        if rate is not None:
            shown["tok/s"] = f"{rate:,.0f}"
        if "mfu" in found:
            shown["mfu"] = f"{found['mfu']:.1%}"
        memory = found.get("mem_peak_gib")
        if memory is None:
            memory = device_memory_stats(pl_module.device)["peak"] / GiB
        shown["mem"] = f"{memory:.2f} GiB"
        return shown
