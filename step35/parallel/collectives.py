"""The one world-wide collective the training loop's bookkeeping needs (expert counts, agreed
decisions, memory maxima): an in-place all_reduce that is a no-op in a single process. Every rank
must call it; it never runs under rank_zero_only."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_(tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """In-place all_reduce over the world (a no-op in a single process). Every rank must call it."""
    if distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def any_rank(mine: bool, device: torch.device | str = "cpu") -> bool:
    """True when `mine` is True on any rank (a MAX over the world; `mine` in one process). Every rank must call it."""
    flag = torch.tensor([int(mine)], device=device)
    return bool(all_reduce_(flag, "max").item())
