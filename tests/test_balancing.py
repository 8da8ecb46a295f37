"""Load balancing: the aux-loss-free router-bias update (it evens out a deliberately skewed router;
rate 0 changes nothing and runs no collective) and the sequence-level auxiliary loss (a hand
computation on a small case, its gradient to the router, the model-level mean over MoE layers, and
the same value and gradients under activation checkpointing)."""

import copy

import lightning.pytorch as pl
import pytest
import torch

import step35.balancing as balancing
from step35.callbacks import ExpertLoadMonitor
from step35.callbacks.expert_load import load_stats
from step35.config import preset
from step35.model import Step35ForCausalLM
from step35.model.moe import MoE, RouterAuxLosses, moe_layers, sequence_balance_loss
from step35.module import Step35LightningModule
from step35.parallel.parallelize import apply_activation_checkpointing
from tests.helpers import make_trainer


def token_loader(batch: int, seq_len: int, n: int, seed: int = 0) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 1024, (n, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=batch)


def fit(module, callbacks, max_steps: int, train) -> pl.Trainer:
    trainer = make_trainer(max_steps=max_steps, enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=train)
    return trainer


class SkewedRouter(Step35LightningModule):
    """Router weight rows of experts 0 and 1 scaled by 8: their sigmoid scores saturate, they win often."""

    def configure_model(self):
        super().configure_model()
        with torch.no_grad():
            for _, moe in moe_layers(self.model):
                moe.gate.weight[:2] *= 8.0


class CVPerStep(pl.Callback):
    def __init__(self, monitor: ExpertLoadMonitor):
        self.monitor, self.cv = monitor, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = self.monitor.last_counts  # the window that ended at this step (every_n_steps=1)
        self.cv.append(sum(load_stats(r)["cv"] for r in rows) / len(rows))


@pytest.fixture
def count_all_reduces(monkeypatch):
    """Shapes of the tensors the expert counter all-reduces (a no-op in one process, but counted)."""
    calls = []
    original = balancing.all_reduce_

    def counting(tensor, op="sum"):
        calls.append(tuple(tensor.shape))
        return original(tensor, op)

    monkeypatch.setattr(balancing, "all_reduce_", counting)
    return calls


@pytest.mark.heavy  # a training run of 10 s or more
@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_bias_update_evens_out_a_skewed_router(rate, count_all_reduces):
    steps = 40
    monitor = ExpertLoadMonitor(every_n_steps=1, heatmap_every_n_steps=0)
    cv = CVPerStep(monitor)
    # lr 0: the weights stay, only the router bias can change the routing.
    module = SkewedRouter(config="tiny", lr=0.0, warmup_steps=1, moe_bias_update_rate=rate)
    fit(module, [monitor, cv], max_steps=steps, train=token_loader(4, 32, n=4 * steps))
    first, last = sum(cv.cv[:3]) / 3, sum(cv.cv[-10:]) / 10
    biases = torch.stack([moe.router_bias for _, moe in moe_layers(module.model)])  # [layers, experts]
    per_step = [c for c in count_all_reduces if c == (4, 8)]
    if rate == 0:
        assert torch.equal(biases, torch.zeros_like(biases))  # the biases never change
        assert last > 0.8 * first, (first, last)  # and the skew stays (CV ~0.5)
        assert not module.expert_counter.reduce_every_step
    else:
        assert last < 0.6 * first, (first, last)  # measured: ~0.49 -> ~0.26 (noise floor ~0.18)
        assert (biases[:, :2] < 0).all() and (biases[:, 2:] > 0).all()  # favoured experts pushed down
        # every bias is a whole number of +-rate steps, at most one per optimizer step
        assert torch.allclose(biases / rate, (biases / rate).round(), atol=1e-3)
        assert biases.abs().max() <= steps * rate + 1e-6
    # Collectives of the counts (no-ops in one process, but counted): with rate > 0 one per optimizer
    # step for the bias update, and the monitor's windows are then already global (no second one);
    # with rate 0 only the monitor's, one per window (every step here).
    assert len(per_step) == steps and len(count_all_reduces) == steps


def test_rate_zero_without_monitor_runs_no_collective(count_all_reduces):
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    fit(module, [], max_steps=3, train=token_loader(2, 16, n=6))
    assert count_all_reduces == []
    assert all(int(moe.router_bias.abs().sum()) == 0 for _, moe in moe_layers(module.model))


def test_bias_update_needs_a_router_bias(tmp_path):
    import json

    from tests.helpers import tiny_config_dict

    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict(use_moe_router_bias=False)))
    with pytest.raises(ValueError, match="moe_bias_update_rate=0.01 needs a router bias"):
        Step35LightningModule(config=str(tmp_path / "config.json"), moe_bias_update_rate=0.01)


