"""A NaN must never cost the run: `step35 fit` guards every run against non-finite gradients and losses
(DivergenceGuard, added unless configured), each checkpoint's manifest records whether its weights and
optimizer state were finite, retention never deletes the newest finite checkpoint, `--ckpt_path last`
passes over non-finite ones, and a run whose weights turned non-finite never ends with exit code 0.

The NaN is planted by tests/dist/hooks.PlantNonFinite: into one gradient element (the guard skips that step)
or into one weight element after an optimizer step (as an overflowing update would: every later loss is NaN,
the guard skips 5 steps in a row and stops)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from step35.checkpoint.integrity import manifest_info, write_manifest
from step35.checkpoint.training import catalog, keys
from step35.checkpoint.training.trainer_io import load_file, save_file, state_is_finite
from step35.run.resolution import resolve
from tests.helpers import CHAOS_CONFIG, saved_steps
from tests.runner import Job, cli_fit, command

EVERY_STEP = CHAOS_CONFIG.replace(
    "        every_n_train_steps: 5\n        keep_last: 2\n", "        every_n_train_steps: 1\n        keep_last: 1\n"
)
assert EVERY_STEP != CHAOS_CONFIG and "DivergenceGuard" not in EVERY_STEP  # no guard listed: fit adds one


def plant(**options) -> list[str]:
    return ["--trainer.callbacks+=tests.dist.hooks.PlantNonFinite"] + [
        f"--trainer.callbacks.{k}={v}" for k, v in options.items()
    ]


def fit_every_step(tmp_path: Path, cache: Path, capfd, *extra: str, check: bool = True):
    """`step35 fit` of EVERY_STEP (a save every step, keep_last 1, no guard listed) into tmp_path/run, in this
    process: (its CompletedProcess, the run folder)."""
    config = tmp_path / "run.yaml"
    config.write_text(EVERY_STEP)
    run = tmp_path / "run"
    return cli_fit(capfd, config, run, cache, *extra, check=check), run


def finite_flags(folder: Path) -> dict[int, bool | None]:
    return {c.global_step: c.finite for c in catalog.complete_checkpoints(folder)}


# ------------------------------------------------------------------------------------------- in-process
def fake_checkpoint(folder: Path, step: int, finite: bool | None) -> Path:
    path = folder / f"step={step:06d}.ckpt"
    path.write_bytes(os.urandom(64))
    extra = {keys.MANIFEST_GLOBAL_STEP: step} | ({} if finite is None else {keys.MANIFEST_FINITE: finite})
    write_manifest(path, extra=extra)
    return path


def test_retention_and_last_keep_the_newest_finite_checkpoint(tmp_path):
    for step, finite in [(5, True), (10, None), (15, True), (20, False), (25, False)]:  # None: an older manifest
        fake_checkpoint(tmp_path, step, finite)
    assert catalog.newest_finite([tmp_path]).global_step == 15
    catalog.point_last_to_newest(tmp_path)
    assert (tmp_path / "last.ckpt").resolve().name == "step=000015.ckpt"
    removed = catalog.prune(tmp_path, keep=1)
    assert [p.name for p in removed] == ["step=000005.ckpt", "step=000010.ckpt", "step=000020.ckpt"]
    assert saved_steps(tmp_path) == [15, 25]  # the newest, and the newest finite one


def test_ckpt_path_last_passes_over_non_finite_checkpoints(tmp_path):
    fake_checkpoint(tmp_path, 5, None)
    fake_checkpoint(tmp_path, 10, False)
    lines = []
    with pytest.raises(Exception) as refused:  # 5 is no real checkpoint: it is read, after 10 was passed over
        resolve("last", [tmp_path], say=lines.append)
    assert "step=000005.ckpt" in str(refused.value)
    assert any("step=000010.ckpt" in line and "NaN/Inf" in line for line in lines), lines


def test_state_is_finite_looks_at_every_floating_tensor():
    state = {"w": torch.ones(3), "opt": [{"state": {0: {"step": torch.tensor(3), "exp_avg": torch.zeros(2)}}}]}
    assert state_is_finite(state)
    state["opt"][0]["state"][0]["exp_avg"][1] = float("inf")
    assert not state_is_finite(state)
    assert state_is_finite({"ids": torch.tensor([1, 2]), "empty": torch.empty(0), "n": 3})


def test_a_saved_file_records_whether_it_is_finite(tmp_path):
    good = {keys.GLOBAL_STEP: 1, keys.STATE_DICT: {"w": torch.ones(2)}, keys.OPTIMIZER_STATES: []}
    bad = {keys.GLOBAL_STEP: 2, keys.STATE_DICT: {"w": torch.ones(2)}, keys.OPTIMIZER_STATES: [{"state": {}}]}
    bad[keys.OPTIMIZER_STATES][0]["state"][0] = {"exp_avg_sq": torch.tensor([float("nan")])}
    save_file(good, tmp_path / "a.ckpt")
    save_file(bad, tmp_path / "b.ckpt")
    assert manifest_info(tmp_path / "a.ckpt")["extra"][keys.MANIFEST_FINITE] is True
    assert manifest_info(tmp_path / "b.ckpt")["extra"][keys.MANIFEST_FINITE] is False
    assert load_file(tmp_path / "a.ckpt")[keys.STATE_DICT]["w"].sum() == 2


# ------------------------------------------------------------------------------------- real runs, 1 process
def test_a_nan_gradient_is_skipped_by_default(tmp_path, builtin_cache, capfd):
    """The probe's case: one NaN gradient element at step 15 and no guard listed. Before, the loss was NaN
    from step 16, the run ended with exit code 0 and every kept checkpoint was NaN."""
    result, run = fit_every_step(tmp_path, builtin_cache, capfd, "--trainer.max_steps=20", *plant(grad_at=15))
    assert "planted NaN in the gradient of model.layers.3.moe.gate.weight at step 15" in result.stdout + result.stderr
    assert "step 14: non-finite gradients in 1 of" in result.stderr and "step skipped" in result.stderr, result.stderr[
        -3000:
    ]
    assert finite_flags(run / "checkpoints") == {20: True}
    final = load_file(run / "checkpoints" / "last.ckpt")  # refuses NaN/Inf itself
    assert final[keys.GLOBAL_STEP] == 20


def test_nan_weights_stop_the_run_and_last_resumes_the_newest_finite_checkpoint(tmp_path, builtin_cache, capfd):
    """NaN in a weight after step 8 (finite gradients until then): steps 9-13 have a NaN loss, the fifth skip in a
    row stops the run (exit code 1). Saving every step with keep_last 1, step 8's save already holds the NaN, so
    step 7's is the newest finite one: it survives retention, last.ckpt names it, and `--ckpt_path last` resumes
    from it, passing over the NaN ones."""
    stopped, run = fit_every_step(
        tmp_path, builtin_cache, capfd, "--trainer.max_steps=20", *plant(weight_at=8), check=False
    )
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "5 consecutive optimizer steps had non-finite values; stopping" in stopped.stderr, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    flags = finite_flags(run / "checkpoints")
    assert flags == {7: True, 12: False}, flags  # saves 8-12 held the NaN; 8-11 were pruned, 7 kept
    assert (run / "checkpoints" / "last.ckpt").resolve().name == "step=000007.ckpt"
    resumed, _ = fit_every_step(tmp_path, builtin_cache, capfd, "--trainer.max_steps=10", "--ckpt_path=last")
    said = resumed.stdout + resumed.stderr
    assert "skipping" in said and "step=000012.ckpt" in said and "NaN/Inf" in said, said[-3000:]
    assert "resuming from" in said and "step=000007.ckpt" in said
    # Kept: the step-12 save (the highest step, never pruned), 10 (the newest finite), 7 (this run resumed it).
    assert finite_flags(run / "checkpoints") == {7: True, 10: True, 12: False}
    assert (run / "checkpoints" / "last.ckpt").resolve().name == "step=000010.ckpt"


def test_nan_weights_after_the_last_step_fail_the_run(tmp_path, builtin_cache, capfd):
    """No later loss shows a NaN planted by the last optimizer step: the end-of-training check does, the run
    fails (exit code 1) and no checkpoint vouches for the NaN weights as the newest finite one."""
    ended, run = fit_every_step(
        tmp_path, builtin_cache, capfd, "--trainer.max_steps=4", *plant(weight_at=4), check=False
    )
    assert ended.returncode == 1, ended.stderr[-3000:]
    assert "step 4: training ended with NaN/Inf in the weights or optimizer state" in ended.stderr, ended.stderr[-3000:]
    assert finite_flags(run / "checkpoints") == {3: True, 4: False}
    assert (run / "checkpoints" / "last.ckpt").resolve().name == "step=000003.ckpt"


# -------------------------------------------------------------------------------------------- two ranks
@pytest.mark.multiprocess
def test_two_ranks_with_muon_skip_a_nan_gradient_and_stop_on_nan_weights_of_one_rank(tmp_path, builtin_cache):
    """One rank of 2 (FSDP 2 x EP 2, Muon): a NaN gradient on rank 1 at step 3 is skipped on both ranks; a NaN
    planted in rank 1's shard of a weight after step 6 is recorded as non-finite in the sharded checkpoints'
    manifests (one reduce over the ranks), the run stops with a non-zero exit code, and the step-5 checkpoint
    survives keep_last 1 as the newest finite one."""
    config = tmp_path / "run.yaml"
    config.write_text(EVERY_STEP)
    args = [
        "fit",
        "--config",
        str(config),
        f"--run_dir={tmp_path / 'run'}",
        "--trainer.max_steps=20",
        "--trainer.strategy=step35.strategy.Step35Strategy",
        "--trainer.strategy.expert_parallel_size=2",
        "--trainer.devices=2",
        "--model.optimizer=muon",
        *plant(grad_at=3, weight_at=6, rank=1),
    ]
    with Job(command(args, nproc=2), tmp_path / "run.log", builtin_cache) as job:
        code = job.wait(timeout=400)
        out = job.output()
    assert code != 0, out[-4000:]
    assert "step 2: non-finite gradients in 1 of" in out and "step skipped" in out, out[-4000:]
    assert "5 consecutive optimizer steps had non-finite values; stopping" in out, out[-4000:]
    folder = tmp_path / "run" / "checkpoints"
    assert finite_flags(folder) == {5: True, 10: False}, finite_flags(folder)
    assert (folder / "last.ckpt").resolve().name == "step=000005.ckpt"
    manifest = json.loads((folder / "step=000010.ckpt" / "step35.manifest.json").read_text())
    assert manifest["extra"]["layout"] == "dcp" and manifest["extra"][keys.MANIFEST_FINITE] is False
