"""Failures, pre-emption and hangs of real runs (the CLI under torchrun, gloo, 2 ranks, EP 2; and the
single-process tiny run): a failing rank ends the job in seconds with the error and its rank
printed (and torchrun's restart then runs the job to its end); SIGTERM / SIGUSR1 stop every rank at the
same step with a checkpoint and exit code 75, and resuming from that checkpoint is bitwise exact; a
damaged shard ends the resume on every rank, naming the file; a SIGSTOPped rank ends the job within the
configured timeout, naming what was waited for."""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from step35 import faults
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.checkpoint.integrity import manifest_info, verify
from step35.checkpoint.training.export import export_checkpoint
from step35.faults import EXIT_ORPHANED, EXIT_PREEMPTED, EXIT_STALLED
from tests.helpers import flip_byte
from tests.runner import ROOT, Job, command, ended, python, step35_in_process, stop_job, wait_for

pytestmark = pytest.mark.early(minutes=3.2)  # minutes of processes: started first in the parallel run (conftest.py)


def two_ranks_after_two_steps(job: Job, run: Path) -> list:
    """The two rank processes of a torchrun job, once its run has logged 2 steps."""
    wait_for(lambda: logged_steps(run) >= 2, 240, job, "2 steps")
    return wait_for(lambda: len(job.workers()) == 2 and job.workers(), 30, job, "two ranks")


def torchrun(args: list[str]) -> list[str]:
    return command(args, nproc=2)


def fit_args(run: Path, *extra: str, ranks: int = 2) -> list[str]:
    strategy = (
        [
            "--trainer.strategy=step35.strategy.Step35Strategy",
            "--trainer.strategy.expert_parallel_size=2",
            "--trainer.devices=2",
        ]
        if ranks == 2
        else []
    )
    return [
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        *strategy,
        "--trainer.val_check_interval=1000",
        "--trainer.log_every_n_steps=1",
        "--data.seq_len=32",
        "--data.micro_batch_size=2",
        "--model.decay_steps=40",  # the schedule must not depend on max_steps (runs differ in it)
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.save_dir={run}",
        "--trainer.logger.init_args.flush_logs_every_n_steps=1",
        *extra,
    ]


def checkpoint_every(n: int, dirpath: Path) -> list[str]:
    return [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.every_n_train_steps={n}",
        "--trainer.callbacks.save_top_k=-1",
        f"--trainer.callbacks.dirpath={dirpath}",
    ]


def logged_steps(run: Path) -> int:
    """Optimizer steps logged so far (the CSV is flushed every step, see fit_args): progress seen
    from outside without a checkpoint save, so a signal lands in the middle of training steps."""
    try:
        return len(losses(run))
    except (ValueError, KeyError, OSError):  # not there yet, or a row half written
        return 0


def preempt_checkpoint(run: Path) -> Path:
    found = sorted(run.glob("**/step=*-preempt.ckpt"))
    assert len(found) == 1, found
    return found[0]


def preempt_step(path: Path) -> int:
    return int(re.search(r"step=(\d+)-preempt", path.name).group(1))


def losses(run: Path) -> dict[int, float]:
    (metrics,) = run.glob("**/metrics.csv")
    with open(metrics) as f:
        return {int(r["step"]): float(r["train/lm_loss"]) for r in csv.DictReader(f) if r.get("train/lm_loss")}


def consolidated_state(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Model parameters and optimizer state of a sharded (DCP) checkpoint, as full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{checkpoint.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    flat = {f"model/{k}": v for k, v in state["state_dict"].items()}
    for key, value in _flatten(state["optimizer_0"]["state"]).items():  # AdamW moments and step counts
        if isinstance(value, torch.Tensor):
            flat[f"optimizer/{key}"] = value
    return flat


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): tree}


