"""Nearest layouts that fit, when the asked one does not (or is invalid): other expert-parallel sizes,
more activation checkpointing, smaller micro-batches on the same devices; failing those, more nodes.
Beside them, other ways to train (`other_ways`): a LoRA fine-tune for a fine-tuning config, and a
context-parallel size for a long sequence (a full plan at that size)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from step35.kernels.sequence_split import rank_tokens
from step35.parallel import valid_cp_sizes, valid_ep_sizes
from step35.plan.lora import LoraInputError, parse_lora
from step35.plan.memory import Verdict
from step35.plan.settings import RunSettings

AC_ORDER = ("none", "selective", "full")


def expert_rows(cfg) -> tuple[int, ...]:
    """Dim 1 of the stacked expert tensors (gate/up_proj: moe_intermediate_size; down_proj: hidden_size), which
    efsdp must divide under EP (ParallelDims.check_expert_rows); none without routed experts."""
    return (cfg.moe_intermediate_size, cfg.hidden_size) if cfg.use_moe else ()


def _ep_sizes(s: RunSettings, world: int) -> list[int]:
    """The EP sizes worth trying on `world` ranks: the valid ones, or only 1 without routed experts."""
    cfg = s.model_config
    return valid_ep_sizes(world, cfg.moe_num_experts, expert_rows(cfg)) if cfg.use_moe else [1]


def _nearest_ep(sizes: list[int], ep: int) -> list[int]:
    return sorted(sizes, key=lambda d: (abs((d / ep) - 1) if d >= ep else abs((ep / d) - 1), -d))


def candidates(s: RunSettings) -> list[tuple[int, RunSettings]]:
    """(distance, layout) on the same world: one change at a time, then pairs, nearest first."""
    eps = _nearest_ep(_ep_sizes(s, s.world_size), s.expert_parallel_size)[:5] if s.sharded else [1]
    acs = AC_ORDER[AC_ORDER.index(s.activation_checkpointing) :] if s.activation_checkpointing in AC_ORDER else AC_ORDER
    mbs = []
    mb = s.micro_batch_size
    while mb >= 1:
        mbs.append(mb)
        mb //= 2
    out = []
    for ep in eps:
        for ac in acs:
            for mb in mbs:
                changes = (
                    (ep != s.expert_parallel_size) + (ac != s.activation_checkpointing) + (mb != s.micro_batch_size)
                )
                if changes == 0:
                    continue
                layout = s.with_layout(
                    expert_parallel_size=ep,
                    activation_checkpointing=ac,
                    micro_batch_size=mb,
                    accumulate_grad_batches=s.accumulate_grad_batches * (s.micro_batch_size // mb),
                )
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
        out.append(
            s.with_layout(num_nodes=nodes, expert_parallel_size=ep, activation_checkpointing="full", sharded=True)
        )
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


LORA_RANKS = (32, 16, 8, 4, 2, 1)  # the suggested rank: 32, or the largest every adapted layer allows
LONG_SEQ = 8192  # from here on a sequence is long enough to suggest context parallelism


@dataclass
class OtherWay:
    """Another way to train the same model on the same devices, with its verdict."""

    what: str  # the change, in the config's words
    verdict: Verdict


def lora_way(s: RunSettings, evaluate: Callable) -> OtherWay | None:
    """A LoRA fine-tune (default targets, rank 32 or the largest that fits every layer) of a config
    that fine-tunes (model.checkpoint) in full; with full checkpointing too when that is what fits."""
    if s.lora is not None or not s.finetune:
        return None
    for rank in LORA_RANKS:
        try:
            lora = parse_lora({"rank": rank}, s.model_config)
            break
        except LoraInputError:
            continue
    else:
        return None
    # under LoRA the vision side trains through adapters only (model.vision.train is refused beside it)
    tries = [s.with_layout(lora=lora, train_vision=False)]
    if s.activation_checkpointing != "full":
        tries.append(s.with_layout(lora=lora, train_vision=False, activation_checkpointing="full"))
    for layout in tries:
        plan = evaluate(layout)
        if plan.verdict.fits:
            break
    ac = (
        f", activation_checkpointing {layout.activation_checkpointing}"
        if layout.activation_checkpointing != s.activation_checkpointing
        else ""
    )
    return OtherWay(
        f"LoRA fine-tune (model.lora: {{rank: {lora.rank}}}: base frozen in bf16, "
        f"adapters of expert rank {lora.expert_rank} on the routed experts{ac})",
        plan.verdict,
    )


def context_parallel_way(s: RunSettings, evaluate: Callable) -> OtherWay | None:
    """The smallest larger context-parallel size (a power of two dividing the world and the sequence
    in 2 x cp chunks) whose plan fits; else the largest tried, with its verdict."""
    if s.seq_len < LONG_SEQ or not s.sharded:
        return None
    found = None
    cp = 2 * s.context_parallel_size
    while cp in valid_cp_sizes(s.world_size, s.seq_len):
        plan = evaluate(s.with_layout(context_parallel_size=cp))
        found = OtherWay(
            f"context parallel size {cp} (trainer.strategy.context_parallel_size: seq {s.seq_len} "
            f"over {cp} ranks, {rank_tokens(s.seq_len, cp)} tokens each)",
            plan.verdict,
        )
        if plan.verdict.fits:
            break
        cp *= 2
    return found


def other_ways(s: RunSettings, evaluate: Callable) -> list[OtherWay]:
    return [w for w in (lora_way(s, evaluate), context_parallel_way(s, evaluate)) if w is not None]
