"""The KTO objective (issue 43, training side): the loss and the gradient of every trained parameter against an
independent float64 computation (plain forwards of each sequence alone, full logits: no packing, no objective
code), full fine-tuning and LoRA, packed several records to a row or one to a row; the rewards and z0 at the first
step; the step's mean over micro-batches; the option and batch refusals; and a few dozen steps of learning.

Batches are packed by hand (`pack`) following the KTO batch contract (step35/training/kto.py's docstring; the data
side builds the same tensors): each record's matched sequence (prompt + its completion) then its KL sequence
(prompt + the completion of record (p + 1) mod n of the row) side by side, labels only on completion tokens whose
previous token is of the same sequence, position_ids restarting per sequence, `unpaired` ids 2 p / 2 p + 1 on the
label slots of record p's matched / KL sequence (-1 elsewhere), `unpaired_label` 1 / 0 / -1 per record slot.
"""

from __future__ import annotations

import math

import pytest
import torch

from step35.model.lora import LoraConfig, adapters_off, apply_lora
from step35.training.kto import KtoObjective, KtoOptions, record_losses
from step35.training.objective import LanguageModelObjective, build_objective, objective_class
from step35.training.reference import ADAPTERS_OFF, FROZEN_COPY
from tests.dist.dpo_steps import EOS, Record, mismatched, sample_records
from tests.dist.dpo_steps import pack_unpaired as pack
from tests.helpers import make_trainer, tiny_model

SEQ = 64
LORA = LoraConfig(rank=4, targets=["attention", "mlp", "shared_expert", "experts"], expert_rank=2)


