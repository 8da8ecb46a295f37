"""Fine-tuning on conversations, end to end through the module and the data module: only the assistant's
tokens are trained (prompts are not), on the built-in conversation set with step35's default template."""

from __future__ import annotations

import json
import random

import lightning.pytorch as pl
import pytest

from step35.data import Step35DataModule
from step35.module import Step35LightningModule
from tests.helpers import make_trainer

REPLY = "The answer is always the same sentence."


class LossLog(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def random_word_conversations(path, n: int, seed: int = 0) -> None:
    """User turns of random letters (nothing to learn), one fixed assistant reply (everything to learn)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(
                "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 5)))
                for _ in range(rng.randint(3, 6))
            )
            messages = [{"role": "user", "content": words}, {"role": "assistant", "content": REPLY}]
            f.write(json.dumps({"messages": messages}) + "\n")


def fit(data_file, cache, train_on: str, steps: int) -> list[float]:
    pl.seed_everything(0)
    module = Step35LightningModule(config="tiny", lr=3e-3, warmup_steps=5, weight_decay=0.0, mtp_loss_weight=0.3)
    data = Step35DataModule(
        files=str(data_file), train_on=train_on, seq_len=64, micro_batch_size=4, cache_dir=str(cache), val_batches=0
    )
    log = LossLog()
    trainer = make_trainer(max_steps=steps, enable_checkpointing=False, callbacks=[log], gradient_clip_val=1.0)
    trainer.fit(module, datamodule=data)
    assert data.train_on == train_on and data._train_sources[0].format == "chat"  # detected from `messages`
    return log.losses


@pytest.mark.heavy  # a training run of 10 s or more
@pytest.mark.timeout(900)
def test_assistant_only_loss_learns_the_fixed_reply_and_all_tokens_cannot(tmp_path, builtin_cache):
    """The reply is the same in every conversation: trained on the assistant's tokens only, the loss falls
    to near zero. Trained on every token (random user words included), it stays high: the prompts are
    unpredictable. So a mask that let prompt tokens through would show here."""
    data_file = tmp_path / "fixed_reply.jsonl"
    random_word_conversations(data_file, 400)
    assistant = fit(data_file, builtin_cache, "assistant", steps=40)
    everything = fit(data_file, builtin_cache, "all", steps=40)
    tail = lambda losses: sum(losses[-5:]) / 5  # noqa: E731
    print(
        f"assistant-only loss {assistant[0]:.2f} -> {tail(assistant):.3f}; all tokens {everything[0]:.2f} -> "
        f"{tail(everything):.3f}"
    )
    assert tail(assistant) < 0.15, assistant
    assert tail(everything) > 1.0, everything
