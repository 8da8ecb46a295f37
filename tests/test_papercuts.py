"""What a new user meets in the first hour (issue 20 §2): the main job's first screen, the progress bar's
loss, val_check_interval under gradient accumulation, the strategy in --help, the export's file modes,
the early-stopping message and the learning-rate names."""

import csv
import os
import stat
import warnings
from pathlib import Path

import pytest

from tests.runner import step35

ROOT = Path(__file__).parent.parent

# Fast settings of the main job: a short sequence, a small batch, one validation batch.
SMALL = [
    "--data.seq_len=32",
    "--data.micro_batch_size=2",
    "--trainer.limit_val_batches=1",
    "--data.val_batches=1",
    "--trainer.log_every_n_steps=1",
]


def metric_rows(run: Path) -> list[dict]:
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.heavy  # the main job as a subprocess (its first screen)
@pytest.mark.timeout(900)
def test_main_job_first_screen_val_interval_in_steps_and_lr_names(tmp_path, builtin_cache):
    """The main job with gradient accumulation 2 and val_check_interval 2: validation at optimizer steps
    2 and 4 (Lightning alone validates every 2 micro-batches: steps 1, 2, 3, 4); learning rates logged as
    lr/decay and lr/no_decay; the screen has none of the libraries' notices, a bar with lm_loss, no FLOPs
    column, and step35's own warning printed as step35's."""
    run = tmp_path / "run"
    proc = step35(
        [
            "fit",
            "--config",
            "configs/tiny.yaml",
            f"--run_dir={run}",
            "--trainer.max_steps=4",
            "--trainer.accumulate_grad_batches=2",
            "--trainer.val_check_interval=2",
            "--model.lr=0.2",
            *SMALL,
        ],
        builtin_cache,
    )
    rows = metric_rows(run)
    # Lightning writes a validation that ends optimizer step N at step N - 1 (before its step counter moves).
    assert sorted(int(r["step"]) for r in rows if r.get("val/loss")) == [1, 3], rows
    assert {"lr/decay", "lr/no_decay"} <= set(rows[0])
    assert not any(name.startswith("lr-") for name in rows[0]), list(rows[0])
    screen = proc.stdout + proc.stderr
    for noise in (
        "litlogger",
        "LeafSpec",
        "set_vital",
        "FLOPs",
        "weights_only",
        "exists and is not empty",
        "Trainer already configured",
        "call.py",
    ):
        assert noise not in screen, (noise, screen[-4000:])
    assert "lm_loss=" in screen and ", loss=" not in screen and "Step35ForCausalLM" in screen
    assert "step35: warning: model.lr=0.2 is above 0.1" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(900)
def test_early_stopping_says_why(tmp_path, step35_here):
    run = tmp_path / "run"
    code, out, err = step35_here(
        "fit",
        "--config",
        "configs/tiny.yaml",
        f"--run_dir={run}",
        "--trainer.max_steps=20",
        "--trainer.val_check_interval=1",
        "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
        "--trainer.callbacks.monitor=val/loss",
        "--trainer.callbacks.patience=2",
        "--trainer.callbacks.min_delta=10",
        *SMALL,
    )
    assert code == 0, out[-3000:] + err[-5000:]
    # Step 1 sets the best; steps 2 and 3 do not improve it by 10: patience 2 is spent at step 3.
    assert max(int(r["step"]) for r in metric_rows(run) if r.get("train/lm_loss")) == 2  # steps 0, 1, 2 logged
    line = next((x for x in err.splitlines() if x.startswith("step35: early stopping")), None)
    assert line is not None, err[-3000:]
    assert line.startswith("step35: early stopping at step 3: val/loss=") and "min_delta=10" in line, line
    assert "in 2 validations (patience=2)" in line, line


@pytest.mark.heavy  # `step35 fit --help` in a new process
def test_help_lists_step35_strategy(builtin_cache):
    """A new process, as a user types it: the strategy is listed only if it was imported before the parser."""
    text = step35(["fit", "--help"], builtin_cache).stdout
    choices = text.split("\n  --trainer.strategy STRATEGY", 1)[1].split("\n  --trainer.devices", 1)[0]
    assert "step35.strategy.Step35Strategy" in choices, choices


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_take_the_umask_mode(tiny_run, tmp_path, umask):
    from step35.cli import main

    run, _ = tiny_run
    old = os.umask(umask)
    try:
        main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--max_shard_size", "2MB"])
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "hf").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_step35_warnings_print_as_step35(capsys):
    from lightning.pytorch.utilities import rank_zero_warn

    from step35.commands.console import step35_console

    def warn_from(module: str, code: str) -> None:
        exec(code, {"__name__": module, "warnings": warnings, "rank_zero_warn": rank_zero_warn})

    with warnings.catch_warnings(record=True) as others:  # what step35_console hands on to Python's display
        warnings.simplefilter("always")
        with step35_console():
            warn_from("step35.data.example", "warnings.warn('a bad record', stacklevel=3)")
            warn_from("step35.callbacks.example", "rank_zero_warn('a skipped step')")
            warn_from("torch.example", "warnings.warn('a torch notice')")
            warn_from("lightning.example", "warnings.warn('`isinstance(treespec, LeafSpec)` is deprecated')")
        shown = warnings.showwarning
    err = capsys.readouterr().err
    assert "step35: warning: a bad record\n" in err and "step35: warning: a skipped step\n" in err, err
    assert [str(w.message) for w in others] == ["a torch notice"]  # shown as usual; LeafSpec dropped
    assert "a torch notice" not in err and "LeafSpec" not in err, err
    assert shown is not None and shown.__name__ != "show"  # restored on exit


@pytest.mark.timeout(600)
def test_the_checkpoint_interval_and_retention_are_set_from_the_command_line(tmp_path, step35_here):
    """`--checkpoint.every_n_train_steps 2 --checkpoint.keep_last 2` set the shipped config's RunCheckpoint
    (listed before other callbacks: `--trainer.callbacks.every_n_train_steps` would reach the last one,
    FinalValidation, which refuses it); with them the 6-step main job keeps steps 4 and 6 (it saved 2, 4, 6)."""
    run = tmp_path / "run"
    code, out, err = step35_here(
        "fit",
        "--config",
        "configs/tiny.yaml",
        f"--run_dir={run}",
        "--trainer.max_steps=6",
        "--checkpoint.every_n_train_steps",
        "2",
        "--checkpoint.keep_last",
        "2",
        *SMALL,
    )
    assert code == 0, out[-3000:] + err[-5000:]
    saved = sorted(p.name for p in (run / "checkpoints").glob("step=*.ckpt"))
    assert saved == ["step=000004.ckpt", "step=000006.ckpt"], saved
    assert "every_n_train_steps: 2" in (run / "config.yaml").read_text()


def test_checkpoint_options_add_a_run_checkpoint_when_the_config_has_none():
    from jsonargparse import Namespace

    from step35.commands.fit import _apply_checkpoint_options

    config = Namespace(
        checkpoint=Namespace(every_n_train_steps=7, keep_last=None),
        trainer=Namespace(callbacks=[Namespace(class_path="step35.callbacks.FinalValidation", init_args=Namespace())]),
    )
    _apply_checkpoint_options(config)
    added = config.trainer.callbacks[-1]
    assert added.class_path == "step35.callbacks.RunCheckpoint" and added.init_args == Namespace(every_n_train_steps=7)
    assert config.trainer.callbacks[0].init_args == Namespace()  # the other callback untouched
