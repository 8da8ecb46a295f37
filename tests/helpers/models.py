"""Configs and tiny models: the one tiny config dict every test starts from (the `tiny` preset, released
layout) and the Flash one, a randomised tiny model whose every feature bites, and the one hand computation of
RoPE inverse frequencies with llama3 scaling (docs/architecture.md §2.4-2.5), which the model tests and the
reference forward share. Other reference math stays in the test that needs it, written from docs/architecture.md."""

from __future__ import annotations

import copy
import math

import torch

from step35.config import PRESETS, Step35Config
from step35.model import Step35ForCausalLM


def tiny_config_dict(**overrides) -> dict:
    """The `tiny` preset's config dict (released layout), with top-level keys replaced."""
    raw = PRESETS["tiny"]()
    raw.update(copy.deepcopy(overrides))
    return raw


def tiny_config(**overrides) -> Step35Config:
    return Step35Config.from_dict(tiny_config_dict(**overrides))


def flash_config_dict() -> dict:
    return PRESETS["flash-196b"]()


def hand_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """Inverse frequency of each rotary pair, theta^(-2j/r) (docs/architecture.md §2.4 step 3), then
    llama3 scaling (§2.5) when `scaling` is given; one pair at a time in Python floats (float64)."""
    inv = [theta ** (-2.0 * j / rotary_dim) for j in range(rotary_dim // 2)]
    if scaling is None:
        return inv
    factor, l_orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    out = []
    for f in inv:
        wavelength = 2 * math.pi / f
        if wavelength < l_orig / high:  # high frequencies: unchanged
            out.append(f)
        elif wavelength > l_orig / low:  # low frequencies: divided by the factor
            out.append(f / factor)
        else:  # in between: interpolated
            s = (l_orig / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return out


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Fill every state-dict tensor with random values so that each feature bites: norm weights
    away from 0 (so 1 + w matters), router bias non-zero (so it changes the chosen experts),
    projections large enough that activations are O(1)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight"):
            values = torch.rand(t.shape, generator=g) - 0.5  # w in [-0.5, 0.5): scale 1 + w
        elif name.endswith("router_bias"):
            values = torch.randn(t.shape, generator=g) * 0.2
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(t.shape, generator=g)
        else:
            values = torch.randn(t.shape, generator=g) * std
        t.copy_(values.to(t.dtype))
    return model


def tiny_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, num_mtp_layers: int | None = None, **overrides
) -> Step35ForCausalLM:
    """A randomised tiny Step-3.5 model (5 main layers + 1 MTP layer, every feature switched on)."""
    torch.manual_seed(seed)
    model = Step35ForCausalLM(tiny_config(**overrides), num_mtp_layers=num_mtp_layers)
    randomize_(model, seed)
    return model.to(dtype)


def state_numel(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict().values())
