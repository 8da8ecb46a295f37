"""One global gradient norm over parameters that live on different meshes (dense FSDP, experts on
efsdp x ep, plain tensors). torch.nn.utils.clip_grad_norm_ cannot mix meshes, hence this."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def _local_and_replication(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local piece of a gradient and on how many ranks that same piece lives."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        mesh = t.device_mesh
        copies = math.prod(mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())
        return t.to_local(), copies
    copies = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return t, copies  # a plain tensor in a distributed run is a full copy on every rank


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients as if they were one vector, identical on every rank (fp32)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = _local_and_replication(grads[0])[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local, copies = _local_and_replication(g)
        total += local.float().pow(2).sum() / copies
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm`; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        _local_and_replication(p.grad)[0].mul_(coef.to(p.grad.device))
    return norm
