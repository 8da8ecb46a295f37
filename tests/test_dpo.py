"""The DPO objective (issue 26, training side): sequence log-probabilities, the loss formulas, the gradient of every
trained parameter against an independent float64 computation (log-probabilities token by token from the full
logits), the reference at the first step, the gradient factor over micro-batches, and the option refusals.

Batches are packed by hand (tests/dist/dpo_steps.py `pack`), following the batch contract of docs/issue 26 (the data side builds the
same tensors): each pair's chosen then rejected sequence (prompt + reply) side by side in one row, labels only on
reply tokens whose previous token is of the same sequence, position_ids restarting per sequence, preference ids
2 p / 2 p + 1 on the label slots of pair p of the row, -1 elsewhere.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import build_model
from step35.model.lora import LoraConfig, adapters_off, apply_lora
from step35.training.dpo import LOSS_TYPES, DpoObjective, DpoOptions, build_objective, pair_losses
from step35.training.objective import LanguageModelObjective
from tests.dist.dpo_steps import pack, sample_rows
from tests.helpers import make_trainer

_BUILT: dict = {}


def _built(seed: int, lora: LoraConfig | None):
    key = (seed, repr(lora))
    if key not in _BUILT:
        model = build_model(preset("tiny"), 0)
        if lora is not None:
            apply_lora(model, lora)
        materialize(model, "cpu", seed=seed)
        _BUILT[key] = model
    return _BUILT[key]


def model_of(seed: int, dtype=torch.float64, lora: LoraConfig | None = None):
    """The tiny model (no MTP layers) from the init of `seed`, in `dtype`: a fresh copy of one built once."""
    return copy.deepcopy(_built(seed, lora)).to(dtype)


# ----------------------------------------------------------------------------------- the independent computation
def token_by_token_logps(model, batch) -> list[list[tuple[torch.Tensor, torch.Tensor, int, int]]]:
    """Per row, per pair: (chosen logp, rejected logp, chosen length, rejected length), summing
    log_softmax(full logits)[label] one slot at a time."""
    logps = torch.log_softmax(model(batch["input_ids"][:, :-1], batch["position_ids"]).double(), dim=-1)
    out = []
    for b in range(logps.shape[0]):
        sums: dict[int, list] = {}
        for i in range(logps.shape[1]):
            label, q = int(batch["labels"][b, i]), int(batch["preference"][b, i])
            if label == -100 or q < 0:
                continue
            entry = sums.setdefault(q, [0.0, 0])
            entry[0] = entry[0] + logps[b, i, label]
            entry[1] += 1
        out.append(
            [(sums[2 * p][0], sums[2 * p + 1][0], sums[2 * p][1], sums[2 * p + 1][1]) for p in range(len(sums) // 2)]
        )
    return out


def float64_loss(options: DpoOptions, policy, reference) -> tuple[torch.Tensor, list[float]]:
    """Mean over every pair of the whole objective, written from the formulas of the issue (not from dpo.py)."""
    beta, losses, rewards = options.beta, [], []
    for b, pairs in enumerate(policy):
        for p, (pc, pr, nc, nr) in enumerate(pairs):
            if options.reference_free:
                h = pc / nc - pr / nr - options.gamma / beta
            else:
                rc, rr = reference[b][p][0].detach(), reference[b][p][1].detach()
                if options.loss_type == "ipo":
                    h = (pc / nc - rc / nc) - (pr / nr - rr / nr)
                else:
                    h = (pc - rc) - (pr - rr)
                rewards.append(float(beta * (pc - rc).detach()))
            if options.loss_type == "sigmoid":
                ls = options.label_smoothing
                loss = -(1 - ls) * torch.log(1 / (1 + torch.exp(-beta * h))) - ls * torch.log(
                    1 / (1 + torch.exp(beta * h))
                )
            elif options.loss_type == "ipo":
                loss = (h - 1 / (2 * beta)) * (h - 1 / (2 * beta))
            else:
                loss = torch.clamp(1 - beta * h, min=0)
            losses.append(loss + options.sft_weight * (-pc / nc))
    return sum(losses) / len(losses), rewards


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------- model side
def test_sequence_logprobs_equal_full_logits_in_chunks_with_gradients():
    batch = pack(sample_rows())
    model = model_of(3)
    B, S = batch["labels"].shape
    ids = torch.where(batch["preference"] >= 0, torch.arange(B)[:, None] * 8 + batch["preference"], -1)
    sums, counts = model.sequence_logprobs(
        batch["input_ids"][:, :-1], batch["labels"], ids, 16, position_ids=batch["position_ids"], loss_chunk_size=7
    )
    (sums * torch.linspace(0.5, 2, 16, dtype=sums.dtype)).sum().backward()
    got = grads(model)
    model.zero_grad()
    want = token_by_token_logps(model, batch)
    flat = {
        b * 8 + 2 * p + s: (pair[s], pair[2 + s])
        for b, row in enumerate(want)
        for p, pair in enumerate(row)
        for s in (0, 1)
    }
    total = 0
    for q in range(16):
        if q in flat:
            assert counts[q] == flat[q][1]
            assert sums[q].item() == pytest.approx(flat[q][0].item(), rel=1e-12)
            total = total + flat[q][0] * torch.linspace(0.5, 2, 16, dtype=torch.float64)[q]
        else:
            assert counts[q] == 0 and sums[q] == 0
    total.backward()
    for name, g in grads(model).items():
        assert relative(got[name], g) < 1e-9, name


def test_sequence_logprobs_fp32_chunked_equals_unchunked():
    batch = pack(sample_rows(1))
    model = model_of(3, torch.float32)
    ids = torch.where(batch["preference"] >= 0, batch["preference"], -1)
    args = (batch["input_ids"][:, :-1], batch["labels"], ids, 6)
    a, _ = model.sequence_logprobs(*args, position_ids=batch["position_ids"], loss_chunk_size=5)
    b, _ = model.sequence_logprobs(*args, position_ids=batch["position_ids"], loss_chunk_size=4096)
    assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-6, atol=1e-5)


def test_adapters_off_computes_no_delta():
    lora = LoraConfig(rank=4, targets=["attention", "mlp", "shared_expert", "experts"], expert_rank=2)
    model = model_of(5, torch.float32, lora)
    base = model_of(5, torch.float32)
    ids = torch.randint(0, 1024, (2, 12))
    for name, p in model.named_parameters():
        if name.endswith(("lora_A", "lora_B")):
            p.data.fill_(float("nan"))  # any read of an adapter would poison the output
    with torch.no_grad(), adapters_off(model):
        off = model(ids)
    assert torch.equal(off, base(ids).detach())
    with torch.no_grad():
        assert torch.isnan(model(ids)).all()  # the adapters are back on after the block


# ----------------------------------------------------------------------------------- the formulas
@pytest.mark.parametrize(
    "options",
    [
        DpoOptions(beta=0.3),
        DpoOptions(beta=0.3, label_smoothing=0.2),
        DpoOptions(beta=0.5, loss_type="ipo"),
        DpoOptions(beta=0.7, loss_type="hinge"),
        DpoOptions(beta=2.0, reference_free=True, gamma=0.8),
        DpoOptions(beta=0.2, sft_weight=0.5),
    ],
    ids=["sigmoid", "smoothed", "ipo", "hinge", "simpo", "sft"],
)
def test_pair_losses_equal_the_formulas(options):
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (-torch.rand(5, generator=g, dtype=torch.float64) * 30 for _ in range(4))
    nc, nr = torch.tensor([3, 7, 1, 12, 5]), torch.tensor([4, 2, 9, 1, 5])
    got = pair_losses(options, pc, pr, nc, nr, rc, rr)
    b, ls, gm, w = options.beta, options.label_smoothing, options.gamma, options.sft_weight
    for i in range(5):
        c, r, Rc, Rr, n1, n2 = (float(t[i]) for t in (pc, pr, rc, rr, nc, nr))
        if options.reference_free:
            h = c / n1 - r / n2 - gm / b
        elif options.loss_type == "ipo":
            h = (c - Rc) / n1 - (r - Rr) / n2
        else:
            h = (c - Rc) - (r - Rr)
        if options.loss_type == "sigmoid":
            want = (1 - ls) * math.log1p(math.exp(-b * h)) + ls * math.log1p(math.exp(b * h))
        elif options.loss_type == "ipo":
            want = (h - 1 / (2 * b)) ** 2
        else:
            want = max(0.0, 1 - b * h)
        assert got.dpo_loss[i].item() == pytest.approx(want, rel=1e-12)
        assert got.loss[i].item() == pytest.approx(want - w * c / n1, rel=1e-12)
        if not options.reference_free:
            assert got.chosen_reward[i].item() == pytest.approx(b * (c - Rc), rel=1e-12)


# ----------------------------------------------------------------------------------- loss and gradients
def dpo_step(objective: DpoObjective, model, batch) -> tuple[torch.Tensor, dict]:
    """The objective's micro-batch loss divided by the step's pairs (the gradient factor of a one-micro-batch step)."""
    mb = objective.micro_batch(model, batch)
    step = objective.reduce(mb.sums.clone(), over_ranks=False)
    factor = step.gradient_factor(1, 1)
    loss = mb.loss * (1.0 if factor is None else factor)
    loss.backward()
    return loss.detach(), step.logged


@pytest.mark.parametrize(
    "options",
    [
        DpoOptions(beta=0.4),
        DpoOptions(beta=0.4, loss_type="ipo"),
        DpoOptions(beta=0.4, loss_type="hinge"),
        DpoOptions(beta=0.4, label_smoothing=0.1, sft_weight=0.3),
        DpoOptions(beta=1.5, reference_free=True),
    ],
    ids=["sigmoid", "ipo", "hinge", "smoothed_sft", "simpo"],
)
def test_full_loss_and_gradients_equal_float64(options):
    batch = pack(sample_rows())
    policy, reference = model_of(3), model_of(11)
    objective = DpoObjective(options)
    if objective.reference == "model":
        objective.set_reference_model(reference)
    loss, logged = dpo_step(objective, policy, batch)
    got = grads(policy)
    policy.zero_grad()
    with torch.no_grad():
        ref = token_by_token_logps(reference, batch)
    want, rewards = float64_loss(options, token_by_token_logps(policy, batch), ref)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-10)
    assert logged["train/pairs"] == 5
    if rewards:
        assert logged["train/chosen_reward"] == pytest.approx(sum(rewards) / 5, rel=1e-10)
    assert all(p.grad is None for p in reference.parameters())
    for name, g in grads(policy).items():
        assert relative(got[name], g) < 1e-6, name


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_lora_loss_and_gradients_equal_float64(loss_type):
    lora = LoraConfig(rank=4, targets=["attention", "mlp", "shared_expert", "experts"], expert_rank=2)
    policy = model_of(3, lora=lora)
    with torch.no_grad():  # adapters that are not zero, so the policy differs from its base
        for name, p in policy.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    options = DpoOptions(beta=0.5, loss_type=loss_type)
    objective = DpoObjective(options, lora=lora)
    assert objective.reference == "lora"
    batch = pack(sample_rows(4))
    loss, _ = dpo_step(objective, policy, batch)
    got = grads(policy)
    policy.zero_grad()
    with torch.no_grad(), adapters_off(policy):
        ref = token_by_token_logps(policy, batch)
    want, _ = float64_loss(options, token_by_token_logps(policy, batch), ref)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-10)
    assert set(got) == {n for n, _ in policy.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    for name, g in grads(policy).items():
        assert relative(got[name], g) < 1e-6, name


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_first_step_policy_is_reference_loss_ln2_rewards_zero(kind):
    lora = LoraConfig(rank=4, expert_rank=2) if kind == "lora" else None
    policy = model_of(3, torch.float32, lora)
    objective = DpoObjective(DpoOptions(beta=0.1), lora=lora)
    if kind == "full":
        objective.set_reference_model(model_of(3, torch.float32))
    loss, logged = dpo_step(objective, policy, pack(sample_rows()))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-7)
    assert logged["train/dpo_loss"] == pytest.approx(math.log(2), rel=1e-7)
    for name in ("train/chosen_reward", "train/rejected_reward", "train/reward_margin", "train/reward_accuracy"):
        assert logged[name] == 0.0, name


def test_gradient_factor_makes_the_mean_over_all_pairs_of_the_step():
    """Two micro-batches of 3 and 2 pairs (accumulate 2): the applied gradient is that of the mean over the 5 pairs,
    not the mean of the two micro-batch means."""
    rows = sample_rows()
    first, second, whole = pack(rows[:1]), pack(rows[1:]), pack(rows)
    policy = model_of(3)
    objective = DpoObjective(DpoOptions(beta=0.4))
    objective.set_reference_model(model_of(11))
    sums = None
    for batch in (first, second):
        mb = objective.micro_batch(policy, batch)
        (mb.loss / 2).backward()  # Lightning divides by accumulate_grad_batches
        sums = mb.sums.clone() if sums is None else sums + mb.sums
    step = objective.reduce(sums, over_ranks=False)
    factor = step.gradient_factor(2, 1)
    assert step.trained == 5 and factor == pytest.approx(2 / 5)
    accumulated = {n: g * factor for n, g in grads(policy).items()}
    policy.zero_grad()
    _, logged = dpo_step(objective, policy, whole)
    assert step.logged["train/loss"] == pytest.approx(logged["train/loss"], rel=1e-12)
    for name, g in grads(policy).items():
        assert relative(accumulated[name], g) < 1e-6, name  # (the fp32 router rounds by batch shape)
    # With 2 data-parallel ranks (FSDP averages over them) the factor doubles: still 1 / the step's pairs.
    assert step.gradient_factor(2, 2) == pytest.approx(4 / 5)


def test_validation_values_are_pair_means():
    objective = DpoObjective(DpoOptions(beta=0.4))
    objective.set_reference_model(model_of(11))
    values = objective.validation(model_of(3), pack(sample_rows()))
    assert {v[1] for v in values.values()} == {5}
    assert set(values) == {
        f"val/{n}"
        for n in (
            "loss",
            "dpo_loss",
            "reward_accuracy",
            "reward_margin",
            "chosen_reward",
            "rejected_reward",
            "chosen_logp",
            "rejected_logp",
        )
    }
    lm = LanguageModelObjective().validation(model_of(3, torch.float32), {"input_ids": torch.randint(0, 1024, (1, 9))})
    assert set(lm) == {"val/loss"} and lm["val/loss"][1] == 8


# ----------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "dpo, message",
    [
        ({"beta": 0}, r"model.dpo.beta=0: must be a number > 0"),
        ({"loss_type": "kto"}, r"model.dpo.loss_type='kto'"),
        ({"label_smoothing": 0.5}, r"model.dpo.label_smoothing=0.5"),
        ({"label_smoothing": 0.1, "loss_type": "ipo"}, r"model.dpo.label_smoothing=0.1 with model.dpo.loss_type=ipo"),
        ({"sft_weight": -1}, r"model.dpo.sft_weight=-1"),
        ({"gamma": -0.1}, r"model.dpo.gamma=-0.1"),
        ({"precompute_reference": True}, r"model.dpo.precompute_reference=true is not built"),
        ({"bta": 1}, r"model.dpo: unknown field\(s\) \['bta'\]"),
    ],
)
def test_bad_dpo_options_are_refused_by_name(dpo, message):
    with pytest.raises(ValueError, match=message):
        build_objective("dpo", dpo, mtp_loss_weight=0, moe_aux_loss_coef=0, loss_chunk_size=8, lora=None)


def test_objective_option_refusals():
    kw = dict(moe_aux_loss_coef=0, loss_chunk_size=8, lora=None)
    with pytest.raises(ValueError, match=r"model.mtp_loss_weight=0.3 with model.objective=dpo"):
        build_objective("dpo", None, mtp_loss_weight=0.3, **kw)
    with pytest.raises(ValueError, match=r"model.moe_aux_loss_coef=0.01 with model.objective=dpo"):
        build_objective("dpo", None, mtp_loss_weight=0, moe_aux_loss_coef=0.01, loss_chunk_size=8, lora=None)
    with pytest.raises(ValueError, match=r"model.objective='ppo'"):
        build_objective("ppo", None, mtp_loss_weight=0, **kw)
    with pytest.raises(ValueError, match=r"model.dpo is set but model.objective=lm"):
        build_objective("lm", {"beta": 1}, mtp_loss_weight=0, **kw)
    lora = LoraConfig(rank=4, targets=["attention", "router"])
    with pytest.raises(ValueError, match=r"model.lora.targets naming \['router'\].*reference would move"):
        build_objective("dpo", None, mtp_loss_weight=0, moe_aux_loss_coef=0, loss_chunk_size=8, lora=lora)
    assert (
        build_objective(
            "dpo", {"reference_free": True}, mtp_loss_weight=0, moe_aux_loss_coef=0, loss_chunk_size=8, lora=lora
        ).reference
        is None
    )  # SimPO needs no reference


def test_batches_of_the_other_objective_are_refused():
    batch = pack(sample_rows())
    model = model_of(3, torch.float32)
    with pytest.raises(ValueError, match=r"preference pairs .*data.format: preference.*model.objective: dpo"):
        LanguageModelObjective().micro_batch(model, batch)
    plain = {k: v for k, v in batch.items() if k != "preference"}
    with pytest.raises(ValueError, match=r"model.objective=dpo needs preference pairs.*data.format: preference"):
        DpoObjective(DpoOptions(reference_free=True)).micro_batch(model, plain)


def test_resume_with_another_objective_is_refused(tmp_path):
    from step35.run import SavedRun, check_resume
    from step35.run.resume import ResumeMismatchError

    config = preset("tiny")
    saved = SavedRun(tmp_path / "last.ckpt", {"objective": "lm"}, config.to_dict())
    with pytest.raises(ResumeMismatchError, match=r"model.objective: lm -> dpo"):
        check_resume(saved, config, {"objective": "dpo"})
    assert check_resume(SavedRun(tmp_path, {}, config.to_dict()), config, {"objective": "lm"}) == []
    notes = check_resume(
        SavedRun(tmp_path, {"objective": "dpo", "dpo": {"beta": 0.1}}, config.to_dict()),
        config,
        {"objective": "dpo", "dpo": {"beta": 0.2}},
    )
    assert notes == ["dpo: {'beta': 0.1} -> {'beta': 0.2}"]


# ----------------------------------------------------------------------------------- the module: reference and resume
class _Pairs(torch.utils.data.Dataset):
    def __init__(self):
        self.batch = pack(sample_rows(7))

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {k: v[i % 2] for k, v in self.batch.items()}


def _reference_callback():
    import lightning.pytorch as pl

    from step35.training.dpo import sequence_logprobs

    class ReferenceAtStart(pl.Callback):
        """The reference's and the policy's log-probabilities on a fixed pair at the start of training."""

        def __init__(self):
            self.seen = []

        def on_train_start(self, trainer, module):
            batch = pack(sample_rows(9)[:1])
            with torch.no_grad():
                ref = sequence_logprobs(module.objective.reference_model, batch, 64)[0]
                policy = sequence_logprobs(module.model, batch, 64)[0]
            self.seen.append((ref.clone(), policy.clone()))

    return ReferenceAtStart()


@pytest.mark.heavy  # two short Lightning fits
def test_full_dpo_reference_is_the_start_model_after_a_resume(tmp_path):
    import lightning.pytorch as pl

    from step35.module import Step35LightningModule

    def fit(steps: int, ckpt=None, record=None):
        module = Step35LightningModule(
            config="tiny", objective="dpo", dpo={"beta": 0.5}, lr=1e-2, warmup_steps=1, num_mtp_layers=0
        )
        loader = torch.utils.data.DataLoader(_Pairs(), batch_size=2)
        trainer = make_trainer(
            max_steps=steps, default_root_dir=tmp_path, callbacks=[pl.Callback()] if record is None else [record]
        )
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt)
        return module, trainer

    record = _reference_callback()
    module, trainer = fit(2, record=record)
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert not any("reference" in k for k in saved["state_dict"])  # not a submodule: not in checkpoints
    assert len(saved["state_dict"]) == len(module.model.state_dict())
    trained = sum(1 for p in module.model.parameters() if p.requires_grad)
    assert sum(len(g["params"]) for g in trainer.optimizers[0].param_groups) == trained  # no reference entries
    fit(3, ckpt=path, record=record)
    (ref0, policy0), (ref1, policy1) = record.seen
    assert torch.equal(ref0, policy0)  # a from-scratch start: the policy is the reference
    assert torch.equal(ref1, ref0)  # bit for bit: the reference is the start model, not the resumed policy
    assert not torch.allclose(policy1, ref1)  # the resumed policy has learned
