"""Plan a run before launching it: build the model on the meta device, shard it exactly as the
Strategy would for a simulated world (torch's fake process group: no devices, no memory, no
communication), and report what one rank holds and needs.

    python -m step35.plan --config flash-196b --world-size 192 --expert-parallel-size 96
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from step35.config import load_config
from step35.flops import training_flops_per_token
from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, parallelize

BYTES_PER_PARAM_TRAINING = 4 + 4 + 8  # fp32 master weight + fp32 grad + Adam moments


@dataclass
class Plan:
    world_size: int
    expert_parallel_size: int
    efsdp: int
    total_params: int
    local_dense_params: int
    local_expert_params: int
    local_expert_shapes: dict[str, list[int]]  # the stacked projections of one MoE layer held by this rank
    state_bytes_per_rank: int  # weights + grads + Adam states (fp32), before activations
    flops_per_token: float
    seconds_to_plan: float


def simulated_world(world_size: int, rank: int = 0) -> None:
    """A fake process group: collectives are no-ops, meshes and DTensors behave as on `world_size` ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def plan(config_name: str, world_size: int, expert_parallel_size: int = 1, replicate_size: int = 1,
         seq_len: int = 4096, num_mtp_layers: int | None = 0) -> Plan:
    start = time.perf_counter()
    config = load_config(config_name)
    dims = ParallelDims(world_size, expert_parallel_size, replicate_size, num_experts=config.moe_num_experts)
    simulated_world(world_size)
    with torch.device("meta"):
        model = Step35ForCausalLM(config, num_mtp_layers)
    parallelize(model, dims.build("cpu"))
    dense = experts = 0
    expert_shapes: dict[str, list[int]] = {}
    total = 0
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += param.numel()
        if ".moe." in name and not name.endswith("gate.weight"):
            experts += local.numel()
            expert_shapes.setdefault(name.split(".moe.")[1], list(local.shape))
        else:
            dense += local.numel()
    mtp = model.num_mtp_layers
    return Plan(world_size, expert_parallel_size, dims.efsdp, total, dense, experts, expert_shapes,
                (dense + experts) * BYTES_PER_PARAM_TRAINING, training_flops_per_token(config, seq_len, mtp),
                time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="flash-196b", help="preset name, config.json or HF checkpoint folder")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--expert-parallel-size", type=int, default=1)
    p.add_argument("--replicate-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--mtp-layers", type=int, default=0)
    args = p.parse_args(argv)
    result = plan(args.config, args.world_size, args.expert_parallel_size, args.replicate_size, args.seq_len,
                  args.mtp_layers)
    print(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
