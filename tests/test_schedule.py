"""The LR schedule keeps the length of the run that started it: resuming with another
trainer.max_steps continues the same cosine, model.decay_steps sets a new length."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from step35.data import Step35DataModule
from step35.module import Step35LightningModule
from step35.schedule import WarmupCosineLR
from tests.helpers import make_trainer

LR, WARMUP, FLOOR = 1e-3, 2, 0.1


def by_hand(step: int, total: int) -> float:
    """The schedule written out: linear warmup, then cosine from LR to LR * FLOOR at `total`, then flat."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / (total - WARMUP))
    return LR * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


class RecordLR(pl.Callback):
    def __init__(self):
        self.lr: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]  # the lr of this step


def run(tmp_path, cache, max_steps: int, ckpt_path=None, decay_steps=None) -> dict[int, float]:
    record = RecordLR()
    module = Step35LightningModule(
        config="tiny", lr=LR, warmup_steps=WARMUP, min_lr_ratio=FLOOR, decay_steps=decay_steps
    )
    data = Step35DataModule(seq_len=16, micro_batch_size=1, val_batches=0, cache_dir=str(cache))
    trainer = make_trainer(
        max_steps=max_steps,
        limit_val_batches=None,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[record, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return record.lr


@pytest.mark.heavy  # three training runs
@pytest.mark.timeout(600)
def test_resume_with_other_max_steps_keeps_the_schedule_and_decay_steps_sets_a_new_one(tmp_path, builtin_cache):
    first = run(tmp_path / "first", builtin_cache, max_steps=8)
    assert first == pytest.approx({s: by_hand(s, 8) for s in range(8)}, rel=1e-12)
    checkpoint = tmp_path / "first" / "ckpt" / "epoch=0-step=3.ckpt"
    assert checkpoint.exists(), list((tmp_path / "first" / "ckpt").iterdir())

    # Longer run from step 3: the same curve as the 8-step run, then the floor (not a re-stretched cosine).
    longer = run(tmp_path / "longer", builtin_cache, max_steps=12, ckpt_path=checkpoint)
    assert sorted(longer) == list(range(3, 12))
    assert longer == pytest.approx({s: by_hand(s, 8) for s in range(3, 12)}, rel=1e-12)
    assert all(longer[s] == pytest.approx(LR * FLOOR) for s in range(8, 12))

    # model.decay_steps on resume: its length, from the resumed step on.
    stretched = run(tmp_path / "stretched", builtin_cache, max_steps=12, ckpt_path=checkpoint, decay_steps=12)
    assert stretched == pytest.approx({s: by_hand(s, 12) for s in range(3, 12)}, rel=1e-12)
    assert stretched[5] > longer[5]  # really another curve


def test_schedule_state_is_plain_data_and_another_schedulers_state_is_refused():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = WarmupCosineLR(optimizer, WARMUP, 8, FLOOR)
    state = scheduler.state_dict()
    assert state["total_steps"] == 8
    assert all(isinstance(v, (int, float, bool, list, type(None))) for v in state.values()), state  # weights_only-safe
    # A state saved by another scheduler (torch's LambdaLR) has no length: refused by name, not guessed.
    legacy = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR), lambda s: 1.0
    )
    for _ in range(3):
        legacy.optimizer.step()
        legacy.step()
    fresh = WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR), WARMUP, 20, FLOOR)
    with pytest.raises(ValueError, match="is not step35's warmup-cosine schedule: it has no total_steps"):
        fresh.load_state_dict(legacy.state_dict())
    assert fresh.total_steps == 20 and fresh.last_epoch == 0  # nothing of it was taken
