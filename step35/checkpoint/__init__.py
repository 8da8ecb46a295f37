"""Checkpoints: the HF safetensors format (read lazily, written atomically)."""

from step35.checkpoint.hf import CheckpointError, load_pretrained, save_pretrained

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]
