"""The edges of stopping and saving (issue 24): a stop signal during a long validation, a stop signal
during a periodic save, Lightning's AsyncCheckpointIO, and a disk that fills up during a run.

- SIGTERM at the start of a long validation was acted on only after it (and one more training step):
  at 196B, torchrun's 30 s grace (Kubernetes' default too) SIGKILLed the ranks first, no checkpoint.
  Now the ranks agree before every validation batch, cut the validation short and write the
  checkpoint of the step it followed; the resume from it is bitwise the uninterrupted run.
- SIGTERM during a periodic save wrote a second checkpoint of the same step (a second multi-TB write
  inside the grace); now it is skipped and said, the exit code is still 75, the resume uses the
  periodic one.
- AsyncCheckpointIO broke every save (FileNotFoundError, a checkpoint without a manifest); it is
  refused at start, also for a Trainer built without the CLI.
- A disk filling up during a run ended the output in a bare traceback (the CSV logger failing again
  while Lightning ended the run after the reported checkpoint failure); now every line that ends
  the output is a `step35:` line.

The runs load their slow validation, slow save and full-disk logger from tests/dist/hooks.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from step35.checkpoint.integrity import is_complete
from step35.checkpoint.training import catalog
from step35.faults import EXIT_FAILED, EXIT_PREEMPTED
from tests.helpers import make_trainer, metric_rows, steps_of, write_run_config
from tests.runner import Job, command, stop_job, wait_for


# ----------------------------------------------------------------------------------- helpers
def run_args(run: Path, *extra: str) -> list[str]:
    run.mkdir(parents=True, exist_ok=True)
    return ["fit", "--config", str(write_run_config(run)), f"--run_dir={run}", *extra]


def run_cmd(run: Path, *extra: str) -> list[str]:
    return command(run_args(run, *extra))


def losses(run: Path) -> dict[int, float]:
    (folder,) = {p.parent for p in run.glob("**/metrics.csv")}
    return steps_of(metric_rows(folder), "train/lm_loss")


def validation(batches: int, every: int) -> list[str]:
    return [f"--trainer.val_check_interval={every}", "--trainer.limit_val_batches=1.0", f"--data.val_batches={batches}"]


def printed(job, line: str) -> bool:
    return f"{line}\n" in job.output()


# ----------------------------------------------------------------------------------- 1. during a validation
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sigterm_during_a_long_validation_stops_within_seconds_and_resumes_bitwise(tmp_path, builtin_cache):
    """A 30 s validation after step 3 (30 batches of 1 s), SIGTERM after its second batch. Before:
    the run went on through the remaining ~28 s of validation and step 4, and stopped after step 4
    (beyond torchrun's 30 s grace at scale). Now: cut short before batch 3, checkpoint of step 3,
    exit 75 within seconds; resuming it (without validation) gives bitwise the losses of an
    uninterrupted run, logged at the same steps."""
    run = tmp_path / "run"
    # RunCheckpoint (the config's last callback) saves no step of this run: the pre-emption save must be written.
    cmd = run_cmd(
        run,
        "--trainer.max_steps=6",
        "--trainer.callbacks.every_n_train_steps=100",
        *validation(30, 3),
        "--trainer.callbacks+=tests.dist.hooks.SlowValidation",
        "--trainer.callbacks.sleep_s=1",
    )
    with Job(cmd, tmp_path / "log.txt", builtin_cache) as job:
        wait_for(lambda: printed(job, "slow validation batch 2 after step 3"), 300, job, "validation batch 2")
        rc, stopped_in = stop_job(job, signal.SIGTERM)
        out = job.output()
    print(f"exit {rc} {stopped_in:.1f} s after SIGTERM")
    assert rc == EXIT_PREEMPTED, out[-4000:]
    assert stopped_in < 10, (stopped_in, out[-3000:])  # before: > 28 s (the rest of the validation, step 4)
    assert "stopped by SIGTERM during the validation after step 3 (cut short before batch 3 of 30" in out, out[-3000:]
    ckpt = run / "checkpoints" / "step=000003-preempt.ckpt"
    assert is_complete(ckpt), sorted(p.name for p in ckpt.parent.iterdir())
    assert "slow validation batch 3 " not in out
    interrupted = losses(run)
    assert sorted(interrupted) == [0, 1, 2]  # every stopped step's row is in the CSV (0-based)

    # The resume and the reference run do not validate (the config's default): the resume must not
    # depend on validating at step 3 as the interrupted run did (before the loop state was recorded
    # as at the step boundary, every metric of such a resume was logged one step early).
    resumed = tmp_path / "resumed"
    with Job(
        run_cmd(resumed, "--trainer.max_steps=6", f"--ckpt_path={ckpt}"), tmp_path / "resumed.txt", builtin_cache
    ) as job:
        assert job.wait(timeout=300) == 0, job.output()[-4000:]
    reference = tmp_path / "reference"
    with Job(run_cmd(reference, "--trainer.max_steps=6"), tmp_path / "reference.txt", builtin_cache) as job:
        assert job.wait(timeout=300) == 0, job.output()[-4000:]
    expected = losses(reference)
    assert {s: expected[s] for s in (0, 1, 2)} == interrupted
    assert losses(resumed) == {s: expected[s] for s in (3, 4, 5)}  # bitwise: float equality


# ----------------------------------------------------------------------------------- 2. during a periodic save
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sigterm_during_a_periodic_save_writes_no_second_checkpoint_of_that_step(tmp_path, builtin_cache):
    """SIGTERM while RunCheckpoint saves step 5. Before: after that save, a second checkpoint of step
    5 (`step=000005-preempt.ckpt`) was written. Now: skipped and said, exit 75, and `--ckpt_path auto`
    resumes from the periodic one."""
    run = tmp_path / "run"
    cmd = run_cmd(
        run, "--trainer.max_steps=50", "--trainer.callbacks+=tests.dist.hooks.SlowSave", "--trainer.callbacks.sleep_s=3"
    )
    with Job(cmd, tmp_path / "log.txt", builtin_cache) as job:
        wait_for(lambda: printed(job, "slow save of step 5"), 300, job, "the save of step 5")
        rc, _ = stop_job(job, signal.SIGTERM)
        out = job.output()
    checkpoints = run / "checkpoints"
    assert rc == EXIT_PREEMPTED, out[-4000:]
    periodic = checkpoints / "step=000005.ckpt"
    assert (
        f"stopped by SIGTERM after step 5; step 5 is saved already ({periodic}), so no second checkpoint of it "
        f"is written; exit code 75"
    ) in out, out[-3000:]
    assert not list(checkpoints.glob("*preempt*")), sorted(p.name for p in checkpoints.iterdir())
    assert [c.global_step for c in catalog.complete_checkpoints(checkpoints)] == [5]
    assert sorted(losses(run)) == [0, 1, 2, 3, 4]

    with Job(run_cmd(run, "--trainer.max_steps=7", "--ckpt_path=auto"), tmp_path / "resumed.txt", builtin_cache) as job:
        assert job.wait(timeout=300) == 0, job.output()[-4000:]
        out = job.output()
    assert str(periodic) in out, out[-3000:]  # resumed from it (said by --ckpt_path auto)
    resumed = [p for p in run.glob("csv/version_*/metrics.csv")]
    assert len(resumed) == 2, resumed
    assert sorted(steps_of(metric_rows(max(resumed).parent), "train/lm_loss")) == [5, 6]


# ----------------------------------------------------------------------------------- 3. AsyncCheckpointIO
def async_plugins(kind: str) -> list:
    from lightning.pytorch.plugins import AsyncCheckpointIO

    from step35.checkpoint.training.plugin import Step35CheckpointIO

    return [AsyncCheckpointIO()] if kind == "plain" else [AsyncCheckpointIO(Step35CheckpointIO())]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("callback", ["RunCheckpoint", "FaultTolerance"])
@pytest.mark.parametrize("kind", ["plain", "wrapping_step35_io"])
def test_async_checkpoint_io_is_refused_at_start_without_the_cli(callback, kind, tmp_path, builtin_cache):
    """A Trainer built in Python with either callback that `step35 fit` always has. Before: with
    RunCheckpoint the first save failed (FileNotFoundError on step=000001.ckpt: its manifest was
    written before the asynchronous write had made the file); with FaultTolerance the pre-emption
    save was asynchronous. Now: refused before the model is built or anything is written."""
    from step35.callbacks import FaultTolerance, RunCheckpoint
    from step35.checkpoint.errors import CheckpointError
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    callbacks = (
        [RunCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)]
        if callback == "RunCheckpoint"
        else [FaultTolerance(watchdog=False)]
    )
    trainer = make_trainer(max_steps=2, default_root_dir=tmp_path, plugins=async_plugins(kind), callbacks=callbacks)
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    with pytest.raises(CheckpointError) as refused:
        trainer.fit(module, datamodule=data)
    assert str(refused.value) == (
        "Lightning's AsyncCheckpointIO is not supported: remove it from trainer.plugins and save in the background with RunCheckpoint(async_save=true)"
    )
    assert trainer.global_step == 0 and not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------- 4. a full disk
@pytest.mark.timeout(300)
def test_a_full_disk_mid_run_ends_in_step35_lines_not_a_traceback(tmp_path, builtin_cache, monkeypatch, capfd):
    """`step35 fit` in this process with a logger whose writes fail from step 3 on (a full disk): the
    failure is reported as a `step35:` line, then Lightning, ending the failed run, flushes the
    logger again, which fails again. Before: that second error escaped the entry point and the
    output ended in its bare traceback. Now: one more `step35:` line says it, exit code 1.
    (A checkpoint save onto a full disk: tests/test_strategy_save.py.)"""
    from step35.cli import main

    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    args = run_args(
        tmp_path / "run",
        "--trainer.max_steps=6",
        "--trainer.logger=tests.dist.hooks.FullDiskLogger",
        # listed, so that `fit` adds no other: no watchdog thread left in this process
        "--trainer.callbacks+=step35.callbacks.FaultTolerance",
        "--trainer.callbacks.watchdog=false",
    )
    capfd.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(args)
    err = capfd.readouterr().err
    assert ended.value.code == EXIT_FAILED, err[-3000:]
    assert "[rank 0] step35: run failed during " in err and "OSError: [Errno 28] No space left on device" in err, err[
        -3000:
    ]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last == (
        "[rank 0] step35: ending the run after that failure failed too: OSError: [Errno 28] No space left on device"
    ), err[-3000:]
