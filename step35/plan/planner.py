"""One plan: shard the real model for the simulated world, then add up memory phase by phase and
estimate the step's speed. `make_plan` is what `step35 plan` prints; suggestions call it again with
other layouts."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from step35.model import build_model
from step35.parallel import ParallelDims
from step35.plan.activations import ActivationEstimate, Shape, model_activations
from step35.plan.devices import Device
from step35.plan.lora import activations_per_token
from step35.plan.memory import Phase, Transients, Verdict, phases, transients, verdict
from step35.plan.settings import RunSettings
from step35.plan.speed import Speed, speed
from step35.plan.state import FsdpGroup, RankState, fsdp_groups, lora_groups, lora_rank_state, rank_state
from step35.plan.world import close_world, sharded_meta_model

GiB = 1024**3


@dataclass
class Plan:
    settings: RunSettings
    device: Device
    efsdp: int
    state: RankState
    activations: ActivationEstimate
    transients: Transients
    phases: list[Phase]
    verdict: Verdict
    speed: Speed
    seconds: float
    suggestions: list["Plan"] = field(default_factory=list)
    other_ways: list = field(default_factory=list)  # suggest.OtherWay: LoRA, context parallelism


_STATE_CACHE: dict[tuple, tuple[RankState, list[FsdpGroup]]] = {}


def sharded_state(s: RunSettings, rank: int = 0) -> tuple[RankState, list[FsdpGroup]]:
    """Local shards of `rank` (rank 0 holds the largest: FSDP gives the first ranks the rounded-up chunks)."""
    cfg = s.model_config
    key = (json.dumps(cfg.to_dict(), sort_keys=True), s.world_size, s.expert_parallel_size, s.replicate_size, s.sharded, s.stored_dtype,
           s.num_mtp_layers, s.train_mtp, rank, s.lora, s.base_dtype)
    if key in _STATE_CACHE:
        return _STATE_CACHE[key]
    dims = parallel_dims(s)
    ep = dims.expert_parallel_size
    if s.sharded:
        model = sharded_meta_model(cfg, s.num_mtp_layers, dims, rank=rank, stored_dtype=s.stored_dtype,
                                   param_dtype=s.param_dtype, reduce_dtype=s.reduce_dtype,
                                   reshard_after_forward=s.reshard_after_forward, train_mtp=s.train_mtp)
        close_world()
    else:
        model = build_model(cfg, s.num_mtp_layers, dtype=s.stored_dtype)
        if not s.train_mtp:
            for layer in model.model.mtp_layers:
                layer.requires_grad_(False)
    groups = fsdp_groups(model, shard_size=dims.shard_size, efsdp=dims.efsdp, ep=ep, train_mtp=s.train_mtp)
    if s.lora is None:
        result = rank_state(model), groups
    else:
        state = lora_rank_state(model, s.lora, base_dtype=s.base_dtype, trained_dtype=s.stored_dtype,
                                num_mtp_layers=s.num_mtp_layers, world=s.world_size if s.sharded else 1,
                                shard_size=dims.shard_size, ep=ep, sharded=s.sharded)
        result = state, lora_groups(groups, s.lora, cfg, s.num_mtp_layers, ep)
    _STATE_CACHE[key] = result
    return result


def parallel_dims(s: RunSettings) -> ParallelDims:
    """The mesh sizes of the layout (one rank holding everything when it is not sharded); bad sizes
    raise ParallelConfigError naming both values."""
    cfg = s.model_config
    if not s.sharded:
        return ParallelDims(1)
    return ParallelDims(s.world_size, s.expert_parallel_size, s.replicate_size,
                        num_experts=cfg.moe_num_experts if cfg.use_moe else None)


def activation_shape(s: RunSettings) -> Shape:
    return Shape(s.micro_batch_size, s.seq_len, torch.empty((), dtype=s.compute_dtype).element_size(),
                 s.accelerator, s.expert_parallel_size if s.sharded else 1,
                 autocast=s.precision == "bf16-mixed" and s.param_dtype is None, document_masking=s.document_masking)


def with_adapter_activations(act: ActivationEstimate, s: RunSettings) -> ActivationEstimate:
    """`act` plus what the adapters keep (lora.activations_per_token), under the run's checkpointing:
    without it they are kept; under full checkpointing only the rebuilt block holds them; under
    selective their matmul results are kept too. Parts are named `lora <kind>`."""
    shape = activation_shape(s)
    mtp = s.num_mtp_layers if s.train_mtp else 0
    per_layer = activations_per_token(s.model_config, s.lora, shape.act_bytes, s.activation_checkpointing,
                                      num_mtp_layers=mtp)
    parts, total = dict(act.parts), act.total
    largest = 0
    for by_kind in per_layer.values():
        layer = sum(by_kind.values()) * shape.tokens
        largest = max(largest, int(layer))
        if act.mode == "full":
            continue
        for kind, per_token in by_kind.items():
            parts[f"lora {kind}"] = parts.get(f"lora {kind}", 0) + int(per_token * shape.tokens)
            total += int(per_token * shape.tokens)
    recompute = act.recompute + largest if act.mode != "none" else 0
    return ActivationEstimate(act.mode, total, parts, recompute, act.largest_layer + largest)


def make_plan(s: RunSettings, device: Device, *, allocator_margin: float, runtime_reserve_gib: float | None = None,
              device_memory_gib: float | None = None) -> Plan:
    start = time.perf_counter()
    cfg = s.model_config
    dims = parallel_dims(s)  # refuse bad sizes first
    state, groups = sharded_state(s)
    act = model_activations(cfg, activation_shape(s), mode=s.activation_checkpointing,
                            num_mtp_layers=s.num_mtp_layers if s.train_mtp else 0, aux_loss=s.aux_loss)
    if s.lora is not None:
        act = with_adapter_activations(act, s)
    t = transients(s, state, groups)
    phase_list = phases(s, state, t, act)
    memory = (device.memory_gib if device_memory_gib is None else device_memory_gib) * GiB
    reserve = (device.runtime_reserve_gib if runtime_reserve_gib is None else runtime_reserve_gib) * GiB
    v = verdict(phase_list, int(memory), allocator_margin, int(reserve))
    return Plan(s, device, dims.efsdp, state, act, t, phase_list, v, speed(s, groups, device), time.perf_counter() - start)
