"""A LoRA run as the plan counts it: the `model.lora` options resolved, the tensors the adapted model
trains (read from the real adapted model that training/setup.py builds, sharded as fit shards it), and
the activations the adapters add.

The options of `model.lora` and their rules belong to step35.model.lora.LoraConfig; this module resolves
them (alpha default rank, expert_rank default max(1, rank // moe_top_k)) for the report and counts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from step35.config import Step35Config
from step35.model.lora import ATTENTION_TARGETS, LoraConfig, LoraError, check_sizes, is_adapter


class LoraInputError(ValueError):
    """A bad `model.lora` value; the message names the field."""


@dataclass(frozen=True)
class LoraSettings:
    """The resolved options the plan counts with (alpha and expert_rank filled in)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    expert_rank: int
    options: LoraConfig = field(compare=False, repr=False)  # what apply_lora is given, as fit gives it

    @property
    def projections(self) -> tuple[str, ...]:
        """The attention projections adapted ("attention" names all five)."""
        if "attention" in self.targets:
            return ATTENTION_TARGETS
        return tuple(p for p in ATTENTION_TARGETS if p in self.targets)

    def adapts(self, kind: str) -> bool:
        return kind in self.targets

    def describe(self) -> str:
        return (
            f"rank {self.rank}, expert rank {self.expert_rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, "
            f"targets {', '.join(self.targets)}"
        )


def parse_lora(value: Any, config: Step35Config) -> LoraSettings | None:
    """`model.lora` as read from the YAML or an override (a mapping, or None for a full fine-tune),
    checked by the model's own rules (step35.model.lora: the options, and each rank against the layers it
    adapts); raises LoraInputError naming the field."""
    if value is None:
        return None
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    try:
        options = LoraConfig.of(value)
        check_sizes(options, config)
        # A field of the wrong type (e.g. dropout "x") surfaces as a TypeError in the comparisons above.
    except (LoraError, TypeError) as err:
        raise LoraInputError(str(err) if isinstance(err, LoraError) else f"model.lora={value!r}: {err}") from None
    return LoraSettings(
        options.rank,
        options.scale_alpha,
        float(options.dropout),
        tuple(dict.fromkeys(options.targets)),
        options.resolved_expert_rank(config) if config.use_moe else options.expert_rank or options.rank,
        options,
    )


# ------------------------------------------------------------------------------------- the tensors
@dataclass(frozen=True)
class Trained:
    """One trained tensor of a LoRA run, as the adapted model holds it: an adapter matrix, or a base
    weight trained in full (router, lm_head, embedding when named)."""

    name: str  # the parameter's name (adapters: the base module's name + .lora_A / .lora_B)
    layer: int | None  # decoder / MTP layer index; None for the root (embedding, lm_head)
    kind: str  # attention | mlp | shared_expert | experts | mtp | router | lm_head | embed | vision | vision_projector
    shape: tuple[int, ...]  # global shape (a DTensor's, not its local shard's)
    expert: bool  # stacked over the routed experts (sharded like them)
    adapter: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


VISION_KINDS = ("vision", "vision_projector")  # adapters on Step-3.7's encoder and projector (run per image)


def _kind(name: str, layer: int | None, config: Step35Config) -> str:
    if name.startswith("vision_model."):
        return "vision"
    if name.startswith("vit_large_projector."):
        return "vision_projector"
    if layer is None:
        return "embed" if "embed_tokens" in name else "lm_head"
    if name.endswith("moe.gate.weight"):
        return "router"
    if layer >= config.num_hidden_layers:
        return "mtp"
    for part, kind in (
        (".self_attn.", "attention"),
        (".moe.", "experts"),
        (".share_expert.", "shared_expert"),
        (".mlp.", "mlp"),
    ):
        if part in name:
            return kind
    raise ValueError(f"{name}: an adapted tensor of no kind the plan knows")


def trained_tensors(model: nn.Module) -> list[Trained]:
    """The adapters of the adapted `model` (trained or, in MTP layers whose loss is not trained, held
    frozen) and the base weights it trains in full, with their global shapes."""
    config = model.config
    out = []
    for name, p in model.named_parameters():
        adapter = is_adapter(name)
        if not (adapter or p.requires_grad):
            continue
        match = _LAYER.match(name)
        layer = int(match.group(1)) if match else None
        kind = _kind(name, layer, config)
        out.append(Trained(name, layer, kind, tuple(p.shape), adapter and kind == "experts", adapter))
    return out


# ------------------------------------------------------------------------------------- activations
def activations_per_token(
    tensors: list[Trained], config: Step35Config, lora: LoraSettings, act_bytes: int, mode: str, *, num_mtp_layers: int
) -> dict[int, dict[str, float]]:
    """Bytes per token each layer's adapters add to what its forward keeps, by kind: {layer: {kind: bytes}}.

    An adapter computes B(A(dropout(x))) * alpha / r beside the frozen base. Without checkpointing
    (and in the block a full checkpoint rebuilds) B keeps A's r-wide output; with dropout, A keeps
    the dropped input and the dropout its mask (bool), per adapted linear. The routed experts do the
    same on every routed row (top-k rows per token). Under selective checkpointing every matmul
    result is kept instead: A's output and B's output (the width of the base output). Only trained
    MTP layers run (`num_mtp_layers`: those that run). What the frozen base stops keeping (weight-gradient
    inputs) is not subtracted. `tensors`: trained_tensors of the adapted model. The vision adapters run per image,
    not per token: plan/vision.py counts theirs."""
    K = config.moe_top_k if config.use_moe else 0
    out: dict[int, dict[str, float]] = {}
    for t in tensors:
        if not t.adapter or t.kind in VISION_KINDS:
            continue
        if t.layer is not None and t.layer >= config.num_hidden_layers + num_mtp_layers:
            continue
        rows = K if t.expert else 1
        if t.name.endswith(".lora_A"):
            r, width_in = (t.shape[2] if t.expert else t.shape[0]), t.shape[1]
            if mode == "selective":
                per = r * act_bytes
            else:
                per = r * act_bytes + (width_in * (act_bytes + 1) if lora.dropout > 0 else 0)
        else:
            width_out = t.shape[-1] if t.expert else t.shape[0]
            per = width_out * act_bytes if mode == "selective" else 0
        layer = out.setdefault(t.layer, {})
        layer[t.kind] = layer.get(t.kind, 0) + rows * per
    return out
