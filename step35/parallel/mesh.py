"""The mesh arithmetic, in one place: one world seen two ways ("dp2ep").

- dense part: FSDP over all ranks, or HSDP as (replicate, shard) when replicate_size > 1;
- routed experts: the same ranks as (efsdp, ep): experts `Shard(0)` over `ep` (contiguous ranks),
  FSDP over `efsdp` = world / ep.
Every rank is a data-parallel rank: each reads its own micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ParallelConfigError(ValueError):
    """Parallel sizes that cannot work together; raised before any collective or large allocation."""


def valid_ep_sizes(world_size: int, num_experts: int | None = None) -> list[int]:
    """Expert-parallel sizes that divide the world size and, when given, the number of experts, ascending."""
    return [d for d in range(1, world_size + 1)
            if world_size % d == 0 and (num_experts is None or num_experts % d == 0)]


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    expert_parallel_size: int = 1
    replicate_size: int = 1
    num_experts: int | None = None

    def __post_init__(self) -> None:
        ws, ep, rep = self.world_size, self.expert_parallel_size, self.replicate_size
        if ws < 1:
            raise ParallelConfigError(f"world size must be >= 1, got {ws}")
        if ep < 1 or ws % ep:
            raise ParallelConfigError(f"expert_parallel_size={ep} must divide the world size {ws}")
        if self.num_experts is not None and self.num_experts % ep:
            raise ParallelConfigError(f"expert_parallel_size={ep} must divide num_experts={self.num_experts} "
                                      f"(sizes that divide both the experts and the world size {ws}: "
                                      f"{valid_ep_sizes(ws, self.num_experts)})")
        if rep < 1 or ws % rep:
            raise ParallelConfigError(f"replicate_size={rep} must divide the world size {ws}")

    @property
    def efsdp(self) -> int:
        """Ranks that FSDP-shard each expert-parallel slice of the experts."""
        return self.world_size // self.expert_parallel_size

    @property
    def shard_size(self) -> int:
        """Ranks that FSDP-shard the dense parameters (within one replica)."""
        return self.world_size // self.replicate_size

    def build(self, device_type: str) -> "Meshes":
        from torch.distributed.device_mesh import init_device_mesh

        if self.replicate_size > 1:
            dense = init_device_mesh(device_type, (self.replicate_size, self.shard_size),
                                     mesh_dim_names=("replicate", "shard"))
        else:
            dense = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("fsdp",))
        experts = None
        if self.expert_parallel_size > 1:
            experts = init_device_mesh(device_type, (self.efsdp, self.expert_parallel_size),
                                       mesh_dim_names=("efsdp", "ep"))
        return Meshes(self, dense, experts)


@dataclass
class Meshes:
    dims: ParallelDims
    dense: "torch.distributed.device_mesh.DeviceMesh"
    experts: "torch.distributed.device_mesh.DeviceMesh | None"  # (efsdp, ep), None when ep == 1
