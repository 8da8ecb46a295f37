"""Options that cannot mean anything are refused at start, with the option named: config overrides
that name no field, numbers out of range, unknown presets; and the strategy given by class path alone."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from step35.config import FIELD_NAMES, ConfigError, Step35Config, load_config
from step35.module import Step35LightningModule
from tests.helpers import flash_config_dict, tiny_config_dict

ROOT = Path(__file__).parent.parent


# ----------------------------------------------------------------------------------- config overrides
def test_misspelt_override_is_refused_with_the_valid_fields():
    with pytest.raises(ConfigError) as err:
        Step35LightningModule(config="tiny", config_overrides={"hiden_size": 64})
    message = str(err.value)
    assert message.startswith("model.config_overrides: unknown config field 'hiden_size'")
    assert "did you mean 'hidden_size'?" in message
    listed = message.split("the fields are: ")[1].split(", ")
    assert set(listed) == FIELD_NAMES and "extra" not in listed and "key_order" not in listed


def test_override_of_a_real_field_and_of_an_alias_applies():
    module = Step35LightningModule(config="tiny", config_overrides={"hidden_size": 64, "dtype": "float64"})
    assert module.model_config.hidden_size == 64 and module.model_config.torch_dtype == "float64"
    # A file that spells the field `share_expert_dims` keeps that spelling when the override changes it.
    raw = tiny_config_dict()
    raw["share_expert_dims"] = raw.pop("share_expert_dim")
    changed = Step35Config.from_dict(raw).with_overrides({"share_expert_dims": 32}).to_dict()
    assert changed["share_expert_dims"] == 32 and "share_expert_dim" not in changed


def test_release_config_json_with_keys_for_other_tools_is_still_accepted(tmp_path):
    raw = flash_config_dict()
    raw["transformers_version"] = "4.57.0"  # not a field: kept as it is, as are auto_map, architectures, ...
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_config(tmp_path)
    assert config.to_dict() == raw
    assert {"auto_map", "architectures", "model_type", "transformers_version"} <= set(config.extra)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("hidden_size", "64", "must be int"),
        ("hidden_size", 64.0, "must be int"),
        ("use_moe", "false", "must be bool"),
        ("moe_top_k", True, "must be int"),
        ("sliding_window", None, "must be int"),
        ("rope_scaling", "llama3", "must be object (dict) or null"),
        ("layer_types", "full_attention", "must be list"),
        ("moe_router_scaling_factor", "3", "must be float"),
    ],
)
def test_wrongly_typed_field_is_refused_by_name(field, value, expected):
    with pytest.raises(ConfigError, match=re.escape(f"config field {field}: {expected}")):
        Step35LightningModule(config="tiny", config_overrides={field: value})
    raw = tiny_config_dict()  # the same check guards a config.json
    raw[field] = value
    with pytest.raises(ConfigError, match=re.escape(f"config field {field}: {expected}")):
        Step35Config.from_dict(raw)


def test_json_numbers_for_float_fields_may_be_ints():
    config = Step35Config.from_dict({**tiny_config_dict(), "moe_router_scaling_factor": 3, "rope_theta": 10000})
    assert config.layer(0).rope_theta == 10000.0


# ----------------------------------------------------------------------------------- presets and paths
def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError) as err:
        Step35LightningModule(config="tyni")
    message = str(err.value)
    assert message.startswith("model.config=tyni: unknown preset 'tyni'")
    assert "did you mean 'tiny'?" in message and "flash-196b, tiny" in message


@pytest.mark.parametrize("name", ["./my/config.json", "runs/model", "~/nowhere-step35", "model.json"])
def test_missing_path_says_not_found(name):
    with pytest.raises(ConfigError) as err:
        Step35LightningModule(config=name)
    message = str(err.value)
    assert "no such file or folder" in message and "unknown preset" not in message and "tiny" in message


def test_missing_checkpoint_folder_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"model.checkpoint=.*no such file or folder"):
        Step35LightningModule(checkpoint=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"model.checkpoint=.*no config.json there"):
        Step35LightningModule(checkpoint=str(tmp_path))  # exists, but holds no config.json


# ----------------------------------------------------------------------------------- optimisation options
@pytest.mark.parametrize(
    "option,value,message",
    [
        ("lr", -1.0, "model.lr=-1.0: must be >= 0"),
        ("lr", math.nan, "model.lr=nan: must be >= 0"),
        ("warmup_steps", -5, "model.warmup_steps=-5: must be >= 0"),
        ("decay_steps", 0, "model.decay_steps=0: must be > model.warmup_steps"),
        ("decay_steps", 50, "model.decay_steps=50: must be > model.warmup_steps"),  # warmup is 100
        ("min_lr_ratio", -0.1, "model.min_lr_ratio=-0.1: must be between 0 and 1"),
        ("min_lr_ratio", 1.5, "model.min_lr_ratio=1.5: must be between 0 and 1"),
        ("weight_decay", -0.1, "model.weight_decay=-0.1: must be >= 0"),
        ("betas", (0.9, 1.0), r"model.betas=\[0.9, 1.0\]: must be two numbers in \[0, 1\)"),
        ("betas", (-0.1, 0.95), r"model.betas=\[-0.1, 0.95\]"),
        ("betas", (0.9,), r"model.betas=\[0.9\]"),
        ("eps", 0.0, "model.eps=0.0: must be > 0"),
        ("loss_chunk_size", 0, "model.loss_chunk_size=0: must be >= 1"),
        ("mtp_loss_weight", -0.3, "model.mtp_loss_weight=-0.3: must be >= 0"),
        ("moe_bias_update_rate", -1e-3, "model.moe_bias_update_rate=-0.001: must be >= 0"),
        ("moe_aux_loss_coef", -1.0, "model.moe_aux_loss_coef=-1.0: must be >= 0"),
        ("num_mtp_layers", 2, "model.num_mtp_layers=2: must be between 0 and the config's num_nextn_predict_layers=1"),
        ("num_mtp_layers", -1, "model.num_mtp_layers=-1"),
    ],
)
def test_nonsensical_option_is_refused_by_name(option, value, message):
    with pytest.raises(ValueError, match=message):
        Step35LightningModule(config="tiny", **{option: value})


def test_mtp_loss_weight_without_mtp_layers_is_refused():
    with pytest.raises(ValueError, match="model.mtp_loss_weight=0.3: no MTP layer is built"):
        Step35LightningModule(config="tiny", num_mtp_layers=0, mtp_loss_weight=0.3)
    Step35LightningModule(config="tiny", num_mtp_layers=0, mtp_loss_weight=0.0)  # fine: nothing asked of MTP


def test_sensible_edges_are_accepted():
    Step35LightningModule(
        config="tiny",
        lr=1e-6,
        warmup_steps=0,
        decay_steps=1,
        min_lr_ratio=0.0,
        weight_decay=0.0,
        betas=(0.0, 0.999),
        loss_chunk_size=1,
    )
    Step35LightningModule(config="tiny", min_lr_ratio=1.0, decay_steps=101)


# ----------------------------------------------------------------------------------- the CLI, as users hit it
# (step35.cli.main in this process, the step35_here fixture: what is checked is the parsing and the message)
@pytest.mark.timeout(700)
def test_cli_strategy_by_class_path_alone_trains(tmp_path, step35_here):
    """`--trainer.strategy step35.strategy.Step35Strategy` with no sub-option: jsonargparse keeps a bare
    class path as a string, which Lightning refused as an unknown strategy name. (Short sequences, one
    validation batch: the parsing and the wrap are what is checked.)"""
    code, out, err = step35_here(
        "fit",
        "--config",
        str(ROOT / "configs/tiny.yaml"),
        "--trainer.strategy",
        "step35.strategy.Step35Strategy",
        "--trainer.max_steps",
        "3",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.log_every_n_steps=1",
        "--data.seq_len=32",
        "--data.micro_batch_size=2",
        "--trainer.limit_val_batches=1",
        "--data.val_batches=1",
    )
    assert code == 0, out[-3000:] + err[-5000:]
    assert "FSDPStep35ForCausalLM" in out  # the model went through Step35Strategy's FSDP2 wrap
    saved = [p.read_text() for p in tmp_path.rglob("config.yaml")]
    assert saved and all("class_path: step35.strategy.Step35Strategy" in text for text in saved)
    metrics = list(tmp_path.rglob("metrics.csv"))
    assert len(metrics) == 1
    with open(metrics[0]) as f:
        losses = {int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")}
    assert losses == {0, 1, 2}, metrics[0].read_text()


def test_cli_strategy_class_path_that_is_not_a_strategy_is_refused(tmp_path, step35_here):
    for value, expected in [
        ("step35.strategy.NoSuchStrategy", "cannot import it"),
        ("step35.module.Step35LightningModule", "is not a lightning.pytorch.strategies.Strategy"),
    ]:
        code, _, err = step35_here(
            "fit",
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "--trainer.strategy",
            value,
            f"--trainer.default_root_dir={tmp_path}",
        )
        assert code != 0
        assert f"trainer.strategy={value!r}" in err and expected in err, err[-3000:]


def test_cli_misspelt_override_fails_before_training(tmp_path, step35_here):
    code, _, err = step35_here(
        "fit",
        "--config",
        str(ROOT / "configs/tiny.yaml"),
        "--model.config_overrides",
        "{hiden_size: 64}",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert code != 0
    assert "unknown config field 'hiden_size' (did you mean 'hidden_size'?)" in err, err[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))


def test_cli_validate_leaves_the_run_folders_config_alone(tmp_path, step35_here, tiny_run):
    """`step35 validate` in a run folder (maybe beside its live fit: validate takes no lock) used to replace
    the run's config.yaml with its own; its config goes to its loggers only."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run[0], run, symlinks=True)
    (run / "config.yaml").write_text("# the live fit's config\n")
    code, out, err = step35_here(
        "validate",
        "--config",
        str(ROOT / "configs/tiny.yaml"),
        f"--run_dir={run}",
        "--ckpt_path=last",
        "--data.seq_len=32",
        "--trainer.limit_val_batches=1",
        "--data.val_batches=1",
        "--model.mtp_loss_weight=0",
    )
    assert code == 0, out[-3000:] + err[-5000:]
    assert "val/loss" in out
    assert (run / "config.yaml").read_text() == "# the live fit's config\n"
