"""A run folder has one live owner (the lock), `--ckpt_path last|auto` gets past a damaged newest
checkpoint, a checkpoint without a manifest is loaded only on request, and `ckpt_path` is read in
one place. Runs are real processes: `step35 fit` subprocesses, torchrun with 2 ranks."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from step35.checkpoint.integrity import manifest_path, write_manifest
from step35.run import RunFolder, RunFolderBusy, lock
from tests.helpers import make_trainer, saved_steps, write_run_config
from tests.runner import ROOT, cli_fit, command, environment, fit, start_at_gate

HOLD = (
    "import os, sys, time\n"
    "from step35.run import RunFolder, lock\n"
    "lock.acquire(RunFolder(sys.argv[1]))\n"
    "child = os.fork() if len(sys.argv) > 2 else None\n"
    "if child == 0:\n"
    "    time.sleep(120); os._exit(0)\n"
    "print('held', child, flush=True)\n"
    "time.sleep(600)\n"
)


def hold(run: Path, fork: bool = False) -> tuple[subprocess.Popen, int | None]:
    """A process holding the run folder's lock (and, with `fork`, a forked child sharing it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run), *(["fork"] if fork else [])],
        env=environment(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    words = proc.stdout.readline().split()
    assert words and words[0] == "held", words
    return proc, (int(words[1]) if fork else None)


def kill9(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


def two_steps_in_process(root: Path, checkpoints: pl.Callback, cache: Path) -> None:
    """Two steps of the tiny model (seq_len 16, micro-batch 1) in this process, under `root`, saved by the
    RunCheckpoint `checkpoints`: a Trainer built without the CLI."""
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    trainer = make_trainer(max_steps=2, default_root_dir=root, callbacks=[checkpoints])
    data = Step35DataModule(seq_len=16, micro_batch_size=1, cache_dir=str(cache))
    trainer.fit(Step35LightningModule(config="tiny", warmup_steps=1), datamodule=data)


# ------------------------------------------------------------------------------ the lock, in process
@pytest.mark.heavy  # step35 as a subprocess, or 10 s or more
def test_lock_refuses_a_live_holder_and_takes_over_from_a_dead_one(tmp_path):
    folder = RunFolder(tmp_path / "run")
    holder, _ = hold(folder.root)
    try:
        with pytest.raises(
            RunFolderBusy,
            match=rf"in use by a live run \(pid {holder.pid} on host "
            rf"{re.escape(socket.gethostname())}, started .*--run_dir",
        ):
            lock.RunLock(folder).acquire()
    finally:
        kill9(holder)
    mine = lock.RunLock(folder)
    note = mine.acquire()
    assert note is not None and "no longer running" in note and f"pid {holder.pid} on host" in note, note
    mine.release()
    assert lock.read_holder(folder.lock_file) is None  # a clean end leaves no holder behind
    again = lock.RunLock(folder)
    assert again.acquire() is None  # nothing to take over
    again.release()


@pytest.mark.heavy  # step35 as a subprocess, or 10 s or more
def test_a_forked_child_does_not_keep_a_dead_holders_lock(tmp_path):
    """A DataLoader worker is a forked child: it must not keep the folder locked after its parent died."""
    folder = RunFolder(tmp_path / "run")
    holder, child = hold(folder.root, fork=True)
    try:
        kill9(holder)
        os.kill(child, 0)  # the child is still alive
        mine = lock.RunLock(folder)
        assert "no longer running" in mine.acquire()
        mine.release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_ckpt_path_is_read_in_one_place():
    """`trainer.ckpt_path` is set by the CLI and read through step35.run.checkpoint_to_load only."""
    readers = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "step35").rglob("*.py") if re.search(r"\.ckpt_path\b", p.read_text())
    )
    assert readers == ["step35/commands/fit.py", "step35/run/__init__.py"], readers


