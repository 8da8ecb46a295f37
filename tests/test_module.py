"""The LightningModule in-process: starting from an HF checkpoint, the LR schedule, optimizer
groups, and the setup-time checks."""

import math

import lightning.pytorch as pl
import pytest
import torch

from step35.checkpoint.hf.pretrained import load_pretrained, save_pretrained
from step35.config import preset
from step35.data import Step35DataModule
from step35.model import Step35ForCausalLM
from step35.module import Step35LightningModule
from step35.schedule import warmup_cosine
from tests.helpers import make_trainer


class FirstLoss(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def trainer(**kw) -> pl.Trainer:
    return make_trainer(**({"max_steps": 1, "enable_checkpointing": False} | kw))


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(seed=123)
    save_pretrained(model, path)
    return path


def test_training_starts_from_hf_checkpoint(hf_checkpoint, builtin_cache):
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    module = Step35LightningModule(checkpoint=str(hf_checkpoint), mtp_loss_weight=0.0, lr=0.0, warmup_steps=1)
    record = FirstLoss()
    trainer(callbacks=[record]).fit(module, datamodule=data)
    # Independent: the checkpoint loaded directly, the first batch of a fresh identical stream.
    direct_data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    direct_data.trainer = None
    direct_data.setup("fit")
    batch = next(iter(direct_data.train_dataloader()))
    tokens = batch["input_ids"]
    loaded = load_pretrained(hf_checkpoint)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(loaded(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert record.losses[0] == pytest.approx(expected.item(), rel=1e-5)
    # and the weights are the checkpoint's, not the from-scratch init
    fresh = Step35ForCausalLM(preset("tiny"))
    fresh.init_weights(seed=0)
    assert not torch.equal(loaded.lm_head.weight, fresh.lm_head.weight)


def test_warmup_cosine_schedule():
    f = warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_and_router_bias_not_optimised():
    module = Step35LightningModule(config="tiny")
    module.trainer = trainer(max_steps=10)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in module.model.named_parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(names[id(p)].endswith("norm.weight") for p in no_decay["params"])
    assert not any(names[id(p)].endswith("norm.weight") for p in decay["params"])
    optimised = {id(p) for g in opt.param_groups for p in g["params"]}
    bias = module.model.model.layers[1].moe.router_bias
    assert id(bias) not in optimised and not bias.requires_grad
    trainable = [p for p in module.model.parameters() if p.requires_grad]
    assert len(optimised) == len(trainable)
    # mtp_loss_weight 0 (the default): the MTP layer is kept but frozen, so it holds no optimizer state
    mtp = module.model.model.mtp_layers[0]
    assert all(not p.requires_grad for p in mtp.parameters())
    assert len(trainable) == len(list(module.model.parameters())) - len(list(mtp.parameters()))


def test_sequence_longer_than_model_supports_is_refused(builtin_cache):
    data = Step35DataModule(seq_len=8192, micro_batch_size=1, cache_dir=str(builtin_cache))
    module = Step35LightningModule(config="tiny")  # max_position_embeddings 4096
    with pytest.raises(ValueError, match=r"data.seq_len=8192 .*max_position_embeddings=4096"):
        trainer().fit(module, datamodule=data)


def test_configure_model_leaves_nothing_on_meta():
    module = Step35LightningModule(config="tiny")
    module.trainer = trainer()
    module.configure_model()
    assert not any(t.is_meta for t in module.model.state_dict().values())
    assert not any(b.is_meta for b in module.model.buffers())
    assert all(int(b.sum()) == 0 for n, b in module.model.named_buffers() if n.endswith("tokens_per_expert"))


@pytest.mark.heavy  # training runs in three precisions
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_precisions_train(precision, builtin_cache):
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    module = Step35LightningModule(
        config="tiny", mtp_loss_weight=0.3, lr=3e-3, warmup_steps=1, moe_bias_update_rate=1e-3
    )
    record = FirstLoss()
    trainer(max_steps=6, precision=precision, callbacks=[record], gradient_clip_val=1.0).fit(module, datamodule=data)
    assert len(record.losses) == 6 and all(math.isfinite(x) for x in record.losses)
    assert 8.0 < record.losses[0] < 9.5  # ~ln(1024) x (1 + 0.3 for MTP) at init, whatever the precision
    weights = {p.dtype for p in module.model.parameters()}
    assert weights == ({torch.bfloat16} if precision == "bf16-true" else {torch.float32})
    bias = module.model.model.layers[1].moe.router_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # fp32 and updated, even under bf16-true


def test_config_overrides_switch_training_conventions(tmp_path):
    from step35.config import ConfigError

    module = Step35LightningModule(config="tiny", config_overrides={"rope_scaling": None, "sliding_window": 65})
    assert module.model_config.rope_scaling is None and module.model_config.sliding_window == 65
    assert not module.model_config.layer(0).rope_scaled  # full layers no longer scaled
    module.trainer = trainer()
    module.configure_model()
    assert module.model.model.layers[1].self_attn.window == 65
    with pytest.raises(ConfigError, match="moe_top_k"):
        Step35LightningModule(config="tiny", config_overrides={"moe_top_k": 99})
