"""Context parallelism counted (step35/parallel/context.py): every sequence of a micro-batch split over
the `cp` ranks of its group, each rank holding S / cp tokens of it (two chunks of c = S / (2 cp)); the
split's arithmetic, which layers gather and how long a halo is, is step35/kernels/sequence_split.py's.

What the exchange adds per attention layer, beyond the rank's share (the only formulas of it in the plan):
- full layers, and sliding windows longer than c + 1 keys: the all-gathered K and V of the whole sequence.
  The kernel keeps them for backward, so the rank keeps the other ranks' S - S / cp tokens of K/V;
  in backward the gather's gradient is a whole-sequence dK/dV (and its chunk-reordered copy) before the
  reduce-scatter hands each rank its share;
- sliding windows of at most c + 1 keys: two halos of window - 1 keys (one before each local chunk),
  kept by the kernel with the local K/V; their gradients go back point to point.
Communication per layer and micro-batch: the gather receives (S - S / cp) tokens of K/V per rank in
forward (again when full checkpointing replays it) and reduce-scatters as much in backward; a halo sends
and receives 2 (window - 1) tokens of K/V each way, forward and backward.
"""

from __future__ import annotations

from step35.config import LayerSpec, Step35Config
from step35.kernels.sequence_split import chunk_tokens, exchanged_tokens, gathers_sequence


def _window(config: Step35Config, spec: LayerSpec) -> int | None:
    return config.sliding_window if spec.sliding else None


def exchange_tokens(config: Step35Config, spec: LayerSpec, seq: int, cp: int) -> int:
    """Tokens of K/V per sequence one rank holds for a layer's attention beyond its own S / cp
    (kernels.sequence_split.exchanged_tokens, the split's own rule)."""
    return exchanged_tokens(_window(config, spec), seq, cp)


def kv_bytes_per_token(spec: LayerSpec, act_bytes: int) -> int:
    """K and V of one token of a layer."""
    return 2 * spec.num_kv_heads * spec.head_dim * act_bytes


def gathered_gradient_bytes(
    config: Step35Config, layers: list[LayerSpec], batch: int, seq: int, cp: int, act_bytes: int
) -> int:
    """The largest whole-sequence dK/dV a gathering layer builds in backward (the gradient and its
    reordered copy, parallel/context._GatherSequence.backward), before the reduce-scatter."""
    gathering = [spec for spec in layers if cp > 1 and gathers_sequence(_window(config, spec), chunk_tokens(seq, cp))]
    return max((2 * batch * seq * kv_bytes_per_token(spec, act_bytes) for spec in gathering), default=0)


def communication_bytes(
    config: Step35Config, layers: list[LayerSpec], batch: int, seq: int, cp: int, act_bytes: int, *, replay: bool
) -> int:
    """Bytes one rank receives per micro-batch for the K/V exchange: all-gathers (forward, and the
    replay under full checkpointing), the backward reduce-scatters, and the halos both ways."""
    if cp <= 1:
        return 0
    total = 0
    for spec in layers:
        per_token = batch * kv_bytes_per_token(spec, act_bytes)
        calls = 2 + (1 if replay else 0)  # forward, backward, replayed forward
        total += exchange_tokens(config, spec, seq, cp) * per_token * calls
    return total
