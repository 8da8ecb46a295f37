"""RMSNorm, zero-centred as in Step-3.5: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32.

The autograd function keeps only the input and the inverse RMS (one fp32 value per row) for
backward; the default autograd of the same ops would keep the fp32 normalised rows as well.

Shape legend: x [..., C] normalised over its last dim C (H hidden for the layer norms, D head dim
for the q/k norms), weight [C]; the inverse RMS kept for backward is [..., 1] fp32.
"""

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        y = x32 * rstd
        scale = weight.float() + 1.0 if zero_centered else weight.float()
        ctx.save_for_backward(x, rstd, weight)
        ctx.zero_centered = zero_centered
        return (y * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        g = grad.float()
        xhat = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        scale = weight.float() + 1.0 if ctx.zero_centered else weight.float()
        gs = g * scale
        # d/dx of x * r(x): r * (gs - xhat * mean(gs * xhat)), r = rsqrt(mean(x^2) + eps); in place on
        # this function's own temporaries (fresh allocations are what costs on CPU)
        dot = (gs * xhat).mean(-1, keepdim=True)
        grad_x = gs.sub_(xhat.mul_(dot)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _RMSNormFunction.apply(x, weight, eps, zero_centered)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, zero_centered: bool = True):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        # Stored w is "gamma - 1" when zero-centred, so an identity norm holds zeros.
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)
