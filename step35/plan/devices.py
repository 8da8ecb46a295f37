"""Devices the plan knows: memory, peak bf16 TFLOP/s and link bandwidths (per device, per direction).
Every value is a default a user can override on the command line; docs/plan.md gives the sources."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16
    intra_node_gbps: float  # GB/s per device, one direction, to devices of its own node
    inter_node_gbps: float  # GB/s per device, one direction, to other nodes
    runtime_reserve_gib: float  # context, communication library buffers, kernel workspaces: not in the allocator


DEVICES = {
    "910b": Device("Ascend 910B", 64, 320, 196, 25, 3.0),
    "a3": Device("Ascend A3 (910C die)", 64, 320, 196, 196, 3.0),
    "h100": Device("NVIDIA H100 SXM", 80, 989, 450, 50, 2.0),
    # NVIDIA A100 datasheet: BF16 tensor cores 312 TFLOP/s dense (624 with sparsity), 80 GB HBM2e or 40 GB HBM2;
    # NVLink 3 600 GB/s bidirectional per GPU (12 links x 50 GB/s) = 300 per direction; DGX A100 has one
    # 200 Gb/s HDR InfiniBand port per GPU = 25 GB/s per direction. SXM4 figures (PCIe cards: NVLink bridges
    # join pairs only, pass --intra-node-gbps).
    "a100": Device("NVIDIA A100 SXM4 80GB", 80, 312, 300, 25, 2.0),
    "a100-40gb": Device("NVIDIA A100 SXM4 40GB", 40, 312, 300, 25, 2.0),
    "h200": Device("NVIDIA H200 SXM", 141, 989, 450, 50, 2.0),
    "b200": Device("NVIDIA B200", 180, 2250, 900, 50, 2.0),
    "cpu": Device("CPU (host memory)", 0, 1, 10, 1, 0.0),
}

DEFAULT_FOR_ACCELERATOR = {"npu": "910b", "cuda": "h100", "cpu": "cpu"}
