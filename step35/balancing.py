"""Expert load balancing, core state of training: `ExpertCounter`, the one reader of the MoE layers'
`tokens_per_expert` buffers, and `update_router_bias`, the aux-loss-free bias update. The
LightningModule owns the counter and applies the update after each optimizer step; the expert-load
callback only reads the same counter, so that neither resets counts the other still needs.

Once per optimizer step the step's counts move out of the buffers into a window (device ops only:
no host sync, no collective). They are summed over ranks only when global numbers are needed:
- the router-bias update (rate > 0): every step, one all_reduce of the step's [layers, experts];
- the expert-load callback: at its interval, one all_reduce of the window (none when every step was
  already reduced for the bias update).
The buffers themselves count training forwards only (not eval, not activation-checkpoint replays).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from step35.model.moe import moe_layers
from step35.parallel.collectives import all_reduce_


class ExpertCounter:
    def __init__(self, model: nn.Module, reduce_every_step: bool = False):
        """
        Args:
            model: the model whose MoE layers are read (named as in the HF checkpoint).
            reduce_every_step: sum each step's counts over ranks in `end_step` (the bias update needs
                them); then the window is already global and `pop_window` needs no collective.
        """
        named = list(moe_layers(model))
        self.names = [name for name, _ in named]
        self.layers = [module for _, module in named]
        # "model.layers.3.moe" -> 3: the layer index of the checkpoint, used in metric names.
        self.layer_ids = [
            int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name + ".")) else i
            for i, name in enumerate(self.names)
        ]
        self.reduce_every_step = reduce_every_step
        self._window: torch.Tensor | None = None  # [L, E] int64; global if reduce_every_step, else this rank's
        self.window_steps = 0  # optimizer steps kept in the window

    def __len__(self) -> int:
        return len(self.layers)

    def _take(self) -> torch.Tensor:
        return torch.stack([moe.take_tokens_per_expert() for moe in self.layers])  # [L, E]

    def _add(self, counts: torch.Tensor) -> None:
        self._window = counts.clone() if self._window is None else self._window + counts

    def end_step(self, keep: bool = True) -> torch.Tensor | None:
        """Call on every rank once per optimizer step, after it: moves the step's counts (all its
        micro-batches) into the window; keep=False drops them (a skipped step; must agree on all
        ranks). With reduce_every_step returns the step's counts summed over ranks [L, E] (one
        all_reduce), else None."""
        if not self.layers:
            return None
        counts = self._take()
        if not keep:
            return None
        if self.reduce_every_step:
            all_reduce_(counts)
        self._add(counts)
        self.window_steps += 1
        return counts if self.reduce_every_step else None

    def pop_window(self) -> torch.Tensor | None:
        """Tokens routed to each expert since the last pop, summed over ranks [L, E] (int64, on the
        buffers' device), and a new window starts. Call on every rank: one all_reduce unless every
        step was already reduced. None without MoE layers."""
        if not self.layers:
            return None
        if not self.reduce_every_step:
            # Counts not yet moved by end_step (a module that never calls it leaves them all here).
            self._add(self._take())
            all_reduce_(self._window)
        window = self._window
        if window is None:  # no step kept since the last pop
            first = self.layers[0].tokens_per_expert
            window = torch.zeros((len(self.layers), first.numel()), dtype=first.dtype, device=first.device)
        self._window, self.window_steps = None, 0
        return window


@torch.no_grad()
def update_router_bias(layers: list, counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): b_e += rate * sign(mean load - load_e) for each layer,
    from global counts [L, E]. On the device, no host sync; identical on every rank (the biases are
    plain replicated buffers and the counts are already summed over ranks)."""
    load = counts.float()
    step = rate * torch.sign(load.mean(-1, keepdim=True) - load)  # [L, E]; 0 where a load equals the mean
    for moe, delta in zip(layers, step):
        moe.router_bias.add_(delta.to(moe.router_bias.device))
