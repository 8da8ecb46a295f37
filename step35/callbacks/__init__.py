"""Lightning callbacks of step35 (each configurable from YAML under trainer.callbacks):

- MemoryMonitor      device/host memory, max and min over ranks; a summary on out-of-memory
- ExpertLoadMonitor  tokens per expert per MoE layer, balance metrics, heatmaps, router-bias stats
- SpeedMonitor       step time, tokens/s, TFLOP/s per device and MFU (not Lightning's ThroughputMonitor,
                     which takes other arguments)
- DivergenceGuard    skip (or stop at) optimizer steps with a non-finite loss or gradient
- FinalValidation    validate after the last step when it is not a validation step
"""

from step35.callbacks.divergence import DivergenceError, DivergenceGuard
from step35.callbacks.expert_counts import ExpertCounter
from step35.callbacks.expert_load import ExpertLoadMonitor
from step35.callbacks.final_validation import FinalValidation
from step35.callbacks.memory import MemoryMonitor
from step35.callbacks.throughput import SpeedMonitor

__all__ = ["DivergenceError", "DivergenceGuard", "ExpertCounter", "ExpertLoadMonitor", "FinalValidation",
           "MemoryMonitor", "SpeedMonitor"]
