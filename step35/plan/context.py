"""Context parallelism as an estimate, until it lands in the trainer: the sequence of each
micro-batch split over `cp` ranks that share it, with the full K and V gathered for attention."""

from __future__ import annotations

from step35.plan.memory import Phase
from step35.plan.settings import RunSettings

SCALED = ("activations", "block backward work", "all-to-all buffers")  # per-token rows: 1 / cp of the tokens


def context_parallel_phases(s: RunSettings, phase_list: list[Phase], cp: int) -> list[Phase]:
    """The phases of the layout `s` with its sequence split over `cp` ranks (an ESTIMATE: step35 has
    no context parallelism yet).

    Each rank keeps 1/cp of the activations, of the block it rebuilds in backward and of the expert
    all-to-all rows (all per token), and gathers the whole sequence's K and V of one layer for its
    attention (batch x seq x 2 x kv heads x head dim, compute dtype, the widest layer), plus their
    gradients of the same size in block backward. Parameters, gradients and optimizer states do not
    change: FSDP shards them over the same ranks as before (the cp ranks are data-parallel ranks that
    read the same micro-batch, so the global batch in tokens shrinks by cp)."""
    cfg = s.model_config
    a = _bytes(s)
    kv = max(spec.num_kv_heads * spec.head_dim for spec in map(cfg.layer, range(cfg.num_hidden_layers)))
    gathered = s.micro_batch_size * s.seq_len * 2 * kv * a
    out = []
    for ph in phase_list:
        rows = {k: (v // cp if k in SCALED else v) for k, v in ph.rows.items()}
        if "activations" in rows:
            rows["cp gathered K/V"] = gathered * (2 if ph.name == "block backward" else 1)
        out.append(Phase(ph.name, rows))
    return out


def _bytes(s: RunSettings) -> int:
    import torch

    return torch.empty((), dtype=s.compute_dtype).element_size()
