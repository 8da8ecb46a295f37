"""DPO learns what the pairs say (issue 26): a real fit through the DataModule (a jsonl file of preference pairs,
the built-in tokenizer, packing, the DPO objective, the frozen reference) on pairs whose chosen reply is always
the same sentence and whose rejected reply is random words. The reward accuracy reaches 0.9 within a few dozen
steps, and the trained model itself (plain forward, full logits, no objective code) prefers the sentence over
random words more than the start model does. With chosen and rejected swapped it learns the opposite."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.helpers import make_trainer

SENTENCE = "The quick brown fox jumps over the lazy dog."
WORDS = "apple river stone blue seven lamp under green table window orange music paper".split()


def write_pairs(path, swapped: bool, n: int = 200) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            noise = " ".join(rng.choice(WORDS) for _ in range(9))
            chosen, rejected = (noise, SENTENCE) if swapped else (SENTENCE, noise)
            f.write(
                json.dumps({"prompt": f"Question {i}: say the line.", "chosen": chosen, "rejected": rejected}) + "\n"
            )


def reply_logp(model, tokenizer, prompt: str, reply: str) -> float:
    """log p(reply + EOS | prompt) by a plain forward of the whole sequence (full logits)."""
    prompt_ids = tokenizer.encode(prompt)
    reply_ids = tokenizer.encode(reply) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + reply_ids])
    with torch.no_grad():
        logps = torch.log_softmax(model(ids[:, :-1]).double(), dim=-1)[0]
    targets = ids[0, 1:]
    start = len(prompt_ids) - 1  # the slot predicting the reply's first token
    return float(logps[start:, :].gather(1, targets[start:, None]).sum())


def preference_of(model, tokenizer) -> float:
    """Mean over held-out prompts of log p(SENTENCE) - log p(random words)."""
    rng = random.Random(1)
    gaps = []
    for i in range(8):
        prompt = f"Question {1000 + i}: say the line."
        noise = " ".join(rng.choice(WORDS) for _ in range(9))
        gaps.append(reply_logp(model, tokenizer, prompt, SENTENCE) - reply_logp(model, tokenizer, prompt, noise))
    return sum(gaps) / len(gaps)


def dpo_fit(tmp_path, builtin_cache, swapped: bool):
    import lightning.pytorch as pl

    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    pairs = tmp_path / ("swapped.jsonl" if swapped else "pairs.jsonl")
    write_pairs(pairs, swapped)
    module = Step35LightningModule(
        config="tiny", objective="dpo", dpo={"beta": 0.1}, num_mtp_layers=0, lr=3e-3, warmup_steps=2, weight_decay=0.0
    )
    data = Step35DataModule(
        files=str(pairs),
        format="preference",
        seq_len=96,
        micro_batch_size=2,
        val_fraction=0,
        cache_dir=str(builtin_cache),
    )
    rows: list[dict] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    trainer = make_trainer(max_steps=30, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[Record()])
    trainer.fit(module, datamodule=data)
    return module, data, rows


@pytest.mark.heavy  # two Lightning fits of 30 steps
def test_dpo_learns_the_preferred_reply_and_the_opposite_when_swapped(tmp_path, builtin_cache):
    from step35.checkpoint.hf.materialize import materialize
    from step35.model import build_model

    gaps = {}
    for swapped in (False, True):
        module, data, rows = dpo_fit(tmp_path, builtin_cache, swapped)
        assert rows[0]["train/dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is the reference
        late = [r["train/reward_accuracy"] for r in rows[-5:]]
        assert min(late) >= 0.9, [round(r["train/reward_accuracy"], 2) for r in rows]
        start = build_model(module.model_config, 0)
        materialize(start, "cpu", seed=0)  # the run's start: the init of init_seed 0, as the reference
        tokenizer = data.tokenizer
        gaps[swapped] = (preference_of(module.model, tokenizer), preference_of(start, tokenizer))
    (trained, before), (trained_swapped, before_swapped) = gaps[False], gaps[True]
    assert before == pytest.approx(before_swapped, abs=1e-9)  # the same start model
    assert trained > before + 5.0, gaps  # the sentence gained against random words ...
    assert trained_swapped < before - 5.0, gaps  # ... and lost against them with the labels swapped


@pytest.mark.heavy  # three short in-process fits
def test_a_resumed_dpo_run_continues_bit_for_bit(tmp_path, builtin_cache, capfd):
    """Stopped at step 5 and resumed, a DPO run logs the losses and rewards of the run that went through: the
    data stream of pairs, the policy and its optimizer state come back, and the reference is the start model."""
    from tests.helpers import RUN_CONFIG, run_losses, write_run_config
    from tests.runner import cli_fit

    pairs = tmp_path / "pairs.jsonl"
    write_pairs(pairs, swapped=False)
    # decay_steps fixed: by default the schedule's length is the max_steps of the run that started (5 for the cut one)
    text = RUN_CONFIG.replace(
        "  mtp_loss_weight: 0.3\n", "  objective: dpo\n  dpo:\n    beta: 0.2\n  decay_steps: 10\n"
    )
    text = text.replace("  seq_len: 32\n", f"  seq_len: 96\n  format: preference\n  files: {pairs}\n")
    assert "objective: dpo" in text and "format: preference" in text
    config = write_run_config(tmp_path, text)
    cli_fit(capfd, config, tmp_path / "through", builtin_cache)
    cli_fit(capfd, config, tmp_path / "cut", builtin_cache, "--trainer.max_steps=5")
    cli_fit(capfd, config, tmp_path / "cut", builtin_cache, "--ckpt_path=last")
    for column in ("train/dpo_loss", "train/chosen_reward", "train/rejected_logp"):
        through, resumed = run_losses(tmp_path / "through", column), run_losses(tmp_path / "cut", column)
        assert sorted(through) == sorted(resumed) == list(range(10)), (through, resumed)
        assert [resumed[s] for s in range(5, 10)] == [through[s] for s in range(5, 10)], column  # bitwise
