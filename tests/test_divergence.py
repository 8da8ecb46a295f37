"""DivergenceGuard: an injected NaN gradient or loss is caught before the optimizer step, the step is
skipped with weights, AdamW moments, step counts (and weight decay) untouched and the router bias
not updated, the message names the parameter; consecutive skips and action=stop end the run."""

import lightning.pytorch as pl
import pytest
import torch

from step35.callbacks import DivergenceError, DivergenceGuard
from step35.model.moe import moe_layers
from step35.module import Step35LightningModule
from tests.helpers import make_trainer

NAN_PARAM = "model.layers.3.moe.gate.weight"  # HF name of a router weight


def token_loader(batch: int = 2, seq_len: int = 16, n: int = 32) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 1024, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=batch)


def fit(module, callbacks, max_steps: int, **kw) -> pl.Trainer:
    trainer = make_trainer(
        max_steps=max_steps, enable_checkpointing=False, gradient_clip_val=1.0, callbacks=callbacks, **kw
    )
    trainer.fit(module, train_dataloaders=token_loader())
    return trainer


class NaNGradient(pl.Callback):
    """After backward at the given (0-based) optimizer steps, one element of one parameter's gradient becomes NaN."""

    def __init__(self, steps, name: str = NAN_PARAM):
        self.steps, self.name = set(steps), name

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step in self.steps:
            pl_module.model.get_parameter(self.name).grad.view(-1)[3] = float("nan")


class Snapshots(pl.Callback):
    """Weights, AdamW state and router biases after every optimizer step (1-based step number)."""

    def __init__(self):
        self.after = {}

    def on_train_start(self, trainer, pl_module):
        self.after[0] = self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = self._take(trainer, pl_module)

    @staticmethod
    def _take(trainer, pl_module):
        opt = trainer.optimizers[0]
        state = {
            id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in pl_module.parameters() if p in opt.state
        }
        return (
            {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            state,
            [moe.router_bias.clone() for _, moe in moe_layers(pl_module.model)],
        )


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a
    )


def test_nan_gradient_skips_the_step_and_leaves_everything_unchanged():
    guard, snaps = DivergenceGuard(), Snapshots()
    # weight decay on, lr high enough that any update would show; bias update on
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1, weight_decay=0.1, moe_bias_update_rate=0.01)
    with pytest.warns(UserWarning, match="step skipped"):
        trainer = fit(module, [NaNGradient(steps=[2]), guard, snaps], max_steps=4)
    assert trainer.global_step == 4 and guard.skipped_steps == 1 and guard.consecutive_skips == 0
    assert f"first in backward order: {NAN_PARAM}" in guard.last_message
    assert "non-finite gradients in 1 of" in guard.last_message and "loss" not in guard.last_message
    (w2, s2, b2), (w3, s3, b3), (w4, s4, b4) = snaps.after[2], snaps.after[3], snaps.after[4]
    assert same(w3, w2), "weights changed on the skipped step (update or weight decay)"
    assert same(s3, s2), "AdamW state (exp_avg, exp_avg_sq, step) changed on the skipped step"
    assert all(torch.equal(a, b) for a, b in zip(b3, b2)), "router bias updated from a skipped step"
    assert int(next(iter(s3.values()))["step"]) == 2
    # training goes on afterwards: the next step changes all three
    assert not same(w4, w3) and not same(s4, s3) and not all(torch.equal(a, b) for a, b in zip(b4, b3))
    assert all(torch.isfinite(p).all() for p in w4.values())


class NaNLoss(Step35LightningModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 1 else loss


def test_nan_loss_is_caught():
    guard, snaps = DivergenceGuard(), Snapshots()
    module = NaNLoss(config="tiny", lr=1e-2, warmup_steps=1)
    with pytest.warns(UserWarning, match="non-finite loss"):
        fit(module, [guard, snaps], max_steps=3)
    assert guard.skipped_steps == 1
    assert guard.last_message.startswith("step 1: non-finite loss; non-finite gradients in")
    assert same(snaps.after[2][0], snaps.after[1][0]) and same(snaps.after[2][1], snaps.after[1][1])


def test_consecutive_skips_stop_the_run():
    guard, snaps = DivergenceGuard(max_consecutive_skips=3), Snapshots()
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1)
    with pytest.raises(DivergenceError, match=r"3 consecutive optimizer steps had non-finite values; stopping"):
        with pytest.warns(UserWarning):
            fit(module, [NaNGradient(steps=range(1, 100)), guard, snaps], max_steps=10)
    assert guard.skipped_steps == 3
    assert same(snaps.after[3][0], snaps.after[1][0])  # steps 2 and 3 were skipped, the 4th raised


def test_action_stop_raises_at_once_naming_the_parameter():
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1)
    with pytest.raises(DivergenceError, match=rf"step 1: non-finite gradients .*{NAN_PARAM}"):
        fit(module, [NaNGradient(steps=[1]), DivergenceGuard(action="stop")], max_steps=5)


class HookOrder(pl.Callback):
    def __init__(self, log):
        self.events = log

    def on_before_backward(self, trainer, pl_module, loss):
        self.events.append("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.events.append("callback.on_before_optimizer_step")


class RecordingModule(Step35LightningModule):
    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.order = log

    def training_step(self, batch, batch_idx):
        self.order.append("training_step")
        return super().training_step(batch, batch_idx)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.order.append("configure_gradient_clipping")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.order.append("optimizer_step done")


def test_guard_hook_sees_every_micro_batch_before_clipping():
    log = []
    module = RecordingModule(log, config="tiny", warmup_steps=1)
    fit(module, [HookOrder(log)], max_steps=1, accumulate_grad_batches=2)
    assert log == [
        "training_step",
        "backward",
        "training_step",
        "backward",
        "callback.on_before_optimizer_step",
        "configure_gradient_clipping",
        "optimizer_step done",
    ]
