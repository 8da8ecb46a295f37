"""Grouped GEMM of the routed experts: every expert's rows times its own weight in one call.

Which kernel runs is decided here, by the device of the tensors: `torch._grouped_mm` (CUDA sm90+ and
CPU), `torch_npu.npu_grouped_matmul` (NPU, through step35.accelerators), or a loop over the groups
for shapes and devices the grouped kernels do not take.
"""

from __future__ import annotations

import torch


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
