"""Context parallelism (with FSDP2 and EP) against one plain model, on real gloo ranks.

  torchrun --standalone --nproc-per-node 4 tests/dist/cp_equivalence.py --cp 2 --ep 2 [--ac selective] --out cp2.pt
  torchrun ... tests/dist/cp_equivalence.py --out all.pt --case cp2="--cp 2" --case cp4="--cp 4 --ac selective"

Every rank builds the tiny model twice from the same init: plain (whole batch, one process's
computation) and parallelized (cp x dp ranks, EP composed). For each case (a sliding window, packed
documents or not, MTP on) it runs one loss + backward on both and rank 0 writes, per case, both
losses and each parameter's relative gradient error ||g - g_ref|| / ||g_ref||.

Batch: 2 rows per data-parallel group (so cp 2 on 4 ranks has 2 groups and 4 rows in all), 32 tokens;
labels of each group's first row masked at the start (uneven across chunks, equal across groups,
so the global token mean is the mean of the groups' means).
"""

import argparse

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, parallelize
from tests.dist.cases import main

SEQ, ROWS = 32, 2
# Documents crossing chunk borders (chunks of 4 or 8 tokens), per row of a group.
DOCS = [[5, 13, 9, 5], [20, 12]]


def position_ids(rows: int) -> torch.Tensor:
    out = []
    for r in range(rows):
        out.append(torch.cat([torch.arange(n) for n in DOCS[r % len(DOCS)]]))
    return torch.stack(out)


def full_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
    return grads


def run_case(window: int, docs: bool, mtp: float, cp: int, ep: int, rank: int, world: int, ac: str) -> dict:
    config = preset("tiny").with_overrides({"sliding_window": window})
    dp = world // cp
    g = torch.Generator().manual_seed(window * 7 + docs)
    tokens = torch.randint(0, config.vocab_size, (dp * ROWS, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[::ROWS, :7] = -100
    pos = position_ids(dp * ROWS) if docs else None

    with torch.device("meta"):
        plain = Step35ForCausalLM(config)
    materialize(plain, "cpu", seed=7)
    ref = plain.loss(tokens[:, :-1], labels, mtp_loss_weight=mtp, position_ids=pos)
    ref.loss.backward()

    with torch.device("meta"):
        model = Step35ForCausalLM(config)
    dims = ParallelDims(world, ep, num_experts=config.moe_num_experts, context_parallel_size=cp)
    meshes = dims.build("cpu")
    parallelize(model, meshes, activation_checkpointing=ac)
    one_per_group = torch.ones(())
    dist.all_reduce(one_per_group, group=meshes.data_parallel_group())  # counts each data-parallel rank once
    materialize(model, "cpu", seed=7)
    group = dims.data_parallel_rank(rank)
    rows = slice(group * ROWS, (group + 1) * ROWS)
    out = model.loss(tokens[rows, :-1], labels[rows], mtp_loss_weight=mtp,
                     position_ids=None if pos is None else pos[rows])
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # mean over data-parallel groups (each cp rank holds its group's loss)
    loss /= world
    got, want = full_grads(model), full_grads(plain)
    errors = {name: ((got[name].double() - w.double()).norm() / w.double().norm().clamp(min=1e-12)).item()
              for name, w in want.items()}
    return {"loss": loss.item(), "ref_loss": ref.loss.item(), "mtp": [t.item() for t in out.mtp_losses],
            "ref_mtp": [t.item() for t in ref.mtp_losses], "grad_errors": errors,
            "missing": sorted(set(want) - set(got)), "dp_group_sum": one_per_group.item(), "dp": dp}


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--ac", default="none", help="activation checkpointing: none, selective or full")
    return p


def run(args: argparse.Namespace, distributed: bool) -> dict:
    """Every case at cp `args.cp` on this job's ranks: {case: losses and gradient errors}."""
    assert distributed, "run under torchrun"
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    # windows: shorter than a chunk, exactly chunk + 1 at cp 4 (the largest halo), longer than a chunk
    for window, docs in [(3, False), (5, True), (12, True), (3, True)]:
        results[f"window{window}_docs{int(docs)}_mtp"] = run_case(window, docs, 0.3, args.cp, args.ep, rank, world,
                                                                   args.ac)
    return results


if __name__ == "__main__":
    main(options(), run)