# ------------------------------------------------------------------------------- aux loss
def test_sequence_balance_loss_by_hand():
    torch.manual_seed(0)
    E, K, H, B, S = 4, 2, 8, 2, 5
    moe = MoE(H, E, K, intermediate_size=4)
    with torch.no_grad():
        moe.gate.weight.normal_()
        moe.router_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # selection bias in play
        for proj in (moe.gate_proj, moe.up_proj, moe.down_proj):
            proj.weight.normal_(std=0.1)
    x = torch.randn(B, S, H)
    sink = RouterAuxLosses()
    moe(x, sink)
    assert len(sink.losses) == 1
    # By hand, one sequence and one token at a time.
    W, bias = moe.gate.weight.detach(), moe.router_bias
    expected = 0.0
    for b in range(B):
        P = [0.0] * E
        routed = [0] * E
        for t in range(S):
            scores = [1 / (1 + torch.exp(-(W[e] @ x[b, t])).item()) for e in range(E)]
            total = sum(scores)
            for e in range(E):
                P[e] += scores[e] / total / S
            chosen = sorted(range(E), key=lambda e: scores[e] + bias[e].item(), reverse=True)[:K]
            for e in chosen:
                routed[e] += 1
        f = [E / (K * S) * routed[e] for e in range(E)]
        expected += sum(f[e] * P[e] for e in range(E)) / B
    assert sink.losses[0].item() == pytest.approx(expected, rel=1e-5)
    # the gradient reaches the router weight (through P; f is a count)
    sink.losses[0].backward()
    grad = moe.gate.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # uniform scores and perfectly even routing give exactly 1
    uniform = sequence_balance_loss(torch.full((4, 4), 0.5), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), 1)
    assert uniform.item() == pytest.approx(1.0)


def _model(seed: int = 0) -> Step35ForCausalLM:
    torch.manual_seed(seed)
    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(seed)
    with torch.no_grad():
        for _, moe in moe_layers(model):
            moe.gate.weight.normal_(std=0.5)  # a router that routes unevenly
    return model


def test_model_aux_loss_is_coef_times_mean_over_layers_and_survives_checkpointing():
    coef = 0.1
    model = _model()
    tokens = torch.randint(0, 1024, (3, 17), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # Independent per-layer values: route() on each MoE input, through the formula.
    per_layer = []
    handles = [
        moe.register_forward_pre_hook(
            lambda m, args: per_layer.append(
                sequence_balance_loss(*m.route(args[0].reshape(-1, args[0].shape[-1]))[:2], args[0].shape[0]).detach()
            )
        )
        for _, moe in moe_layers(model)
    ]
    out = model.loss(inputs, labels, moe_aux_loss_coef=coef)
    for h in handles:
        h.remove()
    assert len(per_layer) == 4
    assert out.aux_loss.item() == pytest.approx(coef * torch.stack(per_layer).mean().item(), rel=1e-6)
    assert out.loss.item() == pytest.approx(out.lm_loss.item() + out.aux_loss.item(), rel=1e-6)
    assert out.aux_loss.item() > coef  # the uneven router is penalised (1 = balanced)
    # coef 0: not computed; the logits API is unchanged
    assert model.loss(inputs, labels).aux_loss is None
    assert model(inputs).shape == (3, 16, 1024)
    # Gradients of the aux loss alone reach every router, identical with activation checkpointing.
    grads = {}
    for name, m in (("plain", model), ("checkpointed", copy.deepcopy(model))):
        if name == "checkpointed":
            for layer in m.model.layers:
                apply_activation_checkpointing(layer, "full")
        m.zero_grad()
        aux = m.loss(inputs, labels, moe_aux_loss_coef=coef).aux_loss
        aux.backward()
        grads[name] = (aux.detach(), [moe.gate.weight.grad.clone() for _, moe in moe_layers(m)])
    (a_plain, g_plain), (a_ckpt, g_ckpt) = grads["plain"], grads["checkpointed"]
    assert torch.equal(a_plain, a_ckpt)
    for gp, gc in zip(g_plain, g_ckpt):
        assert gp.abs().sum() > 0
        torch.testing.assert_close(gc, gp, rtol=1e-5, atol=1e-8)


def test_module_adds_and_logs_aux_loss():
    module = Step35LightningModule(config="tiny", warmup_steps=1, moe_aux_loss_coef=0.01)
    trainer = fit(module, [], max_steps=2, train=token_loader(2, 16, n=4))
    aux = trainer.callback_metrics["train/aux_loss"]
    assert 0 < aux.item() < 0.1  # 0.01 x a balance loss near 1
