"""Cross-entropy over a large vocabulary without materialising all logits at once.

16K tokens x 128,896 vocab in fp32 would be 8 GB; here logits exist for `chunk_size` tokens at a
time, in the forward and again (recomputed) in the backward.

Shape legend: N tokens (B x S flattened), H hidden, V vocabulary, n <= chunk_size rows of one
chunk; hidden [N, H], weight [V, H], labels [N], logits of one chunk [n, V] fp32.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, ignore_index: int):
        # hidden: [N, H]; weight: [V, H]; labels: [N] -> summed loss over non-ignored tokens (fp32)
        total = hidden.new_zeros((), dtype=torch.float32)
        w = weight.to(hidden.dtype)  # one compute dtype (under autocast hidden is bf16, the weight fp32)
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            logits = (h @ w.T).float()  # [n, V]
            valid = y != ignore_index
            target = logits.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
            total += ((torch.logsumexp(logits, dim=-1) - target) * valid).sum()
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            h, y = hidden[start : start + ctx.chunk_size], labels[start : start + ctx.chunk_size]
            logits = (h @ w.T).float()
            valid = y != ctx.ignore_index
            grad_logits = torch.softmax(logits, dim=-1)  # d(lse - target)/d logits = softmax - onehot
            grad_logits.scatter_add_(1, y.clamp(min=0)[:, None], -torch.ones_like(logits[:, :1]))
            grad_logits *= (valid.float() * grad_total)[:, None]
            if grad_hidden is not None:
                grad_hidden[start : start + ctx.chunk_size] = grad_logits.to(w.dtype) @ w
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of counted tokens.

    hidden: [..., H] final (normed) hidden states; weight: [V, H] output matrix; labels: [...] ids,
    `ignore_index` where no loss is taken. Equal to F.cross_entropy(hidden @ weight.T, labels,
    reduction="sum") without holding more than `chunk_size` rows of logits.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels hold {labels.shape[0]} tokens but hidden states hold {hidden.shape[0]}")
    total = _ChunkedCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index)
    return total, (labels != ignore_index).sum()


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, ignore_index: int):
        # hidden: [N, H]; weight: [V, H]; labels: [N] -> log softmax(logits)[label] per token [N] fp32 (0 where
        # ignored); fp64 for fp64 hidden states (a float64 model, as the tests' reference runs)
        acc = _accumulation_dtype(hidden)
        out = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            logits = (h @ w.T).to(acc)  # [n, V]
            target = logits.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
            out[start : start + chunk_size] = (target - torch.logsumexp(logits, dim=-1)) * (y != ignore_index)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # grad_out [N]: d(logp_i)/d logits_i = onehot(label_i) - softmax(logits_i), scaled by grad_out[i].
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = _accumulation_dtype(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            h, y = hidden[start : start + ctx.chunk_size], labels[start : start + ctx.chunk_size]
            logits = (h @ w.T).to(acc)
            scale = grad_out[start : start + ctx.chunk_size].to(acc) * (y != ctx.ignore_index)
            grad_logits = torch.softmax(logits, dim=-1).neg_()
            grad_logits.scatter_add_(1, y.clamp(min=0)[:, None], torch.ones_like(logits[:, :1]))
            grad_logits *= scale[:, None]
            if grad_hidden is not None:
                grad_hidden[start : start + ctx.chunk_size] = grad_logits.to(w.dtype) @ w
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.to(acc)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


def _accumulation_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token log-probability of each label, fp32 (fp64 for fp64 `hidden`) of labels' shape, 0 where the label is `ignore_index`.

    hidden: [..., H] final (normed) hidden states; weight: [V, H]; labels: [...]. Equal to
    log_softmax(hidden @ weight.T)[label] with at most `chunk_size` rows of logits at a time (forward
    and the recomputing backward), as chunked_cross_entropy."""
    shape = labels.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels hold {labels.shape[0]} tokens but hidden states hold {hidden.shape[0]}")
    return _ChunkedTokenLogprobs.apply(hidden, weight, labels, chunk_size, ignore_index).reshape(shape)
