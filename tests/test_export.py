"""A single-file Lightning checkpoint exports back to an HF folder that loads into the same model."""

import lightning.pytorch as pl
import pytest
import torch

from step35.checkpoint.export import export_hf
from step35.cli import main
from step35.data import Step35DataModule
from step35.model import Step35ForCausalLM
from step35.module import Step35LightningModule


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_cache):
    root = tmp_path_factory.mktemp("run")
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1)
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_last=True)])
    trainer.fit(module, datamodule=data)
    return module.model, root / "ckpt" / "last.ckpt"


def test_export_round_trip_fp32(trained, tmp_path):
    model, ckpt = trained
    export_hf(ckpt, tmp_path / "hf", max_shard_size="1MB")
    loaded = Step35ForCausalLM.from_pretrained(tmp_path / "hf")
    reference = model.state_dict()
    assert loaded.state_dict().keys() == reference.keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, reference[name]), name
    init = Step35ForCausalLM(model.config)
    init.init_weights(0)
    assert not torch.equal(loaded.lm_head.weight, init.lm_head.weight)  # the trained weights, not the init


def test_checkpoint_carries_the_model_config(trained):
    from step35.config import preset

    _, ckpt = trained
    meta = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert meta["step35_config"] == preset("tiny").to_dict()


def test_export_to_bf16_keeps_router_bias_fp32(trained, tmp_path):
    model, ckpt = trained
    main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"])
    loaded = Step35ForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.torch_dtype == "bfloat16"
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[1].moe.router_bias.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
