"""A key/value cache for decoding: what `Step35ForCausalLM.step` keeps of the tokens it has seen.

Each layer keeps the keys and values (after q/k norm and RoPE) of the tokens seen so far; a
sliding-window layer keeps only its last `window - 1`, all that the next token can read. A step's
queries then attend to those and to the step's own keys (attention.py, `Attention.forward`).

Shape legend: B batch, Hkv key/value heads, T kept tokens, S tokens of one step, D head dim.
"""

from __future__ import annotations

import torch


class LayerKV:
    """One layer's keys and values [B, Hkv, T, D] and how many tokens it has seen."""

    def __init__(self, window: int | None):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.seen = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add a step's k, v [B, Hkv, S, D]; returns the keys and values the step reads (the kept
        ones, then the step's own) and the number of tokens seen before the step."""
        past = self.seen
        self.seen += k.shape[2]
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        keep = k.shape[2] if self.window is None else min(k.shape[2], self.window - 1)
        self.keys, self.values = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        return k, v, past


class KVCache:
    """Per-layer caches of one generation, created as layers ask for them; `length` tokens seen."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerKV] = {}
        self.length = 0

    def layer(self, layer_id: int, window: int | None) -> LayerKV:
        if layer_id not in self.layers:
            self.layers[layer_id] = LayerKV(window)
        return self.layers[layer_id]
