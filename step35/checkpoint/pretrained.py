"""A model <-> an HF checkpoint folder: `Step35ForCausalLM.from_pretrained` / `save_pretrained` call these.

Imports go one way: model <- materialize (fills a model) <- pretrained; the model reaches this
module only through a local import inside its two thin classmethods.
"""

from __future__ import annotations

from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import write_hf_folder
from step35.checkpoint.materialize import checkpoint_state, materialize
from step35.checkpoint.publish import check_not_interrupted
from step35.config import ConfigError, Step35Config


def load_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    num_mtp_layers: int | None = None):
    """Build `cls(config)` on meta, check the checkpoint against it, then materialise and fill it."""
    path = Path(path)
    check_not_interrupted(path)
    try:
        config = Step35Config.from_json(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    with torch.device("meta"):
        model = cls(config, num_mtp_layers)
    model.to(dtype or getattr(torch, config.torch_dtype))  # router_bias stays fp32 (MoE._apply)
    materialize(model, device, checkpoint=path)
    return model


def save_pretrained(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "5GB") -> None:
    """config.json, model-0000k-of-0000n.safetensors shards, the index and the manifest, atomically."""
    state = checkpoint_state(model)
    weight_dtypes = {t.dtype for n, t in state.items() if not n.endswith("router_bias")}
    if len(weight_dtypes) != 1:
        raise CheckpointError(f"model holds weights of several dtypes {sorted(map(str, weight_dtypes))}; "
                              "cast it to one dtype before saving")
    config = Step35Config.from_dict(model.config.to_dict())
    config.torch_dtype = str(weight_dtypes.pop()).removeprefix("torch.")
    write_hf_folder(path, state.items(), config, max_shard_size)
