"""Which keys each query reads, described once for every attention backend of kernels.attention.

- `causal_mask`: causal, with an optional sliding window, by index;
- `DocumentMask`: packed documents in a batch (a query reads only its own document's keys);
- `PositionMask`: queries and keys that are shares of a sequence, masked by global token positions
  (context parallelism);
- `SequenceShard`: this cp rank's share of every sequence and how its attention reaches the other
  ranks' keys (gathered, halo, or its own), which it describes by a `PositionMask`.
Each gives the forms the backends read: a dense boolean mask (CPU), a FlexAttention block mask
(CUDA), the varlen document lengths (NPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from step35.kernels.sequence_split import gathers_sequence, halo_keys


def causal_mask(seq: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S] boolean, True where query i may read key j: j <= i, and i - window < j with a window."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (j > i - window) if window is not None else j <= i


@functools.lru_cache(maxsize=32)
def sliding_block_mask(seq: int, window: int | None, device: str):
    """The FlexAttention block mask of `causal_mask(seq, window)`, cached per shape and device."""
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, q_idx, kv_idx):
        inside = kv_idx <= q_idx
        return inside & (kv_idx > q_idx - window) if window is not None else inside

    return create_block_mask(keep, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device)


class DocumentMask:
    """Packed documents in a batch, the one mask description every attention backend reads.

    position_ids [B, S]: each token's position within its document, restarting at 0 where a
    document starts (so column 0 is always 0). A query then reads only keys of its own document
    (and, on sliding layers, at most `window` of them). Backends take what they need:
    `dense` (CPU: an explicit boolean mask), `block_mask` (CUDA FlexAttention),
    `cu_seqlens` (the NPU fused kernel's varlen TND form: one host sync, done once per forward).
    """

    def __init__(self, position_ids: torch.Tensor):
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
        self.position_ids = position_ids
        self.ids = torch.cumsum(position_ids == 0, dim=1)  # [B, S] document number within its row
        self._cu_seqlens: list[int] | None = None
        self._block_masks: dict = {}

    def dense(self, window: int | None) -> torch.Tensor:
        """[B, 1, S, S] boolean, True where query i may read key j."""
        seq = self.ids.shape[1]
        keep = causal_mask(seq, window, self.ids.device)[None, None]
        return keep & (self.ids[:, None, :, None] == self.ids[:, None, None, :])

    def cu_seqlens(self) -> list[int]:
        """Cumulative document ends over the flattened batch (B*S tokens), e.g. [3, 8, 12, 16] for
        rows [3 + 5, 4 + 4]: the `actual_seq_qlen` / `actual_seq_kvlen` of a TND call."""
        if self._cu_seqlens is None:
            starts = (self.position_ids == 0).clone()
            ends = torch.zeros_like(starts)
            ends[:, :-1] = starts[:, 1:]
            ends[:, -1] = True
            flat = torch.nonzero(ends.reshape(-1)).squeeze(1) + 1
            self._cu_seqlens = flat.tolist()  # host sync: the kernel takes the lengths as host integers
        return self._cu_seqlens

    def block_mask(self, window: int | None):
        if window not in self._block_masks:
            self._block_masks[window] = _document_block_mask(self.ids, window)
        return self._block_masks[window]


def _document_block_mask(ids: torch.Tensor, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, q_idx, kv_idx):
        inside = (kv_idx <= q_idx) & (ids[b, q_idx] == ids[b, kv_idx])
        return inside & (kv_idx > q_idx - window) if window is not None else inside

    B, S = ids.shape
    return create_block_mask(keep, B=B, H=None, Q_LEN=S, KV_LEN=S, device=str(ids.device))


class PositionMask:
    """Which keys each query may read, decided by global token positions rather than by index: for
    queries that are a share of the sequence and keys that are another share (context parallelism).

    q_pos [Lq] and k_pos [Lk] are positions in the whole sequence (k_pos < 0: an empty slot, never
    read); q_doc [B, Lq] and k_doc [B, Lk] document numbers (None: one document per row). Same rule
    as `DocumentMask`: a key is read when k <= q, q - window < k (with a window) and both are in
    the same document. Duck-types `DocumentMask` where the attention paths read it (`dense`,
    `block_mask`)."""

    def __init__(
        self,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None,
    ):
        self.q_pos, self.k_pos, self.q_doc, self.k_doc = q_pos, k_pos, q_doc, k_doc

    @staticmethod
    def reads(q: torch.Tensor, k: torch.Tensor, window: int | None, q_doc=None, k_doc=None) -> torch.Tensor:
        """The rule, elementwise (broadcasting): a query at position q reads a key at position k."""
        keep = (k >= 0) & (k <= q)
        if window is not None:
            keep = keep & (k > q - window)
        if q_doc is not None:
            keep = keep & (q_doc == k_doc)
        return keep

    def dense(self, window: int | None) -> torch.Tensor:
        """[B or 1, 1, Lq, Lk] boolean, True where query i may read key j."""
        docs = () if self.q_doc is None else (self.q_doc[:, None, :, None], self.k_doc[:, None, None, :])
        return self.reads(self.q_pos[None, None, :, None], self.k_pos[None, None, None, :], window, *docs)

    def block_mask(self, window: int | None):
        from torch.nn.attention.flex_attention import create_block_mask

        q_pos, k_pos, q_doc, k_doc = self.q_pos, self.k_pos, self.q_doc, self.k_doc

        def keep(b, h, q_idx, kv_idx):
            docs = () if q_doc is None else (q_doc[b, q_idx], k_doc[b, kv_idx])
            return self.reads(q_pos[q_idx], k_pos[kv_idx], window, *docs)

        B = q_doc.shape[0] if q_doc is not None else None
        return create_block_mask(
            keep, B=B, H=None, Q_LEN=q_pos.shape[0], KV_LEN=k_pos.shape[0], device=str(q_pos.device)
        )


class SequenceShard:
    """This rank's share of every sequence of a micro-batch under context parallelism, and how its
    attention reaches the keys held by the other cp ranks. Built per forward by
    step35.parallel.context.ContextParallel (which owns the communication: this module has none) and
    passed down the layers where a `DocumentMask` would go; kernels.attention reads it.

    The sequence of S tokens is cut in 2 cp chunks of `chunk` tokens (kernels.sequence_split); this
    rank holds two of them, so its L = 2 x chunk local tokens sit at global positions `positions` [L]
    (ascending within each chunk). doc_ids [B, S]: document number of every token of the whole rows
    (None: one document).
    gather(x [B, H, L, D]) -> [B, H, S, D]: the whole sequence's keys/values in global order;
    halo(x [B, H, L, D], n) -> [B, H, 2n, D]: the n tokens before each local chunk (zeros where the
    sequence has none, or where the local chunks are adjacent). Both differentiable (their backward
    returns the gradient to the owner). The same x may carry K and V stacked in front ([2, B, H, L, D]).
    `npu_segments` caches the NPU varlen plan for the calls of one forward (a host sync each).
    """

    def __init__(
        self,
        positions: torch.Tensor,
        seq_len: int,
        chunk: int,
        doc_ids: torch.Tensor | None,
        gather: Callable[[torch.Tensor], torch.Tensor],
        halo: Callable[[torch.Tensor, int], torch.Tensor],
    ):
        self.positions, self.seq_len, self.chunk, self.doc_ids = positions, seq_len, chunk, doc_ids
        self.gather, self.halo = gather, halo
        self.npu_segments: dict = {}

    def uses_halo(self, window: int | None) -> bool:
        """Sliding windows whose preceding window - 1 keys fit in one chunk take the halo exchange;
        full layers and longer windows gather the whole sequence's keys (exact either way)."""
        return halo_keys(window, self.chunk) > 0

    def keys(self, k: torch.Tensor, v: torch.Tensor, window: int | None):
        """The keys and values the local queries read, from the local k, v [B, Hkv, L, D]: gathered,
        with halos, or the local ones alone. Returns (window, keys, values, PositionMask); window is
        None where it covers the whole sequence."""
        if window is not None and window >= self.seq_len:
            window = None
        kv = torch.stack([k, v])  # one exchange for both: [2, B, Hkv, L, D]
        if gathers_sequence(window, self.chunk):
            kv = self.gather(kv)
            k_pos = torch.arange(self.seq_len, device=self.positions.device)
        elif self.uses_halo(window):
            n, c = halo_keys(window, self.chunk), self.chunk
            halo = self.halo(kv, n)  # [2, B, Hkv, 2n, D]: before the first local chunk, before the second
            kv = torch.cat([halo[..., :n, :], kv[..., :c, :], halo[..., n:, :], kv[..., c:, :]], dim=-2)
            before = torch.arange(-n, 0, device=self.positions.device)
            pos = self.positions
            # Where the two local chunks are adjacent (the middle ones, on the last cp rank) the second's
            # halo repeats the first's own tail: mark it empty, or those keys would count twice.
            second_before = torch.where(pos[c] == pos[c - 1] + 1, -1, pos[c] + before)
            k_pos = torch.cat([pos[0] + before, pos[:c], second_before, pos[c:]])
        else:  # window 1: each token reads itself only, the local keys suffice
            k_pos = self.positions
        q_doc = k_doc = None
        if self.doc_ids is not None:
            q_doc = self.doc_ids[:, self.positions]
            k_doc = self.doc_ids[:, k_pos.clamp(min=0)]  # empty slots (k_pos < 0) are masked anyway
        return window, kv[0], kv[1], PositionMask(self.positions, k_pos, q_doc, k_doc)
