"""Document masking for packed windows (`data.document_masking: true`): a packed window computes for
each document exactly what that document computes alone, on full and sliding layers, forward and
backward; the DataModule delivers the positions and the LightningModule uses them."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from step35.data import Step35DataModule
from step35.data.packing import document_positions
from step35.kernels.masks import DocumentMask
from step35.module import Step35LightningModule
from tests.helpers import make_trainer, tiny_model

EOS = 1  # the tiny config's EOS id
# The tiny model: full layers 0 and 4, sliding (64 keys) layers 1-3 and the MTP layer; the 90-token
# document is longer than the window, so the sliding layers' window bites inside a document too.
DOC_LENGTHS = (30, 90, 8)


def _documents(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in DOC_LENGTHS:
        ids = torch.randint(2, 1024, (n,), generator=g)
        ids[-1] = EOS
        docs.append(ids)
    return docs


def test_document_positions_bruteforce():
    ids = torch.tensor([[5, 6, EOS, 9, 9, EOS, EOS, 4], [EOS, 3, 3, 3, 3, 3, 3, 3]])
    expected = []
    for row in ids.tolist():
        pos, p = [], 0
        for token in row:
            pos.append(p)
            p = 0 if token == EOS else p + 1
        expected.append(pos)
    assert document_positions(ids, [EOS]).tolist() == expected == [[0, 1, 2, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_document_mask_descriptions_agree():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    docs = DocumentMask(positions)
    assert docs.cu_seqlens() == [3, 5, 8, 14, 16]  # TND: document ends over the flattened batch
    dense = docs.dense(window=2)
    for b in range(2):
        for i in range(8):
            for j in range(8):
                same = docs.ids[b, i] == docs.ids[b, j]
                assert bool(dense[b, 0, i, j]) == bool(same and i - 2 < j <= i)


@pytest.mark.parametrize("mtp", [False, True])
def test_packed_window_equals_each_document_alone(mtp):
    """Per-token losses of a packed window (3 documents) against each document run on its own:
    equal within 2e-5 (fp32; summation order differs with the sequence length), and so are the
    gradients (the packed window's summed loss against the sum of the documents' summed losses,
    within 1e-5 of each tensor's largest entry). Without masking the same window gives different losses (the check bites)."""
    model = tiny_model(seed=3)
    docs = _documents()
    packed = torch.cat(docs)[None]  # [1, 128]
    positions = document_positions(packed, [EOS])
    assert positions.max() == max(DOC_LENGTHS) - 1

    def token_losses(ids, position_ids=None):
        logits = model(ids[:, :-1], position_ids=None if position_ids is None else position_ids[:, :-1])
        return F.cross_entropy(logits[0], ids[0, 1:], reduction="none")

    with torch.no_grad():
        alone = [token_losses(d[None]) for d in docs]
        masked = token_losses(packed, positions)
        unmasked = token_losses(packed)
    start = 0
    for d, own in zip(docs, alone):
        # token t of a document predicts its token t + 1; the EOS's target lies in the next document
        torch.testing.assert_close(masked[start : start + len(d) - 1], own, atol=2e-5, rtol=2e-5)
        start += len(d)
    assert not torch.allclose(masked[DOC_LENGTHS[0] :], unmasked[DOC_LENGTHS[0] :], atol=1e-3)

    weight = 0.3 if mtp else 0.0

    def grads(ids, labels, position_ids):
        model.zero_grad(set_to_none=True)
        out = model.loss(ids, labels, position_ids=position_ids, mtp_loss_weight=weight)
        (out.lm_loss * out.num_tokens).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    labels = packed[:, 1:].clone()
    labels[0, torch.tensor(DOC_LENGTHS).cumsum(0)[:-1] - 1] = -100  # EOS -> next document: no target alone
    packed_grads = grads(packed[:, :-1], labels, positions[:, :-1])
    summed: dict[str, torch.Tensor] = {}
    for d in docs:
        for n, g in grads(d[None, :-1], d[None, 1:], None).items():
            summed[n] = summed.get(n, 0) + g
    assert packed_grads.keys() == summed.keys()
    for n in packed_grads:
        err = (packed_grads[n] - summed[n]).abs().max()
        assert err <= 1e-5 * summed[n].abs().max(), (n, err)  # measured <= 1.2e-6 of the largest entry


def test_datamodule_delivers_positions_and_module_uses_them(tmp_path, builtin_cache):
    """document_masking=True: every batch carries position_ids restarting after each EOS, and the
    first training loss is the model's loss with those positions (computed here directly)."""
    texts = [f"document number {i} " + "word " * (i % 7 + 1) for i in range(200)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kw = dict(files=str(tmp_path / "docs.jsonl"), seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))

    class FirstLoss(pl.Callback):
        losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            assert "position_ids" in batch
            self.losses.append(outputs["loss"].item())

    module = Step35LightningModule(config="tiny", mtp_loss_weight=0.0, lr=0.0, warmup_steps=1)
    record = FirstLoss()
    make_trainer(max_steps=1, enable_checkpointing=False, callbacks=[record]).fit(
        module, datamodule=Step35DataModule(document_masking=True, **kw)
    )

    data = Step35DataModule(document_masking=True, **kw)
    data.setup("fit")
    batch = data.on_before_batch_transfer(next(iter(data.train_dataloader())), 0)
    tokens, positions = batch["input_ids"], batch["position_ids"]
    eos = data.eos_token_id
    assert (tokens[:, :-1] == eos).any()  # several documents per window
    for row_tokens, row_pos in zip(tokens[:, :-1].tolist(), positions.tolist()):
        expected, p = [], 0
        for token in row_tokens:
            expected.append(p)
            p = 0 if token == eos else p + 1
        assert row_pos == expected
    with torch.no_grad():
        direct = module.model.loss(tokens[:, :-1], tokens[:, 1:], position_ids=positions).loss
        plain = module.model.loss(tokens[:, :-1], tokens[:, 1:]).loss
    assert record.losses[0] == pytest.approx(direct.item(), rel=1e-6)
    assert abs(direct.item() - plain.item()) > 1e-4  # positions and masking changed the loss


def test_position_ids_of_another_shape_are_refused_by_forward_and_loss():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    positions = document_positions(ids, [0])[:, :8]
    with pytest.raises(ValueError, match=r"position_ids has shape \(2, 8\), input_ids \(2, 16\)"):
        model(ids, position_ids=positions)
    with pytest.raises(ValueError, match=r"position_ids has shape \(2, 8\), input_ids \(2, 16\)"):
        model.loss(ids, ids, position_ids=positions)
