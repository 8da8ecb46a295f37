"""Each rank loads an FP8 HF folder into its FSDP/EP shards (float32); writes the bytes it read and, for every
tensor, its local shard and where that shard sits in the full tensor.

  torchrun --standalone --nproc-per-node 2 tests/dist/fp8_load.py --checkpoint DIR --ep 2 --out DIR
"""

import argparse

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import local_pieces, materialize
from step35.config import Step35Config
from step35.model import build_model
from step35.parallel import ParallelDims, parallelize


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = Step35Config.from_json(args.checkpoint)
    model = build_model(config, dtype=torch.float32)  # on meta; float32 holds the dequantised values exactly
    parallelize(model, ParallelDims(world, args.ep, num_experts=config.moe_num_experts).build("cpu"))
    nbytes = materialize(model, "cpu", checkpoint=args.checkpoint)
    pieces = {
        name: (local.detach().clone(), [(s.start, s.stop) for s in index])
        for name, (local, _, index) in local_pieces(model).items()
    }
    torch.save({"bytes_read": nbytes, "pieces": pieces}, f"{args.out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
