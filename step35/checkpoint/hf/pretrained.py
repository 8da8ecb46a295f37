"""A model <-> an HF checkpoint folder: `load_pretrained(path) -> model`, `save_pretrained(model, path)`.

Imports go one way: model <- materialize (fills a model) <- pretrained. The model package knows
nothing of checkpoints; loading and saving a folder live here, next to the other checkpoint formats.
"""

from __future__ import annotations

from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import check_config_fits, write_hf_folder
from step35.checkpoint.hf.materialize import checkpoint_state, materialize
from step35.checkpoint.publish import check_not_interrupted
from step35.config import ConfigError, Step35Config, VisionConfig
from step35.model import Step35ForCausalLM, build_model


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    num_mtp_layers: int | None = None,
    *,
    vision: bool = False,
) -> Step35ForCausalLM:
    """The model saved in the HF folder `path`, on `device`, in `dtype` (None: the folder's
    torch_dtype), with `num_mtp_layers` MTP layers (None: all of the config's; fewer ignores the
    folder's extra MTP tensors). `vision`: a Step-3.7 folder's vision-language model, its vision encoder and
    projector loaded too (model/vision.py Step35VLForConditionalGeneration); else its language model alone.

    Built on meta from the folder's config.json, checked against the folder's tensors (names,
    shapes, dtypes: CheckpointError naming the file or tensor), then materialised and filled."""
    path = Path(path)
    check_not_interrupted(path)
    try:
        config = Step35Config.from_json(path)
        vision_config = VisionConfig.from_json(path) if vision else None
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_config_fits(config, path, num_mtp_layers)  # before building: a config.json typo fails in seconds
    model = build_model(config, num_mtp_layers, dtype=dtype or getattr(torch, config.torch_dtype), vision=vision_config)
    materialize(model, device, checkpoint=path)
    return model


def save_pretrained(model: Step35ForCausalLM, path: str | Path, max_shard_size: int | str = "5GB") -> None:
    """Write `model` as the HF folder `path`: config.json (torch_dtype set to the weights' dtype),
    model-0000k-of-0000n.safetensors shards of at most `max_shard_size`, the index and the manifest,
    published atomically. A model holding weights of several dtypes is refused (cast it first)."""
    state = checkpoint_state(model)
    weight_dtypes = {t.dtype for n, t in state.items() if not n.endswith("router_bias")}
    if len(weight_dtypes) != 1:
        raise CheckpointError(
            f"model holds weights of several dtypes {sorted(map(str, weight_dtypes))}; "
            "cast it to one dtype before saving"
        )
    config = Step35Config.from_dict(model.config.to_dict())
    config.torch_dtype = str(weight_dtypes.pop()).removeprefix("torch.")
    write_hf_folder(path, state.items(), config, max_shard_size)
