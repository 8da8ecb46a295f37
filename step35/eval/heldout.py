"""Held-out loss and bits per byte: the next-token loss of a model on data it did not train on, over the tokens
a run would train (chat: the assistant's tokens only; text: every token), with the language-model objective's
own loss (`Step35ForCausalLM.loss`, as validation computes val/loss).

Bits per byte: the summed loss in bits over the UTF-8 bytes those tokens stand for, so that models with other
tokenizers compare (a tokenizer with longer tokens has a higher loss per token for the same text). A token's
bytes are those of its text; the trained tokens of a row are decoded span by span (consecutive trained
tokens together: a byte-level BPE splits a character over tokens, whose bytes only make sense together).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from step35.model import Step35ForCausalLM
from step35.model.loss import IGNORE_INDEX


@dataclass
class HeldOut:
    """Sums over a held-out set, and the means they give."""

    loss_sum: float = 0.0  # nats, over the trained tokens
    tokens: int = 0
    bytes: int = 0
    batches: int = 0

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)

    @property
    def bits_per_byte(self) -> float:
        return self.loss_sum / math.log(2) / max(self.bytes, 1)

    def as_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "bits_per_byte": self.bits_per_byte, "tokens": self.tokens, "bytes": self.bytes,
                "ppl": math.exp(min(self.loss, 700.0))}  # fmt: skip


def trained_bytes(labels: torch.Tensor, decode: Callable[[list[int]], str]) -> int:
    """The UTF-8 bytes of the trained labels [B, S] (-100: not trained), decoded span by span."""
    total = 0
    for row in labels.tolist():
        span: list[int] = []
        for token in row + [IGNORE_INDEX]:
            if token != IGNORE_INDEX:
                span.append(token)
            elif span:
                total += len(decode(span).encode("utf-8"))
                span = []
    return total


@torch.no_grad()
def heldout_loss(
    model: Step35ForCausalLM,
    batches: Iterable[dict],
    decode: Callable[[list[int]], str],
    *,
    loss_chunk_size: int = 1024,
    limit: int | None = None,
) -> HeldOut:
    """The loss of `model` over the language-model batches `batches` (input_ids [B, S + 1], optional labels
    [B, S] and position_ids [B, S]: the data module's batches), at most `limit` of them."""
    result = HeldOut()
    device = model.lm_head.weight.device
    for index, batch in enumerate(batches):
        if limit is not None and index >= limit:
            break
        tokens = batch["input_ids"].to(device)
        labels = batch.get("labels")
        labels = tokens[:, 1:] if labels is None else labels.to(device)
        positions = batch.get("position_ids")
        out = model.loss(
            tokens[:, :-1],
            labels,
            loss_chunk_size=loss_chunk_size,
            position_ids=None if positions is None else positions.to(device),
        )
        result.loss_sum += float(out.lm_sum)
        result.tokens += int(out.num_tokens)
        result.bytes += trained_bytes(labels.cpu(), decode)
        result.batches += 1
    return result
