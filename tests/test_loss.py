"""chunked_cross_entropy against F.cross_entropy on the full logits (docs/architecture.md §2.11): value, token
count and gradients w.r.t. the hidden states and the output matrix.

Tolerances: fp32 1e-5 (relative and absolute); bf16 inputs: the reference is computed in fp32
from the same bf16 values, loss within 1e-2 relative (bf16 logits matmul in the chunked path),
gradients within 2e-2 absolute / 2e-2 relative (bf16 output rounding, 2^-8 relative, plus bf16
logit products accumulated over the vocabulary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from step35.model.loss import IGNORE_INDEX, chunked_cross_entropy

N, H, V = 13, 16, 50
TOL32 = dict(atol=1e-5, rtol=1e-5)


def _inputs(dtype=torch.float32, seed=0, ignore=(2, 3, 11)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[list(ignore)] = IGNORE_INDEX
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, h, w


@pytest.mark.parametrize("chunk", [1, 7, N, N + 50])
def test_matches_full_cross_entropy_fp32(chunk):
    hidden, weight, labels = _inputs()
    total, count = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    ref, h, w = _reference(hidden, weight, labels)
    assert total.dtype == torch.float32 and total.shape == ()
    torch.testing.assert_close(total, ref.detach(), **TOL32)
    assert int(count) == N - 3
    g = 1.7  # a non-unit upstream gradient (e.g. 1 / count, a loss weight)
    (total * g).backward()
    (ref * g).backward()
    torch.testing.assert_close(hidden.grad, h.grad, **TOL32)
    torch.testing.assert_close(weight.grad, w.grad, **TOL32)
    assert hidden.grad[[2, 3, 11]].abs().sum() == 0  # ignored rows get no gradient


@pytest.mark.parametrize("chunk", [1, 7, N + 50])
def test_matches_full_cross_entropy_bf16(chunk):
    hidden, weight, labels = _inputs(torch.bfloat16, seed=1)
    total, count = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    ref, h, w = _reference(hidden, weight, labels)
    assert total.dtype == torch.float32 and int(count) == N - 3
    torch.testing.assert_close(total, ref.detach(), rtol=1e-2, atol=1e-2)
    total.backward()
    ref.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad.float(), h.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(weight.grad.float(), w.grad, atol=2e-2, rtol=2e-2)


def test_batched_shape_and_mean():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 7, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (2, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    total, count = chunked_cross_entropy(hidden, weight, labels, chunk_size=4)
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(total / count, want, **TOL32)
    assert int(count) == 14 - 3
    (total / count).backward()
    h_grad, w_grad = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want.backward()
    torch.testing.assert_close(h_grad, hidden.grad, **TOL32)
    torch.testing.assert_close(w_grad, weight.grad, **TOL32)


def test_all_ignored():
    hidden, weight, labels = _inputs(ignore=range(N))
    total, count = chunked_cross_entropy(hidden, weight, labels, chunk_size=5)
    assert total.item() == 0.0 and int(count) == 0
    total.backward()
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_only_hidden_needs_grad():
    hidden, weight, labels = _inputs(seed=3)
    weight = weight.detach()
    total, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=4)
    total.backward()
    ref, h, _ = _reference(hidden, weight, labels)
    ref.backward()
    torch.testing.assert_close(hidden.grad, h.grad, **TOL32)


def test_label_count_mismatch_raises():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(hidden, weight, labels[:-1])
