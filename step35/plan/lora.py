"""A LoRA run as the plan counts it: the `model.lora` options, the adapter tensors they create, what
each rank holds of them, and the activations they add.

The options of `model.lora` and their rules belong to step35.model.lora.LoraConfig; this module resolves
them (alpha default rank, expert_rank default max(1, rank // moe_top_k)) and counts.
A dense `nn.Linear` with weight [out, in] gets A [r, in] and B [out, r]; the routed experts of a layer
get [E, in, r] and [E, r, out] for each of gate, up and down, sharded like the experts (Shard(0) over
ep, then Shard(1) over efsdp). The base is frozen in the compute dtype; adapters and the full targets
(router, lm_head, embed) keep master weights, gradients and AdamW state in the stored dtype (fp32 under
precision 32-true).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from step35.config import Step35Config
from step35.model.lora import ATTENTION_TARGETS, FULL_TARGETS, VALID_TARGETS, LoraConfig, LoraError, check_sizes
from step35.model.lora import DEFAULT_TARGETS as MODEL_DEFAULT_TARGETS

ATTENTION = ATTENTION_TARGETS
KINDS = ("mlp", "shared_expert", "experts", "mtp")
FULL = FULL_TARGETS  # trained as in a full fine-tune, no adapter
TARGETS = VALID_TARGETS
DEFAULT_TARGETS = tuple(MODEL_DEFAULT_TARGETS)


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

    @property
    def projections(self) -> tuple[str, ...]:
        """The attention projections adapted ("attention" names all five)."""
        if "attention" in self.targets:
            return ATTENTION
        return tuple(p for p in ATTENTION if p in self.targets)

    def adapts(self, kind: str) -> bool:
        return kind in self.targets

    def describe(self) -> str:
        return (f"rank {self.rank}, expert rank {self.expert_rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, "
                f"targets {', '.join(self.targets)}")


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
    lora = LoraSettings(options.rank, options.scale_alpha, float(options.dropout), tuple(dict.fromkeys(options.targets)),
                        options.resolved_expert_rank(config) if config.use_moe else options.expert_rank or options.rank)
    if not list(trained_tensors(config, lora, config.num_nextn_predict_layers)):
        raise LoraInputError(f"model.lora.targets={list(options.targets)!r}: adapts nothing in this model")
    return lora


# ------------------------------------------------------------------------------------- the tensors
@dataclass(frozen=True)
class Trained:
    """One trained tensor of a LoRA run: an adapter matrix, or a base weight trained in full."""

    name: str  # the base weight's name, plus .lora_A / .lora_B for adapters
    layer: int | None  # decoder / MTP layer index; None for the root (embedding, lm_head)
    kind: str  # attention | mlp | shared_expert | experts | mtp | router | lm_head | embed
    shape: tuple[int, ...]
    expert: bool  # stacked over the routed experts (sharded like them)
    adapter: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _pair(name: str, layer: int, kind: str, out: int, inp: int, r: int) -> Iterator[Trained]:
    yield Trained(f"{name}.lora_A", layer, kind, (r, inp), False, True)
    yield Trained(f"{name}.lora_B", layer, kind, (out, r), False, True)


def _expert_pair(name: str, layer: int, E: int, out: int, inp: int, r: int) -> Iterator[Trained]:
    yield Trained(f"{name}.lora_A", layer, "experts", (E, inp, r), True, True)
    yield Trained(f"{name}.lora_B", layer, "experts", (E, r, out), True, True)


def _swiglu(prefix: str, layer: int, kind: str, H: int, I: int, r: int) -> Iterator[Trained]:
    yield from _pair(f"{prefix}.gate_proj", layer, kind, I, H, r)
    yield from _pair(f"{prefix}.up_proj", layer, kind, I, H, r)
    yield from _pair(f"{prefix}.down_proj", layer, kind, H, I, r)


def trained_tensors(config: Step35Config, lora: LoraSettings, num_mtp_layers: int) -> Iterator[Trained]:
    """Every tensor a LoRA run trains, with its global shape, built from the config alone. MTP layers
    (named `mtp`) get the adapters of the other targets and one on eh_proj; without `mtp` they stay
    frozen whole. The ranks fit every layer: parse_lora checked them."""
    H, r, re = config.hidden_size, lora.rank, lora.expert_rank
    for i in range(config.num_hidden_layers + num_mtp_layers):
        spec = config.layer(i)
        mtp = i >= config.num_hidden_layers
        if mtp and not lora.adapts("mtp"):
            continue
        p = f"model.layers.{i}"

        def kind(k: str) -> str:
            return "mtp" if mtp else k

        nq, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        shapes = {"q_proj": (nq * d, H), "k_proj": (nkv * d, H), "v_proj": (nkv * d, H), "o_proj": (H, nq * d)}
        if config.use_head_wise_attn_gate:
            shapes["g_proj"] = (nq, H)
        for proj in lora.projections:
            if proj in shapes:
                yield from _pair(f"{p}.self_attn.{proj}", i, kind("attention"), *shapes[proj], r)
        if spec.is_moe:
            if lora.adapts("experts"):
                E, I = config.moe_num_experts, config.moe_intermediate_size
                yield from _expert_pair(f"{p}.moe.gate_proj", i, E, I, H, re)
                yield from _expert_pair(f"{p}.moe.up_proj", i, E, I, H, re)
                yield from _expert_pair(f"{p}.moe.down_proj", i, E, H, I, re)
            if lora.adapts("shared_expert"):
                yield from _swiglu(f"{p}.share_expert", i, kind("shared_expert"), H, config.share_expert_dim, r)
            if lora.adapts("router"):
                yield Trained(f"{p}.moe.gate.weight", i, "router", (config.moe_num_experts, H), False, False)
        elif lora.adapts("mlp"):
            yield from _swiglu(f"{p}.mlp", i, kind("mlp"), H, config.intermediate_size, r)
        if mtp:
            yield from _pair(f"{p}.eh_proj", i, "mtp", H, 2 * H, r)
    if lora.adapts("embed"):
        yield Trained("model.embed_tokens.weight", None, "embed", (config.vocab_size, H), False, False)
    if lora.adapts("lm_head"):
        yield Trained("lm_head.weight", None, "lm_head", (config.vocab_size, H), False, False)


def full_target(name: str, config: Step35Config, lora: LoraSettings) -> bool:
    """Is this base parameter trained in full (router, lm_head, embedding when named)?"""
    if name.endswith("moe.gate.weight") and lora.adapts("router"):
        layer = int(name.split("layers.")[1].split(".")[0])
        return layer < config.num_hidden_layers or lora.adapts("mtp")
    return (name == "lm_head.weight" and lora.adapts("lm_head")) or \
        (name == "model.embed_tokens.weight" and lora.adapts("embed"))


def local_numel(t: Trained, *, world: int, shard_size: int, ep: int, sharded: bool) -> int:
    """Elements of `t` on rank 0 (the largest shard: FSDP2 gives the first ranks ceil-sized chunks).
    Expert tensors: Shard(0) over ep, then Shard(1) over efsdp = world / ep (as the experts; with ep 1
    they belong to the layer's FSDP unit, Shard(0) over the dense mesh); the rest: Shard(0) over
    the dense mesh of `shard_size` ranks."""
    if not sharded:
        return t.numel
    if t.expert and ep > 1:
        E, a, b = t.shape
        return (E // ep) * math.ceil(a / (world // ep)) * b
    return math.ceil(t.shape[0] / shard_size) * math.prod(t.shape[1:])


def group_of(t: Trained, ep: int) -> str:
    """The FSDP unit (state.fsdp_groups' name) that holds `t`."""
    if t.layer is None:
        return "root"
    return f"layers.{t.layer}.moe.experts" if t.expert and ep > 1 else f"layers.{t.layer}"


# ------------------------------------------------------------------------------------- activations
def activations_per_token(config: Step35Config, lora: LoraSettings, act_bytes: int, mode: str, *,
                          num_mtp_layers: int) -> dict[int, dict[str, float]]:
    """Bytes per token each layer's adapters add to what its forward keeps, by kind: {layer: {kind: bytes}}.

    An adapter computes B(A(dropout(x))) * alpha / r beside the frozen base. Without checkpointing
    (and in the block a full checkpoint rebuilds) B keeps A's r-wide output; with dropout, A keeps
    the dropped input and the dropout its mask (bool), per adapted linear. The routed experts do the
    same on every routed row (top-k rows per token). Under selective checkpointing every matmul
    result is kept instead: A's output and B's output (the width of the base output). Only trained
    MTP layers run. What the frozen base stops keeping (weight-gradient inputs) is not subtracted."""
    K = config.moe_top_k if config.use_moe else 0
    out: dict[int, dict[str, float]] = {}
    for t in trained_tensors(config, lora, num_mtp_layers):
        if not t.adapter:
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