# ----------------------------------------------------------------------------------- pre-emption
STEPS = 10  # the uninterrupted run's


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, builtin_cache) -> Path:
    """The uninterrupted 2-rank run (EP 2) of STEPS steps: <folder>/full (its metrics) and <folder>/full_ckpt (its
    sharded checkpoint at step STEPS); the reference a resumed run is compared with, and a checkpoint to damage."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    args = fit_args(folder / "full", f"--trainer.max_steps={STEPS}", *checkpoint_every(STEPS, folder / "full_ckpt"))
    with Job(torchrun(args), folder / "full.txt", builtin_cache) as full:
        assert full.wait(timeout=300) == 0, full.output()[-6000:]
    return folder


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sigterm_to_torchrun_checkpoints_every_rank_and_resume_is_bitwise_exact(tmp_path, builtin_cache, uninterrupted):
    # (and the sharded checkpoint it leaves exports to an HF folder equal to torch's DCP consolidation)
    # What `timeout`, a plain `kill` of the launcher or a scheduler signalling the launcher does:
    # torchrun forwards SIGTERM to every rank, the ranks agree on the stop at the next step boundary.
    steps = STEPS
    with Job(
        torchrun(fit_args(tmp_path / "cut", "--trainer.max_steps=500")), tmp_path / "cut.txt", builtin_cache
    ) as job:
        wait_for(lambda: logged_steps(tmp_path / "cut") >= 2, 240, job, "2 steps")
        _, stopped_in = stop_job(job, signal.SIGTERM)
        out = job.output()
    assert stopped_in < 60, f"{stopped_in:.0f} s\n{out[-4000:]}"
    ckpt = preempt_checkpoint(tmp_path / "cut")
    step = preempt_step(ckpt)
    for rank in (0, 1):
        assert f"[rank {rank}] step35: stopped by SIGTERM after step {step}; checkpoint {ckpt}; exit code 75" in out, (
            out[-4000:]
        )
    assert 2 <= step < steps, step  # mid-run: the resumed run has steps left to compare
    assert ckpt.is_dir() and (ckpt / "meta.pt").exists() and list(ckpt.glob("*.distcp"))
    assert not list(ckpt.parent.glob(".*partial*"))  # the atomic save left no temporary folder
    # The sharded (EP 2) checkpoint exports to an HF folder equal to torch's own DCP consolidation.
    export_checkpoint(ckpt, tmp_path / "hf", max_shard_size="2MB")
    consolidated = consolidated_state(ckpt, tmp_path)
    exported = load_pretrained(tmp_path / "hf").state_dict()
    assert len(exported) == len([k for k in consolidated if k.startswith("model/model.")]) > 0
    for name, value in exported.items():
        assert torch.equal(value, consolidated["model/model." + name]), name  # the LightningModule's `model.`

    with Job(
        torchrun(
            fit_args(
                tmp_path / "resumed",
                f"--trainer.max_steps={steps}",
                f"--ckpt_path={ckpt}",
                *checkpoint_every(steps, tmp_path / "resumed_ckpt"),
            )
        ),
        tmp_path / "resumed.txt",
        builtin_cache,
    ) as job:
        assert job.wait(timeout=300) == 0, job.output()[-6000:]
    a, b = losses(uninterrupted / "full"), losses(tmp_path / "resumed")
    assert sorted(b) == list(range(step, steps)), sorted(b)  # metrics at 0-based steps
    assert [b[s] for s in range(step, steps)] == [a[s] for s in range(step, steps)]  # bitwise equal
    end_a = consolidated_state(next((uninterrupted / "full_ckpt").glob(f"*step={steps}*")), tmp_path)
    end_b = consolidated_state(next((tmp_path / "resumed_ckpt").glob(f"*step={steps}*")), tmp_path)
    assert end_a.keys() == end_b.keys() and any(k.startswith("optimizer") for k in end_a)
    for name in end_a:
        assert torch.equal(end_a[name], end_b[name]), name


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_damaged_shard_ends_every_rank_naming_the_file(tmp_path, builtin_cache, uninterrupted):
    """Each rank hashes the shards it wrote; at resume the checksums are split over the ranks and a damage found by
    one rank ends the job on all of them with the file named (no rank left waiting)."""
    saved = next((uninterrupted / "full_ckpt").glob(f"*step={STEPS}*"))
    path = tmp_path / saved.name  # a copy: the reference stays intact
    shutil.copytree(saved, path)
    files = manifest_info(path)["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(files), files
    verify(path)
    flip_byte(path / "__1_0.distcp")
    args = fit_args(tmp_path / "resumed", f"--trainer.max_steps={STEPS + 1}", f"--ckpt_path={path}")
    with Job(torchrun(args), tmp_path / "resumed.txt", builtin_cache) as job:
        rc = job.wait(timeout=300)
        out = job.output()
    assert rc != 0
    assert f"{path / '__1_0.distcp'}: checksum mismatch" in out, out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_sigterm_to_one_rank_stops_both_ranks_at_the_same_step_with_exit_code_75(tmp_path, builtin_cache):
    # A signal that reaches only some ranks (scancel / SLURM deliver to every task, but not at the
    # same instant): the step-boundary all_reduce makes every rank stop after the same step.
    with Job(
        torchrun(fit_args(tmp_path / "run", "--trainer.max_steps=500")), tmp_path / "log.txt", builtin_cache
    ) as job:
        workers = two_ranks_after_two_steps(job, tmp_path / "run")
        sent = time.monotonic()
        workers[1].send_signal(signal.SIGTERM)
        job.wait(timeout=120)
        stopped_in = time.monotonic() - sent
        out = job.output()
    assert stopped_in < 60, f"{stopped_in:.0f} s\n{out[-4000:]}"
    step = preempt_step(preempt_checkpoint(tmp_path / "run"))
    assert f"[rank 1] step35: stopped by SIGTERM after step {step}" in out, out[-4000:]
    assert f"[rank 0] step35: stopped by a stop signal on another rank after step {step}" in out, out[-4000:]
    # torchrun's summary lists each rank's exit code
    assert len(re.findall(rf"exitcode\s+:\s*{EXIT_PREEMPTED}\b", out)) == 2, out[-3000:]


def slow_backward(*args: str) -> list[str]:
    return ["--trainer.callbacks+=tests.dist.hooks.SlowBackward", *(f"--trainer.callbacks.{a}" for a in args)]


def signal_grace(seconds: float) -> list[str]:
    return ["--trainer.callbacks+=step35.callbacks.FaultTolerance", f"--trainer.callbacks.signal_grace_s={seconds}"]


def backward_started(job: Job, step: int) -> bool:
    return f"slow backward of step {step}\n" in job.output()


@dataclass
class Stopped:
    """A one-process `step35 fit` stopped by a signal: its run folder, exit code, output and the seconds
    from the signal to its end."""

    run: Path
    rc: int
    out: str
    stopped_in: float


def stop_one_process(folder: Path, cache: Path, extra: list[str], ready, sig: int) -> Stopped:
    """`step35 fit` (tiny, one process, up to 500 steps, `extra` options) in `folder`/run, sent `sig` once
    ready(job, run) holds."""
    run = folder / "run"
    with Job(command(fit_args(run, "--trainer.max_steps=500", *extra, ranks=1)), folder / "log.txt", cache) as job:
        ready(job, run)
        rc, stopped_in = stop_job(job, sig)
        return Stopped(run, rc, job.output(), stopped_in)


ONE_PROCESS_STOPS = {
    # SLURM's `--signal=USR1@secs` warning, on the plain tiny run (no Step35Strategy), after 2 logged steps
    "sigusr1": (
        [],
        lambda job, run: wait_for(lambda: logged_steps(run) >= 2, 200, job, "2 steps"),
        signal.SIGUSR1,
    ),
    # every backward 3 s, the signal grace option 2 s; SIGTERM in the middle of step 3's backward (step 2 timed,
    # 1 is the warm-up)
    "slow_step": (
        [*slow_backward("sleep_s=3"), *signal_grace(2)],
        lambda job, run: wait_for(lambda: backward_started(job, 3), 200, job, "the backward of step 3"),
        signal.SIGTERM,
    ),
    # backward of 1 s, stuck for good in step 4's; SIGTERM once it is stuck there
    "stuck": (
        [*slow_backward("sleep_s=1", "stuck_at=4"), *signal_grace(1)],
        lambda job, run: wait_for(lambda: backward_started(job, 4), 200, job, "the backward of step 4"),
        signal.SIGTERM,
    ),
}


@pytest.fixture(scope="module")
def one_process_stops(tmp_path_factory, builtin_cache) -> dict[str, Future]:
    """The ONE_PROCESS_STOPS runs side by side (one OpenMP thread each: together they use the 2 cores a run
    alone leaves half idle), each signalled at its own moment: {name: Future of its Stopped} (a run's failure
    is raised by its own test)."""
    pool = ThreadPoolExecutor(len(ONE_PROCESS_STOPS))
    runs = {
        name: pool.submit(stop_one_process, tmp_path_factory.mktemp(name), builtin_cache, extra, ready, sig)
        for name, (extra, ready, sig) in ONE_PROCESS_STOPS.items()
    }
    yield runs
    pool.shutdown(wait=True)


@pytest.mark.heavy  # processes, signals and their exit codes
@pytest.mark.timeout(300)
def test_sigusr1_on_the_single_process_run_checkpoints_and_exits_75(tmp_path, one_process_stops, builtin_cache, capfd):
    stopped = one_process_stops["sigusr1"].result(timeout=280)
    out = stopped.out
    assert stopped.rc == EXIT_PREEMPTED, out[-4000:]
    assert stopped.stopped_in < 60
    ckpt = preempt_checkpoint(stopped.run)
    step = preempt_step(ckpt)
    assert ckpt.is_file() and f"stopped by SIGUSR1 after step {step}" in out
    assert max(losses(stopped.run)) == step - 1  # the stopped step's row (0-based) is in the CSV
    # It resumes: the next run starts at that step (in this process: the resume, not the process, is checked here).
    step35_in_process(
        capfd,
        fit_args(tmp_path / "resumed", f"--trainer.max_steps={step + 2}", f"--ckpt_path={ckpt}", ranks=1),
        builtin_cache,
    )
    assert sorted(losses(tmp_path / "resumed")) == [step, step + 1]


@pytest.mark.heavy  # processes, signals and their exit codes
@pytest.mark.timeout(300)
def test_sigterm_during_a_step_slower_than_the_signal_grace_still_checkpoints_and_exits_75(one_process_stops):
    # Every backward takes over 3 s, the signal_grace_s option is 2 s: the grace derived from the
    # step time (3 x the slowest recent step) lets the stopped step finish (before: exit 76 after
    # 2 s of 'backward', no checkpoint, and "a peer" blamed in a one-process run).
    stopped = one_process_stops["slow_step"].result(timeout=280)
    out = stopped.out
    assert stopped.rc == EXIT_PREEMPTED, out[-4000:]
    ckpt = preempt_checkpoint(stopped.run)
    assert preempt_step(ckpt) == 3 and "stopped by SIGTERM after step 3" in out, out[-4000:]
    assert max(losses(stopped.run)) == 2  # the stopped step's metrics row (0-based step 2) is in the CSV
    assert "watchdog" not in out and "peer" not in out


@pytest.mark.heavy  # processes, signals and their exit codes
@pytest.mark.timeout(300)
def test_a_one_process_run_stuck_after_sigterm_ends_76_after_the_derived_grace_blaming_no_peer(one_process_stops):
    stopped = one_process_stops["stuck"].result(timeout=280)
    out, ended_in = stopped.out, stopped.stopped_in
    assert stopped.rc == EXIT_STALLED, out[-4000:]
    match = re.search(
        r"\[rank 0\] step35 watchdog: a stop signal arrived \d+ s ago, and 'backward \(step 4\)' has made no "
        r"progress for \d+ s since \(signal grace (\d+) s: 3 x the slowest of the last 2 steps \([\d.]+ s\)\): "
        r"this rank cannot reach the step boundary, no checkpoint",
        out,
    )
    assert match, out[-4000:]
    assert int(match.group(1)) >= 3 and ended_in < int(match.group(1)) + 10, (match.group(0), ended_in)
    assert "peer" not in out and "another rank" not in out


@pytest.mark.heavy  # a Lightning fit, 10 s or more
@pytest.mark.timeout(300)
def test_a_callback_raising_in_on_train_batch_start_is_reported_in_that_phase(tmp_path, builtin_cache, capfd):
    # FaultTolerance runs after every other callback (Lightning puts Checkpoint callbacks last): its
    # phases are set by PhaseMarks, first in the list (before: reported as 'data: next batch'). In this
    # process: the report and the exit code are checked, not how a process ends.
    args = fit_args(
        tmp_path / "run",
        "--trainer.max_steps=5",
        "--trainer.callbacks+=tests.dist.hooks.RaiseAtBatchStart",
        "--trainer.callbacks.at_step=2",
        ranks=1,
    )
    # An earlier failed run in this process (in CI: another in-process test) left its phase behind;
    # before, this run's failure was reported in that phase ('end of training ...').
    faults._PHASE.failed_in = "an earlier run's phase"
    proc = step35_in_process(capfd, args, builtin_cache, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "an earlier run's phase" not in out
    head = (
        "[rank 0] step35: run failed during 'batch start hooks (step 2)': RuntimeError: "
        "injected failure at the start of step 2"
    )
    assert out.count(head) == 2, out[-4000:]  # before and after the traceback, printed once
    assert "[rank 0] Traceback (most recent call last)" in out
    # The failed run's watchdog stopped with the run: left in this process (a caller that goes on), it ended the
    # process 10 minutes later ('node down' of a pytest worker; a notebook's kernel).
    assert not [t.name for t in threading.enumerate() if t.name in ("step35-watchdog", "step35-launcher-watch")]


# ----------------------------------------------------------------------------------- a dead launcher (torchrun)
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_sigkill_to_torchrun_ends_every_rank_within_seconds_saying_why(tmp_path, builtin_cache):
    # An OOM kill of the launcher, `kill -9`, a supervisor: before, the ranks (in their own sessions,
    # re-parented) trained on, writing checkpoints beside the restarted job.
    with Job(
        torchrun(fit_args(tmp_path / "run", "--trainer.max_steps=500")), tmp_path / "log.txt", builtin_cache
    ) as job:
        workers = two_ranks_after_two_steps(job, tmp_path / "run")
        os.killpg(job.proc.pid, signal.SIGKILL)  # torchrun leads its process group; the ranks are not in it
        killed = time.monotonic()
        job.proc.wait(timeout=30)
        while time.monotonic() - killed < 30 and not all(map(ended, workers)):
            time.sleep(0.1)
        gone_in = time.monotonic() - killed
        out = job.output()
    print(f"ranks gone {gone_in:.1f} s after the SIGKILL of torchrun")
    assert gone_in < 10, f"{gone_in:.0f} s\n{out[-4000:]}"
    for rank in (0, 1):
        assert re.search(
            rf"\[rank {rank}\] step35: the launcher \(pid {job.proc.pid}\) is gone \(this rank's parent is "
            rf"now pid \d+\) while in '[^']+': ending this rank with exit code {EXIT_ORPHANED}",
            out,
        ), out[-4000:]


# ----------------------------------------------------------------------------------- a rank that stops responding
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_sigstopped_rank_ends_the_job_within_the_timeout_naming_the_phase(tmp_path, builtin_cache):
    timeout_s = 18  # timeout_minutes 0.3
    with Job(
        torchrun(fit_args(tmp_path / "run", "--trainer.max_steps=500", "--trainer.strategy.timeout_minutes=0.3")),
        tmp_path / "log.txt",
        builtin_cache,
    ) as job:
        workers = two_ranks_after_two_steps(job, tmp_path / "run")
        stopped = time.monotonic()
        workers[1].send_signal(signal.SIGSTOP)
        # rank 0 notices by itself within the timeout (plus the watchdog's poll)...
        wait_for(
            lambda: not workers[0].is_running() or workers[0].status() == psutil.STATUS_ZOMBIE,
            timeout_s + 20,
            job,
            "rank 0 exit",
        )
        rank0_in = time.monotonic() - stopped
        watchdog = wait_for(
            lambda: re.search(
                r"\[rank 0\] step35 watchdog: no progress for \d+ s \(timeout 18 s\) while in '[^']+'", job.output()
            ),
            10,
            job,
            "rank 0's watchdog line",
        )
        # ...and torchrun would end the stopped rank by SIGKILL after its own fixed 30 s grace (SIGTERM cannot
        # reach a stopped process; on a worker failure torchrun ignores --shutdown-timeout): that wait is
        # torchrun's, not step35's, so the test kills the stopped rank itself and torchrun reports at once.
        assert not ended(workers[1]), "the stopped rank 1 ended by itself"
        workers[1].kill()
        killed = time.monotonic()
        job.wait(timeout=60)
        torchrun_in = time.monotonic() - killed
        out = job.output()
    assert timeout_s - 1 <= rank0_in < timeout_s + 15, f"{rank0_in:.0f} s\n{out[-4000:]}"
    assert torchrun_in < 15, f"torchrun ended {torchrun_in:.0f} s after the stopped rank was killed"
    assert watchdog, out[-6000:]
    # torchrun's summary names rank 0's exit code (rank 1's is the test's SIGKILL)
    assert re.search(rf"exitcode\s+:\s*{EXIT_STALLED}\b", out), out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_sigterm_to_a_rank_blocked_by_a_stopped_peer_ends_it_after_the_signal_grace(tmp_path, builtin_cache):
    # Rank 1 stops responding; then a SIGTERM (torchrun's, when another rank failed; or scancel)
    # reaches rank 0, which waits in a collective for rank 1 and can never reach the step boundary.
    # It ends after the signal grace (3 s here), not after the collective timeout (10 min default)
    # or the launcher's SIGKILL.
    grace = ["--trainer.callbacks+=step35.callbacks.FaultTolerance", "--trainer.callbacks.signal_grace_s=3"]
    with Job(
        torchrun(fit_args(tmp_path / "run", "--trainer.max_steps=500", *grace)), tmp_path / "log.txt", builtin_cache
    ) as job:
        workers = two_ranks_after_two_steps(job, tmp_path / "run")
        workers[1].send_signal(signal.SIGSTOP)
        time.sleep(2)  # rank 0 reaches the next collective with rank 1
        sent = time.monotonic()
        workers[0].send_signal(signal.SIGTERM)
        wait_for(
            lambda: not workers[0].is_running() or workers[0].status() == psutil.STATUS_ZOMBIE, 30, job, "rank 0 exit"
        )
        rank0_in = time.monotonic() - sent
        out = job.output()  # (torchrun's 30 s wait for the stopped rank is covered above; the job is killed here)
    assert rank0_in < 15, f"{rank0_in:.0f} s\n{out[-4000:]}"
    assert re.search(
        r"\[rank 0\] step35 watchdog: a stop signal arrived \d+ s ago.*'[^']+' has made no progress "
        rf".*exit code {EXIT_STALLED}",
        out,
    ), out[-6000:]


def test_watchdog_names_the_phase_and_exits_76(tmp_path):
    # The watchdog alone, in a plain process stuck in a named phase.
    code = (
        "import time\nfrom step35 import faults\nw = faults.Watchdog(1.0, rank=3)\n"
        "faults.set_phase('checkpoint save', step=7)\nw.start()\ntime.sleep(30)\n"
    )
    started = time.monotonic()
    proc = python(code)
    assert proc.returncode == EXIT_STALLED and time.monotonic() - started < 15
    assert (
        "[rank 3] step35 watchdog: no progress for 1 s (timeout 1 s) while in 'checkpoint save (step 7)'" in proc.stderr
    )
    assert "time.sleep(30)" in proc.stderr or "<string>" in proc.stderr  # the stacks follow
    assert "another rank" not in proc.stderr and "peer" not in proc.stderr  # one process: no peer to blame


@pytest.mark.heavy  # processes, signals and their exit codes
def test_watchdog_of_a_multi_rank_run_points_at_the_peers(tmp_path):
    code = (
        "import time\nfrom step35 import faults\nw = faults.Watchdog(1.0, rank=1, world_size=2)\n"
        "w.start()\ntime.sleep(30)\n"
    )
    proc = python(code)
    assert proc.returncode == EXIT_STALLED
    assert "Waiting there means another rank stopped responding or died" in proc.stderr, proc.stderr


@pytest.mark.heavy  # processes, signals and their exit codes
def test_signal_grace_grows_with_the_slowest_recent_step_and_blames_no_peer_in_one_process(tmp_path):
    # Steps of 2 s: after a SIGTERM, a phase may last 3 x 2 = 6 s (the option says 1 s) before the
    # watchdog gives up; a one-process run has no peer to blame.
    code = (
        "import os, signal, time\nfrom step35 import faults\n"
        "s = faults.StopSignals()\ns.install()\n"
        "w = faults.Watchdog(60, rank=0, signals=s, signal_grace_s=1.0)\n"
        "w.record_step(0.5)\nw.record_step(2.0)\nw.record_step(1.0)\n"
        "faults.set_phase('backward', step=4)\nw.start()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\nstart = time.monotonic()\n"
        "while time.monotonic() - start < 30:\n    time.sleep(0.5)\n"
        "    print(f'alive {time.monotonic() - start:.1f}', flush=True)\n"
    )
    proc = python(code)
    assert proc.returncode == EXIT_STALLED, proc.stderr
    alive = [float(line.split()[1]) for line in proc.stdout.splitlines()]
    assert 5.0 <= max(alive) < 9.0, alive  # not ended after the option's 1 s: after the derived 6 s
    assert re.search(
        r"'backward \(step 4\)' has made no progress for \d+ s since \(signal grace 6 s: 3 x the slowest "
        r"of the last 3 steps \(2\.0 s\)\): this rank cannot reach the step boundary, no checkpoint",
        proc.stderr,
    ), proc.stderr
    assert "peer" not in proc.stderr and "another rank" not in proc.stderr


@pytest.mark.heavy  # processes, signals and their exit codes
@pytest.mark.parametrize("ignored", [True, False])
def test_a_sigterm_late_in_the_exit_after_a_preemption_does_not_change_the_exit_code(ignored):
    # torchrun SIGTERMs the other ranks as soon as one has exited with 75; one still finalizing then
    # died of it (-15): Python resets its handlers during finalization, SIG_IGN stays.
    code = (
        "import builtins, os, signal, time\nfrom step35 import faults\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        f"if {ignored}: faults.ignore_at_exit((signal.SIGTERM,))\n"
        "class Late:\n    def __del__(self):\n        os.kill(os.getpid(), signal.SIGTERM)\n        time.sleep(0.2)\n"
        "builtins._late = Late()  # dropped late in the interpreter's finalization\n"
        f"raise SystemExit({EXIT_PREEMPTED})\n"
    )
    proc = python(code)
    assert proc.returncode == (EXIT_PREEMPTED if ignored else -signal.SIGTERM), (proc.returncode, proc.stderr)


# ----------------------------------------------------------------------------------- a dead launcher
SUPERVISOR = """
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
rank = "import time; from step35 import faults; print(faults.watch_launcher(), flush=True); time.sleep(60)"
launcher = "import subprocess, sys, time; print(subprocess.Popen([sys.executable, '-c', %r]).pid, flush=True); time.sleep(120)" % rank
proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
pid, watched = int(proc.stdout.readline()), proc.stdout.readline().strip()
os.kill(proc.pid, signal.SIGKILL)
proc.wait()
start = time.monotonic()
while time.monotonic() - start < 5:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(f"watched={watched} exit={os.waitstatus_to_exitcode(status)} after={time.monotonic() - start:.1f}")
        break
    time.sleep(0.05)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print(f"watched={watched} alive")
