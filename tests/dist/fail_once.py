"""A callback for tests/test_fail_fast.py: rank 1 raises at the end of optimizer step `at_step`,
in the first attempt of a torchrun job only (TORCHELASTIC_RESTART_COUNT 0), so that the restarted
attempt runs through."""

import os

import lightning.pytorch as pl


class FailOnce(pl.Callback):
    def __init__(self, at_step: int = 2, rank: int = 1):
        self.at_step, self.rank = at_step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt == 0 and trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            raise RuntimeError(f"injected failure on rank {self.rank} after step {self.at_step} (attempt {attempt})")
