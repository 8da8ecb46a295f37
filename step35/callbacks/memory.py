"""Memory: device memory allocated / reserved / peak, allocator retries and host RSS, each as max and
min over ranks (one all_reduce of a small vector every N steps), and a readable summary of what was
allocated when training dies of an out-of-memory error.

Device numbers come from `device_memory_stats`, the one place that knows each device type: the
caching-allocator statistics on CUDA (torch.cuda.memory_stats) and NPU (torch.npu.memory_stats,
the same keys), host memory of this process on CPU (allocated = reserved = RSS, peak = peak RSS).
"""

from __future__ import annotations

import resource
import sys

import lightning.pytorch as pl
import psutil
import torch

from step35.callbacks.reporting import StepEnds, all_reduce_, every, log_metrics

GiB = 1024**3
FIELDS = ("allocated", "reserved", "peak", "alloc_retries", "host_rss")


def _accelerator_module(device: torch.device):
    """torch.cuda or torch.npu (registered by torch_npu): both expose memory_stats / memory_summary."""
    return getattr(torch, device.type, None) if device.type in ("cuda", "npu") else None


def peak_host_rss() -> int:
    """Peak resident set size of this process in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def device_memory_stats(device: torch.device) -> dict[str, float]:
    """allocated, reserved, peak (bytes) and alloc_retries (count) of `device`; on CPU host memory."""
    backend = _accelerator_module(device)
    if backend is not None:
        stats = backend.memory_stats(device)
        return {
            "allocated": stats.get("allocated_bytes.all.current", 0),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "peak": stats.get("allocated_bytes.all.peak", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0),
        }
    rss = psutil.Process().memory_info().rss
    return {"allocated": rss, "reserved": rss, "peak": max(rss, peak_host_rss()), "alloc_retries": 0}


def memory_summary(device: torch.device) -> str:
    """What is allocated, readable: the allocator's table on CUDA/NPU, host numbers on CPU."""
    backend = _accelerator_module(device)
    host = psutil.virtual_memory()
    lines = [
        f"host: process RSS {psutil.Process().memory_info().rss / GiB:.2f} GiB, peak RSS "
        f"{peak_host_rss() / GiB:.2f} GiB, available {host.available / GiB:.2f} of {host.total / GiB:.2f} GiB"
    ]
    if backend is not None:
        try:
            lines.append(backend.memory_summary(device))
        except Exception as err:  # the summary must never hide the original error
            lines.append(f"({device.type} memory summary unavailable: {err})")
    return "\n".join(lines)


def is_out_of_memory(exception: BaseException) -> bool:
    return isinstance(exception, torch.OutOfMemoryError) or (
        isinstance(exception, RuntimeError) and "out of memory" in str(exception).lower()
    )


class MemoryMonitor(pl.Callback):
    def __init__(self, every_n_steps: int = 10, prog_bar: bool = True):
        """
        Args:
            every_n_steps: optimizer steps between readings (one small all_reduce each); 0 = never.
            prog_bar: show the peak device memory (max over ranks, GiB) in the progress bar.
        """
        self.every_n_steps = every_n_steps
        self.prog_bar = prog_bar
        self._step_ends = StepEnds()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_ends.reset(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._step_ends(trainer) or not every(trainer.global_step, self.every_n_steps):
            return
        device = pl_module.device
        stats = device_memory_stats(device)
        stats["host_rss"] = psutil.Process().memory_info().rss
        local = torch.tensor([stats[k] / (1 if k == "alloc_retries" else GiB) for k in FIELDS], dtype=torch.float32)
        # max and min over ranks in one all_reduce: max of [v, -v] (on the device: nccl/hccl need it)
        both = all_reduce_(torch.cat([local, -local]).to(device), op="max").cpu()  # host sync
        n = len(FIELDS)
        metrics = {}
        for i, key in enumerate(FIELDS):
            unit = "" if key == "alloc_retries" else "_gib"
            metrics[f"memory/{key}{unit}_max"] = float(both[i])
            metrics[f"memory/{key}{unit}_min"] = float(-both[n + i])
        log_metrics(trainer, metrics)
        if self.prog_bar:
            pl_module.log("mem_peak_gib", metrics["memory/peak_gib_max"], prog_bar=True, logger=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # No collective here: the other ranks may be anywhere. Every rank that ran out reports itself.
        if not is_out_of_memory(exception):
            return
        device = pl_module.device
        message = (
            f"[rank {trainer.global_rank}] out of memory on {device} at step {trainer.global_step}: "
            f"{str(exception).splitlines()[0] if str(exception) else type(exception).__name__}\n"
            f"{memory_summary(device)}"
        )
        print(message, file=sys.stderr, flush=True)
