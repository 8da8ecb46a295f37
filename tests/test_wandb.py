"""wandb through the CLI: offline by itself when no key is configured, and the run carries the
resolved config and the code version."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from step35.loggers import wandb_key_configured
from tests.helpers import wandb_records
from tests.runner import ONE_PROCESS_THREADS, environment

ROOT = Path(__file__).parent.parent


def test_key_detection(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_key_configured()  # no env key, no netrc file
    (tmp_path / "netrc").write_text("machine example.org login me password x\n")
    assert not wandb_key_configured()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password not-a-real-key\n")
    assert wandb_key_configured()  # what `wandb login` writes
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_API_KEY", "not-a-real-key")
    assert wandb_key_configured()


@pytest.mark.heavy  # step35 as a subprocess, with wandb deciding offline by itself
@pytest.mark.timeout(600)
def test_cli_run_goes_offline_and_logs_config_and_code_version(tmp_path, builtin_cache):
    job_env = environment(builtin_cache, ONE_PROCESS_THREADS)  # as tests/runner starts every job
    env = {k: v for k, v in job_env.items() if not k.startswith("WANDB_")}  # let step35 decide
    env.update(NETRC=str(tmp_path / "no-netrc"), WANDB_SILENT="true")
    args = [
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.seq_len=32",
        "--data.micro_batch_size=2",
        "--trainer.limit_val_batches=1",
        "--data.val_batches=1",
        "--trainer.logger+=step35.loggers.Step35WandbLogger",
        f"--trainer.logger.save_dir={tmp_path / 'wandb'}",
        "--trainer.logger.project=step35-test",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "step35", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=500
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = list((tmp_path / "wandb").glob("**/offline-run-*"))
    assert runs, "no offline run folder: the logger did not go offline by itself"
    config = {}
    for record in wandb_records(runs[0], "config"):
        for item in record.config.update:
            config[item.key] = json.loads(item.value_json)
    assert config["model"]["config"] == "tiny" and config["data"]["seq_len"] == 32  # the command line's, resolved
    assert config["trainer"]["max_steps"] == 2
    assert len(config["code_version"].split("+")[0]) == 40  # the git commit of the checkout
