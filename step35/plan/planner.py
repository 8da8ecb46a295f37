"""One plan: shard the real model for the simulated world, then add up memory phase by phase and
estimate the step's speed. `make_plan` is what `step35 plan` prints; suggestions call it again with
other layouts."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

from step35.parallel import ParallelDims
from step35.plan.activations import ActivationEstimate, Shape, model_activations
from step35.plan.devices import Device
from step35.plan.drafts import DraftMemory, eval_draft_memory
from step35.plan.lora import Trained, activations_per_token, trained_tensors
from step35.plan.memory import Phase, Transients, Verdict, phases, transients, verdict
from step35.plan.rollout import GenerationMemory, RolloutMemory, eval_generation_memory, rollout_memory
from step35.plan.settings import PlanInputError, RunSettings
from step35.plan.speed import Speed, speed
from step35.plan.state import FsdpGroup, RankState, fsdp_groups, rank_state
from step35.plan.vision import VisionActivations, vision_activations
from step35.plan.world import close_world, sharded_meta_model
from step35.training.reference import reference_copy
from step35.training.setup import TrainedModel, training_model

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
    suggestions: list[Plan] = field(default_factory=list)
    other_ways: list = field(default_factory=list)  # suggest.OtherWay: LoRA, context parallelism
    trained: list[Trained] = field(default_factory=list)  # LoRA: the adapted model's trained tensors
    host_memory_gib: float | None = None  # the node's host memory (`--host-memory-gib`), for the staging check
    rollout: RolloutMemory | None = None  # an objective that generates: its rollouts' bytes (plan/rollout.py)
    vision: VisionActivations | None = None  # model.vision: the vision forward of one micro-batch (plan/vision.py)
    eval_generation: GenerationMemory | None = None  # an EvalCallback: one prompt's generation (plan/rollout.py)
    eval_drafts: DraftMemory | None = None  # its MTP draft scoring: one validation micro-batch (plan/drafts.py)

    @property
    def staging_per_node(self) -> int:
        """Host bytes a node holds for background checkpoint writes (RunCheckpoint async_save): each rank's
        checkpoint share, staged (pinned on GPUs) beside the node's other host memory use."""
        return self.state.checkpoint_bytes * self.settings.devices_per_node if self.settings.async_save else 0

    @property
    def staging_exceeds_host(self) -> bool:
        return self.host_memory_gib is not None and self.staging_per_node > self.host_memory_gib * 1024**3


@dataclass(frozen=True)
class ShardedState:
    """What the plan reads of the model fit would build, on one rank."""

    state: RankState
    groups: list[FsdpGroup]
    trained: list[Trained]  # LoRA: the adapters and full targets (empty for a full fine-tune)


_STATE_CACHE: dict[tuple, ShardedState] = {}


def trained_model_of(s: RunSettings) -> TrainedModel:
    """The training setup's description of the run's model (what fit gives training_model)."""
    lora = s.lora.options if s.lora is not None else None
    return TrainedModel(s.model_config, s.num_mtp_layers, s.mtp_loss_weight, lora, s.vision, s.train_vision)


def sharded_state(s: RunSettings, rank: int = 0) -> ShardedState:
    """Local shards of `rank` (rank 0 holds the largest: FSDP gives the first ranks the rounded-up chunks)
    of the real model: built, adapted, sharded and frozen by the one training setup, on the meta device."""
    cfg = s.model_config
    lora = None if s.lora is None else json.dumps(asdict(s.lora.options), sort_keys=True)
    key = (
        json.dumps(cfg.to_dict(), sort_keys=True),
        s.world_size,
        s.expert_parallel_size,
        s.context_parallel_size,
        s.replicate_size,
        s.sharded,
        s.stored_dtype,
        s.num_mtp_layers,
        s.train_mtp,
        rank,
        lora,
        s.optimizer,
        s.optimizer_slots,
        s.reference_copy,
        s.reference_dtype,
        None if s.vision is None else json.dumps(asdict(s.vision), sort_keys=True),
        s.train_vision,
    )
    if key in _STATE_CACHE:
        return _STATE_CACHE[key]
    dims = parallel_dims(s)
    spec = trained_model_of(s)
    reference = 0
    if s.reference_copy:  # the objective's frozen reference, made as Step35LightningModule.configure_model makes it
        reference = sum(_local_bytes(p) for p in reference_model(s, dims, rank).parameters())
    model = run_model(s, spec, dims, rank, s.stored_dtype)
    trained = trained_tensors(model) if s.lora is not None else []
    if s.lora is not None and not any(t.adapter for t in trained):
        raise PlanInputError(f"model.lora.targets={list(s.lora.targets)!r}: adapts nothing in this model")
    groups = fsdp_groups(
        model, shard_size=dims.shard_size, efsdp=dims.efsdp, ep=dims.expert_parallel_size, train_mtp=s.train_mtp
    )
    state = rank_state(model, s.slots_of, s.exchange_of)
    state.reference = reference
    result = ShardedState(state, groups, trained)
    _STATE_CACHE[key] = result
    return result


def reference_model(s: RunSettings, dims: ParallelDims, rank: int = 0):
    """The objective's frozen reference on `rank` (meta): what training/reference.py's reference_copy says
    (the start model without MTP layers, in its dtype), sharded as the policy."""
    spec, dtype = reference_copy(s.model_config, s.param_dtype, s.stored_dtype)
    return run_model(s, spec, dims, rank, dtype)


