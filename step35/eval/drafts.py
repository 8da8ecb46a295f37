"""MTP draft acceptance over held-out batches: for each MTP depth k, how often its top-1 draft at position t
equals the token the main head emits greedily at position t + k (a proxy for speculative decoding's acceptance;
metrics.mtp_acceptance counts one batch). Counted at the positions whose next token is trained (chat: the
assistant's tokens), in eval mode, without gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from step35.eval.metrics import mtp_acceptance
from step35.model import Step35ForCausalLM


@torch.no_grad()
def draft_acceptance(
    model: Step35ForCausalLM,
    batches: Iterable[dict],
    limit: int | None = None,
    sum_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """{"depth1": rate, ..., "depths": D} over at most `limit` batches (input_ids [B, S + 1], optional labels
    and position_ids); {"depths": 0} for a model built without MTP layers. `sum_counts`, when given, sums the
    [D, 2] (accepted, total) counts over the ranks that share the measurement (each measured its own batches);
    every one of them must call it."""
    if model.num_mtp_layers == 0:
        return {"depths": 0}
    device = model.lm_head.weight.device
    counts = torch.zeros(model.num_mtp_layers, 2, dtype=torch.int64, device=device)
    training = model.training
    model.eval()
    try:
        for index, batch in enumerate(batches):
            if limit is not None and index >= limit:
                break
            positions = batch.get("position_ids")
            main, drafts = model.draft_logits(
                batch["input_ids"][:, :-1].to(device), None if positions is None else positions.to(device)
            )
            labels = batch.get("labels")
            valid = None if labels is None else (labels != -100).to(device)
            for count in mtp_acceptance(main, drafts, valid):
                counts[count.depth - 1] += torch.tensor([count.accepted, count.total], device=device)
    finally:
        model.train(training)
    if sum_counts is not None:
        counts = sum_counts(counts)
    rates = {f"depth{d}": a / max(n, 1) for d, (a, n) in enumerate(counts.tolist(), start=1)}
    return rates | {"depths": model.num_mtp_layers}