# ------------------------------------------------------------------------------ two jobs, one folder
@pytest.mark.heavy  # step35 as a subprocess, or 10 s or more
@pytest.mark.timeout(900)
def test_a_second_run_is_refused_and_the_first_finishes_unharmed(tmp_path, builtin_cache, capfd):
    config, run = write_run_config(tmp_path), tmp_path / "run"
    ckpts = run / "checkpoints"
    go = tmp_path / "go"
    gated = [
        "fit",
        "--config",
        str(config),
        f"--run_dir={run}",
        "--trainer.callbacks+=tests.dist.hooks.Gate",
        f"--trainer.callbacks.file={go}",
        "--trainer.callbacks.at_step=6",
    ]
    first = start_at_gate(command(gated), builtin_cache, go)
    try:
        # The first run's save in progress, as the tidy-up of a second run used to delete it.
        in_progress = ckpts / f".step=000010.ckpt.partial-{first.pid}-0123abcd"
        in_progress.write_bytes(b"being written")
        second = cli_fit(capfd, config, run, builtin_cache, "--trainer.max_steps=99", "--ckpt_path=auto", check=False)
        assert first.poll() is None  # the first run was alive all along
        assert second.returncode != 0
        assert f"in use by a live run (pid {first.pid} on host {socket.gethostname()}" in second.stderr, second.stderr[
            -3000:
        ]
        assert "--run_dir" in second.stderr and "Traceback" not in second.stderr
        assert in_progress.exists() and saved_steps(ckpts) == [5]
    finally:
        go.touch()
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-5000:]
    assert saved_steps(ckpts) == [5, 10] and os.readlink(ckpts / "last.ckpt") == "step=000010.ckpt"
    assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]  # the second run logged nothing
    assert "max_steps: 99" not in (run / "config.yaml").read_text()  # nor replaced the config


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_two_ranks_refused_together_then_take_over_a_dead_holders_lock(tmp_path, builtin_cache):
    config, run = write_run_config(tmp_path), tmp_path / "run"
    two_ranks = [
        "--trainer.max_steps=2",
        "--trainer.devices=2",
        "--trainer.strategy=step35.strategy.Step35Strategy",
        "--trainer.strategy.expert_parallel_size=2",
    ]
    holder, _ = hold(run)
    try:
        started = time.monotonic()
        refused = fit(config, run, builtin_cache, *two_ranks, nproc=2, timeout=400, check=False)
        took = time.monotonic() - started
    finally:
        kill9(holder)
    assert refused.returncode != 0
    assert f"in use by a live run (pid {holder.pid}" in refused.stderr, refused.stderr[-4000:]
    # Rank 1 says why it stopped when it reached its wait for rank 0; when rank 0 is refused before
    # rank 1 has finished importing, the launcher's SIGTERM ends it first (torchrun reports that).
    rank1_said = "[rank 1] step35: stopped before training: the job's rank 0 did not take the lock" in refused.stderr
    rank1_ended_early = re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -15", refused.stderr)
    assert rank1_said or rank1_ended_early, refused.stderr[-4000:]
    assert not (run / "checkpoints").exists() and not (run / "csv").exists()
    print(f"2-rank refusal took {took:.0f} s")

    done = fit(config, run, builtin_cache, *two_ranks, nproc=2)
    assert f"took over the lock of {run} from a run that is no longer running (pid {holder.pid}" in done.stderr
    assert saved_steps(run / "checkpoints") == [2]


