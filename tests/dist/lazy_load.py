"""Each rank loads an HF checkpoint into its FSDP/EP shards; writes what it read and its memory.

  torchrun --standalone --nproc-per-node 4 tests/dist/lazy_load.py --checkpoint DIR --ep 2 --out DIR
"""

import argparse
import json
import resource

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import Step35Config
from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, parallelize


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = Step35Config.from_json(args.checkpoint)
    with torch.device("meta"):
        model = Step35ForCausalLM(config)
    parallelize(model, ParallelDims(world, args.ep, num_experts=config.moe_num_experts).build("cpu"))
    before = peak_rss_bytes()
    nbytes = materialize(model, "cpu", checkpoint=args.checkpoint)
    after = peak_rss_bytes()
    local = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                for t in model.state_dict().values())
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in model.state_dict().items()}
    if rank == 0:
        torch.save(full, f"{args.out}/full.pt")
    with open(f"{args.out}/rank{rank}.json", "w") as f:
        json.dump({"bytes_read": nbytes, "local_bytes": local, "peak_rss_growth": after - before}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
