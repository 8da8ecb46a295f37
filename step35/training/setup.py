"""The one training setup: the model `step35 fit` trains and `step35 plan` counts, made the same way.

build (meta device; with `vision`, the vision-language model: training/vision.py) -> LoRA adapters (model.lora;
the base frozen in its dtype) -> sharded (FSDP2 + EP, when a strategy shards) -> frozen (MTP layers whose loss is
not trained, the vision side unless model.vision.train) -> for fit, filled on the device from an HF checkpoint or
the deterministic init. The plan stops before the fill and reads the local
shards of exactly that model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from step35.checkpoint.hf.folder import check_config_fits
from step35.checkpoint.hf.materialize import materialize
from step35.checkpoint.hf.peft import check_not_adapter_folder
from step35.config import ConfigError, Step35Config, VisionConfig, load_config
from step35.model import Step35ForCausalLM, build_model
from step35.model.lora import LoraConfig, apply_lora, check_sizes
from step35.training.vision import freeze_vision


def model_config_of(
    config: str | Path, checkpoint: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> Step35Config:
    """The model config of a run: the checkpoint folder's config.json when `checkpoint` is given, else
    `config` (a preset or a config.json / folder), with `overrides` applied (every key must be a field).
    Errors name the option they come from (model.checkpoint, model.config, model.config_overrides)."""
    source = ("model.checkpoint", checkpoint) if checkpoint else ("model.config", config)
    if checkpoint:
        check_not_adapter_folder(checkpoint, "model.checkpoint")
    try:
        model_config = load_config(source[1])
    except ConfigError as e:
        raise ConfigError(f"{source[0]}={source[1]}: {e}") from None
    if overrides:
        try:
            model_config = model_config.with_overrides(overrides)
        except ConfigError as e:
            raise ConfigError(f"model.config_overrides: {e}") from None
    return model_config


@dataclass(frozen=True)
class TrainedModel:
    """What fixes the tensors of the trained model and which of them train."""

    config: Step35Config
    num_mtp_layers: int | None = None  # MTP layers built (None: all of the config's)
    mtp_loss_weight: float = 0.0  # > 0: the MTP layers learn; 0: they are frozen
    lora: LoraConfig | None = None
    vision: VisionConfig | None = None  # Step-3.7's encoder and projector, built beside the language model
    train_vision: bool = False  # model.vision.train: they learn; else frozen

    @property
    def train_mtp(self) -> bool:
        return self.mtp_loss_weight > 0

    @property
    def built_mtp_layers(self) -> int:
        return self.config.num_nextn_predict_layers if self.num_mtp_layers is None else self.num_mtp_layers

    def check(self, checkpoint: str | Path | None = None) -> None:
        """Refuse what cannot be built, now rather than after minutes of building: an MTP depth the config
        lacks, a trained MTP loss without MTP layers, a LoRA rank too large for a layer, and (given an HF
        `checkpoint` folder) a config whose shapes its tensors do not have."""
        available = self.config.num_nextn_predict_layers
        if self.num_mtp_layers is not None and not 0 <= self.num_mtp_layers <= available:
            raise ValueError(
                f"model.num_mtp_layers={self.num_mtp_layers}: must be between 0 and the config's "
                f"num_nextn_predict_layers={available}"
            )
        if self.train_mtp and self.built_mtp_layers == 0:
            raise ValueError(
                f"model.mtp_loss_weight={self.mtp_loss_weight}: no MTP layer is built (num_mtp_layers="
                f"{self.num_mtp_layers}, config num_nextn_predict_layers={available}); set it to 0"
            )
        if checkpoint:
            check_config_fits(self.config, checkpoint, self.num_mtp_layers)
        if self.lora is not None:
            check_sizes(self.lora, self.config, self.num_mtp_layers, self.mtp_loss_weight)


def freeze_untrained(model: Step35ForCausalLM, train_mtp: bool) -> None:
    """MTP layers are kept (and exported) but get no gradient when their loss is not trained: frozen, so
    the optimizer holds no state for them (a sharded optimizer checkpoint would otherwise lack their
    entries and refuse to resume). The LoRA base is frozen by apply_lora."""
    if not train_mtp:
        for layer in model.model.mtp_layers:
            layer.requires_grad_(False)


def training_model(
    spec: TrainedModel,
    *,
    shard: Callable[[nn.Module], None] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    checkpoint: str | Path | None = None,
    seed: int = 0,
) -> Step35ForCausalLM:
    """The model a run trains: built on the meta device in `dtype` (None: the ambient default, which
    Lightning's precision sets), adapted (LoRA), sharded by `shard` (e.g. the strategy's parallelize_model;
    None: unsharded), its untrained parts frozen, then, when `device` is given, filled there from the HF
    `checkpoint` folder (each rank reads only its slices) or from the init of `seed`. Without `device`
    the model stays on the meta device (the plan reads its shards)."""
    model = build_model(spec.config, spec.num_mtp_layers, dtype=dtype, vision=spec.vision)
    if spec.lora is not None:
        apply_lora(model, spec.lora)  # before sharding: FSDP2 sees the adapters and the frozen base
    freeze_vision(model, spec.train_vision)  # before sharding too: FSDP2 sees which vision parameters train
    if shard is not None:
        shard(model)
    freeze_untrained(model, spec.train_mtp)
    if device is not None:
        materialize(model, device, checkpoint=checkpoint, seed=seed)
    return model
