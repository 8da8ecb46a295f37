"""The device-specific ops behind one interface: grouped GEMM for the routed experts and attention.

Model code calls `grouped_mm` and `attention`; which kernel runs is decided here, by the device of
the tensors, and nowhere else:
- grouped GEMM: `torch._grouped_mm` (CUDA sm90+ and CPU) or `torch_npu.npu_grouped_matmul` (NPU).
- attention: SDPA (causal) for full layers everywhere; sliding-window layers through FlexAttention
  on CUDA, the fused NPU attention with a band mask on NPU, and SDPA with a boolean mask on CPU.
"""

from __future__ import annotations

import functools

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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Causal attention with grouped KV heads and an optional sliding window.

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq a multiple of Hkv; query head h reads KV head
    h // (Hq / Hkv). window: a query at position i sees keys i - window + 1 .. i (window keys,
    itself included), or all keys <= i when None. Returns [B, Hq, S, D].
    """
    seq = q.shape[-2]
    if window is None or window >= seq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if q.device.type == "cuda":
        return _flex_sliding_attention(q, k, v, window, scale)
    if q.device.type == "npu":
        from step35.accelerators import npu_sliding_attention

        return npu_sliding_attention(q, k, v, window, scale)
    mask = sliding_window_mask(seq, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sliding_window_mask(seq: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S] boolean, True where query i may read key j: i - window < j <= i."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (j > i - window)


@functools.lru_cache(maxsize=32)
def _sliding_block_mask(seq: int, window: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    return create_block_mask(keep, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_sliding_attention(q, k, v, window: int, scale: float) -> torch.Tensor:
    block_mask = _sliding_block_mask(q.shape[-2], window, str(q.device))
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
