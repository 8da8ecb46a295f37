"""The one place a Step-3.5 model is constructed (training, planning, resume checks, generation,
loading an HF folder, the benchmarks).

Every caller gets the same module tree for the same (config, MTP depth), so a change to how the
model is built (adapters, a dtype rule) is made here once.
"""

from __future__ import annotations

import torch

from step35.config import Step35Config, VisionConfig
from step35.model.transformer import Step35ForCausalLM


def build_model(
    config: Step35Config,
    num_mtp_layers: int | None = None,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    vision: VisionConfig | None = None,
) -> Step35ForCausalLM:
    """Step35ForCausalLM for `config` with `num_mtp_layers` MTP layers (None: all of the config's); with `vision`,
    the vision-language model around it (model/vision.py Step35VLForConditionalGeneration, a subclass).

    Its tensors are created on `device` ("meta" by default: no memory, shapes only; the checkpoint
    package's materialize fills such a model) and cast to `dtype` (None: left in fp32). The MoE
    router bias stays fp32 whatever `dtype` is (MoE._apply)."""
    with torch.device(device):
        if vision is None:
            model = Step35ForCausalLM(config, num_mtp_layers)
        else:
            from step35.model.vision import Step35VLForConditionalGeneration

            model = Step35VLForConditionalGeneration(config, vision, num_mtp_layers)
    if dtype is not None:
        model.to(dtype)
    return model
