"""A few optimizer steps (SGD with momentum) of the tiny model with LoRA on every target kind, plain (one process) or
distributed (torchrun, gloo, FSDP2 + EP), from the same init and the same global batches; rank 0
writes the per-step global losses, every adapter's (and full target's) gradient at each step
before clipping, the final trained parameters and a checksum of the frozen base to --out; several runs in one
job with --case (tests/dist/cases.py); `plain` is the one-process run, called in the test's own process.

  python tests/dist/lora_steps.py --out plain.pt
  torchrun --standalone --nproc-per-node 4 tests/dist/lora_steps.py --ep 2 --out ep2.pt
"""

import argparse

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import build_model
from step35.model.lora import LoraConfig, apply_lora
from step35.parallel import ParallelDims, clip_grad_norm_, parallelize
from step35.training.optimizer import OptimizerOptions, build_optimizer
from tests.dist.cases import main

GLOBAL_BATCH, SEQ = 8, 32
TARGETS = ["attention", "mlp", "shared_expert", "experts", "mtp", "router", "lm_head"]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ac", default="none")
    p.add_argument("--base-dtype", default=None, choices=[None, "bfloat16"])
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "muon"])
    return p


def run(args: argparse.Namespace, distributed: bool) -> dict:
    """The steps of one run (in this job's process group when `distributed`): losses, gradients, trained
    parameters and what became of the frozen base."""
    torch.manual_seed(0)  # the same global generator in every case and process (the init itself is seeded)
    config = preset("tiny")
    model = build_model(config)
    apply_lora(model, LoraConfig(rank=4, targets=TARGETS, expert_rank=2, base_dtype=args.base_dtype))
    rank, world = 0, 1
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
        dims = ParallelDims(world, args.ep, num_experts=config.moe_num_experts)
        parallelize(model, dims.build("cpu"), activation_checkpointing=args.ac)
    materialize(model, "cpu", seed=7)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen_before = {n: full(t) for n, t in model.state_dict().items()
                     if n not in dict(trained) and not n.endswith("router_bias")}
    # SGD with momentum (it keeps state, as AdamW does): AdamW's normalised step would turn fp32
    # reduction-order noise in near-zero gradients into 1e-5-sized parameter differences, and
    # this run compares gradients at every step, not only the first.
    if args.optimizer == "muon":  # step35's: Muon on every adapter's A and B (per expert), AdamW on the router
        opt = build_optimizer(model, OptimizerOptions(name="muon", lr=2e-2, extra={"preset": "stepfun"}))
    else:
        opt = torch.optim.SGD([p for _, p in trained], lr=0.5, momentum=0.9, foreach=False)
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, config.vocab_size, (args.steps, GLOBAL_BATCH, SEQ + 1), generator=g)
    per_rank = GLOBAL_BATCH // world
    losses, grads = [], []
    for step in range(args.steps):
        tokens = data[step, rank * per_rank:(rank + 1) * per_rank]
        out = model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=0.3)
        out.loss.backward()
        loss = out.loss.detach()
        if distributed:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        grads.append({n: full(p.grad) for n, p in trained})
        clip_grad_norm_([p for _, p in trained], 0.5)
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    params = {n: full(state[n]) for n, _ in trained}
    base_unchanged = all(torch.equal(full(state[n]), t) for n, t in frozen_before.items())
    no_base_grads = all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    base_dtypes = sorted({str(t.dtype) for n, t in state.items() if n in frozen_before})
    base_state = all(p not in opt.state for n, p in model.named_parameters() if not p.requires_grad)
    return {"losses": losses, "grads": grads, "params": params, "base_unchanged": base_unchanged,
            "no_base_grads": no_base_grads, "no_base_state": base_state, "base_dtypes": base_dtypes,
            "frozen": len(frozen_before)}


def plain(*argv: str) -> dict:
    """One plain run in this process (no process group), with `argv`'s options."""
    return run(options().parse_args(list(argv)), distributed=False)


if __name__ == "__main__":
    main(options(), run)