def run_model(s: RunSettings, spec: TrainedModel, dims: ParallelDims, rank: int, dtype: torch.dtype):
    """`spec` on `rank` (meta) as the run's fit builds it, with its parameters stored in `dtype`: sharded by the
    run's strategy settings, or whole on one device."""
    if not s.sharded:
        return training_model(spec, dtype=dtype)
    model = sharded_meta_model(
        spec,
        dims,
        rank=rank,
        stored_dtype=dtype,
        param_dtype=s.param_dtype,
        reduce_dtype=s.reduce_dtype,
        reshard_after_forward=s.reshard_after_forward,
    )
    close_world()
    return model


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def parallel_dims(s: RunSettings) -> ParallelDims:
    """The mesh sizes of the layout (one rank holding everything when it is not sharded); bad sizes
    raise ParallelConfigError naming both values (and a cp that does not split data.seq_len)."""
    cfg = s.model_config
    if not s.sharded:
        return ParallelDims(1, context_parallel_size=s.context_parallel_size)  # refuses cp > 1 on one device
    dims = ParallelDims(
        s.world_size,
        s.expert_parallel_size,
        s.replicate_size,
        num_experts=cfg.moe_num_experts if cfg.use_moe else None,
        context_parallel_size=s.context_parallel_size,
    )
    dims.check_seq_len(s.seq_len)
    return dims


def activation_shape(s: RunSettings) -> Shape:
    """The training forward's micro-batch: its rows (an objective that generates packs its sequences into rows
    of documents, training/rollout.py) and the dtypes and kernels that size what it keeps."""
    return Shape(
        s.rows_per_micro_batch,
        s.row_tokens,
        torch.empty((), dtype=s.compute_dtype).element_size(),
        s.accelerator,
        s.expert_parallel_size if s.sharded else 1,
        autocast=s.precision == "bf16-mixed" and s.param_dtype is None,
        document_masking=s.document_masking or s.objective_needs.generates is not None,
        context_parallel=s.context_parallel_size,
    )


def with_adapter_activations(act: ActivationEstimate, s: RunSettings, trained: list[Trained]) -> ActivationEstimate:
    """`act` plus what the adapters keep (lora.activations_per_token), under the run's checkpointing:
    without it they are kept; under full checkpointing only the rebuilt block holds them; under
    selective their matmul results are kept too. Parts are named `lora <kind>`."""
    shape = activation_shape(s)
    mtp = s.num_mtp_layers if s.train_mtp else 0
    per_layer = activations_per_token(
        trained, s.model_config, s.lora, shape.act_bytes, s.activation_checkpointing, num_mtp_layers=mtp
    )
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


def scaled(act: ActivationEstimate, factor: float) -> ActivationEstimate:
    """`act` with every part times `factor` (an objective's activations per token against the LM's)."""
    parts = {k: int(v * factor) for k, v in act.parts.items()}
    return ActivationEstimate(
        act.mode, int(act.total * factor), parts, int(act.recompute * factor), int(act.largest_layer * factor)
    )


def run_vision_activations(s: RunSettings) -> VisionActivations | None:
    """The vision forward of one micro-batch of the run (plan/vision.py), its encoder blocks checkpointed as the
    decoder layers are; None without model.vision."""
    if s.vision is None:
        return None
    a = torch.empty((), dtype=s.vision_dtype).element_size()
    return vision_activations(
        s.vision,
        s.model_config.hidden_size,
        s.vision_views,
        a,
        s.vision_grad,
        checkpointing=s.activation_checkpointing,
        device_type=s.accelerator,
    )


def with_vision_activations(act: ActivationEstimate, vision: VisionActivations | None) -> ActivationEstimate:
    """`act` plus what the vision forward keeps (parts named `vision ...`, already under the run's activation
    checkpointing, plan/vision.py): kept through the language model's forward and backward."""
    if vision is None or not vision.total:
        return act
    parts = dict(act.parts)
    for part, nbytes in vision.parts.items():
        parts[part] = parts.get(part, 0) + nbytes
    return ActivationEstimate(act.mode, act.total + vision.total, parts, act.recompute, act.largest_layer)


def make_plan(
    s: RunSettings,
    device: Device,
    *,
    allocator_margin: float,
    runtime_reserve_gib: float | None = None,
    device_memory_gib: float | None = None,
) -> Plan:
    start = time.perf_counter()
    cfg = s.model_config
    dims = parallel_dims(s)  # refuse bad sizes first
    sharded = sharded_state(s)
    state, groups = sharded.state, sharded.groups
    act = model_activations(
        cfg,
        activation_shape(s),
        mode=s.activation_checkpointing,
        num_mtp_layers=s.num_mtp_layers if s.train_mtp else 0,
        aux_loss=s.aux_loss,
    )
    if s.lora is not None:
        act = with_adapter_activations(act, s, sharded.trained)
    if s.objective_needs.activation_factor != 1:  # the objective keeps more (or less) per token than the LM's
        act = scaled(act, s.objective_needs.activation_factor)
    vision = run_vision_activations(s)
    act = with_vision_activations(act, vision)
    t = transients(s, state, groups)
    rollout = rollout_memory(s, activation_shape(s))
    evaluation = eval_generation_memory(s, activation_shape(s))
    drafts = eval_draft_memory(s, activation_shape(s), groups)
    phase_list = phases(s, state, t, act, rollout, vision, evaluation, drafts)
    memory = (device.memory_gib if device_memory_gib is None else device_memory_gib) * GiB
    reserve = (device.runtime_reserve_gib if runtime_reserve_gib is None else runtime_reserve_gib) * GiB
    v = verdict(phase_list, int(memory), allocator_margin, int(reserve))
    return Plan(
        s,
        device,
        dims.efsdp,
        state,
        act,
        t,
        phase_list,
        v,
        speed(s, groups, device, sharded.trained, state.muon_exchange),
        time.perf_counter() - start,
        trained=sharded.trained,
        rollout=rollout,
        vision=vision,
        eval_generation=evaluation,
        eval_drafts=drafts,
    )
