"""Our Step35ForCausalLM against two outside computations on a tiny random checkpoint in which every
feature bites (see tests/hf_oracle.py): transformers 5.24's Step3p7TextModel in fp32 and the slow
float64 per-token reference written from docs/architecture.md (tests/reference_forward.py)."""

import pytest
import torch
import torch.nn.functional as F

from step35.config import Step35Config
from step35.model import Step35ForCausalLM
from tests.hf_oracle import (
    hf_forward_logits,
    hf_grads_to_ours,
    hf_reference_logits,
    hf_reference_model,
    random_state_dict,
    tiny_config_dict,
)
from tests.reference_forward import reference_logits

ATOL = 2e-5  # fp32 against fp32 (oracle) and float64 (reference); logits are O(1)-O(5)


@pytest.fixture(scope="module")
def case():
    cfg = tiny_config_dict()
    sd = random_state_dict(cfg, seed=0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    model = Step35ForCausalLM(Step35Config.from_dict(cfg))
    model.load_state_dict(sd, strict=True)
    return cfg, sd, ids, model


def test_logits_match_transformers_oracle(case):
    cfg, sd, ids, model = case
    torch.testing.assert_close(model(ids), hf_reference_logits(cfg, sd, ids), atol=ATOL, rtol=0)


def test_logits_match_slow_reference(case):
    cfg, sd, ids, model = case
    ref = reference_logits(cfg, sd, ids).float()
    torch.testing.assert_close(model(ids), ref, atol=ATOL, rtol=0)


def test_gradients_match_transformers_oracle(case):
    cfg, sd, ids, model = case
    model.zero_grad()
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    hf_model, lm_head = hf_reference_model(cfg, sd)
    logits = hf_forward_logits(hf_model, lm_head, input_ids=ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    theirs = hf_grads_to_ours(hf_model, lm_head)
    main = {n for n in ours if not n.startswith(f"model.layers.{cfg['num_hidden_layers']}.")}
    assert main == set(theirs), sorted(main ^ set(theirs))
    for name in sorted(main):
        # relative to the gradient's scale: fp32 accumulation order differs between implementations
        scale = theirs[name].abs().max().clamp(min=1e-6)
        err = (ours[name] - theirs[name]).abs().max() / scale
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"


def test_loss_path_equals_plain_cross_entropy(case):
    cfg, sd, ids, model = case
    out = model.loss(ids[:, :-1], ids[:, 1:], loss_chunk_size=5)
    plain = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, plain, atol=1e-5, rtol=0)
