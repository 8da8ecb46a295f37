"""Run a few optimizer steps of the tiny model, plain (one process, no sharding) or distributed
(torchrun, gloo, FSDP2 + EP), from the same init and the same global batches; rank 0 writes the
per-step global losses, grad norms and the final full parameters to --out; several runs in one job with
--case (tests/dist/cases.py); `plain` is the one-process run, called in the test's own process.

  python tests/dist/train_steps.py --out plain.pt
  torchrun --standalone --nproc-per-node 4 tests/dist/train_steps.py --ep 2 --out ep2.pt
  torchrun --standalone --nproc-per-node 2 tests/dist/train_steps.py --out all.pt --case ep1="--ep 1" --case ep2="--ep 2"
  ... --optimizer muon: step35's Muon (training/muon.py) instead of torch's AdamW
  ... --checkpoint FOLDER --batch 6: the model of an HF folder (its config and weights), 6 sequences a step
"""

import argparse

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import load_config, preset
from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, clip_grad_norm_, parallelize
from step35.training.optimizer import OptimizerOptions, build_optimizer
from tests.dist.cases import main

GLOBAL_BATCH, SEQ = 8, 48
# StepFun's recipe (polar express, AdamW-matched lr), its AdamW part at AdamW's lr here
MUON = {"preset": "stepfun", "adamw_lr": 1e-3}


def batches(steps: int, vocab: int, batch: int = GLOBAL_BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (steps, batch, SEQ + 1), generator=g)


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.05)  # small enough to be active every step
    p.add_argument("--mtp", type=float, default=0.3)
    p.add_argument("--ac", default="none")
    p.add_argument("--param-dtype", default=None, choices=[None, "bfloat16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--checkpoint", default=None, help="an HF folder: its config and weights, not the tiny init")
    p.add_argument("--batch", type=int, default=GLOBAL_BATCH, help="sequences per step, a multiple of the world")
    return p


def run(args: argparse.Namespace, distributed: bool) -> dict:
    """The steps of one run (in this job's process group when `distributed`): losses, grad norms, final parameters."""
    torch.manual_seed(0)
    config = load_config(args.checkpoint) if args.checkpoint else preset("tiny")
    with torch.device("meta"):
        model = Step35ForCausalLM(config)
    rank, world = 0, 1
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
        dims = ParallelDims(world, args.ep, args.replicate, num_experts=config.moe_num_experts)
        parallelize(model, dims.build("cpu"), activation_checkpointing=args.ac, compile=args.compile,
                    param_dtype=getattr(torch, args.param_dtype) if args.param_dtype else None)
    materialize(model, "cpu", checkpoint=args.checkpoint, seed=7)
    if args.optimizer == "muon":  # step35's, as fit builds it: Newton–Schulz of whole matrices under FSDP2 + EP
        opt = build_optimizer(model, OptimizerOptions(name="muon", lr=2e-2, weight_decay=0.1, extra=MUON))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    data = batches(args.steps, config.vocab_size, args.batch)
    per_rank = args.batch // world
    micro = per_rank // args.accum
    losses, norms = [], []
    for step in range(args.steps):
        mine = data[step, rank * per_rank:(rank + 1) * per_rank]
        step_loss = torch.zeros(())
        for m in range(args.accum):
            tokens = mine[m * micro:(m + 1) * micro]
            out = model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=args.mtp)
            (out.loss / args.accum).backward()
            step_loss += out.loss.detach() / args.accum
        if distributed:
            dist.all_reduce(step_loss)
            step_loss /= world
        norms.append(clip_grad_norm_(model.parameters(), args.clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(step_loss.item())
    full = {}
    for name, t in model.state_dict().items():
        full[name] = t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
    return {"losses": losses, "norms": norms, "params": full}


def plain(*argv: str) -> dict:
    """One plain run in this process (no process group), with `argv`'s options."""
    return run(options().parse_args(list(argv)), distributed=False)


if __name__ == "__main__":
    main(options(), run)
