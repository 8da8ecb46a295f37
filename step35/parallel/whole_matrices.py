"""Whole logical matrices out of sharded tensors, for an update that must see each matrix at once
(Muon's Newton–Schulz, training/muon.py), and the result back in the shards.

A tensor [..., A, B] holds prod(...) logical matrices [A, B] (stacked experts [E, out, in]: E of them).
Sharded as step35 shards (parallel/parallelize.py), a DTensor's placements are of two kinds:
- a split of a leading (stacking) dim, Shard(0) over `ep` for the routed experts: every rank already
  holds whole matrices there, nothing moves;
- a split of a matrix dim, Shard(0) of a dense weight over the FSDP mesh, Shard(1) (an expert's rows)
  over `efsdp`: the ranks of that mesh dim each hold a slice of every matrix; at most one such dim.
Replicated dims (HSDP's replicate) compute the same result on every replica.

The exchange, per group of ranks sharing a split (`k` ranks): the matrices are dealt to owners, the
largest first to the least loaded (the same deal on every rank: the same parameters in the same order),
and moved in buckets of about BUCKET_BYTES per rank (`buckets`). Per bucket, one all_to_all brings each owner the
k slices of each of its matrices, which it concatenates (slice i is the chunk of group rank i, torch.chunk
sizes, as DTensor's Shard), transforms (matrices of one shape stacked: one batched call), and one
all_to_all sends every rank its slice of each result. Each matrix's values cross the network twice, as
an all-gather would have moved them once to every rank; each rank computes 1/k of the matrices.
Without a split matrix dim (one process, EP with efsdp 1) the transform runs on the local tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A bucket: about this many bytes of whole fp32 matrices per rank of a split, per exchange; what the
# exchange holds at once is a few times this (step35 plan counts 8 x, plan/memory.py).
BUCKET_BYTES = 256 * 2**20

# fn(stacked [n, A, B] whole matrices of one shape, key) -> the transformed [n, A, B]; `key` is the
# caller's tag of the tensor the matrices belong to (the same for all n).
Transform = Callable[[torch.Tensor, object], torch.Tensor]


# Bytes this process has sent through the exchange (both ways), for benchmarks and logging.
SENT_BYTES = [0]


class ShardingError(ValueError):
    """A placement this exchange cannot reassemble (named with the tensor)."""


def chunk_sizes(n: int, k: int) -> list[int]:
    """The sizes torch.chunk (and DTensor's Shard) gives `n` rows split `k` ways: ceil(n / k) each, the
    last ones shorter or empty."""
    size = math.ceil(n / k) if k else 0
    return [max(0, min(size, n - i * size)) for i in range(k)]


@dataclass(frozen=True)
class Split:
    """How one tensor's matrices are sliced: tensor dim `dim` over the group `group` (k ranks, this rank
    `index`), slice sizes `sizes`; `group` None: whole on this rank."""

    dim: int | None = None
    group: object = None
    index: int = 0
    sizes: tuple[int, ...] = ()

    @property
    def ranks(self) -> int:
        return len(self.sizes) if self.group is not None else 1


def _matrix_splits(tensor: torch.Tensor, name: str) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of each mesh dim of more than one rank that splits `tensor`'s matrices."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    matrix_dims = (tensor.dim() - 2, tensor.dim() - 1)
    found: list[tuple[int, int]] = []  # (mesh dim, tensor dim) of splits inside a matrix
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # (a _StridedShard or Partial is not a slice of rows or columns)
            raise ShardingError(f"{name}: placement {placement!r} on mesh dim {mesh_dim} is not a plain Shard")
        if placement.dim in matrix_dims and mesh.size(mesh_dim) > 1:
            found.append((mesh_dim, placement.dim))
    if len(found) > 1:
        raise ShardingError(
            f"{name}: its matrices are split over {len(found)} mesh dims {tensor.placements}; one at most"
        )
    return found


def split_ranks(tensor: torch.Tensor, name: str = "tensor") -> int:
    """Over how many ranks each matrix of `tensor` is sliced (1: whole on every rank). Needs no process group
    (step35 plan's meta models)."""
    if getattr(tensor, "device_mesh", None) is None:
        return 1
    found = _matrix_splits(tensor, name)
    return tensor.device_mesh.size(found[0][0]) if found else 1


def split_of(tensor: torch.Tensor, name: str) -> Split:
    """The Split of `tensor` (a DTensor, or a plain tensor: whole). `name` says which tensor in errors."""
    if getattr(tensor, "device_mesh", None) is None:
        return Split()
    found = _matrix_splits(tensor, name)
    if not found:
        return Split()
    mesh = tensor.device_mesh
    mesh_dim, dim = found[0]
    sizes = tuple(chunk_sizes(tensor.shape[dim], mesh.size(mesh_dim)))
    split = Split(dim, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), sizes)
    local = tensor.to_local()
    if local.shape[dim] != sizes[split.index]:
        raise ShardingError(
            f"{name}: local shard {tuple(local.shape)} has {local.shape[dim]} of dim {dim}'s {tensor.shape[dim]}, "
            f"expected {sizes[split.index]} (torch.chunk over {len(sizes)} ranks)"
        )
    return split


