"""The context-parallel split of a sequence, the one place of its arithmetic (the runtime in
step35.parallel.context and kernels.masks.SequenceShard, the refusal of a bad size in
step35.parallel.mesh, the plan's counts and the callbacks' token counts all read it here).

A sequence of S tokens is cut in 2 cp chunks of c = S / (2 cp) tokens, so S must be a multiple of
2 cp. cp rank r holds chunk r and chunk 2 cp - 1 - r: one early (cheap) and one late (expensive)
chunk, the same causal attention work on every rank, S / cp tokens in all. Deterministic: a function
of (S, cp, r) only.

The keys a rank's queries read beyond its own, per attention layer, by the layer's window:
- window 1 (each token reads itself): none, the local keys suffice;
- sliding windows whose window - 1 preceding keys fit in one chunk (1 < window <= c + 1): a halo of
  window - 1 keys before each local chunk, from the neighbouring ranks;
- full layers and longer windows: the whole sequence's keys, gathered (S - S / cp of them remote).
"""

from __future__ import annotations

import torch


def splits(seq_len: int, cp: int) -> bool:
    """Whether `seq_len` tokens cut in 2 x cp equal chunks (always true without context parallelism)."""
    return cp == 1 or seq_len % (2 * cp) == 0


def chunk_tokens(seq_len: int, cp: int) -> int:
    """Tokens of one chunk, c = S / (2 cp) (each rank holds two); `seq_len` must split (`splits`)."""
    return seq_len // (2 * cp)


def rank_tokens(tokens: int, cp: int) -> int:
    """Tokens of whole rows (one sequence, or a micro-batch of them) that one cp rank holds and computes."""
    return tokens // cp


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The global chunks cp rank `rank` holds, in its slot order: chunk r, then chunk 2 cp - 1 - r."""
    return rank, 2 * cp - 1 - rank


def chunk_owner(j: int, cp: int) -> tuple[int, int]:
    """(rank, slot) holding global chunk j (the inverse of `rank_chunks`): chunks 0..cp-1 are the ranks'
    first slots, the rest their second slots in reverse."""
    return (j, 0) if j < cp else (2 * cp - 1 - j, 1)


def chunk_order(cp: int) -> list[int]:
    """For each global chunk j (2 cp of them), its index in the rank-major layout [rank, slot] that an
    all-gather of the ranks' shares gives."""
    order = []
    for j in range(2 * cp):
        rank, slot = chunk_owner(j, cp)
        order.append(2 * rank + slot)
    return order


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """[2 c] global positions of rank `rank`'s tokens, its chunks in slot order (`rank_chunks`);
    `seq_len` must split (`splits`)."""
    c = chunk_tokens(seq_len, cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in rank_chunks(rank, cp)])


def halo_fits(n: int, chunk: int) -> bool:
    """Whether the n keys before a chunk lie in the one chunk before it (0 < n <= c), so that they come
    from a single neighbouring rank."""
    return 0 < n <= chunk


def halo_keys(window: int | None, chunk: int) -> int:
    """Keys before each local chunk that a layer takes by the halo exchange: window - 1 for a sliding
    window whose preceding keys fit in one chunk, else 0 (the layer gathers the sequence, or, with
    window 1, reads only its own keys)."""
    n = window - 1 if window is not None else 0
    return n if halo_fits(n, chunk) else 0


def gathers_sequence(window: int | None, chunk: int) -> bool:
    """Whether a layer reads the whole sequence's keys, all-gathered: full layers and windows whose
    preceding window - 1 keys do not fit in one chunk."""
    return window is None or window - 1 > chunk


def exchanged_tokens(window: int | None, seq_len: int, cp: int) -> int:
    """Tokens of K/V per sequence that one rank holds for a layer's attention beyond its own S / cp:
    the remote S - S / cp when the layer gathers, two halos of window - 1 keys, or none."""
    if cp == 1:
        return 0
    chunk = chunk_tokens(seq_len, cp)
    if gathers_sequence(window, chunk):
        return seq_len - rank_tokens(seq_len, cp)
    return 2 * halo_keys(window, chunk)
