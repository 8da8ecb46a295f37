"""The device-specific ops behind one interface: grouped GEMM for the routed experts and attention.

Model code calls `grouped_mm` and `attention`; which kernel runs is decided here, by the device of
the tensors, and nowhere else:
- grouped GEMM: `torch._grouped_mm` (CUDA sm90+ and CPU) or `torch_npu.npu_grouped_matmul` (NPU).
- attention: SDPA (causal) for full layers everywhere; sliding-window layers and packed documents
  (`DocumentMask`) through FlexAttention block masks on CUDA, the fused NPU attention (band mode,
  varlen TND for documents) on NPU, and SDPA's CPU kernel with an explicit mask on CPU.
- context parallelism (`SequenceShard`): the local queries against keys gathered or exchanged by
  step35.parallel.context, masked by global token positions (`PositionMask`): FlexAttention on CUDA,
  the fused NPU attention on NPU (`npu_position_attention`), SDPA's CPU kernel with the explicit mask
  on CPU.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------- grouped GEMM


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """y[rows of group g] = x[rows of group g] @ weight[g].T for tokens sorted by group.

    x: [N, in] rows sorted by group; weight: [G, out, in] (nn.Linear layout, stacked);
    counts: [G] rows per group (sum = N). Returns [N, out].
    An expert-parallel weight (a DTensor sharded over experts) contributes its local experts.
    """
    weight = _local(weight)
    if torch.is_autocast_enabled(x.device.type):  # autocast does not cover the grouped kernels: cast as it would
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if x.device.type == "npu":
        return _npu_grouped_mm(x, weight, counts)
    if _grouped_mm_supported(x, weight):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return _grouped_mm_by_segments(x, weight, counts)


def _local(weight: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def _grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._grouped_mm needs row strides that are multiples of 16 bytes; real model widths
    # (4096, 1280) always satisfy it, only odd test shapes fall back to the segment loop.
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.dtype != torch.bfloat16 and (x.device.type == "cuda" or torch.compiler.is_compiling()):
        return False  # the CUDA kernel and the op's compile-time shape function take bf16 only (torch 2.13)
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    item = x.element_size()
    return (x.shape[-1] * item) % 16 == 0 and (weight.shape[-2] * item) % 16 == 0


def _grouped_mm_by_segments(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # Cold path (unaligned shapes, old GPUs). One host sync for the split sizes.
    pieces = torch.split(x, counts.tolist())
    return torch.cat([p @ weight[g].T for g, p in enumerate(pieces)], dim=0)


def _npu_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    from step35.accelerators import npu_grouped_matmul  # torch_npu only when an NPU tensor arrives

    return npu_grouped_matmul(x, weight, counts)


# ---------------------------------------------------------------------------------- attention


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
            B, S = self.ids.shape
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float,
              documents: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention with grouped KV heads, an optional sliding window and optional documents.

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq a multiple of Hkv; query head h reads KV head
    h // (Hq / Hkv). window: a query at position i sees keys i - window + 1 .. i (window keys,
    itself included), or all keys <= i when None. documents: keys of other documents are never
    read (packed windows). Returns [B, Hq, S, D].
    """
    if isinstance(documents, SequenceShard):  # context parallelism: keys come from the other cp ranks
        return documents.attend(q, k, v, window, scale)
    seq = q.shape[-2]
    if window is not None and window >= seq:
        window = None
    if window is None and documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if q.device.type == "cuda":
        return _flex_attention(q, k, v, window, scale, documents)
    if q.device.type == "npu":
        from step35.accelerators import npu_attention

        return npu_attention(q, k, v, window, scale, documents)
    return _MaskedAttentionCPU.apply(q, k, v, window, scale, documents)


def causal_mask(seq: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S] boolean, True where query i may read key j: j <= i, and i - window < j with a window."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (j > i - window) if window is not None else j <= i