def model_of(seed: int, dtype=torch.float64, lora: LoraConfig | None = None, moved: bool = True):
    """The tiny model without MTP layers from `seed`; with `lora`, random adapters: lora_B 0 unless `moved` (the
    policy then differs from its base)."""
    model = tiny_model(seed, dtype, num_mtp_layers=0)
    if lora is not None:
        apply_lora(model, lora)
        model.to(dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_A") or (moved and name.endswith("lora_B")):
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


# ----------------------------------------------------------------------------------- the independent computation
def completion_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log pi(completion | prompt) from a plain forward of the sequence alone, full logits, in float64."""
    ids = torch.tensor([prompt + completion])
    logps = torch.log_softmax(model(ids[:, :-1]).double(), dim=-1)[0]
    start = len(prompt) - 1  # the slot predicting the completion's first token
    return logps[start:].gather(1, ids[0, len(prompt) :, None]).sum()


def float64_kto(options: KtoOptions, records: list[Record], policy, reference) -> dict:
    """One micro-batch of `records` from the paper's formulas (not kto.py): the summed losses, z0, the rewards.
    `reference(prompt, completion)` gives the reference's log-probability."""
    beta = options.beta
    kl = [float(completion_logp(policy, p, k).detach() - reference(p, k)) for p, _, k, _ in records]
    z0 = max(0.0, sum(kl) / len(kl))
    total, rewards = 0.0, {True: [], False: []}
    for prompt, completion, _, desirable in records:
        r = completion_logp(policy, prompt, completion) - reference(prompt, completion)
        if desirable:
            total = total + options.desirable_weight * (1 - 1 / (1 + torch.exp(-beta * (r - z0))))
        else:
            total = total + options.undesirable_weight * (1 - 1 / (1 + torch.exp(-beta * (z0 - r))))
        rewards[desirable].append(beta * float(r.detach()))
    return {"sum": total, "z0": z0, "rewards": rewards}


def reference_of(objective: KtoObjective, policy):
    """The reference log-probability function of the test: the frozen copy, or the policy with its adapters off."""

    def logp(prompt, completion):
        with torch.no_grad():
            if objective.reference == FROZEN_COPY:
                return float(completion_logp(objective.reference_model, prompt, completion))
            with adapters_off(policy):
                return float(completion_logp(policy, prompt, completion))

    return logp


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def kto_step(objective: KtoObjective, model, batches: list[dict]) -> tuple[float, dict]:
    """One optimizer step of `batches` as micro-batches (Lightning divides each loss by their number, then the
    factor applies): the step's loss and its logged values; the gradients are left in `model`."""
    sums = None
    for batch in batches:
        mb = objective.micro_batch(model, batch)
        (mb.loss / len(batches)).backward()
        sums = mb.sums.clone() if sums is None else sums + mb.sums
    step = objective.reduce(sums, over_ranks=False)
    factor = step.gradient_factor(len(batches), 1)
    for p in model.parameters():
        if p.grad is not None and factor is not None:
            p.grad.mul_(factor)
    return step.logged["train/loss"], step.logged


# ----------------------------------------------------------------------------------- loss and gradients
OPTIONS = KtoOptions(beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)


@pytest.mark.parametrize("layout", ["packed", "one_per_row"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_loss_and_gradients_equal_float64(kind, layout):
    """Within 1e-6 relative (the router computes in fp32: a packed row and a sequence alone round it apart by about
    1e-7). z0 > 0 here (the seeds are chosen so): its value and its detachment both count."""
    lora = LORA if kind == "lora" else None
    policy = model_of(4 if lora else 3, lora=lora)
    objective = KtoObjective(OPTIONS, loss_chunk_size=7, lora=lora)
    assert objective.reference == (ADAPTERS_OFF if lora else FROZEN_COPY)
    if lora is None:
        objective.set_reference_model(model_of(11))
    rows = sample_records()
    batch = pack(rows) if layout == "packed" else pack([[record] for row in rows for record in row])
    loss, logged = kto_step(objective, policy, [batch])
    got = grads(policy)
    policy.zero_grad()
    records = [record for row in rows for record in row]
    want = float64_kto(OPTIONS, records, policy, reference_of(objective, policy))
    (want["sum"] / len(records)).backward()
    assert want["z0"] > 0.05, want["z0"]
    assert logged["train/kl"] == pytest.approx(want["z0"], rel=1e-6)
    assert loss == pytest.approx(float(want["sum"].detach()) / 5, rel=1e-6)
    assert logged["train/kto_loss"] == loss
    assert (logged["train/desirable_records"], logged["train/undesirable_records"]) == (3, 2)
    for desirable, name in ((True, "desirable_reward"), (False, "undesirable_reward")):
        rewards = want["rewards"][desirable]
        assert logged[f"train/{name}"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
    if lora is None:
        assert all(p.grad is None for p in objective.reference_model.parameters())
    else:
        assert set(got) == {n for n, _ in policy.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    for name, g in grads(policy).items():
        assert relative(got[name], g) < 1e-6, name


def test_two_micro_batches_make_the_mean_over_the_steps_records_each_with_its_own_z0():
    """z0 is the mean over the micro-batch's own KL sequences; the step's loss the mean over all 5 records (what 2
    data-parallel ranks of one micro-batch each compute as well: the same sums, the same factor per rank)."""
    rows = sample_records(1)
    policy = model_of(3)
    objective = KtoObjective(OPTIONS)
    objective.set_reference_model(model_of(11))
    loss, logged = kto_step(objective, policy, [pack(rows[:1]), pack(rows[1:])])
    got = grads(policy)
    policy.zero_grad()
    reference = reference_of(objective, policy)
    parts = [float64_kto(OPTIONS, row, policy, reference) for row in rows]
    ((parts[0]["sum"] + parts[1]["sum"]) / 5).backward()
    assert parts[0]["z0"] != parts[1]["z0"]
    assert logged["train/kl"] == pytest.approx((parts[0]["z0"] + parts[1]["z0"]) / 2, rel=1e-6)
    assert loss == pytest.approx(float((parts[0]["sum"] + parts[1]["sum"]).detach()) / 5, rel=1e-6)
    for name, g in grads(policy).items():
        assert relative(got[name], g) < 1e-6, name


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_first_step_rewards_and_kl_are_exactly_zero(kind):
    lora = LORA if kind == "lora" else None
    policy = model_of(3, torch.float32, lora, moved=False)
    objective = KtoObjective(OPTIONS, lora=lora)
    if lora is None:
        objective.set_reference_model(model_of(3, torch.float32))
    loss, logged = kto_step(objective, policy, [pack(sample_records())])
    for name in ("train/desirable_reward", "train/undesirable_reward", "train/kl"):
        assert logged[name] == 0.0, name
    # every record's loss is its weight x (1 - sigmoid(0)): 3 desirable, 2 undesirable
    assert loss == pytest.approx((3 * 1.3 + 2 * 0.7) / 2 / 5, rel=1e-7)


def test_record_losses_follow_the_formulas():
    options = KtoOptions(beta=0.4, desirable_weight=2.0, undesirable_weight=0.5)
    label = torch.tensor([1, 0, 1, -1, 0], dtype=torch.int64)
    ratio = torch.tensor([0.8, -1.5, 2.0, 9.0, 0.3], dtype=torch.float64)
    lengths, kl_lengths = torch.tensor([3, 2, 0, 4, 5]), torch.tensor([2, 2, 3, 4, 0])
    for kl_ratio, z0 in (
        (torch.tensor([0.3, 0.5, 0.7, 100.0, 100.0]), 0.5),
        (torch.tensor([-0.3, -0.5, 0.1, 9, 9]), 0),
    ):
        got = record_losses(options, label, ratio, kl_ratio.double(), lengths, kl_lengths)
        # z0: the mean over the KL sequences of records (label >= 0) with a KL sequence (length > 0), clamped at 0
        assert float(got.z0) == pytest.approx(z0, abs=1e-12) and not got.z0.requires_grad
        assert got.valid.tolist() == [True, True, False, False, True]  # record 3: no matched tokens; 4: no record
        assert got.desirable.tolist() == [True, False, False, False, False]
        sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        want = [2.0 * (1 - sigmoid(0.4 * (0.8 - z0))), 0.5 * (1 - sigmoid(0.4 * (z0 + 1.5))), 0, 0]
        want.append(0.5 * (1 - sigmoid(0.4 * (z0 - 0.3))))
        assert got.loss.tolist() == pytest.approx(want, rel=1e-12)
        assert got.reward.tolist() == pytest.approx((0.4 * ratio).tolist(), rel=1e-12)


def test_validation_values_and_weights():
    objective = KtoObjective(OPTIONS)
    objective.set_reference_model(model_of(11))
    values = objective.validation(model_of(3), pack(sample_records()))
    assert {name: weight for name, (_, weight) in values.items()} == {
        "val/loss": 5,
        "val/kto_loss": 5,
        "val/desirable_reward": 3,
        "val/undesirable_reward": 2,
        "val/kl": 1,
        "val/desirable_records": 1,
        "val/undesirable_records": 1,
    }
    assert float(values["val/desirable_records"][0]) == 3 and float(values["val/kl"][0]) > 0


# ----------------------------------------------------------------------------------- what it declares, refusals
def test_the_objective_declares_its_reference_and_records():
    kto = objective_class("kto")
    assert kto is KtoObjective and kto.record_kinds == {"unpaired": "unpaired feedback"}
    assert kto.sequences_per_record == 2 and kto.options_field == "objective_options"
    assert {"kto_loss", "desirable_reward", "undesirable_reward", "kl"} <= set(kto.logged)
    full, lora = build_objective("kto"), build_objective("kto", lora=LORA)
    assert (full.reference, lora.reference) == (FROZEN_COPY, ADAPTERS_OFF)
    assert full.options == KtoOptions(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
    built = build_objective("kto", objective_options={"beta": 0.3, "undesirable_weight": 1.5})
    assert (built.options.beta, built.options.desirable_weight, built.options.undesirable_weight) == (0.3, 1.0, 1.5)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"beta": 0}, r"model.objective_options.beta=0: must be a finite number > 0"),
        ({"beta": float("nan")}, r"model.objective_options.beta=nan"),
        ({"beta": True}, r"model.objective_options.beta=True"),
        ({"desirable_weight": -1}, r"model.objective_options.desirable_weight=-1"),
        ({"undesirable_weight": float("inf")}, r"model.objective_options.undesirable_weight=inf"),
        ({"undesirable_weight": "1"}, r"model.objective_options.undesirable_weight=1"),
        ({"bta": 1}, r"model.objective_options: unknown field\(s\) \['bta'\] for kto"),
    ],
)
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        build_objective("kto", objective_options=options)


def test_options_of_other_objectives_and_language_model_terms_are_refused():
    with pytest.raises(ValueError, match=r"model.dpo is set but model.objective=kto"):
        build_objective("kto", {"beta": 0.1})
    with pytest.raises(
        ValueError, match=r"model.objective_options is set but model.objective=lm: set model.objective: kto"
    ):
        build_objective("lm", objective_options={"beta": 0.1})
    with pytest.raises(ValueError, match=r"model.mtp_loss_weight=0.3 with model.objective=kto"):
        build_objective("kto", mtp_loss_weight=0.3)
    with pytest.raises(ValueError, match=r"model.moe_aux_loss_coef=0.01 with model.objective=kto"):
        build_objective("kto", moe_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match=r"model.objective=kto with model.lora.targets naming \['router'\]"):
        build_objective("kto", lora=LoraConfig(rank=4, targets=["attention", "router"]))


def test_batches_of_other_kinds_are_refused():
    batch = pack(sample_records())
    model = model_of(3, torch.float32)
    objective = KtoObjective(KtoOptions())
    objective.set_reference_model(model_of(3, torch.float32))
    plain = {k: v for k, v in batch.items() if k not in ("unpaired", "unpaired_label")}
    with pytest.raises(ValueError, match=r"model.objective=kto needs unpaired feedback.*data.format: unpaired"):
        objective.micro_batch(model, plain)
    with pytest.raises(ValueError, match=r"no `unpaired_label` ids.*data.format: unpaired"):
        objective.micro_batch(model, {k: v for k, v in batch.items() if k != "unpaired_label"})
    with pytest.raises(ValueError, match=r"batch\['unpaired_label'\] \(2, 3\).*must be .*\(2, 33\)"):
        objective.micro_batch(model, {**batch, "unpaired_label": batch["unpaired_label"][:, :3]})
    with pytest.raises(ValueError, match=r"preference pairs .*model.objective=kto.*set model.objective: dpo"):
        objective.micro_batch(model, {**batch, "preference": batch["unpaired"]})
    with pytest.raises(ValueError, match=r"unpaired feedback .*data.format: unpaired.*set model.objective: kto"):
        LanguageModelObjective().micro_batch(model, batch)
    with pytest.raises(ValueError, match=r"model.objective=dpo needs preference pairs"):
        build_objective("dpo", {"reference_free": True}).micro_batch(model, batch)


def test_the_plan_counts_what_kto_declares():
    """`step35 plan` asks the objective: a frozen copy (the bytes of DPO's, the same rule) and one more forward
    without gradients per micro-batch; under LoRA no copy at all."""
    from pathlib import Path

    from step35.plan.devices import DEVICES
    from step35.plan.planner import make_plan, sharded_state
    from step35.plan.report import text
    from step35.plan.settings import read_settings

    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    world = ["--trainer.devices", "2", "--trainer.strategy", "step35.strategy.Step35Strategy"]
    world += ["--trainer.strategy.expert_parallel_size", "2", "--model.mtp_loss_weight", "0"]

    def settings(objective: str, *extra: str):
        return read_settings(["--config", tiny, "--model.objective", objective, *world, *extra])

    kto = settings("kto", "--model.objective_options", "{beta: 0.2}")
    assert kto.objective_needs.extra_forwards == 1 and kto.objective_needs.reference == FROZEN_COPY
    for rank in (0, 1):
        held = sharded_state(kto, rank=rank).state.reference
        assert held > 0 and held == sharded_state(settings("dpo"), rank=rank).state.reference
    lines = text(make_plan(kto, DEVICES["h100"], allocator_margin=0.1)).splitlines()
    assert any(line.startswith("objective  kto: 1 forward(s) without gradients") for line in lines), lines
    lora = settings("kto", "--model.lora", "{rank: 4}")
    assert lora.objective_needs.reference == ADAPTERS_OFF and sharded_state(lora, rank=0).state.reference == 0


# ----------------------------------------------------------------------------------- learning
SENTENCE = [17, 42, 99, 5, 230, 311, 77, 8, EOS]  # one fixed completion
WORDS = list(range(500, 513))  # random words: 9 of these 13 ids, drawn anew for every record


class Windows(torch.utils.data.Dataset):
    """Rows of 4 records (2 of the sentence, 2 of random words) with prompts of 3 random ids; `swapped` labels the
    random words desirable and the sentence undesirable."""

    def __init__(self, swapped: bool, seed: int = 0, rows: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(rows):
            records = []
            for i in range(4):
                prompt = torch.randint(2, 400, (3,), generator=g).tolist()
                noise = [WORDS[j] for j in torch.randint(0, len(WORDS), (8,), generator=g)] + [EOS]
                sentence = i % 2 == 0
                records.append((prompt, SENTENCE if sentence else noise, sentence != swapped))
            self.rows.append(pack([mismatched(records)], seq_len=96))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {k: v[0] for k, v in self.rows[i].items()}


def kto_fit(tmp_path, swapped: bool) -> tuple[list[dict], object]:
    import lightning.pytorch as pl

    from step35.module import Step35LightningModule

    module = Step35LightningModule(
        config="tiny",
        objective="kto",
        objective_options={"beta": 0.1},
        num_mtp_layers=0,
        lr=3e-3,
        warmup_steps=2,
        weight_decay=0.0,
    )
    rows: list[dict] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    loader = torch.utils.data.DataLoader(Windows(swapped), batch_size=2)
    trainer = make_trainer(max_steps=30, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[Record()])
    trainer.fit(module, train_dataloaders=loader)
    return rows, module


def sentence_gap(model) -> float:
    """Mean over held-out prompts of log p(SENTENCE) - log p(random words), by plain forwards (no objective code)."""
    g = torch.Generator().manual_seed(1)
    gaps = []
    for _ in range(8):
        prompt = torch.randint(2, 400, (3,), generator=g).tolist()
        noise = [WORDS[j] for j in torch.randint(0, len(WORDS), (8,), generator=g)] + [EOS]
        with torch.no_grad():
            gaps.append(float(completion_logp(model, prompt, SENTENCE) - completion_logp(model, prompt, noise)))
    return sum(gaps) / len(gaps)


@pytest.mark.heavy  # two Lightning fits of 30 steps
def test_kto_learns_the_desirable_completion_and_the_opposite_when_swapped(tmp_path):
    """The sentence's reward rises above the random words' when it is desirable, and falls below them with the
    labels swapped; the trained model itself (plain forwards) moves its preference the same way."""
    reward = {}
    for swapped in (False, True):
        rows, module = kto_fit(tmp_path, swapped)
        first = rows[0]
        assert first["train/desirable_reward"] == first["train/undesirable_reward"] == first["train/kl"] == 0.0
        late = rows[-5:]
        desirable = sum(r["train/desirable_reward"] for r in late) / 5
        undesirable = sum(r["train/undesirable_reward"] for r in late) / 5
        sentence, noise = (undesirable, desirable) if swapped else (desirable, undesirable)
        start = module.objective.reference_model  # the frozen copy: the run's start
        reward[swapped] = (sentence, noise, sentence_gap(module.model), sentence_gap(start))
    (sentence, noise, trained, before), (sentence_s, noise_s, trained_s, before_s) = reward[False], reward[True]
    assert sentence > noise + 2.0, reward  # the desirable reward rose above the undesirable ...
    assert sentence_s < noise_s - 2.0, reward  # ... and the opposite with the labels swapped
    assert before == pytest.approx(before_s, abs=1e-9)  # the same start model
    assert trained > before + 10.0 and trained_s < before - 10.0, reward


# ----------------------------------------------------------------------------------- the recipe, end to end
@pytest.mark.heavy  # a short fit through the CLI in this process
def test_the_kto_recipe_trains_on_the_builtin_unpaired_records(tmp_path, builtin_cache, capfd):
    """configs/tiny-kto.yaml as shipped, on a tiny HF start folder instead of the fine-tune's export, three steps:
    the built-in `unpaired` records reach the KTO objective through the data module and the CLI, the frozen
    reference copy is the start (both rewards and z0 exactly 0 at the first step), and validation logs KTO's values."""
    from step35.data import builtin_tokenizer_dir
    from tests.helpers import hf_base, metric_rows, steps_of
    from tests.runner import ROOT, cli_fit

    base = hf_base(tmp_path / "start", seed=1)
    tokenizer = builtin_tokenizer_dir(cache_dir=builtin_cache)  # carries step35's default chat template
    run = tmp_path / "run"
    overrides = [f"--model.checkpoint={base}", f"--data.tokenizer={tokenizer}", "--trainer.max_steps=3"]
    overrides += ["--trainer.log_every_n_steps=1", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2"]
    overrides += ["--data.seq_len=192", "--data.micro_batch_size=2", "--trainer.enable_progress_bar=false"]
    cli_fit(capfd, ROOT / "configs" / "tiny-kto.yaml", run, builtin_cache, *overrides)
    rows = metric_rows(run / "csv" / "version_0")
    first = min(steps_of(rows, "train/kto_loss"))
    for name in ("train/desirable_reward", "train/undesirable_reward", "train/kl"):
        assert steps_of(rows, name)[first] == 0.0, (name, steps_of(rows, name))
    assert steps_of(rows, "train/kto_loss")[first] == pytest.approx(0.5)  # 1 - sigmoid(0), both weights 1
    assert steps_of(rows, "train/desirable_records") and steps_of(rows, "train/undesirable_records")
    assert set(steps_of(rows, "val/kto_loss")) == {2} and steps_of(rows, "val/kl")
