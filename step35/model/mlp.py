"""SwiGLU feed-forward with Step-3.5's optional clamp (docs/architecture.md §2.7, §2.8), dense or as the shared expert."""

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """min(SiLU(gate), L) * clip(up, -L, L); plain SiLU(gate) * up when L == 0."""
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return act * up


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float = 0.0):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
