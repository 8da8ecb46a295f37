"""Context parallelism: every sequence of a micro-batch split over the `cp` ranks of its group.

Split (load-balanced for causal attention, step35.kernels.sequence_split has its arithmetic): the S
tokens are cut in 2 cp chunks of c = S / (2 cp); cp rank r holds chunk r and chunk 2 cp - 1 - r, so
every rank has one cheap (early) and one expensive (late) chunk and the same attention work.

All ranks of a cp group read the same window from the data stream (they are one data-parallel
rank) and each takes its share here, before the first layer: no scatter is needed.

Attention, per layer (step35.kernels.masks.SequenceShard.keys decides which):
- full layers and sliding windows longer than a chunk: all-gather of K/V over the cp group (small
  under GQA; docs/parallelism.md has the bytes), backward reduce-scatters dK/dV to their owners;
- sliding windows of at most chunk + 1 keys: a halo exchange of the window - 1 keys that precede
  each local chunk, point to point with the neighbouring cp ranks, never the whole sequence.
MTP depth k: its shifted inputs and targets are built on the whole rows before the split
(Step35ForCausalLM.loss), so no token has to cross ranks. Loss sums and token counts are summed
over the cp group (`sum`), so the mean is that of one process holding the whole sequence.

Shape legend: B batch, S sequence, L = 2 c local tokens, H heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from step35.kernels.masks import SequenceShard
from step35.kernels.sequence_split import chunk_order, chunk_tokens, halo_fits, local_positions
from step35.parallel.mesh import ParallelConfigError, ParallelDims


class ContextParallel:
    """Installed on the model as `model.context_parallel` by `parallelize` when cp > 1; the model
    calls `split` once per loss, `take` on each whole-row tensor and `sum` on its loss sums and counts
    (it never sees a process group)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.peers = [dist.get_global_rank(group, i) for i in range(self.size)]
        self.world_size = dist.get_world_size()  # a refused sequence length names this world's valid cp sizes

    def split(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> SequenceShard:
        """The SequenceShard of rows [B, S] (the same rows on every rank of the cp group)."""
        S = input_ids.shape[1]
        ParallelDims(self.world_size, context_parallel_size=self.size).check_seq_len(S)  # as at setup
        positions = local_positions(S, self.size, self.rank, input_ids.device)
        doc_ids = torch.cumsum(position_ids == 0, dim=1) if position_ids is not None else None  # as DocumentMask
        return SequenceShard(positions, S, chunk_tokens(S, self.size), doc_ids, gather=self.gather, halo=self.halo)

    @staticmethod
    def take(shard: SequenceShard, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [B, L] of whole rows x [B, S]."""
        return x[:, shard.positions]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the cp group; differentiable: every cp rank backpropagates the same whole-row loss,
        so a share's gradient is the sum of the ranks' upstream gradients (cp times one). That factor
        cancels FSDP's division by dp x cp: the reduced gradient is the mean over data-parallel groups."""
        if t.requires_grad:
            return _AllReduceSum.apply(t, self.group)
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., L, D] local -> [..., S, D] the whole sequence in global order."""
        return _GatherSequence.apply(x, self.group, self.size)

    def halo(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[..., L, D] local -> [..., 2 n, D]: the n tokens before the first local chunk, then the n
        before the second (zeros before the sequence's start, and before the last rank's second chunk,
        whose preceding keys are its own first chunk)."""
        c = x.shape[-2] // 2
        if not halo_fits(n, c):
            raise ParallelConfigError(
                f"a halo of {n} keys does not fit in one chunk of {c} tokens: a sliding "
                f"window longer than chunk + 1 = {c + 1} must gather the whole sequence"
            )
        return _Halo.apply(x, n, self)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Every cp rank's loss depends on every rank's part through this sum: the part's gradient is
        # the sum of all ranks' upstream gradients.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 then reorder chunks to global order; backward: reorder back and
    reduce-scatter (each rank gets the sum over ranks of the gradient of its own chunks)."""

    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        L = x.shape[-2]
        seq_first = x.movedim(-2, 0).contiguous()  # [L, ...]
        out = seq_first.new_empty((cp * L, *seq_first.shape[1:]))
        dist.all_gather_single(out, seq_first, group=group)
        order = chunk_order(cp)
        chunks = out.view(len(order), L // 2, *seq_first.shape[1:])
        ordered = chunks[order].reshape(cp * L, *seq_first.shape[1:])
        return ordered.movedim(0, -2)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        seq_first = grad.movedim(-2, 0)
        S = seq_first.shape[0]
        c = chunk_tokens(S, cp)
        order = chunk_order(cp)
        chunks = seq_first.reshape(len(order), c, *seq_first.shape[1:])
        inverse = [0] * len(order)
        for j, idx in enumerate(order):
            inverse[idx] = j
        rank_major = chunks[inverse].reshape(S, *seq_first.shape[1:]).contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce_scatter: sum everywhere, keep mine
            dist.all_reduce(rank_major, group=ctx.group)
            rank = dist.get_rank(ctx.group)
            mine = rank_major[rank * 2 * c : (rank + 1) * 2 * c]
        else:
            mine = rank_major.new_empty((2 * c, *seq_first.shape[1:]))
            dist.reduce_scatter_single(mine, rank_major, group=ctx.group)
        return mine.movedim(0, -2), None, None


class _Halo(torch.autograd.Function):
    """Point-to-point halo exchange along dim -2. Rank r's first chunk (r) is preceded by chunk r - 1,
    the first chunk of rank r - 1; its second chunk (2 cp - 1 - r) by chunk 2 cp - 2 - r, the second
    chunk of rank r + 1, or for r = cp - 1 its own first chunk (that halo is left empty: attention
    reads those keys in place, SequenceShard.keys). So each rank sends the tail of its first chunk
    to r + 1 and the tail of its second to r - 1, and receives from both."""

    @staticmethod
    def forward(ctx, x, n, cp_: ContextParallel):
        ctx.n, ctx.cp, ctx.x_shape = n, cp_, x.shape
        c = x.shape[-2] // 2
        tail_first = x[..., c - n : c, :].contiguous()
        tail_second = x[..., 2 * c - n :, :].contiguous()
        before_first = torch.zeros_like(tail_first)
        before_second = torch.zeros_like(tail_second)
        _swap_with_neighbours(
            cp_, to_next=tail_first, from_next=before_second, to_previous=tail_second, from_previous=before_first
        )
        return torch.cat([before_first, before_second], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        n, cp_ = ctx.n, ctx.cp
        grad_before_first = grad[..., :n, :].contiguous()
        grad_before_second = grad[..., n:, :].contiguous()
        grad_tail_first = torch.zeros_like(grad_before_first)  # from rank r + 1's first chunk's halo
        grad_tail_second = torch.zeros_like(grad_before_second)  # from rank r - 1's second chunk's halo
        # The forward's exchange run backwards: each gradient goes back to the rank its halo came from.
        _swap_with_neighbours(
            cp_,
            to_next=grad_before_second,
            from_next=grad_tail_first,
            to_previous=grad_before_first,
            from_previous=grad_tail_second,
        )
        grad_x = grad.new_zeros(ctx.x_shape)
        c = ctx.x_shape[-2] // 2
        grad_x[..., c - n : c, :] = grad_tail_first
        grad_x[..., 2 * c - n :, :] = grad_tail_second
        return grad_x, None, None


def _swap_with_neighbours(
    cp_: ContextParallel,
    to_next: torch.Tensor,
    from_next: torch.Tensor,
    to_previous: torch.Tensor,
    from_previous: torch.Tensor,
) -> None:
    """Send to / receive from ranks r + 1 and r - 1 of the cp group in one batch (the ends of the group
    have one neighbour; a receive buffer without a sender keeps its contents)."""
    r, ops = cp_.rank, []
    if r + 1 < cp_.size:
        ops += [
            dist.P2POp(dist.isend, to_next, cp_.peers[r + 1], cp_.group),
            dist.P2POp(dist.irecv, from_next, cp_.peers[r + 1], cp_.group),
        ]
    if r > 0:
        ops += [
            dist.P2POp(dist.isend, to_previous, cp_.peers[r - 1], cp_.group),
            dist.P2POp(dist.irecv, from_previous, cp_.peers[r - 1], cp_.group),
        ]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