# ------------------------------------------------------------------------------ damaged and unverified checkpoints
@pytest.mark.heavy  # step35 as a subprocess, or 10 s or more
@pytest.mark.timeout(900)
def test_auto_falls_back_past_a_damaged_newest_and_an_unverified_path_needs_the_flag(tmp_path, builtin_cache, capfd):
    config, run = write_run_config(tmp_path), tmp_path / "run"
    ckpts = run / "checkpoints"
    cli_fit(capfd, config, run, builtin_cache)  # saves steps 5 and 10 (each run in this process but the failing one)
    newest = ckpts / "step=000010.ckpt"
    size = newest.stat().st_size
    with open(newest, "r+b") as f:
        f.truncate(size // 2)  # damaged: the manifest still vouches for the full size

    resumed = cli_fit(capfd, config, run, builtin_cache, "--ckpt_path=auto", "--trainer.max_steps=12")
    assert (
        f"--ckpt_path auto: skipping {newest} (global step 10), it is damaged: {newest}: {size // 2} bytes, "
        f"the manifest says {size}: truncated"
    ) in resumed.stderr, resumed.stderr[-3000:]
    assert f"resuming from {ckpts / 'step=000005.ckpt'} (global step 5" in resumed.stderr
    assert saved_steps(ckpts) == [5, 10, 12]  # step 10 saved again, whole

    older = ckpts / "step=000005.ckpt"
    manifest_path(older).unlink()
    refused = cli_fit(capfd, config, run, builtin_cache, f"--ckpt_path={older}", "--trainer.max_steps=7", check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (
        f"{older}: no {manifest_path(older).name}, so its integrity cannot be checked" in refused.stderr
        and "--allow_unverified_checkpoint" in refused.stderr
        and f"python -m step35.checkpoint.integrity write {older}" in refused.stderr
    ), refused.stderr[-3000:]

    accepted = cli_fit(
        capfd,
        config,
        run,
        builtin_cache,
        f"--ckpt_path={older}",
        "--allow_unverified_checkpoint=true",
        "--trainer.max_steps=7",
    )
    assert f"ignoring {older}" not in accepted.stderr  # it is loaded on purpose, not "ignored"
    assert 7 in saved_steps(ckpts)

    # A flipped byte keeps the size: choosing by size picks the checkpoint, the load's checksums find
    # the damage and record it, and the next automatic restart skips it.
    newest = ckpts / "step=000012.ckpt"
    with open(newest, "r+b") as f:
        f.seek(newest.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    failed = fit(config, run, builtin_cache, "--ckpt_path=auto", "--trainer.max_steps=14", check=False)  # a process
    assert failed.returncode != 0, failed.stderr[-3000:]
    assert f"{newest}: checksum mismatch" in failed.stderr and ".step=000012.ckpt.damaged" in failed.stderr, (
        failed.stderr[-3000:]
    )
    restarted = cli_fit(capfd, config, run, builtin_cache, "--ckpt_path=auto", "--trainer.max_steps=12")
    assert (
        f"skipping {newest} (global step 12), it is damaged: {newest}: checksum mismatch" in restarted.stderr
        and "found by an earlier load" in restarted.stderr
    ), restarted.stderr[-3000:]
    assert f"resuming from {ckpts / 'step=000010.ckpt'} (global step 10" in restarted.stderr
    assert 12 in saved_steps(ckpts)  # step 12 saved again at the end of training, though a damaged save had it
    from step35.checkpoint.integrity import verify

    verify(newest)  # the new save of step 12 is whole, and its old damage record does not apply to it


def test_last_refuses_when_every_checkpoint_is_damaged(tmp_path):
    from step35.run import NoCheckpoint, resolve

    path = tmp_path / "step=000005.ckpt"
    path.write_bytes(os.urandom(64))
    write_manifest(path, extra={"global_step": 5})
    path.write_bytes(os.urandom(32))
    said = []
    for value in ("last", "auto"):  # auto must not start from scratch over a run's damaged saves
        with pytest.raises(
            NoCheckpoint,
            match=rf"--ckpt_path {value}: no intact checkpoint in {tmp_path}: every one "
            rf"is damaged \({re.escape(str(path))}: .*32 bytes, the manifest says 64",
        ):
            resolve(value, [tmp_path], say=said.append)
    assert said and all("skipping" in line for line in said)


# ------------------------------------------------------------------------------ command-line edges
@pytest.mark.heavy  # step35 as a subprocess, or 10 s or more
def test_an_abbreviated_option_is_refused_with_a_suggestion(tmp_path, builtin_cache, capfd):
    proc = cli_fit(
        capfd, ROOT / "configs" / "tiny.yaml", tmp_path, builtin_cache, "--trainer.max_step", "5", check=False
    )
    assert proc.returncode != 0
    assert "unrecognized arguments: --trainer.max_step 5" in proc.stderr, proc.stderr[-2000:]
    assert "did you mean --trainer.max_steps" in proc.stderr
    assert not (tmp_path / "csv").exists()


def test_an_absurd_lr_is_warned_about_a_sane_one_is_not():
    from step35.module import Step35LightningModule

    with pytest.warns(UserWarning, match=r"model.lr=1000000.0 is above 0.1: .*1e-5 to 1e-2"):
        Step35LightningModule(lr=1e6)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Step35LightningModule(lr=3e-3)


@pytest.mark.heavy  # step35 as a subprocess, or 10 s or more
def test_a_trainer_built_without_the_cli_takes_the_lock_in_runcheckpoint(tmp_path, builtin_cache):
    from step35.callbacks import RunCheckpoint

    def fit(folder: Path) -> None:
        two_steps_in_process(folder, RunCheckpoint(every_n_train_steps=2), builtin_cache)

    busy = RunFolder(tmp_path / "busy")
    holder, _ = hold(busy.root)
    try:
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid}"):
            fit(busy.root)
    finally:
        kill9(holder)
    free = RunFolder(tmp_path / "free")
    fit(free.root)
    assert (free.checkpoints / "last.ckpt").exists()
    assert not lock.held(free) and lock.read_holder(free.lock_file) is None  # released with the run


def test_export_and_generate_read_a_run_folders_newest_intact_checkpoint(tmp_path):
    # `step35 export|generate --checkpoint <run folder>` choose as `--ckpt_path last` does: a truncated
    # newest checkpoint is skipped, and said; a folder without checkpoints is refused by name.
    import torch

    from step35.checkpoint.errors import CheckpointError
    from step35.run import checkpoint_of

    run = RunFolder(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    for step in (1, 2):
        path = run.checkpoints / f"step={step:06d}.ckpt"
        torch.save({"hyper_parameters": {"lr": 1e-3}, "global_step": step}, path)
        write_manifest(path, extra={"global_step": step})
    assert checkpoint_of(run.root) == run.checkpoints / "step=000002.ckpt"
    newest = run.checkpoints / "step=000002.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])  # a save cut short after its manifest was written
    said = []
    assert checkpoint_of(run.root, said.append) == run.checkpoints / "step=000001.ckpt"
    assert len(said) == 1 and "step=000002.ckpt" in said[0] and "skipped a damaged checkpoint" in said[0], said
    assert checkpoint_of(newest) == newest  # a checkpoint named by path is read as it is (its loader verifies it)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint .* nor a run folder"):
        checkpoint_of(tmp_path / "empty")


def test_two_runs_given_one_checkpoint_folder_are_kept_apart(tmp_path, builtin_cache):
    """`RunCheckpoint.dirpath` outside the run folder is locked too: a second run (its own run folder) given
    the checkpoint folder a live run saves into is refused naming it and the option, and touches nothing
    there (it used to prune and tidy the other's saves); a run given a free shared folder locks and releases it."""
    from step35.callbacks import RunCheckpoint

    shared = tmp_path / "scratch-ckpts"
    shared.mkdir()
    theirs = shared / "step=000033.ckpt"
    theirs.write_bytes(b"the other run's save")
    write_manifest(theirs, extra={"global_step": 33})

    def fit(run: Path) -> None:
        checkpoints = RunCheckpoint(dirpath=str(shared), every_n_train_steps=2, keep_last=1)
        two_steps_in_process(run, checkpoints, builtin_cache)

    holder, _ = hold(shared)  # the live run that saves into the shared folder
    try:
        with pytest.raises(
            RunFolderBusy,
            match=rf"the checkpoint folder \(RunCheckpoint.dirpath\) {shared} is in use "
            rf"by a live run \(pid {holder.pid}.*own RunCheckpoint.dirpath",
        ):
            fit(tmp_path / "second")
        assert theirs.read_bytes() == b"the other run's save" and not (shared / "last.ckpt").exists()
    finally:
        kill9(holder)
    theirs.unlink()
    fit(tmp_path / "alone")
    assert (shared / "step=000002.ckpt").exists()
    assert lock.read_holder(shared / ".step35.lock") is None and not lock.held(RunFolder(shared))  # released
