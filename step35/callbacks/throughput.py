"""Throughput: step time, tokens/s (global and per device), model TFLOP/s per device and MFU.

Model FLOPs per token come from step35.flops.training_flops_per_token (docs/architecture.md §5:
6 x matmul-active parameters + causal attention, MTP layers counted when mtp_loss_weight > 0;
activation-checkpoint recomputation is not counted, as usual for MFU). Tokens come from the batch
shape: each micro-batch {"input_ids": [B, S + 1]} trains B x S tokens on every rank, so a step is
micro-batches x accumulation x world tokens (all ranks get the same shapes from the step35 data).

Timing is wall clock over a window of steps, with one device synchronisation at each window end
(so queued kernels are counted); time spent in validation is left out, checkpoint writes are not.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from step35.callbacks.reporting import StepEnds, every, log_metrics
from step35.flops import training_flops_per_token
from step35.kernels.sequence_split import rank_tokens

# Peak dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s, matched by substring of the device name in
# this order (specific names first). NVIDIA datasheets print bf16 "with sparsity"; dense is half.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),  # NVIDIA H100 datasheet: BF16 1,513 TFLOPS with sparsity
    ("H100 NVL", 835.0),  # NVIDIA H100 datasheet (NVL): BF16 1,671 with sparsity
    ("H200 NVL", 835.0),  # NVIDIA H200 datasheet (NVL): BF16 1,671 with sparsity
    ("GH200", 989.0),  # NVIDIA GH200 datasheet: same Hopper GPU as H100 SXM
    ("H100", 989.0),  # NVIDIA H100 datasheet (SXM5): BF16 1,979 with sparsity
    ("H200", 989.0),  # NVIDIA H200 datasheet (SXM): BF16 1,979 with sparsity
    ("H800", 989.0),  # same SXM5 compute as H100 (interconnect differs)
    ("A100", 312.0),  # NVIDIA A100 datasheet: BF16 312 dense (624 with sparsity), SXM and PCIe
    ("A800", 312.0),  # A100 compute
    ("B200", 2250.0),  # NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS with sparsity per GPU
    # ASSUMPTION: Huawei publishes no per-variant 910B datasheet number; ~320 TFLOPS fp16/bf16 is
    # the figure reported by third parties (the original Ascend 910: 256 TFLOPS fp16, Hot Chips 2019).
    # Override with peak_tflops on 910B1-B4, which differ in core count.
    ("Ascend910B", 320.0),
]


def device_name(device: torch.device) -> str:
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).get_device_name(device)
    return device.type


def peak_tflops_for(name: str) -> float | None:
    """Peak dense bf16 TFLOP/s of a device by name (see PEAK_BF16_TFLOPS), None if unknown (e.g. CPU)."""
    squashed = name.replace(" ", "").replace("-", "").lower()
    for key, peak in PEAK_BF16_TFLOPS:
        if key.replace(" ", "").lower() in squashed:
            return peak
    return None


def synchronize(device: torch.device) -> None:
    if device.type in ("cuda", "npu"):
        getattr(torch, device.type).synchronize(device)


def context_parallel_size(trainer) -> int:
    """Ranks that share each sequence (Step35Strategy.context_parallel_size; 1 for other strategies)."""
    return int(getattr(trainer.strategy, "context_parallel_size", 1))


def batch_tokens(batch) -> tuple[int, int]:
    """(trained tokens, sequence length) of one micro-batch of {"input_ids": [B, S + 1]} windows."""
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    B, S1 = ids.shape
    return B * (S1 - 1), S1 - 1


def rank_batch_tokens(trainer, batch) -> tuple[int, int]:
    """(tokens this rank computes, sequence length) of one micro-batch: under context parallelism the
    rank's share of every row (kernels.sequence_split), else all of `batch_tokens`."""
    tokens, seq_len = batch_tokens(batch)
    return rank_tokens(tokens, context_parallel_size(trainer)), seq_len


