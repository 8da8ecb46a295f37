"""The mesh arithmetic, in one place: one world seen two ways ("dp2ep").

- dense part: FSDP over all ranks, or HSDP as (replicate, shard) when replicate_size > 1;
- routed experts: the same ranks as (efsdp, ep): experts `Shard(0)` over `ep` (contiguous ranks),
  FSDP over `efsdp` = world / ep.
- context parallelism (cp > 1): the same ranks as (dp, cp), cp contiguous ranks sharing each
  sequence (step35/parallel/context.py). The dense FSDP mesh and the expert meshes above still span
  every rank, so the dense mesh is dp x cp, EP draws from the same ranks and gradients are reduced
  over dp x cp.
Without cp every rank is a data-parallel rank and reads its own micro-batches; with cp the ranks of
one cp group are one data-parallel rank and read the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from step35.kernels.sequence_split import splits


class ParallelConfigError(ValueError):
    """Parallel sizes that cannot work together; raised before any collective or large allocation."""


def valid_ep_sizes(world_size: int, num_experts: int | None = None, expert_rows: tuple[int, ...] = ()) -> list[int]:
    """Expert-parallel sizes that divide the world size and, when given, the number of experts, ascending; with
    `expert_rows` (dim 1 of the stacked expert tensors, `ParallelDims.check_expert_rows`), only those whose efsdp
    = world / ep divides every one of them (EP 1 keeps the experts in the dense units: no such limit)."""
    return [
        d
        for d in range(1, world_size + 1)
        if world_size % d == 0
        and (num_experts is None or num_experts % d == 0)
        and (d == 1 or all(r % (world_size // d) == 0 for r in expert_rows))
    ]


def valid_cp_sizes(world_size: int, seq_len: int | None = None) -> list[int]:
    """Context-parallel sizes that divide the world size and, when given, split `seq_len` into 2 x cp
    equal chunks (the load-balanced split), ascending."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0 and (seq_len is None or splits(seq_len, d))]


