"""The training loss over masked labels and packed documents: the mean over every trained token of
an optimizer step (all micro-batches, all data-parallel ranks), packed documents as if alone, plain
text unchanged bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from step35.model import IGNORE_INDEX
from step35.module import Step35LightningModule
from step35.training.objective import micro_batch_loss
from tests.helpers import make_trainer, tiny_model
from tests.runner import run_dist_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "global_batch_grads.py"

# Three documents packed into one window of S + 1 = 24 tokens; each has its last label masked (the
# border: the next document's first token), the first and last also their first two (a prompt).
DOC_LENGTHS = (9, 6, 9)
PROMPTS = (2, 0, 2)


def packed_window(vocab: int):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, vocab, (sum(DOC_LENGTHS),), generator=g)
    S = tokens.numel() - 1
    labels, positions, spans, start = tokens[1:].clone(), torch.zeros(S, dtype=torch.long), [], 0
    for length, prompt in zip(DOC_LENGTHS, PROMPTS):
        end = start + length  # the document holds tokens[start:end]
        positions[start : min(end, S)] = torch.arange(min(end, S) - start)
        labels[start : start + prompt] = IGNORE_INDEX
        if end <= S:
            labels[end - 1] = IGNORE_INDEX
        spans.append((start, end))
        start = end
    return tokens, labels, positions, spans


def alone(tokens, labels, span):
    """The document as its own one-row batch: input_ids its tokens at the window's input positions,
    labels the window's labels there (the border one masked; the window's last token is only a label)."""
    start, end = span
    return tokens[start : end + 1][None, :-1], labels[start : min(end, labels.numel())][None]


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


def assert_grads_close(a, b, rtol=1e-5):
    for x, y in zip(a, b):
        if x is None or y is None:  # a parameter the loss does not reach: then on both sides
            assert x is None and y is None
            continue
        scale = max(y.abs().max().item(), 1e-6)
        assert (x - y).abs().max().item() <= rtol * scale + 1e-7, (x - y).abs().max().item()


def test_packed_documents_train_as_if_alone():
    model = tiny_model()
    tokens, labels, positions, spans = packed_window(model.config.vocab_size)
    inputs = tokens[None, :-1]
    packed = model.loss(inputs, labels[None], mtp_loss_weight=1.0, position_ids=positions[None])
    per_token = F.cross_entropy(model(inputs, positions[None])[0], labels, reduction="none")
    lm, mtp, grad_sum = 0.0, 0.0, None
    for span in spans:
        ids, doc_labels = alone(tokens, labels, span)
        out = model.loss(ids, doc_labels, mtp_loss_weight=1.0)
        # Per token, the main head reads the same as when the document is alone.
        own = F.cross_entropy(model(ids)[0], doc_labels[0], reduction="none")
        torch.testing.assert_close(per_token[span[0] : span[0] + own.numel()], own, rtol=1e-5, atol=1e-5)
        # Only this document's labels in the packed window: same sums per depth, same gradient.
        only = torch.full_like(labels, IGNORE_INDEX)
        only[span[0] : span[0] + doc_labels.numel()] = doc_labels[0]
        isolated = model.loss(inputs, only[None], mtp_loss_weight=1.0, position_ids=positions[None])
        torch.testing.assert_close(isolated.lm_sum, out.lm_sum, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(isolated.mtp_sums[0], out.mtp_sums[0], rtol=1e-5, atol=1e-5)
        assert isolated.mtp_counts[0] == out.mtp_counts[0]
        mine = grads(model, out.lm_sum + out.mtp_sums[0])
        assert_grads_close(grads(model, isolated.lm_sum + isolated.mtp_sums[0]), mine)
        lm, mtp = lm + out.lm_sum.detach(), mtp + out.mtp_sums[0].detach()
        grad_sum = mine if grad_sum is None else [a if b is None else a + b for a, b in zip(grad_sum, mine)]
    # The whole window: the documents' sums, nothing more. Before MTP targets were masked across
    # documents, depth 1 also predicted the next document's first labels from this one.
    torch.testing.assert_close(packed.lm_sum, lm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.mtp_sums[0], mtp, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads(model, packed.lm_sum + packed.mtp_sums[0]), grad_sum)


def test_mtp_target_in_another_document_is_masked():
    # Depth 1 at position t predicts labels[t + 1]: counted only where t + 1 is in t's document.
    model = tiny_model()
    tokens = torch.randint(1, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])  # documents of 4, 3 and 1 tokens
    out = model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=1.0, position_ids=positions)
    assert out.mtp_counts[0].item() == 3 + 2 + 0  # t = 0..2 and 4..5; t = 3, 6 cross; t = 7 has none
    unpacked = model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=1.0)
    assert unpacked.mtp_counts[0].item() == 7


def test_plain_text_loss_and_gradients_bitwise_unchanged():
    # Without masked labels the micro-batch loss is the old per-micro-batch mean, bit for bit:
    # lm_loss + w * mean of the MTP means + aux (the model's LossOutput.loss is that old formula).
    model = tiny_model()
    tokens = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    kwargs = dict(mtp_loss_weight=0.3, moe_aux_loss_coef=0.01)
    old = model.loss(tokens[:, :-1], tokens[:, 1:], **kwargs)
    new_out = model.loss(tokens[:, :-1], tokens[:, 1:], **kwargs)
    new = micro_batch_loss(new_out, (3, 16), 0.3)
    assert torch.equal(new, old.loss)
    for a, b in zip(grads(model, new), grads(model, old.loss)):
        assert (a is None and b is None) or torch.equal(a, b)
    # The old formula by hand, from the means alone.
    by_hand = old.lm_loss + 0.3 * torch.stack(old.mtp_losses).mean() + old.aux_loss
    assert torch.equal(new, by_hand)


def test_aux_balance_loss_weighs_sequences_by_trained_share():
    # A fully masked sequence adds nothing to the balance loss, a half-trained one half its own: the
    # step's aux term is then coef x (trained-weighted mean of sequence balance losses), with the
    # same scale against the token-mean cross-entropy whatever share of labels is trained.
    model = tiny_model()
    tokens = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(6))
    labels = tokens[:, 1:].clone()
    alone = [model.loss(tokens[i : i + 1, :-1], labels[i : i + 1], moe_aux_loss_coef=0.01).aux_loss for i in range(3)]
    labels[1] = IGNORE_INDEX
    labels[2, :8] = IGNORE_INDEX
    mixed = model.loss(tokens[:, :-1], labels, moe_aux_loss_coef=0.01).aux_loss
    # Per layer (sum over rows of weight x loss) / 3; the layer mean is linear, so it holds for the mean too.
    torch.testing.assert_close(mixed, (alone[0] + 0.5 * alone[2]) / 3, rtol=1e-5, atol=1e-8)


class GradsAfterStep(Step35LightningModule):
    """Keeps the gradients as the optimizer step would see them (before and after the rescale)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        self.before = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
        super().on_before_optimizer_step(optimizer)
        self.after = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}


