"""What one rank holds for the whole run (parameters, gradients, AdamW states, buffers), read from the
local shards of the really-sharded meta model, and the FSDP groups whose gathered parameters and
gradients are the large transient buffers of a step."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from step35.model import Step35ForCausalLM
from step35.plan.lora import LoraSettings, full_target, group_of, local_numel, trained_tensors

ADAM_STATES = 2  # exp_avg and exp_avg_sq, each like the parameter (the step counter lives on the host)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class RankState:
    params: int  # local parameter shards, stored dtype
    grads: int  # local gradient shards of trainable parameters (FSDP keeps them in the parameter dtype)
    optimizer: int  # AdamW exp_avg + exp_avg_sq of trainable parameters
    buffers: int  # router biases and token counters (replicated)
    params_total: int  # global parameter count
    params_local: int  # local parameter count
    trainable_local: int
    largest_local_param: int  # bytes of the biggest local shard (the non-foreach optimizer's temporaries)
    expert_shapes: dict[str, list[int]]  # local shard shape of one MoE layer's stacked projections
    frozen: int = 0  # LoRA: bytes of the frozen base (part of `params`)
    adapter_params: int = 0  # LoRA: bytes of the local adapter shards (part of `params`)
    adapters_total: int = 0  # LoRA: global adapter element count (not in params_total, the model's)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


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


def rank_state(model: Step35ForCausalLM) -> RankState:
    params = grads = trainable = largest = total = local_numel = 0
    shapes: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        local = _local(p)
        total += p.numel()
        local_numel += local.numel()
        params += _nbytes(local)
        largest = max(largest, _nbytes(local))
        if p.requires_grad:
            grads += _nbytes(local)
            trainable += local.numel()
        if ".moe." in name and not name.endswith("gate.weight"):
            shapes.setdefault(name.split(".moe.")[1], list(local.shape))
    buffers = sum(_nbytes(_local(b)) for b in model.buffers())
    return RankState(params, grads, ADAM_STATES * grads, buffers, total, local_numel, trainable, largest, shapes)


def _numel(params: list[nn.Parameter], ep: int, experts: bool) -> int:
    return sum(p.numel() // (ep if experts else 1) for p in params)


def fsdp_groups(model: Step35ForCausalLM, *, shard_size: int, efsdp: int, ep: int, train_mtp: bool) -> list[FsdpGroup]:
    """The fully_shard units of parallelize.apply_fsdp, in order: per layer the experts (EP) and the
    rest of the layer, then the root (embedding, final norm, lm_head)."""
    groups: list[FsdpGroup] = []
    in_layers: set[int] = set()
    n_main = model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        runs = i < n_main or train_mtp
        layer_params = list(layer.parameters())
        in_layers.update(id(p) for p in layer_params)
        expert_params: list[nn.Parameter] = []
        if layer.spec.is_moe and ep > 1:
            expert_params = [layer.moe.gate_proj.weight, layer.moe.up_proj.weight, layer.moe.down_proj.weight]
            groups.append(FsdpGroup(f"layers.{i}.moe.experts", _numel(expert_params, ep, True), efsdp, runs,
                                    any(p.requires_grad for p in expert_params)))
        ids = {id(p) for p in expert_params}
        rest = [p for p in layer_params if id(p) not in ids]
        groups.append(FsdpGroup(f"layers.{i}", _numel(rest, ep, False), shard_size, runs,
                                any(p.requires_grad for p in rest)))
    root = [p for p in model.parameters() if id(p) not in in_layers]
    groups.append(FsdpGroup("root", _numel(root, ep, False), shard_size, True, any(p.requires_grad for p in root)))
    return groups


def lora_rank_state(model: Step35ForCausalLM, lora: LoraSettings, *, base_dtype: torch.dtype,
                    trained_dtype: torch.dtype, num_mtp_layers: int, world: int, shard_size: int, ep: int,
                    sharded: bool) -> RankState:
    """What one rank holds in a LoRA run: the local base shards of the sharded model in `base_dtype`
    (frozen: no gradient, no AdamW state) except the full targets, and the local adapter shards; the
    trained tensors are kept in `trained_dtype` with gradients and AdamW state like it."""
    base, trained_bytes = torch.empty((), dtype=base_dtype).element_size(), torch.empty((), dtype=trained_dtype).element_size()
    frozen = trained = largest = total = local_numel_sum = trainable = 0
    shapes: dict[str, list[int]] = {}
    cfg = model.config
    for name, p in model.named_parameters():
        n = _local(p).numel()
        total += p.numel()
        local_numel_sum += n
        if full_target(name, cfg, lora):
            trained += n * trained_bytes
            trainable += n
            largest = max(largest, n * trained_bytes)
        else:
            frozen += n * base
        if ".moe." in name and not name.endswith("gate.weight"):
            shapes.setdefault(name.split(".moe.")[1], list(_local(p).shape))
    adapters = adapters_total = 0
    for t in trained_tensors(cfg, lora, num_mtp_layers):
        if not t.adapter:
            continue
        n = local_numel(t, world=world, shard_size=shard_size, ep=ep, sharded=sharded)
        adapters += n * trained_bytes
        adapters_total += t.numel
        trainable += n
        local_numel_sum += n
        largest = max(largest, n * trained_bytes)
    grads = trained + adapters
    buffers = sum(_nbytes(_local(b)) for b in model.buffers())
    return RankState(frozen + grads, grads, ADAM_STATES * grads, buffers, total, local_numel_sum,
                     trainable, largest, shapes, frozen=frozen, adapter_params=adapters, adapters_total=adapters_total)


def lora_groups(groups: list[FsdpGroup], lora: LoraSettings, config, num_mtp_layers: int, ep: int) -> list[FsdpGroup]:
    """The FSDP units of a LoRA run: each gathers its adapters too (their expert-parallel slice), and
    reduce-scatters only the gradients of what it trains (adapters and full targets)."""
    extra: dict[str, int] = {}
    grads: dict[str, int] = {}
    for t in trained_tensors(config, lora, num_mtp_layers):
        g = group_of(t, ep)
        n = t.numel // (ep if t.expert and ep > 1 else 1)
        if t.adapter:
            extra[g] = extra.get(g, 0) + n
        grads[g] = grads.get(g, 0) + n
    return [replace(g, unsharded_numel=g.unsharded_numel + extra.get(g.name, 0), trainable=g.name in grads,
                    grad_numel=grads.get(g.name, 0)) for g in groups]
