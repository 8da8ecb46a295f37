"""Rollout routing replay (R3): the experts each MoE layer chose for each token while a completion was generated,
recorded, then imposed on the training forward that computes the same tokens' log-probabilities.

Why: a mixture of experts is a discontinuous function of its router. Between the rollout (KV-cache decoding,
one token at a time, the weights of the rollout) and the training forward (whole rows, packed, split over
context-parallel ranks, the weights after some updates), a token near a top-k boundary can change experts; its
log-probability then jumps, and the importance ratio pi_train / pi_rollout measures the flip, not the policy.
Replaying the rollout's expert ids makes the two forwards the same function up to rounding; the routing
*weights* are still the live router's scores at those ids, so the router trains (model/moe.py `route`).

Two objects, passed down the layers as `routing` (Step35Model.forward), never module state, so that an
activation-checkpoint recompute in backward sees the same object as its forward:
- RouteRecorder: keeps every MoE layer's chosen ids of each forward, in order (the prefill, then each decoded
  token); `routes(batch)` joins them into [B, S, K] int16 per layer.
- RouteReplay: per MoE layer a [B, S, K] tensor of logical expert ids (int16; -1: nothing recorded for that
  token, e.g. padding: the live router chooses, and the token counts as a fallback). Each layer's routes are
  consumed exactly once per forward and once per recompute; a second use in one pass, a missing layer or a
  shape that does not match the tokens raises RouteReplayError naming the layer. In a forward (not in a
  recompute) it also counts how often the live router would have chosen the same experts anyway
  (`agreement`: same set of K ids) and the fallbacks, as tensors (no host sync).

Layers are named by their `layer_id` (the checkpoint's `model.layers.{i}`); shapes: B rows, S tokens, K top-k.
"""

from __future__ import annotations

import torch


def in_backward_recompute() -> bool:
    """True while autograd's engine is running, i.e. when activation checkpointing replays a forward."""
    return torch._C._current_graph_task_id() != -1


class RouteReplayError(RuntimeError):
    """Recorded routes that do not fit the forward replaying them: a bug in whoever built them."""


class LayerRoutes:
    """One MoE layer's handle on a RouteRecorder or RouteReplay (what `MoE.route` calls)."""

    def __init__(self, owner: RouteRecorder | RouteReplay, layer_id: int, tokens_shape: tuple[int, ...]):
        self.owner, self.layer_id, self.tokens_shape = owner, layer_id, tokens_shape

    def choose(self, live_ids: torch.Tensor) -> torch.Tensor:
        """live_ids [T, K] (the live router's top-k) -> the ids this layer uses [T, K]."""
        return self.owner.choose(self.layer_id, live_ids, self.tokens_shape)


class RouteRecorder:
    """Records the ids every MoE layer chose, forward after forward (decoding: the prompt, then each token)."""

    def __init__(self) -> None:
        self.chunks: dict[int, list[torch.Tensor]] = {}

    def layer(self, layer_id: int, tokens_shape: tuple[int, ...]) -> LayerRoutes:
        return LayerRoutes(self, layer_id, tokens_shape)

    def choose(self, layer_id: int, live_ids: torch.Tensor, tokens_shape: tuple[int, ...]) -> torch.Tensor:
        self.chunks.setdefault(layer_id, []).append(live_ids.to(torch.int16).view(*tokens_shape, -1))
        return live_ids

    def routes(self) -> dict[int, torch.Tensor]:
        """{layer_id: [B, S, K] int16}: each layer's chunks joined along the tokens, in the order recorded."""
        return {layer_id: torch.cat(chunks, dim=-2) for layer_id, chunks in self.chunks.items()}


class RouteReplay:
    """Imposes recorded routes {layer_id: [B, S, K]} (this module's docstring) on one forward (and its recompute).
    `impose=False` leaves the live router's choice and only counts the agreement (replay off, measured).
    `counted` [B, S] bool: the tokens the counts are over (None: all; padding, whose routes are -1 by design,
    is left out so that a fallback means a real token without a record)."""

    PASSES = ("forward", "recompute")

    def __init__(self, routes: dict[int, torch.Tensor], impose: bool = True, counted: torch.Tensor | None = None):
        self.routes, self.impose, self.counted = routes, impose, counted
        self.consumed = {p: dict.fromkeys(routes, 0) for p in self.PASSES}
        self.fallbacks: torch.Tensor | int = 0  # tokens x layers whose routes were -1 (forward only)
        self.agreed: torch.Tensor | int = 0  # token-layer routes the live router chose too (forward only)
        self.compared: torch.Tensor | int = 0  # token-layer routes replayed (forward only)

    def layer(self, layer_id: int, tokens_shape: tuple[int, ...]) -> LayerRoutes:
        return LayerRoutes(self, layer_id, tokens_shape)

    def choose(self, layer_id: int, live_ids: torch.Tensor, tokens_shape: tuple[int, ...]) -> torch.Tensor:
        phase = "recompute" if in_backward_recompute() else "forward"
        routes = self.routes.get(layer_id)
        if routes is None:
            raise RouteReplayError(
                f"MoE layer {layer_id}: no recorded routes to replay (recorded: {sorted(self.routes)})"
            )
        if self.consumed[phase][layer_id]:
            raise RouteReplayError(f"MoE layer {layer_id}: its recorded routes were used twice in one {phase}")
        expected = (*tokens_shape, live_ids.shape[-1])
        if tuple(routes.shape) != expected:
            raise RouteReplayError(
                f"MoE layer {layer_id}: recorded routes of shape {tuple(routes.shape)} for tokens of shape {expected}"
            )
        self.consumed[phase][layer_id] += 1
        replayed = routes.to(device=live_ids.device, dtype=live_ids.dtype).reshape(live_ids.shape)
        missing = (replayed < 0).any(-1, keepdim=True)  # [T, 1]: the live router chooses for these tokens
        if phase == "forward":
            with torch.no_grad():
                counted = self.counted.to(missing.device).reshape(-1, 1) if self.counted is not None else True
                same = (replayed.sort(-1).values == live_ids.sort(-1).values).all(-1, keepdim=True)
                self.agreed = self.agreed + (same & ~missing & counted).sum()
                self.compared = self.compared + (~missing & counted).sum()
                self.fallbacks = self.fallbacks + (missing & counted).sum()
        return torch.where(missing, live_ids, replayed) if self.impose else live_ids

    def check_forward(self) -> None:
        """Every recorded layer was replayed exactly once by the forward (call after it)."""
        self._check("forward")

    def check_recompute(self) -> None:
        """Every recorded layer was replayed exactly once by activation checkpointing's recompute."""
        self._check("recompute")

    def _check(self, phase: str) -> None:
        wrong = {layer_id: n for layer_id, n in self.consumed[phase].items() if n != 1}
        if wrong:
            said = ", ".join(f"layer {i}: {n} times" for i, n in sorted(wrong.items()))
            raise RouteReplayError(f"recorded routes not used exactly once in the {phase}: {said}")

    def taken(self, take) -> RouteReplay:
        """The same routes with `take` applied to each layer's [B, S, K] (this rank's tokens under context
        parallelism), as a fresh replay."""
        counted = take(self.counted) if self.counted is not None else None
        return RouteReplay({layer_id: take(r) for layer_id, r in self.routes.items()}, self.impose, counted)


Routing = RouteRecorder | RouteReplay
