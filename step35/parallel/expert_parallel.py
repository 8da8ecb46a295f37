"""Expert parallelism: routed experts sharded over the `ep` mesh dimension, tokens moved to the
rank that holds their expert and back with two uneven all-to-alls.

Shape legend: N rows routed from this rank (tokens x top-k), M rows received, H hidden,
E experts, El = E / ep experts held here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from step35.faults import phase
from step35.model.moe import MoE, expert_swiglu, in_backward_recompute


def all_to_all(x: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group) -> torch.Tensor:
    """all_to_all_single with uneven splits (None: equal), differentiable (backward sends gradients
    back the way rows came), as the functional collective: a plain op whose output selective
    activation checkpointing can keep (parallelize.py), where the in-place `dist.all_to_all_single`
    would have to be replayed. The one call of torch's `_c10d_functional` ops in step35 (parallelize's
    selective-checkpointing policy names them too)."""
    try:
        ops = torch.ops._c10d_functional
    except AttributeError as e:  # moved in a later torch: say where to look
        raise RuntimeError(
            f"torch {torch.__version__} lacks torch.ops._c10d_functional, whose all_to_all_single "
            "step35.parallel.expert_parallel.all_to_all calls; update that function"
        ) from e
    if output_splits is None or input_splits is None:
        n = dist.get_world_size(group)
        output_splits = input_splits = [x.shape[0] // n] * n
    with phase("expert all-to-all"):  # named by the hang watchdog (forward; a replay in backward keeps this name)
        return ops.wait_tensor(ops.all_to_all_single(x.contiguous(), output_splits, input_splits, group.group_name))


class ExpertParallelDispatcher:
    """Runs the routed experts of one MoE layer across the `ep` group (see model.moe.ExpertDispatcher).

    Host syncs: one per MoE layer and forward, reading the split sizes of the two all-to-alls (the
    kernels take them as host integers). When selective activation checkpointing replays the layer
    in backward, the count exchange and the row all-to-alls are not replayed (their outputs are kept,
    parallelize._save_matmuls) and the split sizes come from `_splits`, keyed by the kept counts'
    storage, so the replay has no collective and no host sync before the experts' backward."""

    def __init__(self, group, ep_size: int, num_experts: int):
        self.group, self.ep_size = group, ep_size
        self.local_experts = num_experts // ep_size
        self._splits: dict[StorageWeakRef, tuple[list[int], list[int]]] = {}
        self.host_syncs = 0  # split-size reads so far (tests count them)

    def __call__(
        self, x: torch.Tensor, token_of_row: torch.Tensor, counts: torch.Tensor, moe: MoE, row_weight: torch.Tensor
    ) -> torch.Tensor:
        """The rows and their routing weights go to the experts' ranks and come back weighted. Kept for backward:
        the rows each rank received (regrouped by expert; rebuilding them would take another all-to-all) and,
        as without EP, the gate and up outputs and the weights; not the outputs (the weight scales the SwiGLU)."""
        ep, El = self.ep_size, self.local_experts
        x_sorted = x[token_of_row]  # [N, H] by global expert (its gather keeps only the index)
        send_counts = counts.view(ep, El)  # rows for [destination rank, its local expert]
        # rows from [source rank, my local expert]
        recv_counts = all_to_all(send_counts.reshape(-1), None, None, self.group).view(ep, El)
        send_splits, recv_splits = self._split_sizes(send_counts, recv_counts)
        x_recv = all_to_all(x_sorted, recv_splits, send_splits, self.group)  # [M, H] by (source, expert)
        w_recv = all_to_all(row_weight[:, None], recv_splits, send_splits, self.group)[:, 0]  # [M] fp32
        expert_of_row = torch.repeat_interleave(
            torch.arange(El, device=counts.device).repeat(ep), recv_counts.reshape(-1), output_size=sum(recv_splits)
        )  # output_size given: no host sync for the length
        order = torch.argsort(expert_of_row, stable=True)  # regroup rows by local expert
        y_local = expert_swiglu(moe, x_recv[order], recv_counts.sum(0), w_recv[order])
        y_recv = y_local[torch.argsort(order)]  # back to (source, expert) order
        return all_to_all(y_recv, send_splits, recv_splits, self.group)  # [N, H]

    def _split_sizes(self, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        key = StorageWeakRef(recv_counts.untyped_storage())
        if in_backward_recompute() and key in self._splits:
            return self._splits.pop(key)  # the replay got the kept counts back: reuse their sizes
        # The one host sync of this layer: both split lists in one read.
        send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        self.host_syncs += 1
        if torch.is_grad_enabled() and not in_backward_recompute():
            for stale in [k for k in self._splits if k.expired()]:  # graphs freed without a replay
                del self._splits[stale]
            self._splits[key] = (send_splits, recv_splits)
        return send_splits, recv_splits


def shard_experts(moe: MoE, ep_mesh) -> None:
    """Make the stacked expert weights (and their LoRA adapters, [E, ...] too) global-shape DTensors,
    Shard(0) over `ep`, and swap in the all-to-all dispatcher. Works on meta tensors (nothing is
    allocated or communicated)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for proj in (moe.gate_proj, moe.up_proj, moe.down_proj):
        for name, param in list(proj.named_parameters(recurse=False)):  # weight, lora_A, lora_B
            setattr(
                proj,
                name,
                nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]), requires_grad=param.requires_grad),
            )
    moe.dispatcher = ExpertParallelDispatcher(ep_mesh.get_group(), ep_mesh.size(), moe.num_experts)