def one_step(module, batches, accumulate):
    trainer = make_trainer(max_steps=1, accumulate_grad_batches=accumulate, enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


def test_plain_text_step_is_the_old_mean(tmp_path):
    # Accumulating two plain-text micro-batches: the factor is exactly 1 (no rescale) and the
    # logged train/loss is the mean of the two micro-batch losses.
    tokens = torch.randint(0, 1024, (2, 2, 13), generator=torch.Generator().manual_seed(2))
    module = GradsAfterStep(config="tiny", warmup_steps=1, mtp_loss_weight=0.3, moe_aux_loss_coef=0.01)
    trainer = one_step(module, [{"input_ids": t} for t in tokens], accumulate=2)
    assert module.before.keys() == module.after.keys() and module.before
    assert all(torch.equal(module.before[n], module.after[n]) for n in module.before)
    assert trainer.callback_metrics["train/trained_tokens"].item() == 2 * 2 * 12


class GradsAgainstTokenMean(GradsAfterStep):
    """Also computes, before the optimizer step, the gradient of PyTorch's own masked mean cross-entropy
    over the whole global batch (all micro-batches at once) with the same weights."""

    global_batch: dict

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        batch = self.global_batch
        with torch.enable_grad():
            logits = self.model(batch["input_ids"][:, :-1], batch["position_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
            names = [n for n, p in self.named_parameters() if p.requires_grad]
            expected = torch.autograd.grad(loss, [self.get_parameter(n) for n in names], allow_unused=True)
        self.expected = {n: g for n, g in zip(names, expected) if g is not None}
        self.expected_loss = loss.item()


def masked_rows(rows: int, seq: int):
    # Row i trains a span of 2 + 3 * i labels (uneven), packed with a second document after position 9.
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 1024, (rows, seq + 1), generator=g)
    labels = torch.full((rows, seq), IGNORE_INDEX)
    positions = torch.arange(seq).repeat(rows, 1)
    positions[:, 10:] = torch.arange(seq - 10)
    for i in range(rows):
        n = 2 + 3 * i
        labels[i, seq - n :] = ids[i, seq - n + 1 :]
    labels[:, 9] = IGNORE_INDEX  # the document border
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def test_accumulated_step_is_the_mean_over_trained_tokens():
    # Four micro-batches of two rows with 2 to 23 trained labels each: the applied gradient is that of
    # the masked mean over all eight rows at once (not the mean of per-micro-batch means).
    batch = masked_rows(8, 24)
    module = GradsAgainstTokenMean(config="tiny", warmup_steps=1)
    module.global_batch = batch
    micro = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    trainer = one_step(module, micro, accumulate=4)
    assert module.expected.keys() == module.after.keys()
    assert_grads_close(list(module.after.values()), list(module.expected.values()), rtol=1e-6)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(module.expected_loss, rel=1e-6)
    assert trainer.callback_metrics["train/trained_tokens"].item() == (batch["labels"] != IGNORE_INDEX).sum()


def test_all_masked_step_is_skipped():
    tokens = torch.randint(0, 1024, (2, 13), generator=torch.Generator().manual_seed(2))
    module = GradsAfterStep(config="tiny", warmup_steps=1, moe_aux_loss_coef=0.01)
    batch = {"input_ids": tokens, "labels": torch.full((2, 12), IGNORE_INDEX)}
    with pytest.warns(UserWarning, match="every label of the step is masked"):
        trainer = one_step(module, [batch], accumulate=1)
    assert module.before and not module.after  # gradients dropped: no update, no division by zero
    assert trainer.callback_metrics["train/trained_tokens"].item() == 0


def test_validation_loss_is_the_mean_over_trained_tokens():
    # Two batches training 2 and 48 labels: val/loss weighs every trained token alike.
    first, second = masked_rows(2, 24), masked_rows(2, 24)
    first["labels"][:, :-1] = IGNORE_INDEX
    second["labels"] = second["input_ids"][:, 1:]
    module = Step35LightningModule(config="tiny")
    trainer = make_trainer(limit_val_batches=None)  # every validation batch
    trainer.validate(module, torch.utils.data.DataLoader([first, second], batch_size=None))
    outs = [
        module.model.loss(b["input_ids"][:, :-1], b["labels"], position_ids=b["position_ids"]) for b in (first, second)
    ]
    expected = sum(o.lm_sum for o in outs) / sum(o.num_tokens for o in outs)
    assert [o.num_tokens.item() for o in outs] == [2, 48]
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_labels_of_the_wrong_shape_are_refused():
    module = Step35LightningModule(config="tiny")
    batch = {"input_ids": torch.zeros(2, 9, dtype=torch.long), "labels": torch.zeros(2, 9, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(2, 9\).*\(2, 8\)"):
        module.objective.micro_batch(module.model, batch)


def run_split(tmp_path: Path, name: str, world: int, batch: int, accumulate: int) -> dict:
    """tests/dist/global_batch_grads.py's step: in this process for one rank, on `world` gloo ranks under torchrun."""
    if world == 1:
        from tests.dist.global_batch_grads import one_step

        return one_step(batch, accumulate)
    return run_dist_script(
        SCRIPT, tmp_path / f"{name}.pt", world, "--batch", str(batch), "--accum", str(accumulate), timeout=400
    )


@pytest.mark.multiprocess
def test_same_gradient_whatever_the_split(tmp_path):
    # Eight sequences of very different trained lengths (one fully masked), packed documents, MTP and
    # the aux loss on: one step as 1 x 8, as 4 x 2 accumulated and on 2 gloo ranks x 2 x 2.
    ref = run_split(tmp_path, "one", 1, 8, 1)
    assert ref["trained"] == sum(ref["trained_per_row"]) and 0 in ref["trained_per_row"]
    for name, world, batch, accumulate in [("accum", 1, 2, 4), ("ranks", 2, 2, 2)]:
        got = run_split(tmp_path, name, world, batch, accumulate)
        assert got["trained"] == ref["trained"]
        for key in ("loss", "lm_loss", "mtp1_loss"):
            assert got[key] == pytest.approx(ref[key], rel=1e-6), (name, key)
        for n, g in ref["grads"].items():
            diff = (got["grads"][n] - g).norm() / g.norm().clamp(min=1e-12)
            assert diff <= 1e-6, (name, n, diff.item())
