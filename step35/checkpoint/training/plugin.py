"""Lightning's side of step35's training checkpoints: the CheckpointIO plugin for trainers without
Step35Strategy (the CLI installs it) and the refusal of Lightning's asynchronous plugin. The reading and
writing itself is `trainer_io`'s, which imports nothing of Lightning (export and generate start faster)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.training.background import writer_of
from step35.checkpoint.training.trainer_io import load_file, remove, save_file, save_file_in_background

ASYNC_REFUSAL = "Lightning's AsyncCheckpointIO is not supported: remove it from trainer.plugins and save in the background with RunCheckpoint(async_save=true)"


def refuse_asynchronous_io(strategy) -> None:
    """Refuses Lightning's AsyncCheckpointIO (the plugin itself or wrapped in another) before anything is
    saved. Its save returns before the file exists, while step35 vouches for a checkpoint right after
    the save returns (manifest, `last.ckpt`, retention, the pre-emption exit): every save then failed
    (FileNotFoundError on the checkpoint) and left a checkpoint without a manifest. Raises CheckpointError."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    io, seen = strategy.checkpoint_io, set()
    while io is not None and id(io) not in seen:
        if isinstance(io, AsyncCheckpointIO):
            raise CheckpointError(ASYNC_REFUSAL)
        seen.add(id(io))
        io = getattr(io, "checkpoint_io", None)  # a wrapping plugin's base


class Step35CheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints for trainers without Step35Strategy: atomic, with a manifest, read
    with weights_only=True and the step35 allowlist, verified and checked for NaN/Inf at load."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        writer = writer_of(storage_options, type(self).__name__)  # RunCheckpoint(async_save=True) passes one
        if writer is None or not save_file_in_background(writer, checkpoint, path):
            save_file(checkpoint, path)

    def load_checkpoint(
        self, path, map_location: Callable | Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise CheckpointError(f"{path}: step35 never unpickles checkpoints with weights_only=False")
        return load_file(path, map_location=map_location)

    def remove_checkpoint(self, path) -> None:
        remove(path)
