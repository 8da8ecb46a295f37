"""The reference model of the objectives that compare the policy with where it started (DPO; KTO next):
where its log-probabilities come from, and the one rule for the frozen copy's dtype and sharding, which the
module builds and `step35 plan` counts.

Where the reference comes from (an objective's `reference`, declared in its Needs):
- None: no reference (DPO's reference_free, SimPO);
- ADAPTERS_OFF ("lora"): under LoRA, the policy with its adapters off (model/lora.py adapters_off): no bytes;
- FROZEN_COPY ("model"): for full fine-tuning, a frozen copy of the start model (model.checkpoint or the
  init of init_seed, also on a resume), held by the objective: no submodule of the LightningModule, so in
  no state_dict, checkpoint, optimizer or parameter count.

The frozen copy (reference_copy): the one training setup without MTP layers, sharded as the policy (the
same shard function, the strategy's parallelize_model), in the dtype the policy's weights enter its forward
in: FSDP's param_dtype when set, else the dtype Lightning's precision stores parameters in (32-true and
bf16-mixed: fp32; bf16-true: bf16). So the copy computes the policy's start log-probabilities exactly.
Under bf16-mixed without param_dtype a bf16 copy would halve the bytes but not compute the same function:
autocast casts only the matmuls, so the policy keeps fp32 embeddings, norm weights and residual stream
where a bf16 copy keeps bf16 (measured on the tiny model: log-probabilities off by up to 2.3e-3 per token,
|h| up to 0.01 at the first step on 4-token replies, more with depth and length). param_dtype: bfloat16
halves the copy and keeps it exact: the policy then computes in bf16 too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from step35.config import Step35Config
from step35.model import Step35ForCausalLM
from step35.model.lora import FULL_TARGETS, LoraConfig, adapters_off
from step35.training.setup import TrainedModel, training_model

ADAPTERS_OFF = "lora"
FROZEN_COPY = "model"

T = TypeVar("T")


def reference_kind(
    objective: str, lora: LoraConfig | None, reference_free: bool = False, without: str = ""
) -> str | None:
    """Where `objective`'s reference comes from (this module's docstring); LoRA targets that train the
    base's own weights are refused: the reference (the adapters off) would move with the policy. `without`:
    the option that drops the reference, said in that refusal."""
    if reference_free:
        return None
    if lora is None:
        return FROZEN_COPY
    full = sorted(set(lora.targets) & set(FULL_TARGETS))
    if full:
        raise ValueError(
            f"model.objective={objective} with model.lora.targets naming {full}: with LoRA the reference is the "
            "policy with its adapters off, but those targets train the weights themselves, so the "
            "reference would move with the policy; drop them from the targets"
            + (f" (or use {without})" if without else "")
        )
    return ADAPTERS_OFF


def reference_dtype(param_dtype: torch.dtype | None, stored_dtype: torch.dtype) -> torch.dtype:
    """The frozen copy's dtype: the policy's compute weights' (FSDP's param_dtype), else its stored dtype."""
    return param_dtype if param_dtype is not None else stored_dtype


def reference_copy(
    config: Step35Config, param_dtype: torch.dtype | None, stored_dtype: torch.dtype
) -> tuple[TrainedModel, torch.dtype]:
    """What the frozen copy is: the start model without MTP layers, in reference_dtype (sharded as the policy)."""
    return TrainedModel(config, num_mtp_layers=0), reference_dtype(param_dtype, stored_dtype)


def build_reference_copy(
    config: Step35Config,
    *,
    shard: Callable | None,
    param_dtype: torch.dtype | None,
    device: torch.device | str,
    checkpoint: str | Path | None,
    seed: int,
) -> Step35ForCausalLM:
    """The frozen copy on this rank, filled on `device` like the policy's start; its stored dtype is the
    ambient one, which Lightning's precision sets while configure_model runs (as for the policy)."""
    spec, dtype = reference_copy(config, param_dtype, torch.get_default_dtype())
    return training_model(spec, shard=shard, dtype=dtype, device=device, checkpoint=checkpoint, seed=seed)


class ComparesWithReference:
    """The reference side of an objective: `reference` (None | ADAPTERS_OFF | FROZEN_COPY) and, for the copy,
    `reference_model`, set by the module after it built the policy."""

    reference: str | None = None
    reference_model: Step35ForCausalLM | None = None

    def set_reference_model(self, model: Step35ForCausalLM) -> None:
        """The frozen full-fine-tuning reference: no gradients, eval mode, kept out of any module tree."""
        model.requires_grad_(False)
        model.eval()
        self.reference_model = model

    @torch.no_grad()
    def on_reference(self, model: Step35ForCausalLM, forward: Callable[[Step35ForCausalLM], T]) -> T:
        """`forward(reference)` without gradients and in eval mode (no LoRA dropout, no expert-load counts):
        on the frozen copy, or on `model` (the policy) with its adapters off."""
        if self.reference == FROZEN_COPY:
            if self.reference_model is None:
                raise RuntimeError(f"{type(self).__name__}: the reference model was not set (set_reference_model)")
            return forward(self.reference_model)
        training = model.training
        model.eval()
        try:
            with adapters_off(model):
                return forward(model)
        finally:
            model.train(training)
