"""Chaos: a training run SIGKILLed at random moments (some in the middle of a checkpoint save) and
restarted each time with `--ckpt_path auto`, as torchrun --max-restarts or a SLURM requeue would,
ends with parameters and optimizer state bitwise equal to those of an uninterrupted run.

The supervisor follows the run through its checkpoint folder: a kill "at a step" waits until a
checkpoint at or after that step is complete (and one saved by this attempt), then a random
fraction of a second more; a kill
"during a save" waits for a save in progress (a temporary `.partial` entry, or a checkpoint whose
manifest is not written yet), freezes the job (SIGSTOP), looks again and kills it only if the save is
still unfinished; otherwise it lets the job go on and waits for the next save. So a kill counted as
"during a save" really cut one short, however fast the save and however loaded the machine. Kill
plans come from a seeded generator."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from step35.checkpoint.publish import leftovers
from step35.checkpoint.training import catalog
from step35.checkpoint.training.keys import LORA_BASE
from tests.helpers import CHAOS_CONFIG, assert_bitwise, lora_config
from tests.runner import ROOT, command, environment, kill_job, signal_job

# a chaos supervisor kills and restarts step35 processes, for minutes: started first in the parallel run
pytestmark = [pytest.mark.heavy, pytest.mark.early(minutes=2.2)]


@dataclass
class Kill:
    after_step: int
    during_save: bool


TWO_RANKS = [
    "--trainer.strategy=step35.strategy.Step35Strategy",
    "--trainer.strategy.expert_parallel_size=2",
    "--trainer.devices=2",
]


def start(
    config: Path, run: Path, cache: Path, max_steps: int, log: Path, nproc: int = 1, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    args = [
        "fit",
        "--config",
        str(config),
        f"--run_dir={run}",
        f"--trainer.max_steps={max_steps}",
        "--ckpt_path=auto",
        *(TWO_RANKS if nproc == 2 else []),
        *extra,
    ]
    with open(log, "w") as out:
        return subprocess.Popen(
            command(args, nproc),
            cwd=ROOT,
            env=environment(cache),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def newest_step(folder: Path) -> int:
    newest = catalog.newest_complete([folder])
    return newest.global_step if newest is not None else -1


def save_in_progress(folder: Path, newest: int) -> bool:
    if leftovers(folder):
        return True
    return any(catalog.step_from_name(p) > newest for p in catalog.incomplete_checkpoints(folder))


def supervise(
    config: Path,
    run: Path,
    cache: Path,
    max_steps: int,
    plan: list[Kill],
    seed: int,
    deadline_s: float,
    nproc: int = 1,
    extra: tuple[str, ...] = (),
) -> dict:
    """Run to max_steps under `plan`, restarting after each kill. Returns counts of what happened."""
    rng = random.Random(seed)
    folder = run / "checkpoints"
    stats = {"attempts": 0, "kills": 0, "mid_save": 0, "logs": [], "newest_at_start": []}
    deadline = time.monotonic() + deadline_s
    pending = list(plan)
    while True:
        log = run.parent / f"{run.name}-attempt{stats['attempts']}.log"
        run.mkdir(parents=True, exist_ok=True)
        stats["newest_at_start"].append(newest_step(folder))
        proc = start(config, run, cache, max_steps, log, nproc, extra)
        stats["attempts"] += 1
        stats["logs"].append(log)
        try:
            while pending and proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chaos run not done in {deadline_s} s")
                target = pending[0]
                newest = newest_step(folder)
                # A kill "at a step" also waits for this attempt to have saved once (it has resumed
                # and trained), so that every attempt makes progress.
                at_least = (
                    target.after_step
                    if target.during_save
                    else max(target.after_step, stats["newest_at_start"][-1] + 1)
                )
                if newest < at_least:
                    time.sleep(0.005)
                    continue
                if target.during_save:
                    if not save_in_progress(folder, newest):
                        time.sleep(0.0005)
                        continue
                    signal_job(proc, signal.SIGSTOP)  # frozen, the job cannot finish the save behind our back
                    if not save_in_progress(folder, newest):  # it finished before the freeze: try the next one
                        signal_job(proc, signal.SIGCONT)
                        continue
                    kill_job(proc)
                    stats["mid_save"] += 1
                else:
                    time.sleep(rng.uniform(0.0, 0.3))
                    kill_job(proc)
                stats["kills"] += 1
                pending.pop(0)
            if proc.poll() is None:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            if proc.poll() is None:
                kill_job(proc)
            raise
        if proc.returncode == 0:
            if pending:  # finished before the remaining kills could happen: they are dropped
                pending.clear()
            return stats
        assert proc.returncode == -signal.SIGKILL, log.read_text()[-5000:]


def final_state(run: Path, step: int) -> dict:
    path = run / "checkpoints" / f"step={step:06d}.ckpt"
    if path.is_dir():  # sharded: consolidated by torch's own DCP reader
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, run / "consolidated.pt")
        state = torch.load(run / "consolidated.pt", map_location="cpu", weights_only=False)
        optim = {k: v for k, v in state.items() if k.startswith("optimizer")}
        return {"params": state["state_dict"], "optimizer": [optim], "step": step}
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {"params": state["state_dict"], "optimizer": state["optimizer_states"], "step": state["global_step"]}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert len(a["params"]) > 0
    assert_bitwise(a["params"], b["params"], "params")
    assert_bitwise(a["optimizer"], b["optimizer"], "optimizer")


def chaos(
    tmp_path: Path,
    cache: Path,
    max_steps: int,
    kills: int,
    seed: int,
    deadline_s: float,
    nproc: int = 1,
    config_text: str = CHAOS_CONFIG,
    extra: tuple[str, ...] = (),
) -> dict:
    """The run to `max_steps` uninterrupted, then again with `kills` SIGKILLs (every other one during a save)
    and restarts (`--ckpt_path auto`), on `nproc` ranks with `extra` options: bitwise the same end."""
    config = tmp_path / "chaos.yaml"
    config.write_text(config_text)
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, max_steps - 5), kills))
    # Every other kill waits for a save in progress, the others land at a random moment.
    plan = [Kill(after_step=s, during_save=(i % 2 == 0)) for i, s in enumerate(steps)]

    # One process (one OpenMP thread) leaves a core of the two idle: the uninterrupted reference then runs beside
    # the killed one (nothing in the kill plan is timed: it follows the checkpoint folder). Ranks of two jobs
    # would only share the cores: one after the other.
    with ThreadPoolExecutor(1) as pool:
        reference_run = pool.submit(
            supervise, config, tmp_path / "reference", cache, max_steps, [], seed, deadline_s, nproc, extra
        )
        if nproc > 1:
            reference_run.result()
        stats = supervise(config, tmp_path / "chaos", cache, max_steps, plan, seed, deadline_s, nproc, extra)
        reference = reference_run.result()
    assert reference["attempts"] == 1
    assert stats["kills"] == kills and stats["attempts"] == kills + 1, stats
    assert stats["mid_save"] >= 1, stats  # at least one kill cut a save short
    assert_bitwise_equal(final_state(tmp_path / "chaos", max_steps), final_state(tmp_path / "reference", max_steps))
    # Every restart resumed the newest complete checkpoint or, before the first save, started afresh.
    folder = tmp_path / "chaos" / "checkpoints"
    for log, newest in zip(stats["logs"], stats["newest_at_start"], strict=True):
        text = log.read_text()
        if newest < 0:
            assert "--ckpt_path auto: no complete checkpoint" in text and "starting from scratch" in text, text[-3000:]
        else:
            assert f"--ckpt_path auto: resuming from {folder}/step={newest:06d}.ckpt (global step {newest}," in text, (
                text[-3000:]
            )
    assert max(stats["newest_at_start"]) > 0, stats  # some attempt did resume
    print(
        f"chaos: {stats['kills']} kills ({stats['mid_save']} during a save), newest checkpoint at each start: "
        f"{stats['newest_at_start']}"
    )
    return stats


@pytest.mark.timeout(1200)
def test_chaos_short_three_kills_bitwise_equal(tmp_path, builtin_cache):
    chaos(tmp_path, builtin_cache, max_steps=40, kills=3, seed=1, deadline_s=900)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_chaos_200_steps_eight_kills_bitwise_equal(tmp_path, builtin_cache):
    stats = chaos(tmp_path, builtin_cache, max_steps=200, kills=8, seed=8, deadline_s=3000)
    assert stats["mid_save"] >= 2, stats


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(3600)
def test_chaos_two_ranks_sharded_bitwise_equal(tmp_path, builtin_cache):
    """2 ranks under torchrun (Step35Strategy, EP 2, sharded checkpoints): every rank and the launcher
    killed at once, restarted with --ckpt_path auto."""
    chaos(tmp_path, builtin_cache, max_steps=30, kills=3, seed=2, deadline_s=3000, nproc=2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(3600)
def test_sigkill_then_resume_under_cp2_is_bitwise_equal(tmp_path, builtin_cache):
    """The 2-rank run with cp 2 (and EP 2): every rank and the launcher SIGKILLed twice (once during a save),
    restarted with --ckpt_path auto; final weights and optimizer state bitwise equal to an uninterrupted cp 2
    run (tests/test_context_parallel.py has the cp equivalence itself)."""
    chaos(
        tmp_path,
        builtin_cache,
        max_steps=20,
        kills=2,
        seed=3,
        deadline_s=3000,
        nproc=2,
        extra=("--trainer.strategy.context_parallel_size=2",),
    )


# Fine-tuning on conversations (the built-in set, step35's default template): packed windows with labels
# and positions, the loss over the global batch, the conversation stream's position.
SFT_CONFIG = CHAOS_CONFIG.replace(
    """data:
  seq_len: 32
  micro_batch_size: 2
  num_workers: 0
