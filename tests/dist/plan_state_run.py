"""One optimizer step of the tiny model under torchrun with Step35Strategy, configured from a
`step35 fit` YAML (read with step35 plan's own copy of the fit parser); every rank then writes the
bytes of what it really holds: local parameter shards, gradient shards and optimizer states. Each
`--config` is one fit, one after the other in the same job and process group (one job's start for all):
its results go to DIR/<config's file stem>-rank<R>.json.

  torchrun --standalone --nproc-per-node 4 tests/dist/plan_state_run.py --config a.yaml --config b.yaml --out DIR
"""

import argparse
import json
import os
from pathlib import Path

import torch

from step35.module import Step35LightningModule
from step35.plan.settings import parse_fit_args
from step35.strategy import Step35Strategy
from tests.helpers import make_trainer


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", action="append", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ["STEP35_KEEP_PROCESS_GROUP"] = "1"  # the next fit of this job runs in the same process group
    for config in args.config:
        one_step(config, Path(args.out))


def one_step(config: str, out: Path) -> None:
    cfg = parse_fit_args(["--config", config])
    world = int(os.environ["WORLD_SIZE"])
    B, S = cfg.data.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, 1024, (B * world, S + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=B)
    model_args = {k: v for k, v in vars(cfg.model).items()}
    model_args["betas"] = tuple(model_args["betas"])
    module = Step35LightningModule(**model_args)
    strategy = Step35Strategy(**vars(cfg.trainer.strategy.init_args))
    trainer = make_trainer(devices=world, strategy=strategy, precision=cfg.trainer.precision, max_steps=1,
                           enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=loader)
    params = list(module.model.parameters())
    state = trainer.optimizers[0].state
    result = {
        "params": sum(local_bytes(q) for q in params),
        "grads": sum(local_bytes(q.grad) for q in params if q.grad is not None),
        # AdamW's exp_avg and exp_avg_sq, Muon's momentum_buffer; the step counters are 0-dim host tensors
        "optimizer": sum(local_bytes(v) for s in state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
        "frozen": sum(local_bytes(q) for q in params if not q.requires_grad),
    }
    (out / f"{Path(config).stem}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