def data_parallel_place(global_rank: int, world_size: int, context_parallel_size: int) -> tuple[int, int]:
    """(data-parallel rank, number of data-parallel ranks) of a global rank: the cp consecutive ranks of
    a context-parallel group read the same micro-batches (each keeps its share of the rows), so they
    are one data-parallel rank; without cp every rank is one. The sampler and the meshes read it here."""
    return global_rank // context_parallel_size, world_size // context_parallel_size


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    expert_parallel_size: int = 1
    replicate_size: int = 1
    num_experts: int | None = None
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        ws, ep, rep = self.world_size, self.expert_parallel_size, self.replicate_size
        if ws < 1:
            raise ParallelConfigError(f"world size must be >= 1, got {ws}")
        cp = self.context_parallel_size
        if cp < 1 or cp > ws or ws % cp:
            why = "is larger than" if cp > ws else "must divide"
            raise ParallelConfigError(
                f"context_parallel_size={cp} {why} the world size {ws} (valid: {valid_cp_sizes(ws)})"
            )
        if ep < 1 or ws % ep:
            raise ParallelConfigError(
                f"expert_parallel_size={ep} must divide the world size {ws} (sizes that divide "
                f"the world size{' and the experts' if self.num_experts else ''}: "
                f"{valid_ep_sizes(ws, self.num_experts)})"
            )
        if self.num_experts is not None and self.num_experts % ep:
            # The model's expert count is the folder's (a pruned release may have any), so its divisors
            # are said too: they are the sizes some world size allows.
            raise ParallelConfigError(
                f"expert_parallel_size={ep} must divide num_experts={self.num_experts} (the routed experts "
                f"per MoE layer of the model; its divisors: {valid_ep_sizes(self.num_experts)}; sizes that "
                f"divide both the experts and the world size {ws}: {valid_ep_sizes(ws, self.num_experts)})"
            )
        if rep < 1 or ws % rep:
            raise ParallelConfigError(f"replicate_size={rep} must divide the world size {ws}")

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: groups of cp ranks that read different micro-batches."""
        return data_parallel_place(0, self.world_size, self.context_parallel_size)[1]

    def data_parallel_rank(self, global_rank: int) -> int:
        """The data-parallel rank (cp group) of a global rank."""
        return data_parallel_place(global_rank, self.world_size, self.context_parallel_size)[0]

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse a sequence length the cp split cannot cut in 2 x cp equal chunks, listing valid cp sizes."""
        cp = self.context_parallel_size
        if not splits(seq_len, cp):
            raise ParallelConfigError(
                f"context_parallel_size={cp} needs data.seq_len divisible by 2 x cp = {2 * cp} "
                f"(two chunks per rank); data.seq_len={seq_len} (valid cp sizes for this "
                f"world size {self.world_size}: {valid_cp_sizes(self.world_size, seq_len)})"
            )

    def check_expert_rows(self, rows: dict[str, int]) -> None:
        """Refuse an efsdp that does not divide dim 1 of every stacked expert tensor ({name: size}: the rows of
        gate/up_proj, moe_intermediate_size; of down_proj, hidden_size; a LoRA adapter's rank or width). Under
        EP the experts' dim 0 is split over ep and FSDP2 shards dim 1 over efsdp, which it does evenly only
        (torch raises "FSDP does not support uneven sharding on dim 1" deep in the model's setup otherwise). A
        pruned or smaller model makes more world sizes hit this; the message lists the EP sizes that work."""
        efsdp, ep = self.efsdp, self.expert_parallel_size
        if ep == 1:
            return  # no expert mesh: the experts are sharded with their layer along dim 0 (experts)
        uneven = {name: size for name, size in rows.items() if size % efsdp}
        if uneven:
            listed = ", ".join(f"{name} {size}" for name, size in uneven.items())
            valid = valid_ep_sizes(self.world_size, self.num_experts, tuple(rows.values()))
            raise ParallelConfigError(
                f"expert_parallel_size={ep} on {self.world_size} ranks shards each expert's rows over efsdp = "
                f"{self.world_size} / {ep} = {efsdp} ranks, which must divide them evenly (FSDP2 shards dim 1 "
                f"evenly only); dim 1 of the stacked experts not a multiple of {efsdp}: {listed}. Sizes that "
                f"work on this world size: {valid}"
            )

    @property
    def efsdp(self) -> int:
        """Ranks that FSDP-shard each expert-parallel slice of the experts."""
        return self.world_size // self.expert_parallel_size

    @property
    def shard_size(self) -> int:
        """Ranks that FSDP-shard the dense parameters (within one replica)."""
        return self.world_size // self.replicate_size

    def build(self, device_type: str) -> Meshes:
        from torch.distributed.device_mesh import init_device_mesh

        if self.replicate_size > 1:
            dense = init_device_mesh(
                device_type, (self.replicate_size, self.shard_size), mesh_dim_names=("replicate", "shard")
            )
        else:
            dense = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("fsdp",))
        experts = None
        if self.expert_parallel_size > 1:
            experts = init_device_mesh(
                device_type, (self.efsdp, self.expert_parallel_size), mesh_dim_names=("efsdp", "ep")
            )
        context = None
        if self.context_parallel_size > 1:
            context = init_device_mesh(
                device_type, (self.data_parallel_size, self.context_parallel_size), mesh_dim_names=("dp", "cp")
            )
        return Meshes(self, dense, experts, context)


@dataclass
class Meshes:
    dims: ParallelDims
    dense: torch.distributed.device_mesh.DeviceMesh
    experts: torch.distributed.device_mesh.DeviceMesh | None  # (efsdp, ep), None when ep == 1
    context: torch.distributed.device_mesh.DeviceMesh | None = None  # (dp, cp), None when cp == 1

    def data_parallel_group(self):
        """The ranks over which a per-batch quantity (a token count) is summed once per data-parallel
        rank: those at this rank's cp position, one per cp group; None (the world) without cp."""
        return self.context["dp"].get_group() if self.context is not None else None