class _MaskedAttentionCPU(torch.autograd.Function):
    """SDPA with an explicit mask that is rebuilt in backward instead of kept: the [S, S] float
    mask SDPA makes from a boolean one would otherwise stay alive per layer (4 MB at 1K tokens,
    1 GB at 16K). The forward is SDPA's own CPU kernel with the same float mask, so outputs are
    bit-identical to `F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)`."""

    @staticmethod
    def forward(ctx, q, k, v, window, scale, documents):
        ctx.window, ctx.scale, ctx.documents = window, scale, documents
        mask = _float_mask(q, window, documents)
        out, lse = _flash_cpu_ops()[0](q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        mask = _float_mask(q, ctx.window, ctx.documents)
        grads = _flash_cpu_ops()[1](grad.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None, None


def _float_mask(q: torch.Tensor, window: int | None, documents: DocumentMask | None) -> torch.Tensor:
    seq = q.shape[-2]
    keep = documents.dense(window) if documents is not None else causal_mask(seq, window, q.device)
    # as SDPA converts a boolean mask: 0 where kept, -inf elsewhere, in the query dtype
    return torch.where(keep, torch.zeros((), dtype=q.dtype, device=q.device),
                       torch.full((), float("-inf"), dtype=q.dtype, device=q.device))


def _flash_cpu_ops():
    # Private ATen ops behind F.scaled_dot_product_attention on CPU (the only place they are used).
    # Not lru_cached: per-block compile traces this, and dynamo warns about cache wrappers.
    try:
        aten = torch.ops.aten
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    except AttributeError as e:  # renamed in a later torch: say where to look
        raise RuntimeError(f"torch {torch.__version__} lacks SDPA's CPU flash-attention ops that "
                           "step35.kernels._MaskedAttentionCPU calls; update that function") from e


@functools.lru_cache(maxsize=32)
def _sliding_block_mask(seq: int, window: int | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, q_idx, kv_idx):
        inside = kv_idx <= q_idx
        return inside & (kv_idx > q_idx - window) if window is not None else inside

    return create_block_mask(keep, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device)


def _document_block_mask(ids: torch.Tensor, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, q_idx, kv_idx):
        inside = (kv_idx <= q_idx) & (ids[b, q_idx] == ids[b, kv_idx])
        return inside & (kv_idx > q_idx - window) if window is not None else inside

    B, S = ids.shape
    return create_block_mask(keep, B=B, H=None, Q_LEN=S, KV_LEN=S, device=str(ids.device))


@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q, k, v, window: int | None, scale: float, documents: DocumentMask | None) -> torch.Tensor:
    if documents is not None:
        block_mask = documents.block_mask(window)
    else:
        block_mask = _sliding_block_mask(q.shape[-2], window, str(q.device))
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


# ---------------------------------------------------------------------------------- context parallelism


class PositionMask:
    """Which keys each query may read, decided by global token positions rather than by index: for
    queries that are a share of the sequence and keys that are another share (context parallelism).

    q_pos [Lq] and k_pos [Lk] are positions in the whole sequence (k_pos < 0: an empty slot, never
    read); q_doc [B, Lq] and k_doc [B, Lk] document numbers (None: one document per row). Same rule
    as `DocumentMask`: a key is read when k <= q, q - window < k (with a window) and both are in
    the same document. Duck-types `DocumentMask` where the attention paths read it (`dense`,
    `block_mask`)."""

    def __init__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
                 k_doc: torch.Tensor | None = None):
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
        return create_block_mask(keep, B=B, H=None, Q_LEN=q_pos.shape[0], KV_LEN=k_pos.shape[0],
                                 device=str(q_pos.device))


