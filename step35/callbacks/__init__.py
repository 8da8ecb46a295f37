"""Lightning callbacks of step35 (each configurable from YAML under trainer.callbacks):

- MemoryMonitor      device/host memory, max and min over ranks; a summary on out-of-memory
- ExpertLoadMonitor  tokens per expert per MoE layer, balance metrics, heatmaps, router-bias stats
- SpeedMonitor       step time, tokens/s, TFLOP/s per device and MFU (not Lightning's ThroughputMonitor,
                     which takes other arguments)
- DivergenceGuard    skip (or stop at) optimizer steps with a non-finite loss or gradient
- RunCheckpoint      periodic checkpoints of the run folder: atomic last.ckpt, keep the newest K, tidy leftovers
- FaultTolerance     SIGTERM/SIGUSR1 -> checkpoint at the next step boundary -> exit 75; hang watchdog
                     (added by `step35 fit` by itself)
- FinalValidation    validate after the last step when it is not a validation step
- Step35ProgressBar  the training bar in optimizer steps (loss, tokens/s, memory); the CLI installs it
"""

from step35.callbacks.checkpointing import RunCheckpoint
from step35.callbacks.divergence import DivergenceError, DivergenceGuard
from step35.callbacks.expert_load import ExpertLoadMonitor
from step35.callbacks.fault_tolerance import FaultTolerance
from step35.callbacks.final_validation import FinalValidation
from step35.callbacks.memory import MemoryMonitor
from step35.callbacks.progress import Step35ProgressBar
from step35.callbacks.throughput import SpeedMonitor

__all__ = [
    "DivergenceError",
    "DivergenceGuard",
    "ExpertLoadMonitor",
    "FaultTolerance",
    "FinalValidation",
    "MemoryMonitor",
    "RunCheckpoint",
    "SpeedMonitor",
    "Step35ProgressBar",
]
