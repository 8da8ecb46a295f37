"""What a start folder holds beside the model step35 trains: a Step-3.7-Flash folder's vision encoder and
projector (checkpoint/hf/release.py). They are never built, sharded or loaded on a device: they stay in the
folder, and `step35 export` copies them on the host, tensor by tensor, into the exported folder. The plan counts
them from the safetensors headers, apart from the per-device memory, so that a reader of the plan knows they
exist and that no device holds them; `step35 fit` says at start what it does with them. (Here, in checkpoint/,
so that both the plan and the fit command read it without importing each other.)"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import model_tensor_infos
from step35.checkpoint.hf.release import wrapping_config


@dataclass(frozen=True)
class CarriedWeights:
    """The carried tensors of `folder`: how many, their values and bytes as stored (an FP8 tensor's block scales
    counted with it: tensors and bytes, not values), and their dtypes."""

    folder: str
    tensors: int
    params: int
    bytes: int
    dtypes: tuple[str, ...]

    def describe(self) -> str:
        size = f"{self.bytes / 1024**3:.2f} GiB" if self.bytes >= 1024**3 else f"{self.bytes / 1024**2:.2f} MiB"
        return (
            f"{self.params:,} vision parameters ({size} {'/'.join(self.dtypes)}, {self.tensors} tensors: the vision "
            "encoder and projector of the Step-3.7 folder) carried on the host, not on devices: never loaded for "
            "training, copied by `step35 export`; not in the per-device numbers"
        )


def carried_weights(checkpoint: str | Path | None) -> tuple[CarriedWeights | None, list[str]]:
    """(the carried weights of the start folder `checkpoint`, or None when it carries none; notes). A Step-3.7
    folder whose tensors cannot be read here (a config.json alone, to plan with) gets a note instead."""
    if not checkpoint or wrapping_config(Path(checkpoint)) is None:
        return None, []
    try:
        _, carried, _ = model_tensor_infos(checkpoint)
    except CheckpointError as error:
        return None, [
            f"model.checkpoint {checkpoint} is a Step-3.7 folder whose tensors are not readable here ({error}): its "
            "vision encoder and projector (carried on the host, never on devices) are not counted"
        ]
    if not carried:
        return None, []
    infos = carried.values()
    params = sum(math.prod(info.shape) for info in infos)
    size = sum(math.prod(info.shape) * info.dtype.itemsize for info in infos)
    size += sum(info.scales.nbytes(info.shape) for info in infos if info.scales)
    tensors = len(carried) + sum(1 for info in infos if info.scales)
    dtypes = tuple(sorted({str(info.dtype).removeprefix("torch.") for info in infos}))
    return CarriedWeights(str(checkpoint), tensors, params, size, dtypes), []
