"""The shipped YAML recipes parse, their parallel layout is valid for their world size, and the
CLI wires the checkpoint's tokenizer into the data when none is named."""

import shutil
from pathlib import Path

import pytest
import yaml

from step35.checkpoint.hf.pretrained import save_pretrained
from step35.config import preset
from step35.parallel import ParallelDims

ROOT = Path(__file__).parent.parent
RECIPES = {"configs/flash-196b-4k-npu.yaml": (192, 96, "npu"), "configs/flash-196b-4k-gpu.yaml": (64, 32, "gpu")}


@pytest.mark.parametrize("path", sorted(RECIPES))
def test_production_recipe_is_consistent(path):
    world, ep, accelerator = RECIPES[path]
    cfg = yaml.safe_load((ROOT / path).read_text())
    trainer = cfg["trainer"]
    assert trainer["devices"] * trainer["num_nodes"] == world and trainer["accelerator"] == accelerator
    strategy = trainer["strategy"]
    assert strategy["class_path"] == "step35.strategy.Step35Strategy"
    assert strategy["init_args"]["expert_parallel_size"] == ep
    dims = ParallelDims(world, ep, num_experts=preset("flash-196b").moe_num_experts)  # raises if inconsistent
    assert dims.efsdp == 2
    assert cfg["data"]["seq_len"] == 4096


@pytest.mark.parametrize("path", sorted(RECIPES))
def test_production_recipe_parses_with_overrides(path, step35_here):
    code, out, err = step35_here(
        "fit", "--config", path, "--model.checkpoint=/ckpt", "--data.files=/corpus/*.jsonl", "--print_config"
    )
    assert code == 0, err[-3000:]
    printed = yaml.safe_load(out)
    assert printed["model"]["checkpoint"] == "/ckpt" and printed["data"]["files"] == "/corpus/*.jsonl"


def test_checkpoint_tokenizer_is_used_when_data_names_none(tmp_path, builtin_cache):
    from step35.commands.fit import Step35CLI  # noqa: F401
    from step35.data import Step35DataModule, builtin_tokenizer_dir
    from step35.model import Step35ForCausalLM
    from step35.module import Step35LightningModule

    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(0)
    save_pretrained(model, tmp_path / "hf")
    for f in builtin_tokenizer_dir(cache_dir=builtin_cache).iterdir():
        shutil.copy(f, tmp_path / "hf" / f.name)  # a checkpoint folder ships its tokenizer files
    cli = Step35CLI(
        Step35LightningModule,
        Step35DataModule,
        run=False,
        save_config_callback=None,
        args=[
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            f"--model.checkpoint={tmp_path / 'hf'}",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ],
    )
    assert cli.datamodule.hparams.tokenizer == str(tmp_path / "hf")
