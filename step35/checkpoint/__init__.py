"""Checkpoints: HF safetensors folders (hf, materialize, pretrained), Lightning training checkpoints
(trainer_io), export between them; every save published atomically (publish) with a manifest
(integrity), every load free of code execution (safe_load)."""

from step35.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]


def __getattr__(name: str):
    if name in ("load_pretrained", "save_pretrained"):  # lazily: they import the model
        from step35.checkpoint import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'step35.checkpoint' has no attribute {name!r}")