class SequenceShard:
    """This rank's share of every sequence of a micro-batch under context parallelism, and how its
    attention reaches the keys held by the other cp ranks. Built per forward by
    step35.parallel.context.ContextParallel (which owns the communication: this module has none) and
    passed down the layers where a `DocumentMask` would go.

    The sequence of S tokens is cut in 2 cp chunks of `chunk` tokens; this rank holds two of them, so
    its L = 2 x chunk local tokens sit at global positions `positions` [L] (ascending within each
    chunk). doc_ids [B, S]: document number of every token of the whole rows (None: one document).
    gather(x [B, H, L, D]) -> [B, H, S, D]: the whole sequence's keys/values in global order;
    halo(x [B, H, L, D], n) -> [B, H, 2n, D]: the n tokens before each local chunk (zeros where the
    sequence has none, or where the local chunks are adjacent). Both differentiable (their backward
    returns the gradient to the owner). The same x may carry K and V stacked in front ([2, B, H, L, D]).
    """

    def __init__(self, positions: torch.Tensor, seq_len: int, chunk: int, doc_ids: torch.Tensor | None,
                 gather: Callable[[torch.Tensor], torch.Tensor], halo: Callable[[torch.Tensor, int], torch.Tensor]):
        self.positions, self.seq_len, self.chunk, self.doc_ids = positions, seq_len, chunk, doc_ids
        self.gather, self.halo = gather, halo
        self._npu_segments: dict = {}  # the NPU varlen segments, once per forward (a host sync each)

    def uses_halo(self, window: int | None) -> bool:
        """Sliding windows whose preceding window - 1 keys fit in one chunk take the halo exchange;
        full layers and longer windows gather the whole sequence's keys (exact either way)."""
        return window is not None and 0 < window - 1 <= self.chunk

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float) -> torch.Tensor:
        """q [B, Hq, L, D] local queries, k, v [B, Hkv, L, D] local keys -> [B, Hq, L, D]."""
        window, keys, values, mask = self.keys(k, v, window)
        if q.device.type == "cuda":
            return _flex_attention(q, keys, values, window, scale, mask)
        if q.device.type == "npu":
            return npu_position_attention(q, keys, values, window, scale, mask, self._npu_segments)
        return _MaskedAttentionCPU.apply(q, keys, values, window, scale, mask)

    def keys(self, k: torch.Tensor, v: torch.Tensor, window: int | None):
        """The keys and values the local queries read, from the local k, v [B, Hkv, L, D]: gathered,
        with halos, or the local ones alone. Returns (window, keys, values, PositionMask); window is
        None where it covers the whole sequence."""
        if window is not None and window >= self.seq_len:
            window = None
        kv = torch.stack([k, v])  # one exchange for both: [2, B, Hkv, L, D]
        if window == 1:  # each token reads itself only: the local keys suffice
            k_pos = self.positions
        elif self.uses_halo(window):
            n, c = window - 1, self.chunk
            halo = self.halo(kv, n)  # [2, B, Hkv, 2n, D]: before the first local chunk, before the second
            kv = torch.cat([halo[..., :n, :], kv[..., :c, :], halo[..., n:, :], kv[..., c:, :]], dim=-2)
            before = torch.arange(-n, 0, device=self.positions.device)
            pos = self.positions
            # Where the two local chunks are adjacent (the middle ones, on the last cp rank) the second's
            # halo repeats the first's own tail: mark it empty, or those keys would count twice.
            second_before = torch.where(pos[c] == pos[c - 1] + 1, -1, pos[c] + before)
            k_pos = torch.cat([pos[0] + before, pos[:c], second_before, pos[c:]])
        else:
            kv = self.gather(kv)
            k_pos = torch.arange(self.seq_len, device=self.positions.device)
        q_doc = k_doc = None
        if self.doc_ids is not None:
            q_doc = self.doc_ids[:, self.positions]
            k_doc = self.doc_ids[:, k_pos.clamp(min=0)]  # empty slots (k_pos < 0) are masked anyway
        return window, kv[0], kv[1], PositionMask(self.positions, k_pos, q_doc, k_doc)


