"""Train the tiny model a few steps under torchrun (gloo, Step35Strategy: FSDP2 + EP) with the
observability callbacks, the router-bias update and the sequence aux loss; optionally NaN one
parameter's gradient on one rank at one step. Every rank writes to --out/rank{r}.json what it routed
itself (recounted with MoE.route() on each MoE input, per optimizer step), its final router biases
and what its DivergenceGuard saw, so a test can add them up against what rank 0 logged.

  torchrun --standalone --nproc-per-node 2 tests/dist/observability_run.py --out DIR --ep 2 \
      [--nan-step 1 --nan-rank 1] [--ac full] [--param-dtype bfloat16]
"""

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from step35.callbacks import DivergenceGuard, ExpertLoadMonitor, MemoryMonitor, SpeedMonitor
from step35.model.moe import moe_layers
from step35.module import Step35LightningModule
from step35.strategy import Step35Strategy
from tests.helpers import make_trainer

NAN_PARAM = "model.layers.2.moe.gate.weight"


class Recount(pl.Callback):
    """This rank's own count: route() on each MoE input in training forwards, per optimizer step."""

    def __init__(self):
        self.per_step: dict[int, list[list[int]]] = {}

    def on_train_start(self, trainer, pl_module):
        layers = [moe for _, moe in moe_layers(pl_module.model)]

        def hook(moe, args):
            if not moe.training or torch._C._current_graph_task_id() != -1:  # eval, or an AC replay in backward
                return
            x = args[0]
            with torch.no_grad():
                _, ids, _ = moe.route(x.reshape(-1, x.shape[-1]))
            row = torch.bincount(ids.flatten(), minlength=moe.num_experts).tolist()
            step = self.per_step.setdefault(trainer.global_step, [[0] * moe.num_experts for _ in layers])
            step[layers.index(moe)] = [a + b for a, b in zip(step[layers.index(moe)], row)]

        for moe in layers:
            moe.register_forward_pre_hook(hook)


class NaNGradient(pl.Callback):
    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            grad = pl_module.model.get_parameter(NAN_PARAM).grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--ac", default="none", help="activation checkpointing: none, selective, full")
    p.add_argument("--param-dtype", default=None, help="FSDP mixed precision, e.g. bfloat16 (casts layer inputs)")
    args = p.parse_args()
    out = Path(args.out)
    world = int(os.environ["WORLD_SIZE"])
    B, S = 2, 32
    ids = torch.randint(0, 1024, (B * args.accum * args.steps * world, S + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=B)  # sharded by Lightning
    module = Step35LightningModule(config="tiny", warmup_steps=1, mtp_loss_weight=0.3,
                                   moe_bias_update_rate=0.01, moe_aux_loss_coef=0.01)
    recount, guard = Recount(), DivergenceGuard()
    callbacks = [recount, SpeedMonitor(every_n_steps=2, peak_tflops=1.0), MemoryMonitor(every_n_steps=2),
                 ExpertLoadMonitor(every_n_steps=2, heatmap_every_n_steps=2), guard]
    if args.nan_step >= 0:
        callbacks.append(NaNGradient(args.nan_step, args.nan_rank))
    strategy = Step35Strategy(expert_parallel_size=args.ep, activation_checkpointing=args.ac,
                              param_dtype=args.param_dtype)
    trainer = make_trainer(devices=world, strategy=strategy, max_steps=args.steps, accumulate_grad_batches=args.accum,
                           gradient_clip_val=1.0, logger=CSVLogger(out, name="csv"), callbacks=callbacks,
                           enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=loader)
    result = {
        "recount": {str(k): v for k, v in recount.per_step.items()},
        "router_bias": [moe.router_bias.tolist() for _, moe in moe_layers(module.model)],
        "skipped_steps": guard.skipped_steps,
        "guard_message": guard.last_message,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
