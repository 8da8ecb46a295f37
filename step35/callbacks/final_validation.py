"""Validation at the end of training when the last step is not a validation step: a short run
(`--trainer.max_steps 60` with `val_check_interval: 100`) would otherwise never validate, and a
longer one would end without the final model's validation loss.

Mechanism: on the last training batch this callback sets `trainer.should_stop`, Lightning's public
flag for stopping early. Lightning runs a validation after a batch that requests a stop
(`lightning/pytorch/loops/training_epoch_loop.py`, `_should_check_val_fx`: "allow validation if
requesting to stop early through `Trainer.should_stop`"), then ends the run, which was ending at
this batch anyway. At most one validation runs after a batch, so a last step that is also a
validation step validates once. tests/test_callbacks.py checks this against the installed Lightning.
"""

from __future__ import annotations

import lightning.pytorch as pl


class FinalValidation(pl.Callback):
    def __init__(self, enabled: bool = True):
        """
        Args:
            enabled: validate after the last training step (when the run ends at trainer.max_steps);
                False leaves validation to trainer.val_check_interval alone.
        """
        self.enabled = enabled

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.enabled or trainer.max_steps is None or trainer.max_steps < 0:
            return
        # global_step has already counted this batch's optimizer step; with gradient accumulation
        # only the last micro-batch of the last step reaches max_steps.
        if trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True