def npu_position_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float,
                           mask: PositionMask, segments: dict | None = None) -> torch.Tensor:
    """`PositionMask` attention on the fused NPU kernel (torch_npu.npu_fusion_attention).

    q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D] at the mask's positions. Full layers (window None):
    varlen TND, one segment per run of consecutive query positions of one document (a cp chunk, or
    its part in one document) against that document's keys from its start up to the run's last
    query, causal aligned to the bottom right (sparse mode 3: query i of a run of n reads the first
    kvlen - n + i + 1 keys), so the kernel skips the masked blocks. Sliding windows: BNSD with the
    explicit boolean mask (sparse mode 0, True = not read) of `mask.dense`, as small as the halo
    keys are; not the band mode 4, whose origin for Sq != Skv Huawei's CPU reference puts at the top
    left and Ascend's text leaves unsaid, so it could not be checked. `segments` caches the varlen
    plan (host lists from one sync, the key index on the device) for the calls of one forward.
    Checked against Huawei's CPU reference of the kernel in tests/test_npu_golden.py."""
    from step35.accelerators import import_torch_npu

    torch_npu = import_torch_npu()
    B, Hq, Lq, D = q.shape
    if window is not None:
        masked = ~mask.dense(window)  # [B or 1, 1, Lq, Lk]
        masked = masked[0, 0] if masked.shape[0] == 1 else masked
        return torch_npu.npu_fusion_attention(q, k, v, Hq, "BNSD", atten_mask=masked, scale=scale,
                                              sparse_mode=0)[0]
    plan = segments.get(None) if segments is not None else None
    if plan is None:
        q_ends, kv_ends, index = _varlen_segments(mask, B)
        plan = q_ends, kv_ends, index.to(k.device)
        if segments is not None:
            segments[None] = plan
    q_ends, kv_ends, index = plan
    Lk = k.shape[-2]

    def tnd(t: torch.Tensor, rows: int) -> torch.Tensor:  # [B, H, L, D] -> [B*L, H, D]
        return t.transpose(1, 2).reshape(B * rows, t.shape[1], D)

    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1)
    out = torch_npu.npu_fusion_attention(tnd(q, Lq), tnd(k, Lk).index_select(0, index),
                                         tnd(v, Lk).index_select(0, index), Hq, "TND", atten_mask=compressed,
                                         scale=scale, sparse_mode=3, actual_seq_qlen=q_ends,
                                         actual_seq_kvlen=kv_ends)[0]
    return out.reshape(B, Lq, Hq, D).transpose(1, 2)


def _varlen_segments(mask: PositionMask, batch: int) -> tuple[list[int], list[int], torch.Tensor]:
    """The TND segments of a full (causal, per document) layer: cumulative query ends, cumulative
    key ends, and the flat key index ([B*Lk] numbering) of every segment's keys in order."""
    q_pos, k_pos = mask.q_pos.tolist(), mask.k_pos.tolist()  # host sync: the kernel takes host lengths
    q_doc = mask.q_doc.tolist() if mask.q_doc is not None else [[0] * len(q_pos)] * batch
    k_doc = mask.k_doc.tolist() if mask.k_doc is not None else [[0] * len(k_pos)] * batch
    slot = {p: i for i, p in enumerate(k_pos) if p >= 0}
    q_ends, kv_ends, index = [], [], []
    for b in range(batch):
        i = 0
        while i < len(q_pos):
            j = i + 1  # the run: consecutive positions of one document
            while j < len(q_pos) and q_pos[j] == q_pos[j - 1] + 1 and q_doc[b][j] == q_doc[b][i]:
                j += 1
            first, last = q_pos[i], q_pos[j - 1]
            start = first  # back to the document's (or the sequence's) first key
            while start - 1 in slot and k_doc[b][slot[start - 1]] == q_doc[b][i]:
                start -= 1
            if any(p not in slot for p in range(start, last + 1)):
                raise ValueError(f"npu_position_attention: keys {start}..{last} of a full layer are not all "
                                 "present (a full layer reads gathered keys)")
            index.extend(b * len(k_pos) + slot[p] for p in range(start, last + 1))
            q_ends.append(b * len(q_pos) + j)
            kv_ends.append(len(index))
            i = j
    return q_ends, kv_ends, torch.tensor(index, dtype=torch.long)
