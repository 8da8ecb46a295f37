"""How fast the run could go: model FLOPs per token, the bytes each rank moves per optimizer step
(expert all-to-all, FSDP all-gather and reduce-scatter, the context-parallel K/V exchange), and an upper bound on MFU from the device's
peak and its link bandwidths. Balanced expert routing is assumed; kernels are taken to run at peak. For an
objective that generates (online RL) these are the training forward and backward's, on its packed rows: the
rollouts' decoding, one token per forward, is not in them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from step35.flops import attention_flops_per_token, training_flops_per_token
from step35.plan.context import communication_bytes
from step35.plan.devices import Device
from step35.plan.lora import VISION_KINDS, Trained
from step35.plan.settings import RunSettings
from step35.plan.state import FsdpGroup


@dataclass
class Speed:
    flops_per_token: float  # model FLOPs (6N + attention), the MFU numerator
    hardware_flops_per_token: float  # plus what activation checkpointing recomputes
    tokens_per_rank_step: int
    all_to_all_bytes: float  # per rank per optimizer step, sent (the same received)
    fsdp_gather_bytes: float  # per rank per step, received by all-gathers
    fsdp_reduce_bytes: float  # per rank per step, sent by reduce-scatters
    intra_node_seconds: float
    inter_node_seconds: float
    compute_seconds: float  # hardware FLOPs at peak
    step_seconds_overlapped: float  # max(compute, intra, inter): links and compute fully overlapped
    step_seconds_serial: float  # compute + communication, nothing overlapped
    mfu_bound: float
    mfu_serial: float
    tokens_per_second_per_device: float
    context_bytes: float = 0.0  # per rank per step, received by the cp K/V all-gathers, reduce-scatters and halos
    muon_bytes: float = 0.0  # per rank per step, sent by Muon's whole-matrix exchange (fp32, there and back)


def _bytes(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype).element_size()


def adapter_params_per_token(s: RunSettings, trained: list[Trained]) -> float:
    """Adapter parameters one token passes through in a LoRA run (a routed expert's adapters for top-k
    of the experts; MTP layers only when they run). Each costs 2 FLOPs forward and 4 backward, while
    the frozen base's matmuls skip their weight gradients (4 of their 6 FLOPs per parameter remain). The vision
    adapters run per image, not per token: not counted (nor is the vision encoder's compute)."""
    cfg = s.model_config
    mtp = s.num_mtp_layers if s.train_mtp else 0
    active = 0.0
    for t in trained:
        if not t.adapter or t.kind in VISION_KINDS or (t.layer is not None and t.layer >= cfg.num_hidden_layers + mtp):
            continue  # full targets are in the base count; MTP layers that do not run
        active += t.numel * (cfg.moe_top_k / cfg.moe_num_experts if t.expert else 1.0)
    return active


@dataclass
class _Links:
    """Seconds the links take per optimizer step, within a node and between nodes."""

    intra: float = 0.0
    inter: float = 0.0

    def add(self, sent: float, group: int, devices_per_node: int, device: Device) -> None:
        """`sent` bytes within a group of `group` consecutive ranks: the share of its peers on other nodes
        over the inter-node link, the rest within the node."""
        remote = max(0, group - devices_per_node) / (group - 1)
        self.inter += sent * remote / (device.inter_node_gbps * 1e9)
        self.intra += sent * (1 - remote) / (device.intra_node_gbps * 1e9)


def flops_per_token(s: RunSettings, trained: list[Trained]) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token: 6N + attention, LoRA's adapters instead of the base's weight
    gradients, plus what activation checkpointing recomputes and the objective's forwards without gradients."""
    cfg = s.model_config
    mtp = s.num_mtp_layers if s.train_mtp else 0
    fpt = training_flops_per_token(cfg, s.row_tokens, mtp)
    attention = attention_flops_per_token(cfg, s.row_tokens, mtp)
    forward = fpt / 3
    if s.lora is not None:
        adapters = adapter_params_per_token(s, list(trained))
        fpt = attention + (fpt - attention) * 4 / 6 + 6 * adapters
        forward += 2 * adapters
    # The objective's forwards without gradients (DPO's reference) run on the hardware, not in the model FLOPs.
    extra = s.objective_needs.extra_forwards * forward
    if s.activation_checkpointing == "full":  # the blocks' forward once more (all but the lm_head)
        return fpt, fpt + forward - 2 * cfg.vocab_size * cfg.hidden_size + extra
    if s.activation_checkpointing == "selective":  # attention kernels outside the saved set recompute
        return fpt, fpt + attention / 3 + extra
    return fpt, fpt + extra


def all_to_all_bytes(s: RunSettings) -> float:
    """Expert all-to-all per rank per step: each MoE layer sends its routed rows away and back in forward,
    twice more in backward, and once more each way when full checkpointing replays the forward (selective
    keeps the all-to-all results, so its replay communicates nothing) or the objective runs a forward
    without gradients (DPO's reference)."""
    cfg, ep = s.model_config, s.expert_parallel_size
    if not cfg.use_moe or ep == 1:
        return 0.0
    per_call = s.tokens_per_rank * cfg.moe_top_k * cfg.hidden_size * _bytes(s.compute_dtype) * (ep - 1) / ep
    calls = 4 + (2 if s.activation_checkpointing == "full" else 0) + 2 * s.objective_needs.extra_forwards
    return per_call * calls * len(cfg.moe_layer_ids) * s.accumulate_grad_batches


def fsdp_bytes(s: RunSettings, groups: list[FsdpGroup]) -> tuple[float, float]:
    """(all-gathered, reduce-scattered) bytes per rank per step of the FSDP groups that run; each of the
    objective's forwards without gradients gathers every group once more (the reference copy, sharded as
    the policy, or the policy with its adapters off)."""
    a, r = _bytes(s.compute_dtype), _bytes(s.reduce_dtype or s.compute_dtype)
    gather = reduce = 0.0
    for g in groups:
        if not g.runs or g.ranks == 1:
            continue
        share = (g.ranks - 1) / g.ranks
        times = (2 if (s.reshard_after_forward and g.name != "root") else 1) + s.objective_needs.extra_forwards
        gather += g.unsharded_numel * a * share * times * s.accumulate_grad_batches
        reduce += g.grad_numel * r * share * s.accumulate_grad_batches  # LoRA: adapters and full targets only
    return gather, reduce


def speed(
    s: RunSettings, groups: list[FsdpGroup], device: Device, trained: list[Trained] = (), muon_bytes: float = 0.0
) -> Speed:
    """`trained`: the LoRA run's trained tensors (planner.sharded_state), empty for a full fine-tune;
    `muon_bytes`: what the optimizer's exchange sends per rank per step (RankState.muon_exchange), charged
    to the FSDP links once per optimizer step (not per micro-batch)."""
    cfg = s.model_config
    fpt, hw = flops_per_token(s, trained)
    links = _Links()
    a2a = all_to_all_bytes(s)
    if a2a:
        links.add(a2a, s.expert_parallel_size, s.devices_per_node, device)  # contiguous ranks
    # Context parallelism: the K/V exchange of every attention layer (plan/context.py), within the cp
    # group: cp consecutive ranks, on one node when cp <= devices per node.
    cp = s.context_parallel_size
    layers = [cfg.layer(i) for i in range(cfg.num_hidden_layers + (s.num_mtp_layers if s.train_mtp else 0))]
    replay = s.activation_checkpointing == "full"
    context = communication_bytes(
        cfg, layers, s.rows_per_micro_batch, s.row_tokens, cp, _bytes(s.compute_dtype), replay=replay
    )
    context *= s.accumulate_grad_batches
    if cp > 1:
        links.add(context, cp, s.devices_per_node, device)
    gather, reduce = fsdp_bytes(s, groups) if s.sharded else (0.0, 0.0)
    if s.sharded:
        link = device.inter_node_gbps if s.num_nodes > 1 else device.intra_node_gbps
        t = (gather + reduce + muon_bytes) / (link * 1e9)
        if s.num_nodes > 1:
            links.inter += t
        else:
            links.intra += t
    step_tokens = s.tokens_per_rank * s.accumulate_grad_batches
    compute = step_tokens * hw / (device.peak_tflops * 1e12)
    overlapped = max(compute, links.intra, links.inter)
    serial = compute + links.intra + links.inter
    useful = step_tokens * fpt / (device.peak_tflops * 1e12)
    return Speed(
        fpt,
        hw,
        step_tokens,
        a2a,
        gather,
        reduce,
        links.intra,
        links.inter,
        compute,
        overlapped,
        serial,
        useful / overlapped,
        useful / serial,
        step_tokens / overlapped,
        context,
        muon_bytes,
    )
