"""One training step of the tiny model on 2 gloo ranks with expert parallelism 2, per activation
checkpointing mode; counts the all-to-all collectives run in the forward and in the backward, and
the split-size host reads of the expert dispatchers. Rank 0 writes the counts and the loss to --out (JSON); one
job runs every mode with --case (tests/dist/cases.py).

  torchrun --standalone --nproc-per-node 2 tests/dist/ep_all_to_all_count.py --ac selective --out c.json
  torchrun --standalone --nproc-per-node 2 tests/dist/ep_all_to_all_count.py --out c.json --case none="--ac none" ...
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, parallelize
from step35.parallel.expert_parallel import ExpertParallelDispatcher
from tests.dist.cases import main


class CountAllToAll(TorchDispatchMode):
    """Counts every all-to-all that reaches the dispatcher: the functional op and the in-place one."""

    def __init__(self):
        super().__init__()
        self.count = 0
        names = [("_c10d_functional", "all_to_all_single"), ("c10d", "alltoall_base_")]
        self.ops = {getattr(getattr(torch.ops, ns), op).default for ns, op in names}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.count += 1
        return func(*args, **(kwargs or {}))


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--ac", default="none")
    return p


def run(args: argparse.Namespace, distributed: bool) -> dict:
    """Two steps with activation checkpointing `args.ac`; the second step's counts."""
    assert distributed, "run under torchrun with 2 ranks"
    rank = dist.get_rank()
    config = preset("tiny")
    with torch.device("meta"):
        model = Step35ForCausalLM(config, num_mtp_layers=0)
    parallelize(model, ParallelDims(2, 2, num_experts=config.moe_num_experts).build("cpu"),
                activation_checkpointing=args.ac)
    materialize(model, "cpu", seed=7)
    tokens = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    dispatchers = [m.moe.dispatcher for m in model.model.layers if m.spec.is_moe]
    assert all(isinstance(d, ExpertParallelDispatcher) for d in dispatchers)
    counts = {}
    for _ in range(2):  # the second step: nothing left over from the first (cache entries, counts)
        for d in dispatchers:
            d.host_syncs = 0
        with CountAllToAll() as forward:
            loss = model.loss(tokens[:, :-1], tokens[:, 1:]).loss
        syncs_forward = sum(d.host_syncs for d in dispatchers)
        with CountAllToAll() as backward:
            loss.backward()
        model.zero_grad()
        counts = {"forward": forward.count, "backward": backward.count, "moe_layers": len(dispatchers),
                  "host_syncs_forward": syncs_forward, "host_syncs": sum(d.host_syncs for d in dispatchers),
                  "live_split_entries": sum(not k.expired() for d in dispatchers for k in d._splits), "loss": loss.item()}
    return counts


def save_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(options(), run, save=save_json)
