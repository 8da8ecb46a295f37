"""The step35 command line on the built-in data: what it prints and refuses, validate and export as listed, an
exact resume. (The main job as a user runs it, a subprocess of the README's own command line, is test_readme.py's.)"""

from pathlib import Path

import pytest

from tests.helpers import metric_rows, steps_of
from tests.runner import step35

# Fast data settings of the main job: short sequences, a small batch, one validation batch.
SMALL = ["--data.seq_len=32", "--data.micro_batch_size=2", "--trainer.limit_val_batches=1", "--data.val_batches=1"]


def test_print_config(step35_here):
    code, out, err = step35_here("fit", "--config", "configs/tiny.yaml", "--model.lr=0.01", "--print_config")
    assert code == 0, err[-3000:]
    assert "lr: 0.01" in out and "class_path: step35.data.Step35DataModule" not in out.split("data:")[0]
    assert "seq_len: 128" in out


@pytest.mark.timeout(900)
def test_resume_continues_exactly(tmp_path, step35_here):
    """Kill-free stand-in for a crash: a run resumed from its step-10 checkpoint reproduces steps
    11..20 of an uninterrupted run (model, optimizer, LR schedule and data stream restored). Both in this
    process (the process boundary is test_resume.py's), on short sequences."""

    def fit_here(run: Path, *extra: str) -> dict[int, float]:
        code, out, err = step35_here(
            "fit",
            "--config",
            "configs/tiny.yaml",
            f"--trainer.default_root_dir={run}",
            f"--trainer.logger.init_args.save_dir={run}",
            *SMALL,
            *extra,
        )
        assert code == 0, out[-3000:] + err[-5000:]
        return steps_of(metric_rows(run / "csv" / "version_0"), "train/lm_loss")

    common = [
        "--trainer.max_steps=20",
        "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=1000",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=10",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.dirpath=" + str(tmp_path / "ckpt"),
    ]
    full = fit_here(tmp_path / "full", *common)
    ckpt = sorted((tmp_path / "ckpt").glob("*step=10*.ckpt"))
    assert ckpt, list((tmp_path / "ckpt").iterdir())
    resumed = fit_here(tmp_path / "resumed", *common[:4], f"--ckpt_path={ckpt[0]}")
    later = [s for s in sorted(full) if s > 10]
    assert later and all(s in resumed for s in later), (sorted(full), sorted(resumed))
    for s in later:
        assert resumed[s] == pytest.approx(full[s], rel=1e-6), (s, resumed[s], full[s])


SUBCOMMANDS = ("fit", "validate", "export", "generate", "plan")


@pytest.mark.heavy  # `python -m step35 --help` as a subprocess
def test_help_lists_every_subcommand_and_each_answers(builtin_cache, capsys):
    from step35.cli import main

    listed = step35(["--help"], builtin_cache).stdout  # the installed entry point, as a user types it
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in listed, listed
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0, name
        assert "--" in capsys.readouterr().out, name
    with pytest.raises(SystemExit) as export_help:
        main(["export", "--help"])
    assert export_help.value.code == 0
    text = capsys.readouterr().out
    assert "--max_shard_size" in text and "--max-shard-size" not in text  # underscores, as every other option


@pytest.mark.parametrize("hidden", ["test", "predict"])
def test_unsupported_lightning_subcommands_are_refused_by_name(hidden, step35_here):
    code, _, err = step35_here(hidden, "--config", "configs/tiny.yaml")
    assert code != 0 and f"invalid choice: '{hidden}'" in err, err[-2000:]


@pytest.mark.timeout(900)
def test_validate_and_export_run_as_listed(tmp_path, step35_here, tiny_run):
    run, _ = tiny_run  # mtp_loss_weight 0 and no bias update, as saved: the resume check passes
    code, out, err = step35_here(
        "validate",
        "--config",
        "configs/tiny.yaml",
        f"--run_dir={tmp_path / 'run'}",
        f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        "--model.mtp_loss_weight=0",
        "--model.moe_bias_update_rate=0",
        "--trainer.limit_val_batches=1",
        "--data.val_batches=1",
        "--data.seq_len=16",
        "--data.micro_batch_size=1",
        "--trainer.logger=false",
    )
    assert code == 0 and "val/loss" in out, out[-2000:] + err[-3000:]
    code, out, err = step35_here(
        "export",
        "--checkpoint",
        str(run),
        "--out",
        str(tmp_path / "hf"),
        "--dtype",
        "bfloat16",
        "--max_shard_size",
        "2MB",
    )
    assert code == 0 and (tmp_path / "hf" / "tokenizer.json").is_file() and "wrote" in out, err[-3000:]


def test_cli_installs_the_step_progress_bar(builtin_cache, tmp_path):
    from step35.callbacks import Step35ProgressBar
    from step35.commands.fit import Step35CLI
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    def trainer(*extra):
        args = ["--config", "configs/tiny.yaml", f"--run_dir={tmp_path}", *extra]
        return Step35CLI(
            Step35LightningModule, Step35DataModule, args=args, run=False, auto_configure_optimizers=False
        ).trainer

    assert isinstance(trainer().progress_bar_callback, Step35ProgressBar)
    assert trainer("--trainer.enable_progress_bar=false").progress_bar_callback is None
    # A configured bar is kept, not doubled (Lightning's own TQDM bar: RichProgressBar needs `rich`, not a dependency).
    chosen = trainer("--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar").progress_bar_callback
    assert type(chosen).__name__ == "TQDMProgressBar"
