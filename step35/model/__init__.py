"""Step-3.5-Flash in plain PyTorch: no Lightning, no process groups, no checkpoint code (HF folders are
loaded and saved by the checkpoint package's pretrained module; step35.parallel shards the model)."""

from step35.model.builder import build_model
from step35.model.cache import KVCache
from step35.model.loss import IGNORE_INDEX, chunked_cross_entropy
from step35.model.transformer import DecoderLayer, LossOutput, MTPLayer, Step35ForCausalLM, Step35Model

__all__ = [
    "DecoderLayer",
    "IGNORE_INDEX",
    "KVCache",
    "LossOutput",
    "MTPLayer",
    "Step35ForCausalLM",
    "Step35Model",
    "build_model",
    "chunked_cross_entropy",
]
