"""Rotary position embedding: partial (first r dims of a head), rotate-half convention, with the
llama3 frequency scaling used on Step-3.5's full-attention layers (docs/architecture.md §2.4 step 3 and §2.5).

Shape legend: B batch, S sequence, Hh heads, D head dim, r rotated dims (r <= D, even); tables
cos/sin [S, r] (one sequence of positions) or [B, 1, S, r] (positions per row: packed documents).
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies theta^(-2j/r), llama3-scaled when `scaling` is given."""
    # device="cpu" explicitly: the model keeps these as plain CPU tensors and is often built under
    # `with torch.device("meta")` (build_model's default), which would otherwise make them data-less.
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim))
    if scaling is not None:
        inv = _llama3_scale(inv, scaling)
    return inv.float()


def _llama3_scale(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelength > original / low, inv / factor, interpolated)  # long waves: divided
    return torch.where(wavelength < original / high, inv, out)  # short waves: unchanged


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., rotary_dim] for positions [...] ([S], or [B, S] per sequence), each
    frequency repeated for both halves, fp32."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., r/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, r]
    return angles.cos(), angles.sin()


class _Rotary(torch.autograd.Function):
    """The rotation is linear in x: backward rotates the gradient back and needs only cos and sin
    (shared by every layer), where default autograd would keep fp32 copies of the rotated q and k."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = cos.shape[-1]
        rot, passthrough = x[..., :r], x[..., r:]
        rot32 = rot.float()
        first, second = rot32[..., : r // 2], rot32[..., r // 2 :]
        rotated = torch.cat([-second, first], dim=-1)
        out = (rot32 * cos + rotated * sin).to(x.dtype)
        ctx.save_for_backward(cos, sin)
        return torch.cat([out, passthrough], dim=-1) if passthrough.shape[-1] else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        r = cos.shape[-1]
        g = grad[..., :r].float()
        via_sin = g * sin  # gradient reaching `rotated` = [-second, first]
        grad_rot = (g * cos + torch.cat([via_sin[..., r // 2 :], -via_sin[..., : r // 2]], dim=-1)).to(grad.dtype)
        grad_x = torch.cat([grad_rot, grad[..., r:]], dim=-1) if grad.shape[-1] > r else grad_rot
        return grad_x, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first r = cos.shape[-1] dims of x [B, Hh, S, D]; dims r..D pass through.

    Within the rotated slice, dim i pairs with dim i + r/2 (rotate-half, not interleaved).
    cos, sin: [S, r], or [B, 1, S, r] when positions differ per sequence (document masking)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rotary cos/sin tables are constants; got tables that require grad")
    return _Rotary.apply(x, cos, sin)
