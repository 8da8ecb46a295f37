"""Training Step-3.7-Flash's vision side: `model.vision` (VisionOptions), which builds the vision-language model
(model/vision.py Step35VLForConditionalGeneration) instead of the language model alone, and the checks between it
and the data's images (`data.images`, step35/data/image_records.py).

* `model.vision` unset: as before, a Step-3.7 folder trains its language model; its vision tensors are carried.
* `model.vision: {}` (train: false, the default, as NeMo Automodel's and Megatron-Bridge's recipes): the encoder
  and the projector are built, loaded and run on every micro-batch, frozen (no gradient, no optimizer state).
* `model.vision: {train: true}`: they train with the rest. LoRA targets them by name (model/lora.py: `vision`,
  `vision_projector`).

The objective hands a batch's images to `model.loss` (`image_inputs`); a batch without them (a text-only run on a
vision-language model) still runs the encoder on no view, so that every rank calls every vision module once per
micro-batch under FSDP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from step35.config import ConfigError, VisionConfig, load_vision_config
from step35.model.vision import images_of_batch

IMAGE_BATCH_KEYS = ("pixel_values", "pixel_values_local", "num_local_patches", "num_images")  # the data's contract


@dataclass(frozen=True)
class VisionOptions:
    """model.vision: train the encoder and the projector (`train: true`) or keep them frozen (the default)."""

    train: bool = False

    @classmethod
    def of(cls, value: Any) -> VisionOptions | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"train"})
            if unknown:
                raise ValueError(f"model.vision: unknown field(s) {unknown}; the field: train")
            if not isinstance(value.get("train", False), bool):
                raise ValueError(f"model.vision.train={value['train']!r}: expected true or false")
            return cls(**value)
        raise ValueError(f"model.vision: expected a mapping such as {{train: false}}, got {value!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def vision_config_of(options: VisionOptions | None, config: Any, checkpoint: Any = None) -> VisionConfig | None:
    """The vision side the run builds: None without `model.vision`; else the checkpoint folder's (or the config
    preset's / file's) `vision_config`, refused by name where there is none."""
    if options is None:
        return None
    source = ("model.checkpoint", checkpoint) if checkpoint else ("model.config", config)
    try:
        return load_vision_config(source[1])
    except ConfigError as error:
        raise ConfigError(
            f"model.vision is set but {source[0]}={source[1]} has no vision side ({error}); a Step-3.7 model has one"
            " (the tiny one: model.config tiny-vl), or leave model.vision out"
        ) from None


def freeze_vision(model: torch.nn.Module, train: bool) -> None:
    """Frozen vision side (no gradient, no optimizer state) unless `train`; LoRA adapters on it stay trainable."""
    if train:
        return
    for name, parameter in model.named_parameters():
        if name.startswith(("vision_model.", "vit_large_projector.")) and not name.endswith(("lora_A", "lora_B")):
            parameter.requires_grad_(False)


def image_inputs(batch: dict) -> dict:
    """`model.loss`'s `images=` argument for a batch carrying the data's image tensors; {} for one without."""
    if "num_images" not in batch:
        return {}
    return {"images": images_of_batch(*(batch[key] for key in IMAGE_BATCH_KEYS))}


def check_image_data(datamodule: Any, vision: VisionConfig | None) -> None:
    """Refuse images without a vision side, and a tokenizer whose `<im_patch>` is not the model's image token."""
    if getattr(datamodule, "images", None) is None:
        return
    if vision is None:
        raise ValueError(
            "data.images is set but the model has no vision side: set model.vision (e.g. {train: false}) with a"
            " Step-3.7 model (model.config tiny-vl, or a Step-3.7 folder as model.checkpoint)"
        )
    token = datamodule.image_token_id
    if token != vision.image_token_id:
        raise ValueError(
            f"data.images: the tokenizer's <im_patch> is id {token}, the model's image_token_id is"
            f" {vision.image_token_id}: give the tokenizer the model was trained with (data.tokenizer; the built-in"
            " one puts <im_patch> at data.builtin_vocab_size)"
        )
