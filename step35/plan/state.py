"""What one rank holds for the whole run (parameters, gradients, optimizer states, buffers), read from the
local shards of the model fit trains (training/setup.py: adapted, sharded, frozen; on the meta device),
and the FSDP groups whose gathered parameters and gradients are the large transient buffers of a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from step35.model import Step35ForCausalLM
from step35.model.lora import is_adapter
from step35.parallel.whole_matrices import split_ranks
from step35.plan.vision import is_vision


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class RankState:
    params: int  # local parameter shards, stored dtype
    grads: int  # local gradient shards of trainable parameters (FSDP keeps them in the parameter dtype)
    optimizer: int  # the optimizer's states of trainable parameters (AdamW: exp_avg + exp_avg_sq)
    buffers: int  # router biases and token counters (replicated)
    params_total: int  # global parameter count of the language model
    params_local: int  # local parameter count
    trainable_local: int
    largest_local_param: int  # bytes of the biggest local shard (the non-foreach optimizer's temporaries)
    expert_shapes: dict[str, list[int]]  # local shard shape of one MoE layer's stacked projections
    frozen: int = 0  # LoRA: bytes of the frozen base (part of `params`)
    adapter_params: int = 0  # LoRA: bytes of the local adapter shards (part of `params`)
    adapters_total: int = 0  # LoRA: global adapter element count (not in params_total, the model's)
    reference: int = 0  # the objective's frozen reference copy's local shards (training/reference.py's dtype)
    # bytes this rank sends per optimizer step to bring whole matrices to their owners and the results back
    # (Muon's, parallel/whole_matrices.py): 2 x its slices x (k - 1) / k for a matrix split k ways
    muon_exchange: float = 0.0
    # Step-3.7's vision side (model.vision), part of the numbers above: local bytes of its parameters (adapters on
    # it included), gradients and optimizer states, and its global parameter count (adapters apart)
    vision_params: int = 0
    vision_grads: int = 0
    vision_optimizer: int = 0
    vision_total: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.reference

    @property
    def checkpoint_bytes(self) -> int:
        """This rank's share of a training checkpoint: its trained parameters, optimizer states and buffers (a
        LoRA base and the DPO reference are not saved); what a background save stages in host memory."""
        return self.params - self.frozen + self.optimizer + self.buffers


@dataclass
class FsdpGroup:
    """One fully_shard unit: its parameters gathered for compute, and its gradients reduce-scattered."""

    name: str
    unsharded_numel: int  # elements all-gathered (the expert-parallel slice for expert groups)
    ranks: int  # ranks the group is sharded over (all-gather / reduce-scatter size)
    runs: bool  # is it used in the training forward (MTP layers only when their loss is trained)
    trainable: bool
    grad_numel: int | None = None  # elements reduce-scattered (default: all when trainable, else none)

    def __post_init__(self) -> None:
        if self.grad_numel is None:
            self.grad_numel = self.unsharded_numel if self.trainable else 0


def rank_state(
    model: Step35ForCausalLM,
    slots_of: Callable[[str, tuple[int, ...]], float],
    exchange_of: Callable[[str, tuple[int, ...]], int] = lambda name, shape: 0,
) -> RankState:
    """The local shards `model` holds on this rank, each in its own dtype (a LoRA base in its base dtype,
    the adapters and full targets in theirs); gradients like each trainable parameter, and
    `slots_of(name, shape)` optimizer states of its size (RunSettings.slots_of: its param group's);
    `exchange_of(name, shape)`: bytes per value the optimizer sends each way to see its matrices whole
    (RunSettings.exchange_of: Muon's fp32 exchange; 0 for none)."""
    muon_exchange = 0.0
    vision = {"params": 0, "grads": 0, "optimizer": 0.0, "total": 0}
    params = grads = optimizer = trainable = largest = total = local_numel = frozen = adapters = adapters_total = 0
    shapes: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        local = _local(p)
        if is_vision(name):
            vision["params"] += _nbytes(local)
            vision["total"] += 0 if is_adapter(name) else p.numel()
            if p.requires_grad:
                vision["grads"] += _nbytes(local)
                vision["optimizer"] += slots_of(name, tuple(p.shape)) * _nbytes(local)
        else:
            total += 0 if is_adapter(name) else p.numel()  # the language model's own count; adapters apart
        local_numel += local.numel()
        params += _nbytes(local)
        if p.requires_grad:
            grads += _nbytes(local)
            optimizer += slots_of(name, tuple(p.shape)) * _nbytes(local)
            if (value_bytes := exchange_of(name, tuple(p.shape))) and (k := split_ranks(p, name)) > 1:
                muon_exchange += 2 * local.numel() * value_bytes * (k - 1) / k
            trainable += local.numel()
            largest = max(largest, _nbytes(local))
        else:
            frozen += _nbytes(local)
        if is_adapter(name):
            adapters += _nbytes(local)
            adapters_total += p.numel()
        elif ".moe." in name and not name.endswith("gate.weight"):
            shapes.setdefault(name.split(".moe.")[1], list(local.shape))
    buffers = sum(_nbytes(_local(b)) for b in model.buffers())
    lora = adapters_total > 0
    return RankState(
        params,
        grads,
        round(optimizer),
        buffers,
        total,
        local_numel,
        trainable,
        largest,
        shapes,
        frozen=frozen if lora else 0,
        adapter_params=adapters,
        adapters_total=adapters_total,
        muon_exchange=muon_exchange,
        vision_params=vision["params"],
        vision_grads=vision["grads"],
        vision_optimizer=round(vision["optimizer"]),
        vision_total=vision["total"],
    )


def _numel(params: list[nn.Parameter], ep: int, experts: bool) -> int:
    return sum(p.numel() // (ep if experts else 1) for p in params)


def _unit(name: str, params: list[nn.Parameter], ranks: int, runs: bool, ep: int, experts: bool) -> FsdpGroup:
    trained = [p for p in params if p.requires_grad]
    return FsdpGroup(name, _numel(params, ep, experts), ranks, runs, bool(trained), _numel(trained, ep, experts))


def fsdp_groups(model: Step35ForCausalLM, *, shard_size: int, efsdp: int, ep: int, train_mtp: bool) -> list[FsdpGroup]:
    """The fully_shard units of parallelize.apply_fsdp, in order: per layer the experts (EP: the three
    stacked projections with their adapters) and the rest of the layer; with a vision side each encoder block,
    then the rest of the encoder (parallelize._shard_vision: run every micro-batch, with or without images); then
    the root (embedding, final norm, lm_head; the vision projector). Each gathers all its parameters and
    reduce-scatters the gradients of those it trains."""
    groups: list[FsdpGroup] = []
    in_layers: set[int] = set()
    n_main = model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        runs = i < n_main or train_mtp
        layer_params = list(layer.parameters())
        in_layers.update(id(p) for p in layer_params)
        expert_params: list[nn.Parameter] = []
        if layer.spec.is_moe and ep > 1:
            expert_params = [
                p for proj in (layer.moe.gate_proj, layer.moe.up_proj, layer.moe.down_proj) for p in proj.parameters()
            ]
            groups.append(_unit(f"layers.{i}.moe.experts", expert_params, efsdp, runs, ep, True))
        ids = {id(p) for p in expert_params}
        groups.append(_unit(f"layers.{i}", [p for p in layer_params if id(p) not in ids], shard_size, runs, ep, False))
    encoder = getattr(model, "vision_model", None)
    if encoder is not None:
        for i, block in enumerate(encoder.transformer.resblocks):
            block_params = list(block.parameters())
            in_layers.update(id(p) for p in block_params)
            groups.append(_unit(f"vision.blocks.{i}", block_params, shard_size, True, ep, False))
        rest = [p for p in encoder.parameters() if id(p) not in in_layers]
        in_layers.update(id(p) for p in rest)
        groups.append(_unit("vision.encoder", rest, shard_size, True, ep, False))
    root = [p for p in model.parameters() if id(p) not in in_layers]
    groups.append(_unit("root", root, shard_size, True, ep, False))
    return groups
