"""Optimizer step time of Muon (training/muon.py) against AdamW on the tiny model, in one process or
under torchrun (gloo, FSDP2 + EP as step35 shards), and the bytes Muon's whole-matrix exchange sends
per rank per step (parallel/whole_matrices.py). Run by hand; results go to docs/benchmarks.md.

    python benchmarks/optimizer_step.py
    torchrun --standalone --nproc-per-node 2 benchmarks/optimizer_step.py --ep 2
    torchrun --standalone --nproc-per-node 2 benchmarks/optimizer_step.py --ep 1
"""

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, parallelize, whole_matrices
from step35.training.optimizer import OptimizerOptions, build_optimizer

OPTIMIZERS = {
    "adamw": OptimizerOptions(name="adamw", lr=1e-3),
    "muon classic x5": OptimizerOptions(name="muon", lr=2e-2, extra={"coefficients": "classic", "ns_steps": 5}),
    "muon stepfun": OptimizerOptions(name="muon", lr=2e-2, extra={"preset": "stepfun"}),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    config = preset(args.config)
    results = {}
    for label, options in OPTIMIZERS.items():
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Step35ForCausalLM(config)
        if distributed:
            dims = ParallelDims(world, args.ep, 1, num_experts=config.moe_num_experts)
            parallelize(model, dims.build("cpu"))
        materialize(model, "cpu", seed=7)
        optimizer = build_optimizer(model, options)
        for param in model.parameters():  # a fixed gradient: the step's cost does not depend on its values
            param.grad = torch.randn_like(param) * 1e-3
        times = []
        whole_matrices.SENT_BYTES[0] = 0
        for step in range(args.steps + 2):
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            if step >= 2:  # two warm-up steps (state allocation)
                times.append(time.perf_counter() - start)
        sent = whole_matrices.SENT_BYTES[0] / (args.steps + 2)
        results[label] = {
            "step_ms": round(1e3 * sorted(times)[len(times) // 2], 1),
            "muon_sent_bytes_per_step": int(sent),
        }
    if not distributed or dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "config": args.config,
                    "world": world,
                    "ep": args.ep,
                    "threads": torch.get_num_threads(),
                    "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "results": results,
                },
                indent=1,
            )
        )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