""",
    """data:
  format: chat
  seq_len: 96
  micro_batch_size: 2
  num_workers: {workers}
""",
)


@pytest.mark.timeout(1500)
def test_chaos_sft_two_workers_bitwise_equal(tmp_path, builtin_cache):
    """Conversations read by 2 DataLoader workers, killed twice (once during a save), resumed bitwise."""
    assert "format: chat" in SFT_CONFIG
    chaos(
        tmp_path,
        builtin_cache,
        max_steps=20,
        kills=2,
        seed=3,
        deadline_s=1200,
        config_text=SFT_CONFIG.format(workers=2),
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(2400)
def test_chaos_sft_two_ranks_bitwise_equal(tmp_path, builtin_cache):
    """Conversations on 2 ranks under torchrun (EP 2, sharded checkpoints), killed twice, resumed bitwise; trained
    with Muon (StepFun's preset): its momentum buffers are sharded DTensors in the checkpoint like AdamW's moments,
    and Newton–Schulz of the dense matrices exchanges their halves between the ranks (parallel/whole_matrices.py)."""
    chaos(
        tmp_path,
        builtin_cache,
        max_steps=16,
        kills=2,
        seed=4,
        deadline_s=2100,
        nproc=2,
        config_text=SFT_CONFIG.format(workers=0),
        extra=("--model.optimizer=muon", "--model.optimizer_options={preset: stepfun}"),
    )


@pytest.mark.timeout(1500)
def test_lora_run_killed_twice_resumes_bitwise(tmp_path, builtin_cache):
    """A LoRA run (tests/test_lora_checkpoint.py) SIGKILLed twice (once during a save), then --ckpt_path auto: the
    final adapters, router, buffers and optimizer state are bitwise those of a run never killed."""
    chaos(tmp_path, builtin_cache, max_steps=16, kills=2, seed=5, deadline_s=1200, config_text=lora_config())
    final = torch.load(tmp_path / "chaos" / "checkpoints" / "step=000016.ckpt", weights_only=True)
    assert final[LORA_BASE] == {"folder": None, "init_seed": 0}
    assert not [k for k in final["state_dict"] if k.endswith("self_attn.q_proj.weight")]  # no frozen base
