"""Attention with grouped KV heads, causal with an optional sliding window, over the masks of
kernels.masks; which kernel runs is decided here, by the device of the tensors, and nowhere else:
- full layers without documents: SDPA (causal) everywhere;
- sliding windows and packed documents (`DocumentMask`): FlexAttention block masks on CUDA, the fused
  NPU attention on NPU (step35.accelerators.npu_attention: band mode, varlen TND for documents), and
  SDPA's CPU kernel with an explicit mask on CPU;
- context parallelism (`SequenceShard`): the local queries against keys gathered or exchanged by
  step35.parallel.context, masked by global token positions (`PositionMask`): FlexAttention on CUDA,
  the fused NPU attention on NPU (`npu_position_attention`), SDPA's CPU kernel with the explicit mask
  on CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from step35.kernels.masks import DocumentMask, PositionMask, SequenceShard, causal_mask, sliding_block_mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    scale: float,
    documents: DocumentMask | SequenceShard | None = None,
) -> torch.Tensor:
    """Causal attention with grouped KV heads, an optional sliding window and optional documents.

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq a multiple of Hkv; query head h reads KV head
    h // (Hq / Hkv). window: a query at position i sees keys i - window + 1 .. i (window keys,
    itself included), or all keys <= i when None. documents: keys of other documents are never
    read (packed windows); a SequenceShard (context parallelism): q, k, v are this rank's share of
    the rows and the other ranks' keys are read through it. Returns [B, Hq, S, D].
    """
    if isinstance(documents, SequenceShard):  # context parallelism: keys come from the other cp ranks
        return _shard_attention(q, k, v, window, scale, documents)
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


def _shard_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float, shard: SequenceShard
) -> torch.Tensor:
    """q [B, Hq, L, D] a cp rank's local queries, k, v [B, Hkv, L, D] its local keys -> [B, Hq, L, D],
    against the keys `shard.keys` reaches (gathered, halo or local)."""
    window, keys, values, mask = shard.keys(k, v, window)
    if q.device.type == "cuda":
        return _flex_attention(q, keys, values, window, scale, mask)
    if q.device.type == "npu":
        return npu_position_attention(q, keys, values, window, scale, mask, shard.npu_segments)
    return _MaskedAttentionCPU.apply(q, keys, values, window, scale, mask)


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
    return torch.where(
        keep,
        torch.zeros((), dtype=q.dtype, device=q.device),
        torch.full((), float("-inf"), dtype=q.dtype, device=q.device),
    )


def _flash_cpu_ops():
    # Private ATen ops behind F.scaled_dot_product_attention on CPU (the only place they are used).
    # Not lru_cached: per-block compile traces this, and dynamo warns about cache wrappers.
    try:
        aten = torch.ops.aten
        return (
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    except AttributeError as e:  # renamed in a later torch: say where to look
        raise RuntimeError(
            f"torch {torch.__version__} lacks SDPA's CPU flash-attention ops that "
            "step35.kernels.attention._MaskedAttentionCPU calls; update that function"
        ) from e


@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q, k, v, window: int | None, scale: float, documents: DocumentMask | None) -> torch.Tensor:
    if documents is not None:
        block_mask = documents.block_mask(window)
    else:
        block_mask = sliding_block_mask(q.shape[-2], window, str(q.device))
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def npu_position_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    scale: float,
    mask: PositionMask,
    segments: dict | None = None,
) -> torch.Tensor:
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
        return torch_npu.npu_fusion_attention(q, k, v, Hq, "BNSD", atten_mask=masked, scale=scale, sparse_mode=0)[0]
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
    out = torch_npu.npu_fusion_attention(
        tnd(q, Lq),
        tnd(k, Lk).index_select(0, index),
        tnd(v, Lk).index_select(0, index),
        Hq,
        "TND",
        atten_mask=compressed,
        scale=scale,
        sparse_mode=3,
        actual_seq_qlen=q_ends,
        actual_seq_kvlen=kv_ends,
    )[0]
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
                raise ValueError(
                    f"npu_position_attention: keys {start}..{last} of a full layer are not all "
                    "present (a full layer reads gathered keys)"
                )
            index.extend(b * len(k_pos) + slot[p] for p in range(start, last + 1))
            q_ends.append(b * len(q_pos) + j)
            kv_ends.append(len(index))
            i = j
    return q_ends, kv_ends, torch.tensor(index, dtype=torch.long)
