"""Runs live in one folder and resume does what it says: `--ckpt_path last|auto` find the newest
complete checkpoint of the run folder (or fail / start fresh, saying so), RunCheckpoint keeps an
atomic `last.ckpt` and the newest K and tidies what killed saves left, and single-file and sharded
resumes follow one rule (command line wins; a different model shape is refused, fields named). The runs are
`step35 fit` in this process (tests/runner.py's cli): what they leave in the run folder and say is the point."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from step35.checkpoint.integrity import is_complete, write_manifest
from step35.checkpoint.publish import leftover_of
from step35.checkpoint.training import catalog
from step35.training.optimizer import apply_resumed_settings
from tests.helpers import metric_rows, saved_steps, steps_of, write_run_config
from tests.runner import cli_fit

pytestmark = pytest.mark.heavy  # step35 started as a subprocess

SHARDED = ["--trainer.strategy=step35.strategy.Step35Strategy", "--trainer.strategy.expert_parallel_size=1"]


# ------------------------------------------------------------------------------ the run folder
@pytest.mark.timeout(900)
def test_auto_starts_fresh_then_last_resumes_the_newest_complete_checkpoint(tmp_path, builtin_cache, capfd):
    config, run = write_run_config(tmp_path), tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    leftover = ckpts / ".step=000005.ckpt.partial-1234-deadbeef"  # a save killed in an earlier life
    leftover.write_bytes(b"half a checkpoint")

    first = cli_fit(
        capfd,
        config,
        run,
        builtin_cache,
        "--ckpt_path=auto",
        "--trainer.max_steps=20",
        "--trainer.callbacks.keep_last=2",
    )
    assert (
        f"--ckpt_path auto: no complete checkpoint in {ckpts}" in first.stderr
        and "starting from scratch" in first.stderr
    )
    assert f"removed {leftover}" in first.stderr and not leftover.exists()
    assert saved_steps(ckpts) == [15, 20]  # keep_last=2: steps 5 and 10 deleted, manifests with them
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "last.ckpt",
        "step=000015.ckpt",
        "step=000015.ckpt.manifest.json",
        "step=000020.ckpt",
        "step=000020.ckpt.manifest.json",
    ]
    assert (ckpts / "last.ckpt").is_symlink() and os.readlink(ckpts / "last.ckpt") == "step=000020.ckpt"
    assert "max_steps: 20" in (run / "config.yaml").read_text()

    # A newer save that never finished (no manifest) must not be picked, but said.
    shutil.copy(ckpts / "step=000020.ckpt", ckpts / "step=000025.ckpt")
    second = cli_fit(
        capfd,
        config,
        run,
        builtin_cache,
        "--ckpt_path=last",
        "--trainer.max_steps=30",
        "--trainer.callbacks.keep_last=1",
    )
    assert f"--ckpt_path last: resuming from {ckpts / 'step=000020.ckpt'} (global step 20" in second.stderr
    assert f"ignoring {ckpts / 'step=000025.ckpt'}: its save did not finish" in second.stderr
    # keep_last=1 keeps the newest, and the checkpoint this attempt resumed from is never deleted.
    assert saved_steps(ckpts) == [20, 30]
    assert os.readlink(ckpts / "last.ckpt") == "step=000030.ckpt"
    assert not (ckpts / "step=000025.ckpt").exists()  # re-saved complete, then pruned
    # Logs of every attempt in the same run folder; the second attempt starts at step 20.
    attempts = sorted((run / "csv").iterdir())
    assert [a.name for a in attempts] == ["version_0", "version_1"]
    assert min(steps_of(metric_rows(attempts[1]), "train/lm_loss")) == 20
    assert "max_steps: 30" in (run / "config.yaml").read_text()


@pytest.mark.timeout(300)
def test_last_without_a_complete_checkpoint_fails_saying_where_it_looked(tmp_path, builtin_cache, capfd):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step=000005.ckpt").write_bytes(b"no manifest: never finished")
    proc = cli_fit(capfd, write_run_config(tmp_path), run, builtin_cache, "--ckpt_path=last", check=False)
    assert proc.returncode != 0
    assert f"--ckpt_path last: no complete checkpoint in {run / 'checkpoints'}" in proc.stderr
    assert f"ignored: {run / 'checkpoints' / 'step=000005.ckpt'}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run / "csv").exists()  # refused before training


# ------------------------------------------------------------------------------ one rule, both formats
def expected_lr(lr: float, step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup then cosine, written from the schedule's definition (not step35's code)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / (total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * t)) / 2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["ckpt", "sharded"])
def test_resume_honours_the_command_line_and_refuses_a_new_shape(tmp_path, builtin_cache, capfd, fmt):
    config, run = write_run_config(tmp_path), tmp_path / "run"
    strategy = SHARDED if fmt == "sharded" else []
    cli_fit(capfd, config, run, builtin_cache, *strategy)
    newest = run / "checkpoints" / "step=000010.ckpt"
    assert newest.is_dir() == (fmt == "sharded") and is_complete(newest)

    resumed = cli_fit(
        capfd,
        config,
        run,
        builtin_cache,
        *strategy,
        "--ckpt_path=last",
        "--trainer.max_steps=15",
        "--model.lr=0.001",
        "--model.mtp_loss_weight=0.1",
        "--model.decay_steps=15",
    )
    assert "lr: 0.003 -> 0.001" in resumed.stdout and "mtp_loss_weight: 0.3 -> 0.1" in resumed.stdout
    lrs = steps_of(metric_rows(run / "csv" / "version_1"), "lr/decay")
    assert set(range(10, 15)) <= set(lrs), sorted(lrs)
    for step in range(10, 15):  # the new peak lr, on the new schedule length that decay_steps asks for
        assert lrs[step] == pytest.approx(expected_lr(1e-3, step, warmup=4, total=15), rel=1e-6), step
    assert "mtp_loss_weight: 0.1" in (run / "csv" / "version_1" / "hparams.yaml").read_text()

    refused = cli_fit(
        capfd,
        config,
        run,
        builtin_cache,
        *strategy,
        "--ckpt_path=last",
        "--trainer.max_steps=20",
        "--model.config_overrides={hidden_size: 64}",
        check=False,
    )
    assert refused.returncode != 0
    assert "the model shape differs: hidden_size: 128 -> 64" in refused.stderr, refused.stderr[-3000:]
    assert saved_steps(run / "checkpoints") == [5, 10, 15]  # nothing trained, nothing saved


# ------------------------------------------------------------------------------ in-process pieces
def fake_checkpoint(folder: Path, name: str, step: int | None, complete: bool = True) -> Path:
    path = folder / name
    path.write_bytes(os.urandom(64))
    if complete:
        write_manifest(path, extra={} if step is None else {"global_step": step})
    return path


def test_catalog_newest_is_the_highest_complete_step_from_any_writer(tmp_path):
    fake_checkpoint(tmp_path, "step=000010.ckpt", 10)
    fake_checkpoint(tmp_path, "step=000012-preempt.ckpt", 12)  # written by a pre-emption save
    fake_checkpoint(tmp_path, "step=000015.ckpt", 15, complete=False)
    fake_checkpoint(tmp_path, "epoch=0-step=11.ckpt", None)  # no step in the manifest: the name says 11
    (tmp_path / ".step=000020.ckpt.partial-1-x").mkdir()
    assert [(c.path.name, c.global_step) for c in catalog.complete_checkpoints(tmp_path)] == [
        ("step=000010.ckpt", 10),
        ("epoch=0-step=11.ckpt", 11),
        ("step=000012-preempt.ckpt", 12),
    ]
    assert catalog.newest_complete([tmp_path, tmp_path / "missing"]).path.name == "step=000012-preempt.ckpt"
    assert [p.name for p in catalog.incomplete_checkpoints(tmp_path)] == ["step=000015.ckpt"]
    catalog.point_last(tmp_path, tmp_path / "step=000012-preempt.ckpt")
    assert catalog.newest_complete([tmp_path]).path.name == "step=000012-preempt.ckpt"  # the link is no candidate


def test_last_pointer_is_switched_by_one_rename(tmp_path, monkeypatch):
    a = fake_checkpoint(tmp_path, "step=000005.ckpt", 5)
    b = fake_checkpoint(tmp_path, "step=000010.ckpt", 10)
    catalog.point_last(tmp_path, a)
    calls = []
    real_replace = os.replace
    monkeypatch.setattr(
        catalog.os, "replace", lambda src, dst: calls.append((Path(src).name, Path(dst).name)) or real_replace(src, dst)
    )
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        assert Path(path).name != "last.ckpt", "last.ckpt removed before it is replaced"
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(catalog.os, "unlink", unlink)
    catalog.point_last(tmp_path, b)
    assert len(calls) == 1 and calls[0][1] == "last.ckpt" and leftover_of(calls[0][0]) == ("last.ckpt", "partial")
    assert os.readlink(tmp_path / "last.ckpt") == b.name and (tmp_path / "last.ckpt").read_bytes() == b.read_bytes()
    # A link left by a kill before the rename is a leftover that the next start removes.
    os.symlink(a.name, tmp_path / ".last.ckpt.partial-99-link")
    monkeypatch.undo()
    assert catalog.clean_leftovers(tmp_path) == [
        f"removed {tmp_path / '.last.ckpt.partial-99-link'} (left by a save of last.ckpt that was killed)"
    ]


def test_leftovers_are_removed_and_a_checkpoint_moved_aside_is_restored(tmp_path):
    old = tmp_path / ".step=000010.ckpt.old-7-abc"  # a folder swap killed between its two renames
    old.mkdir()
    (old / "shard").write_bytes(b"intact")
    partial = tmp_path / ".step=000015.ckpt.partial-7-def"
    partial.mkdir()
    (partial / "shard").write_bytes(b"half")
    kept = fake_checkpoint(tmp_path, "step=000005.ckpt", 5)
    report = catalog.clean_leftovers(tmp_path)
    assert sorted(report) == sorted(
        [
            f"restored {tmp_path / 'step=000010.ckpt'} (an interrupted save had moved it aside to {old.name})",
            f"removed {partial} (left by a save of step=000015.ckpt that was killed)",
        ]
    )
    assert (tmp_path / "step=000010.ckpt" / "shard").read_bytes() == b"intact" and not partial.exists()
    assert kept.exists() and catalog.clean_leftovers(tmp_path) == []


def test_prune_keeps_the_newest_k_and_protected_ones(tmp_path):
    paths = [fake_checkpoint(tmp_path, f"step={s:06d}.ckpt", s) for s in (5, 10, 15, 20, 25)]
    incomplete = fake_checkpoint(tmp_path, "step=000001.ckpt", 1, complete=False)
    removed = catalog.prune(tmp_path, keep=2, protect=[paths[1]])
    assert [p.name for p in removed] == ["step=000005.ckpt", "step=000015.ckpt"]
    assert saved_steps(tmp_path) == [10, 20, 25] and incomplete.exists()  # unfinished saves are not counted
    assert not (tmp_path / "step=000005.ckpt.manifest.json").exists()
    with pytest.raises(ValueError, match="keep=0"):
        catalog.prune(tmp_path, keep=0)


def test_optimizer_settings_after_restore_are_the_runs_and_unchanged_ones_are_bitwise(tmp_path):
    def build(lr, betas=(0.9, 0.95), wd=0.1):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
        settings = [
            {"lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": wd},
            {"lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW([{"params": [params[0]], **settings[0]}, {"params": [params[1]], **settings[1]}])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 ** (s // 4))
        return params, opt, sched, settings

    params, opt, sched, settings = build(3e-3)
    for _ in range(6):
        sum(p.square().sum() for p in params).backward()
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    _, same, same_sched, same_settings = build(3e-3)
    same.load_state_dict(saved_opt)
    same_sched.load_state_dict(saved_sched)
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in same.param_groups]
    apply_resumed_settings(same, same_settings, same_sched)
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in same.param_groups] == before
    assert same_sched.get_last_lr() == sched.get_last_lr()

    _, new, new_sched, new_settings = build(1e-3, betas=(0.8, 0.9), wd=0.05)
    new.load_state_dict(saved_opt)  # brings back lr 3e-3, betas (0.9, 0.95), wd 0.1
    new_sched.load_state_dict(saved_sched)
    apply_resumed_settings(new, new_settings, new_sched)
    factor = min(1.0, 7 / 3) * 0.5 ** (6 // 4)
    assert [g["lr"] for g in new.param_groups] == [1e-3 * factor] * 2 == new_sched.get_last_lr()
    assert [g["betas"] for g in new.param_groups] == [(0.8, 0.9)] * 2
    assert [g["weight_decay"] for g in new.param_groups] == [0.05, 0.0]
    new_sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** (7 // 4))


def test_prune_passes_over_a_checkpoint_a_reader_holds_and_clears_dead_readers_markers(tmp_path):
    paths = [fake_checkpoint(tmp_path, f"step={s:06d}.ckpt", s) for s in (5, 10, 15)]
    stale = tmp_path / f".{paths[1].name}{catalog.READING}99999-dead"  # a reader killed while reading
    stale.touch()
    with catalog.reading(paths[0]):  # export / generate reading a live run's checkpoint
        assert catalog.held_for_reading(tmp_path) == {paths[0].name} and not stale.exists()
        assert catalog.prune(tmp_path, keep=1) == [paths[1]]
    assert saved_steps(tmp_path) == [5, 15] and list(tmp_path.glob(f".*{catalog.READING}*")) == []
    assert catalog.prune(tmp_path, keep=1) == [paths[0]]  # the next save's prune, once it was read