"""


@pytest.mark.heavy  # processes, signals and their exit codes
@pytest.mark.parametrize(
    "launcher_env",
    [{"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, {"LOCAL_RANK": "1"}, {}],
    ids=["torchrun", "lightning", "shell"],
)
def test_a_rank_ends_itself_when_its_launcher_is_sigkilled_but_a_run_from_a_shell_does_not(launcher_env):
    # (a STEP35_JOB left in this process by an in-process run is kept: a rank must not take it for its launcher's)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")}
    env.setdefault("STEP35_JOB", f"{os.getpid()}-inherited")
    proc = python(SUPERVISOR, timeout=90, env={**env, "PYTHONPATH": str(ROOT), **launcher_env})
    assert proc.returncode == 0, proc.stderr
    if not launcher_env:  # started from a shell: its parent's death is no reason to stop
        assert proc.stdout.strip() == "watched=False alive", proc.stdout + proc.stderr
        return
    match = re.fullmatch(r"watched=True exit=(\d+) after=([\d.]+)", proc.stdout.strip())
    assert match and int(match.group(1)) == EXIT_ORPHANED, proc.stdout + proc.stderr
    assert float(match.group(2)) < 2.0  # the watch polls every 0.5 s
    rank = launcher_env.get("RANK", launcher_env.get("LOCAL_RANK"))  # Lightning's launcher sets LOCAL_RANK only
    assert re.search(
        rf"\[rank {rank}\] step35: the launcher \(pid \d+\) is gone \(this rank's parent is now pid \d+\) "
        rf"while in '[^']+': ending this rank with exit code {EXIT_ORPHANED}",
        proc.stderr,
    ), proc.stderr


# ----------------------------------------------------------------------------------- restarts
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_failing_rank_ends_its_attempt_in_seconds_and_torchrun_restarts_the_job_to_its_end(tmp_path, builtin_cache):
    # A rank that raises: rank 1 fails after step 2 of the first attempt while rank 0 goes on into the next
    # step's collectives. The attempt ends in seconds with the error and its rank printed (before fail-fast, rank 0
    # waited in an all_gather and rank 1 in the teardown barrier for the 30-minute collective timeout, printing
    # nothing). Then what scripts/launch_torchrun.sh sets up (--max-restarts): torchrun restarts both ranks, and
    # the new attempt must form its process groups (with torch 2.13 it did not: its device-mesh subgroups read the
    # first attempt's addresses).
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "step35",
        *fit_args(tmp_path / "run", "--trainer.max_steps=4", "--trainer.callbacks+=tests.dist.hooks.FailOnce"),
    ]
    with Job(cmd, tmp_path / "log.txt", builtin_cache) as job:
        first_attempt = wait_for(lambda: len(job.workers()) == 2 and job.workers(), 240, job, "the first two ranks")
        wait_for(lambda: "step35: run failed" in job.output(), 240, job, "the error")
        failed = time.monotonic()
        wait_for(lambda: all(map(ended, first_attempt)), 60, job, "the first attempt's end")
        attempt_ended_in = time.monotonic() - failed
        rc = job.wait(timeout=300)
        out = job.output()
    # (start-up alone can take a minute on a loaded machine: the bound that matters is from the error to the end)
    assert attempt_ended_in < 20, f"{attempt_ended_in:.0f} s after the error\n{out[-4000:]}"
    assert re.search(
        r"\[rank 1\] step35: run failed during '[^']+': RuntimeError: injected failure on rank 1 after step 2 "
        r"\(attempt 0\)",
        out,
    ), out[-6000:]
    assert "[rank 1] Traceback (most recent call last)" in out  # the traceback, each line with its rank
    assert rc == 0, out[-6000:]
    assert "(attempt 1)" not in out and "Trainer.fit` stopped: `max_steps=4` reached" in out
