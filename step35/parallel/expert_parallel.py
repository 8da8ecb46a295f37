"""Expert parallelism: routed experts sharded over the `ep` mesh dimension, tokens moved to the
rank that holds their expert and back with two uneven all-to-alls.

Shape legend: N rows routed from this rank (tokens x top-k), M rows received, H hidden,
E experts, El = E / ep experts held here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from step35.faults import phase
from step35.model.moe import MoE, expert_swiglu


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        with phase("expert all-to-all (forward)"):  # named by the hang watchdog
            dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        with phase("expert all-to-all (backward)"):
            dist.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, output_splits, input_splits, group)


class ExpertParallelDispatcher:
    """Runs the routed experts of one MoE layer across the `ep` group (see model.moe.ExpertDispatcher)."""

    def __init__(self, group, ep_size: int, num_experts: int):
        self.group, self.ep_size = group, ep_size
        self.local_experts = num_experts // ep_size

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, moe: MoE) -> torch.Tensor:
        ep, El = self.ep_size, self.local_experts
        send_counts = counts.view(ep, El)  # rows for [destination rank, its local expert]
        recv_counts = torch.empty_like(send_counts)  # rows from [source rank, my local expert]
        with phase("expert all-to-all (token counts)"):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            # Host sync (one per MoE layer): the split sizes of the all-to-all.
            send_splits = send_counts.sum(1).tolist()
            recv_splits = recv_counts.sum(1).tolist()
        x_recv = all_to_all(x_sorted, recv_splits, send_splits, self.group)  # [M, H] by (source, expert)
        expert_of_row = torch.repeat_interleave(
            torch.arange(El, device=counts.device).repeat(ep), recv_counts.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)  # regroup rows by local expert
        y_local = expert_swiglu(moe, x_recv[order], recv_counts.sum(0))
        y_recv = y_local[torch.argsort(order)]  # back to (source, expert) order
        return all_to_all(y_recv, send_splits, recv_splits, self.group)  # [N, H]


def shard_experts(moe: MoE, ep_mesh) -> None:
    """Make the stacked expert weights global-shape DTensors, Shard(0) over `ep`, and swap in the
    all-to-all dispatcher. Works on meta tensors (nothing is allocated or communicated)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for proj in (moe.gate_proj, moe.up_proj, moe.down_proj):
        weight = proj.weight
        proj.weight = nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)]),
                                   requires_grad=weight.requires_grad)
    moe.dispatcher = ExpertParallelDispatcher(ep_mesh.get_group(), ep_mesh.size(), moe.num_experts)
