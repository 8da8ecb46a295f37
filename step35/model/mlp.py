"""SwiGLU feed-forward with Step-3.5's optional clamp (docs/architecture.md §2.7, §2.8), dense or as the shared expert.

`clamped_swiglu` is an autograd function that keeps only its two inputs (and, for routed rows, their
routing weights) for backward and recomputes the activation there (a few elementwise ops), instead of the
three or four intermediate tensors (SiLU output, clamped copies) the default autograd would keep.

Shape legend: H hidden, I intermediate width (dense MLP, shared expert or one routed expert); any
leading dims (B, S or N routed rows) pass through.
"""

import torch
import torch.nn.functional as F
from torch import nn


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, limit: float, row_weight: torch.Tensor | None):
        ctx.save_for_backward(gate, up, row_weight)
        ctx.limit = limit
        act = F.silu(gate)
        if limit > 0:
            act = act.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        if row_weight is None:
            return act * up
        return ((act * up).float() * row_weight[:, None]).to(gate.dtype)  # the weight's product in fp32

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, row_weight = ctx.saved_tensors
        limit = ctx.limit
        g, gate32, up32 = grad.float(), gate.float(), up.float()
        act = F.silu(gate32)
        if limit > 0:
            up32 = up32.clamp(min=-limit, max=limit)
            over = act > limit
            act.clamp_(max=limit)
        grad_weight = None
        if row_weight is not None:
            if ctx.needs_input_grad[3]:  # d out / d w = the unweighted product, recomputed
                grad_weight = (g * act * up32).sum(-1).to(row_weight.dtype)
            g = g * row_weight[:, None]
        # silu_backward(t, gate) = t * SiLU'(gate), the kernel default autograd of F.silu uses
        grad_gate = torch.ops.aten.silu_backward(g * up32, gate32)
        if limit > 0:
            # clamp passes the gradient where its input lies inside [min, max], bounds included
            grad_gate.masked_fill_(over, 0)
        grad_up = act.mul_(g)
        if limit > 0:
            grad_up.masked_fill_(up.float().abs() > limit, 0)
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype), None, grad_weight


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, row_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """min(SiLU(gate), L) * clip(up, -L, L); plain SiLU(gate) * up when L == 0. With `row_weight` [rows] (the
    routing weights of routed rows, fp32) each row is scaled by its weight, so that the down projection's
    output is already weighted: the routing weight's gradient comes from the two inputs kept anyway, and
    nobody keeps the [rows, H] expert outputs for it (model/moe.py)."""
    return _ClampedSwiGLU.apply(gate, up, limit, row_weight)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float = 0.0):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