class SpeedMonitor(pl.Callback):
    """Step time, tokens/s (global and per device), TFLOP/s per device and MFU of the step35 model.

    Named apart from Lightning's own `ThroughputMonitor` (which needs a batch-size function and
    knows nothing of the model's FLOPs), so that a class_path in YAML means one thing."""

    clock = staticmethod(time.perf_counter)  # wall clock (tests substitute a fake one)

    def __init__(self, every_n_steps: int = 5, peak_tflops: float | None = None, prog_bar: bool = True):
        """
        Args:
            every_n_steps: optimizer steps per measurement window (one device sync per window).
            peak_tflops: peak TFLOP/s of one device for MFU; None: looked up by device name (dense
                bf16 of H100/H200/A100/B200/Ascend 910B). On CPU, or an unknown device, without it
                MFU is not logged (TFLOP/s still is).
            prog_bar: show tokens/s (global) and MFU in the progress bar.
        """
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.peak_tflops = peak_tflops
        self.prog_bar = prog_bar
        self._step_ends = StepEnds()
        self._flops_per_token: dict[int, float] = {}
        self._reset_window()
        self._t0: float | None = None

    def _reset_window(self) -> None:
        self._elapsed, self._steps, self._tokens, self._flops = 0.0, 0, 0, 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_ends.reset(trainer)
        self._reset_window()
        self._t0 = None
        self._peak = self.peak_tflops or peak_tflops_for(device_name(pl_module.device))
        if self._peak is None:
            rank_zero_info(
                f"SpeedMonitor: no peak TFLOP/s known for device '{device_name(pl_module.device)}'; "
                "MFU is not logged (set peak_tflops to get it)"
            )
        config = getattr(pl_module, "model_config", None)
        model = getattr(pl_module, "model", None)
        mtp_weight = getattr(pl_module, "hparams", {}).get("mtp_loss_weight", 0.0)
        self._config = config
        self._num_mtp = getattr(model, "num_mtp_layers", 0) if mtp_weight > 0 else 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:  # first batch, or first after a pause
            self._t0 = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tokens, seq_len = rank_batch_tokens(trainer, batch)
        self._tokens += tokens
        self._flops += tokens * self._model_flops_per_token(seq_len)
        if not self._step_ends(trainer):
            return
        self._steps += 1
        if not every(trainer.global_step, self.every_n_steps):
            return
        synchronize(pl_module.device)  # host sync (once per window): count the kernels still queued
        now = self.clock()
        self._elapsed += now - self._t0
        self._t0 = now
        metrics = self.window_metrics(trainer.world_size)
        self._reset_window()
        log_metrics(trainer, metrics)
        if self.prog_bar:
            pl_module.log("tok/s", metrics["throughput/tokens_per_s"], prog_bar=True, logger=False)
            if "throughput/mfu" in metrics:
                pl_module.log("mfu", metrics["throughput/mfu"], prog_bar=True, logger=False)

    def window_metrics(self, world_size: int) -> dict[str, float]:
        """The current window's numbers; tokens and FLOPs are this rank's, scaled by the world."""
        elapsed = max(self._elapsed, 1e-12)
        metrics = {
            "throughput/step_time_s": elapsed / max(self._steps, 1),
            "throughput/tokens_per_s": self._tokens * world_size / elapsed,
            "throughput/tokens_per_s_per_device": self._tokens / elapsed,
        }
        if self._config is not None:
            tflops = self._flops / elapsed / 1e12
            metrics["throughput/tflops_per_device"] = tflops
            if self._peak:
                metrics["throughput/mfu"] = tflops / self._peak
        return metrics

    def _model_flops_per_token(self, seq_len: int) -> float:
        if self._config is None:
            return 0.0
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = training_flops_per_token(self._config, seq_len, self._num_mtp)
        return self._flops_per_token[seq_len]

    # Validation pauses the clock: its time is not training throughput.
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t0 is not None:
            synchronize(pl_module.device)  # host sync: finish the training kernels before the pause
            self._elapsed += self.clock() - self._t0
        self._t0 = None
