"""Nearest layouts that fit, when the asked one does not (or is invalid): other expert-parallel sizes,
more activation checkpointing, smaller micro-batches on the same devices; failing those, more nodes."""

from __future__ import annotations

from typing import Callable

from step35.parallel import valid_ep_sizes
from step35.plan.settings import RunSettings

AC_ORDER = ("none", "selective", "full")


def _ep_sizes(s: RunSettings, world: int) -> list[int]:
    """The EP sizes worth trying on `world` ranks: the valid ones, or only 1 without routed experts."""
    cfg = s.model_config
    return valid_ep_sizes(world, cfg.moe_num_experts) if cfg.use_moe else [1]


def _nearest_ep(sizes: list[int], ep: int) -> list[int]:
    return sorted(sizes, key=lambda d: (abs((d / ep) - 1) if d >= ep else abs((ep / d) - 1), -d))


def candidates(s: RunSettings) -> list[tuple[int, RunSettings]]:
    """(distance, layout) on the same world: one change at a time, then pairs, nearest first."""
    eps = _nearest_ep(_ep_sizes(s, s.world_size), s.expert_parallel_size)[:5] if s.sharded else [1]
    acs = AC_ORDER[AC_ORDER.index(s.activation_checkpointing):] if s.activation_checkpointing in AC_ORDER else AC_ORDER
    mbs = []
    mb = s.micro_batch_size
    while mb >= 1:
        mbs.append(mb)
        mb //= 2
    out = []
    for ep in eps:
        for ac in acs:
            for mb in mbs:
                changes = (ep != s.expert_parallel_size) + (ac != s.activation_checkpointing) + (mb != s.micro_batch_size)
                if changes == 0:
                    continue
                layout = s.with_layout(expert_parallel_size=ep, activation_checkpointing=ac, micro_batch_size=mb,
                                       accumulate_grad_batches=s.accumulate_grad_batches * (s.micro_batch_size // mb))
                out.append((changes, layout))
    out.sort(key=lambda x: x[0])
    return out


def more_nodes(s: RunSettings, max_factor: int = 64) -> list[RunSettings]:
    """The same recipe on 2x, 4x, ... the nodes, with the valid EP size nearest to the asked one."""
    out, factor = [], 2
    while factor <= max_factor:
        nodes = s.num_nodes * factor
        world = s.devices_per_node * nodes
        sizes = _ep_sizes(s, world)
        target = max(s.expert_parallel_size, 1) * factor  # keep the experts per rank where they were
        ep = min(sizes, key=lambda d: (abs(d - target), -d))
        out.append(s.with_layout(num_nodes=nodes, expert_parallel_size=ep, activation_checkpointing="full",
                                 sharded=True))
        factor *= 2
    return out


def suggest(s: RunSettings, evaluate: Callable, limit: int = 5) -> list:
    """Plans that fit, nearest first: up to `limit` on the same devices, else the fewest extra nodes."""
    found = []
    for _, layout in candidates(s):
        plan = evaluate(layout)
        if plan.verdict.fits:
            found.append(plan)
            if len(found) >= limit:
                break
    if found:
        return found
    for layout in more_nodes(s):
        plan = evaluate(layout)
        if plan.verdict.fits:
            return [plan]
    return []
