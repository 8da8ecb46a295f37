"""A callback for tests: right after a resume (on_train_start, before any step), rank 0 writes
the full parameters and the full optimizer state (gathered from every rank's shards) to `out`."""

import lightning.pytorch as pl
import torch


class CaptureRestored(pl.Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        params = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                  for name, t in pl_module.state_dict().items()}  # every rank: full_tensor is a collective
        optim = get_optimizer_state_dict(pl_module, trainer.optimizers[0],
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.global_rank == 0:
            torch.save({"global_step": trainer.global_step, "world_size": trainer.world_size, "params": params,
                        "optim": optim}, self.out)
