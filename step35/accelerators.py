"""Ascend NPU support: a Lightning accelerator (`--trainer.accelerator npu`) and the NPU kernels
behind step35.kernels (grouped matmul for the experts, fused attention with a sliding window).

torch_npu is imported only when an NPU is actually used. Not run on NPU hardware by the step35
authors: the calls follow Ascend's torch_npu documentation (see docs/npu.md).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry


class NPUUnavailableError(RuntimeError):
    pass


def import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ImportError as e:
        raise NPUUnavailableError(
            "accelerator 'npu' was requested but torch_npu cannot be imported "
            f"({e}); install it with `pip install -e '.[npu]'` on a machine with Ascend's CANN toolkit"
        ) from None
    return torch_npu


class NPUAccelerator(Accelerator):
    """Ascend NPUs through torch_npu, for Lightning's Trainer."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise ValueError(f"NPUAccelerator needs an npu device, got {device}")
        import_torch_npu()
        torch.npu.set_device(device)

    def get_device_stats(self, device) -> dict[str, Any]:
        import_torch_npu()
        return torch.npu.memory_stats(device)

    def teardown(self) -> None:
        if "torch_npu" in __import__("sys").modules:
            torch.npu.empty_cache()

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        if devices in ("auto", -1, "-1"):
            return list(range(NPUAccelerator.auto_device_count()))
        if isinstance(devices, str):
            devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
        return list(range(devices)) if isinstance(devices, int) else list(devices)

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("npu", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        import_torch_npu()
        return torch.npu.device_count()

    @staticmethod
    def is_available() -> bool:
        import_torch_npu()  # raises a clear error instead of Lightning's generic "not available"
        return torch.npu.is_available()

    @staticmethod
    def name() -> str:
        return "npu"


if "npu" not in AcceleratorRegistry:
    AcceleratorRegistry.register("npu", NPUAccelerator, description="Ascend NPU through torch_npu")


# ------------------------------------------------------------------------------------ kernels


class _NPUGroupedMatmul(torch.autograd.Function):
    """y_g = x_g @ w_g^T for row groups; torch_npu's grouped matmul has no autograd of its own."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        torch_npu = import_torch_npu()
        group_list = torch.cumsum(counts, 0).to(torch.int64)
        ctx.save_for_backward(x, weight, group_list)
        # weight [G, out, in] -> per group (in, out); split_item=3: one output tensor; group_type=0: split M
        return torch_npu.npu_grouped_matmul(
            [x], [weight.transpose(1, 2)], group_list=group_list, split_item=3, group_type=0, group_list_type=0
        )[0]

    @staticmethod
    def backward(ctx, grad_y):
        torch_npu = import_torch_npu()
        x, weight, group_list = ctx.saved_tensors
        grad_x = torch_npu.npu_grouped_matmul(
            [grad_y], [weight], group_list=group_list, split_item=3, group_type=0, group_list_type=0
        )[0]
        # grad_w[g] = grad_y_g^T @ x_g: groups split along K (group_type=2).
        grad_w = torch_npu.npu_grouped_matmul(
            [grad_y.t()], [x], group_list=group_list, split_item=3, group_type=2, group_list_type=0
        )[0]
        return grad_x, grad_w.view_as(weight), None


def npu_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return _NPUGroupedMatmul.apply(x, weight, counts)


def npu_attention(q, k, v, window: int | None, scale: float, documents=None) -> torch.Tensor:
    """Causal attention with the fused NPU kernel (torch_npu.npu_fusion_attention).

    q [B, Hq, S, D], k, v [B, Hkv, S, D]. The kernel takes a 2048 x 2048 compressed upper-triangle
    mask and a sparse mode: 3 (causal, aligned to the bottom right) or 4 (band: pre_tockens keys
    before the query, next_tockens after), band with pre_tockens = window - 1, next_tockens = 0
    for a window of `window` keys including the query. With `documents` (kernels.masks.DocumentMask) the
    rows are flattened to the varlen TND layout [B*S, H, D] and each document is its own sequence
    (actual_seq_qlen = actual_seq_kvlen = cumulative document ends). Semantics checked against
    Huawei's CPU reference (tests/test_npu_golden.py, docs/npu.md)."""
    torch_npu = import_torch_npu()
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1)
    band = (
        {"sparse_mode": 4, "pre_tockens": window - 1, "next_tockens": 0} if window is not None else {"sparse_mode": 3}
    )
    if documents is None:
        return torch_npu.npu_fusion_attention(q, k, v, q.shape[1], "BNSD", atten_mask=mask, scale=scale, **band)[0]
    B, Hq, S, D = q.shape
    cu = documents.cu_seqlens()

    def tnd(t: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] -> [B*S, H, D]
        return t.transpose(1, 2).reshape(B * S, t.shape[1], D)

    out = torch_npu.npu_fusion_attention(
        tnd(q), tnd(k), tnd(v), Hq, "TND", atten_mask=mask, scale=scale, actual_seq_qlen=cu, actual_seq_kvlen=cu, **band
    )[0]
    return out.reshape(B, S, Hq, D).transpose(1, 2)
