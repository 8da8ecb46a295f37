"""Step-3.5 mixture of experts (spec 2.9): fp32 sigmoid router with a selection-only bias, top-k
weights from unbiased scores renormalised and scaled, routed SwiGLU experts stacked [E, out, in]
and computed through one grouped GEMM per projection.

The shared expert is a sibling module of the layer (`share_expert.*`), not part of this one; the
decoder layer adds the two. Expert parallelism plugs in through `dispatcher` (see
step35/parallel): this file knows nothing of process groups.

Shape legend: T tokens, H hidden, E experts, K top-k, N = T*K routed rows, I expert width.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from step35 import kernels
from step35.model.mlp import clamped_swiglu


class ExpertWeight(nn.Module):
    """One stacked projection of all experts, nn.Linear layout per expert: weight [E, out, in]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, in] rows sorted by expert, counts: [E_held] rows per expert held here -> [N, out].

        Under expert parallelism this module holds a slice of the experts (see kernels.grouped_mm)."""
        return kernels.grouped_mm(x, self.weight, counts)


def expert_swiglu(moe: "MoE", x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Routed experts on rows sorted by expert. x: [N, H]; counts: [E_held] -> [N, H]."""
    hidden = clamped_swiglu(moe.gate_proj(x, counts), moe.up_proj(x, counts), moe.limit)  # [N, I]
    return moe.down_proj(hidden, counts)


class ExpertDispatcher(Protocol):
    """Runs the routed experts on rows sorted by global expert id and returns their outputs in the
    same order. The default runs every expert locally; expert parallelism swaps in an all-to-all."""

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, moe: "MoE") -> torch.Tensor: ...


def local_dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, moe: "MoE") -> torch.Tensor:
    return expert_swiglu(moe, x_sorted, counts)


def in_backward_recompute() -> bool:
    """True while autograd's engine is running, i.e. when activation checkpointing replays a forward."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 limit: float = 0.0, scaling_factor: float = 3.0, renormalize: bool = True,
                 use_bias: bool = True, fp32_router: bool = True):
        super().__init__()
        self.num_experts, self.top_k, self.limit = num_experts, top_k, limit
        self.scaling_factor, self.renormalize, self.fp32_router = scaling_factor, renormalize, fp32_router
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.gate_proj = ExpertWeight(num_experts, hidden_size, intermediate_size)
        self.up_proj = ExpertWeight(num_experts, hidden_size, intermediate_size)
        self.down_proj = ExpertWeight(num_experts, intermediate_size, hidden_size)
        # Selection-only bias: a buffer, so no optimizer or FSDP shard ever touches it; kept in
        # fp32 whatever the module is cast to (see _apply). Updated by load balancing, not by grads.
        self.register_buffer("router_bias", torch.zeros(num_experts, dtype=torch.float32) if use_bias else None)
        # Tokens routed to each expert since the last reset, counted in training forwards only
        # (not in eval, not again when activation checkpointing recomputes). Readers reset it.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.dispatcher: ExpertDispatcher = local_dispatch

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] -> scores [T, E] fp32, expert ids [T, K], weights [T, K] fp32."""
        if self.fp32_router:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x).float()
        scores = torch.sigmoid(logits)  # [T, E]
        choice = scores + self.router_bias if self.router_bias is not None else scores
        expert_ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, K]
        weights = scores.gather(-1, expert_ids)  # unbiased scores of the chosen experts
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, expert_ids, weights * self.scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        _, expert_ids, weights = self.route(x)
        flat_ids = expert_ids.reshape(-1)  # [N]
        order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert
        token_of_row = order // self.top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts)  # [E]
        if self.training and not in_backward_recompute():
            self.tokens_per_expert += counts.detach()
        y = self.dispatcher(x[token_of_row], counts, self)  # [N, H]
        y = (y.float() * weights.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of_row, y)
        return out.view(shape)

    def _apply(self, fn: Callable, recurse: bool = True):
        # Module casts (model.to(bfloat16), Lightning's bf16-true) must not round the fp32 router
        # bias: keep its values and dtype, follow only the device change.
        bias = self.router_bias
        super()._apply(fn, recurse)
        if bias is not None and self.router_bias.dtype != torch.float32:
            moved = self.router_bias
            self.router_bias = (torch.empty_like(bias, device=moved.device) if bias.is_meta
                                else bias.to(moved.device))
        return self
