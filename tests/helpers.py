"""Shared tiny-model builders for the step35 tests (no reference math here: each test file writes
its own independent computation from the spec)."""

from __future__ import annotations

import copy

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


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, num_mtp_layers: int | None = None,
               **overrides) -> Step35ForCausalLM:
    """A randomised tiny Step-3.5 model (5 main layers + 1 MTP layer, every feature switched on)."""
    torch.manual_seed(seed)
    model = Step35ForCausalLM(tiny_config(**overrides), num_mtp_layers=num_mtp_layers)
    randomize_(model, seed)
    return model.to(dtype)


def state_numel(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict().values())