@dataclass
class _Matrix:
    tensor: int  # index into the caller's list
    index: int  # logical matrix within it (its leading dims flattened)
    owner: int = 0


def buckets(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """`tensors` (the sharded parameters, in order) cut into runs of indices whose whole fp32 matrices are
    about `bucket_bytes` per rank of their split (a tensor larger than that is a bucket of its own): the
    unit of one transform_whole call, so that what is held at once stays bounded. The same on every rank."""
    out, current, held = [], [], 0.0
    for i, tensor in enumerate(tensors):
        current.append(i)
        held += _share_bytes(tensor)
        if held >= bucket_bytes:
            out.append(current)
            current, held = [], 0.0
    return out + ([current] if current else [])


def _share_bytes(tensor: torch.Tensor) -> float:
    """A rank's share of `tensor` in fp32 bytes, the same number on every rank (local shards differ by a
    row where the sizes do not divide: bucket bounds from them would differ between ranks)."""
    mesh = getattr(tensor, "device_mesh", None)
    ways = (
        1 if mesh is None else math.prod(mesh.size(d) for d, p in enumerate(tensor.placements) if not p.is_replicate())
    )
    return tensor.numel() * 4 / ways


def transform_whole(
    locals_: list[torch.Tensor], splits: list[Split], keys: list[object], fn: Transform
) -> list[torch.Tensor]:
    """fn applied to every logical matrix of the sharded tensors whose local shards are `locals_` (fp32,
    [..., a, b]; `splits[i]` how tensor i is sliced, `keys[i]` passed to fn), returned as local shards of
    the result, same shapes. Every rank of every group calls this with the same tensors in the same order;
    one all_to_all each way per group of ranks (cut the tensors into `buckets` to bound the memory)."""
    out: list[torch.Tensor | None] = [None] * len(locals_)
    by_group: dict[int, list[int]] = {}
    for i, split in enumerate(splits):
        if split.group is None:
            out[i] = _apply(locals_[i], keys[i], fn)
        else:
            by_group.setdefault(id(split.group), []).append(i)
    for members in by_group.values():
        results = _exchange([locals_[i] for i in members], [splits[i] for i in members], [keys[i] for i in members], fn)
        for i, result in zip(members, results):
            out[i] = result
    return out


def _apply(local: torch.Tensor, key: object, fn: Transform) -> torch.Tensor:
    stacked = local.reshape(math.prod(local.shape[:-2]), *local.shape[-2:])
    return fn(stacked, key).reshape(local.shape)


@dataclass(frozen=True)
class _Layout:
    """One tensor's matrices in the exchange: the split axis of a matrix (0 rows, 1 columns) and its
    whole shape [A, B]."""

    axis: int
    whole: tuple[int, int]
    sizes: tuple[int, ...]

    def piece(self, rank: int) -> tuple[int, int]:
        shape = list(self.whole)
        shape[self.axis] = self.sizes[rank]
        return shape[0], shape[1]


def _exchange(
    locals_: list[torch.Tensor], splits: list[Split], keys: list[object], fn: Transform
) -> list[torch.Tensor]:
    group, k, me = splits[0].group, splits[0].ranks, splits[0].index
    layouts = []
    for local, split in zip(locals_, splits):
        axis = split.dim - (local.dim() - 2)
        whole = list(local.shape[-2:])
        whole[axis] = sum(split.sizes)
        layouts.append(_Layout(axis, (whole[0], whole[1]), split.sizes))
    matrices = [_Matrix(t, m) for t, local in enumerate(locals_) for m in range(math.prod(local.shape[:-2]))]
    cost = [math.prod(layouts[x.tensor].whole) for x in matrices]
    load = [0] * k
    for j in sorted(range(len(matrices)), key=lambda j: (-cost[j], j)):  # largest first, least loaded owner
        owner = min(range(k), key=lambda r: (load[r], r))
        matrices[j].owner = owner
        load[owner] += cost[j]
    stacked = [local.reshape(math.prod(local.shape[:-2]), *local.shape[-2:]) for local in locals_]
    results = [torch.empty_like(s) for s in stacked]
    if matrices:
        _bucket(matrices, stacked, results, layouts, keys, fn, group, k, me)
    return [r.reshape(local.shape) for r, local in zip(results, locals_)]


def _bucket(bucket, stacked, results, layouts, keys, fn, group, k: int, me: int) -> None:
    """One exchange: the owners get whole matrices, transform them, and every rank gets its slices back."""
    mine = [x for x in bucket if x.owner == me]
    send = [stacked[x.tensor][x.index].reshape(-1) for o in range(k) for x in bucket if x.owner == o]
    to_owner = [sum(stacked[x.tensor][x.index].numel() for x in bucket if x.owner == o) for o in range(k)]
    from_rank = [sum(math.prod(layouts[x.tensor].piece(r)) for x in mine) for r in range(k)]
    dtype, device = stacked[bucket[0].tensor].dtype, stacked[bucket[0].tensor].device
    received = torch.empty(sum(from_rank), dtype=dtype, device=device)
    dist.all_to_all_single(received, _cat(send, dtype, device), from_rank, to_owner, group=group)
    SENT_BYTES[0] += (sum(to_owner) - to_owner[me] + sum(from_rank) - from_rank[me]) * received.element_size()
    # Rank r's slices of my matrices arrive in bucket order: cut, reshape, concatenate along the split.
    incoming = list(received.split(from_rank))
    offsets = [0] * k
    wholes = []
    for x in mine:
        layout = layouts[x.tensor]
        parts = []
        for r in range(k):
            shape = layout.piece(r)
            parts.append(incoming[r][offsets[r] : offsets[r] + math.prod(shape)].view(shape))
            offsets[r] += math.prod(shape)
        wholes.append(torch.cat(parts, dim=layout.axis))
    # The matrices of one tensor (one shape, one key) in one call.
    done: list[torch.Tensor] = [None] * len(mine)  # type: ignore[list-item]
    by_tensor: dict[int, list[int]] = {}
    for j, x in enumerate(mine):
        by_tensor.setdefault(x.tensor, []).append(j)
    for t, js in by_tensor.items():
        for j, result in zip(js, fn(torch.stack([wholes[j] for j in js]), keys[t])):
            done[j] = result
    back = []
    for r in range(k):
        for j, x in enumerate(mine):
            layout = layouts[x.tensor]
            start = sum(layout.sizes[:r])
            back.append(done[j].narrow(layout.axis, start, layout.sizes[r]).reshape(-1))
    returned = torch.empty(sum(to_owner), dtype=dtype, device=device)
    dist.all_to_all_single(returned, _cat(back, dtype, device), to_owner, from_rank, group=group)
    start = 0
    for o in range(k):
        for x in bucket:
            if x.owner == o:
                target = results[x.tensor][x.index]
                target.copy_(returned[start : start + target.numel()].view(target.shape))
                start += target.numel()


def _cat(pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
