"""Lightning callbacks of step35 (each configurable from YAML under trainer.callbacks):

- MemoryMonitor      device/host memory, max and min over ranks; a summary on out-of-memory
- ExpertLoadMonitor  tokens per expert per MoE layer, balance metrics, heatmaps, router-bias stats
- ThroughputMonitor  step time, tokens/s, TFLOP/s per device and MFU
- DivergenceGuard    skip (or stop at) optimizer steps with a non-finite loss or gradient
- RunCheckpoint      periodic checkpoints of the run folder: atomic last.ckpt, keep the newest K, tidy leftovers
- Step35ProgressBar  the training bar in optimizer steps (loss, tokens/s, memory); the CLI installs it
"""

from step35.callbacks.checkpointing import RunCheckpoint
from step35.callbacks.divergence import DivergenceError, DivergenceGuard
from step35.callbacks.expert_counts import ExpertCounter
from step35.callbacks.expert_load import ExpertLoadMonitor
from step35.callbacks.memory import MemoryMonitor
from step35.callbacks.progress import Step35ProgressBar
from step35.callbacks.throughput import ThroughputMonitor

__all__ = ["DivergenceError", "DivergenceGuard", "ExpertCounter", "ExpertLoadMonitor", "MemoryMonitor",
           "RunCheckpoint", "Step35ProgressBar", "ThroughputMonitor"]
