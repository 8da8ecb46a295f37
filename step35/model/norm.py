"""RMSNorm, zero-centred as in Step-3.5: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, zero_centered: bool = True):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        # Stored w is "gamma - 1" when zero-centred, so an identity norm holds zeros.
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        return (y * scale).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)
