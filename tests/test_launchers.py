"""One job however it was started: Lightning's own launcher (`step35 fit --trainer.devices N`), torchrun,
and SLURM's srun (emulated by tests/dist/fake_srun.py with the variables srun gives its tasks).

In process: `step35.job` reads each launcher's variables the way Lightning's cluster environments do
(which process is the job's rank 0, what identifies the job). As real jobs, one per launcher: EP 2 composed
with cp 2 on 2 ranks gives one process's per-step losses (relative 1e-5), and a real second job started the
same way in the same run folder, while the first is held at a step, is refused naming the live one; the
first then finishes unharmed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from step35 import job
from step35.run import lock
from tests.helpers import metric_rows, steps_of, write_run_config
from tests.runner import (
    LAUNCH_PREFIXES,
    LAUNCH_VARIABLES,
    LAUNCHERS,
    cli_fit,
    command,
    environment,
    start_at_gate,
    step35,
)

pytestmark = pytest.mark.early(minutes=2.5)  # minutes of processes: started first in the parallel run (conftest.py)

REL = 1e-5
STEPS = ["--trainer.max_steps=4", "--trainer.callbacks.every_n_train_steps=4"]
STRATEGY = ["--trainer.strategy=step35.strategy.Step35Strategy"]


# ------------------------------------------------------------------------------ in process: step35.job
@pytest.fixture
def launched_as(monkeypatch):
    """place(variables): step35.job's reading of this process with only `variables` set of every launcher's
    (the test process may itself run under a launcher, e.g. CI under SLURM)."""
    assert job.JOB_VARIABLE in LAUNCH_VARIABLES
    for name in [*LAUNCH_VARIABLES, *(k for k in os.environ if k.startswith(LAUNCH_PREFIXES))]:
        monkeypatch.delenv(name, raising=False)

    def place(variables: dict, devices_per_node: int | None = None) -> job.JobPlace:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return job.place_of_environment(devices_per_node)

    return place


def slurm_task(rank: int, ntasks: int = 4, per_node: int = 2, job_name: str = "train") -> dict:
    return {
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NAME": job_name,
    }


def test_a_process_started_from_a_shell_is_rank_zero_of_its_job(launched_as):
    place = launched_as({})
    assert (place.launcher, place.global_rank, place.is_rank_zero, place.started_by_launcher) == (
        "lightning",
        0,
        True,
        False,
    )


def test_torchrun_ranks(launched_as):
    place = launched_as(
        {
            "TORCHELASTIC_RUN_ID": "abc",
            "TORCHELASTIC_RESTART_COUNT": "1",
            "RANK": "3",
            "LOCAL_RANK": "1",
            "GROUP_RANK": "1",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "29500",
        }
    )
    assert (place.launcher, place.node_rank, place.local_rank, place.global_rank, place.world_size) == (
        "torchrun",
        1,
        1,
        3,
        4,
    )
    assert not place.is_rank_zero and place.started_by_launcher
    assert place.same_job(
        {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    )
    # another torchrun job (same default run id "none" elsewhere, but its own port), or the next attempt
    assert not place.same_job(
        {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29501"}
    )
    assert not place.same_job(
        {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    )


def test_srun_tasks_on_two_nodes(launched_as):
    place = launched_as(slurm_task(3))
    assert (place.launcher, place.node_rank, place.local_rank, place.global_rank, place.world_size) == (
        "slurm",
        1,
        1,
        3,
        4,
    )
    assert not place.is_rank_zero and not place.started_by_launcher  # srun ends its tasks itself
    assert place.same_job({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"})
    assert not place.same_job({"SLURM_JOB_ID": "78", "SLURM_STEP_ID": "0"})
    assert launched_as(slurm_task(0)).is_rank_zero


def test_lightning_launcher_inside_an_interactive_slurm_allocation(launched_as):
    """`salloc` then `step35 fit --trainer.devices 2`: SLURM_PROCID is 0 in every process (inherited from the
    shell), and Lightning uses its own launcher (job name 'bash'); the started local rank 1 is not rank 0."""
    shell = {**slurm_task(0, ntasks=1, per_node=1, job_name="bash")}
    assert launched_as(shell).launcher == "lightning" and launched_as(shell).is_rank_zero
    child = launched_as({**shell, "LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", job.JOB_VARIABLE: "j1"})
    assert (child.launcher, child.global_rank, child.is_rank_zero, child.started_by_launcher) == (
        "lightning",
        1,
        False,
        True,
    )


def test_lightning_launcher_local_ranks_know_their_job_by_the_inherited_id(launched_as):
    rank0 = launched_as({})
    assert rank0.is_rank_zero
    recorded = job.start_job_identity()  # (reads this process's cached place; only the id matters here)
    child = launched_as(
        {
            "LOCAL_RANK": "1",
            "NODE_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "40000",
            job.JOB_VARIABLE: recorded[job.JOB_VARIABLE],
        }
    )
    assert child.same_job(recorded)  # rank 0 recorded no port: it was chosen when the children started
    assert not child.same_job({**recorded, job.JOB_VARIABLE: "another job"})


def test_lightning_multi_node_ranks(launched_as):
    variables = {"NODE_RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"}
    assert launched_as(variables).global_rank is None  # devices per node unknown
    place = launched_as(variables, devices_per_node=8)
    assert (place.global_rank, place.is_rank_zero, place.describe()) == (8, False, "rank 8")
    assert place.same_job({"MASTER_ADDR": "n0", "MASTER_PORT": "1234", job.JOB_VARIABLE: "x"})
    assert not place.same_job({"MASTER_ADDR": "n0", "MASTER_PORT": "999"})


def test_devices_per_node_reads_every_spelling_of_trainer_devices():
    from step35.commands.fit import devices_per_node

    assert [devices_per_node(v) for v in (2, "2", "0,1", "0,1,", [0, 1, 2], "auto", -1, None)] == [
        2,
        2,
        2,
        2,
        3,
        None,
        None,
        None,
    ]


# ------------------------------------------------------------------------------ real jobs
def on_ranks(launcher: str, nproc: int, args: list[str]) -> list[str]:
    """The argv of `step35 <args>` on `nproc` ranks of one node (`--trainer.devices` said), started by `launcher`."""
    return command([*args, f"--trainer.devices={nproc}"], nproc, launcher)


def losses(run: Path) -> dict[int, float]:
    return steps_of(metric_rows(run / "csv" / "version_0"), "train/loss")


def assert_same_losses(reference: dict[int, float], got: dict[int, float]) -> None:
    assert sorted(reference) == sorted(got) and len(reference) == 4, (reference, got)
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= REL * abs(loss), (step, loss, got[step])


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return write_run_config(tmp_path_factory.mktemp("launchers"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, config, builtin_cache) -> dict[int, float]:
    """The losses of the same run in one process: this one."""
    run = tmp_path_factory.mktemp("one") / "run"
    cli_fit(None, config, run, builtin_cache, *STEPS)
    return losses(run)


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ep2_cp2_gives_one_process_losses_and_a_second_job_is_refused(
    tmp_path, launcher, config, builtin_cache, one_process
):
    """EP 2 composed with context parallel 2 on 2 ranks, started by `launcher`: both ranks read the same batches
    and the job logs, step by step, the losses one process logs. While it is held at step 2
    (tests.dist.hooks.Gate), a second job started the same way in its run folder is refused, naming the first's
    rank 0; the first then finishes with its checkpoint, and the second wrote nothing."""
    run, go = tmp_path / "run", tmp_path / "go"
    args = [
        "fit",
        "--config",
        str(config),
        f"--run_dir={run}",
        *STEPS,
        *STRATEGY,
        "--trainer.strategy.expert_parallel_size=2",
        "--trainer.strategy.context_parallel_size=2",
        "--trainer.callbacks+=tests.dist.hooks.Gate",
        f"--trainer.callbacks.file={go}",
        "--trainer.callbacks.at_step=2",
    ]
    first = start_at_gate(on_ranks(launcher, 2, args), builtin_cache, go)
    try:
        holder = lock.read_holder(run / ".step35.lock")
        assert holder["launcher"] == launcher, holder
        second = step35(
            [
                "fit",
                "--config",
                str(config),
                f"--run_dir={run}",
                "--trainer.max_steps=9",
                *STRATEGY,
                "--trainer.devices=2",
            ],
            builtin_cache,
            nproc=2,
            launcher=launcher,
            timeout=300,
            check=False,
        )
        assert first.poll() is None  # alive all along
        assert second.returncode != 0
        assert f"in use by a live run (pid {holder['pid']} on host" in second.stderr, second.stderr[-4000:]
        assert f"a {launcher} job" in second.stderr, second.stderr[-4000:]
    finally:
        go.touch()
        try:
            out, err = first.communicate(timeout=600)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, 9)
    assert first.returncode == 0, err[-5000:]
    assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]  # the second job logged nothing
    assert (run / "checkpoints" / "step=000004.ckpt").exists()
    assert_same_losses(one_process, losses(run))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_bad_expert_parallel_size_ends_the_whole_lightning_launched_job_at_once(tmp_path, config, builtin_cache):
    """EP 3 on 2 ranks: rank 0 fails listing the valid sizes, and the rank it started does not wait for it
    (its launcher, rank 0, is gone: it ends within a second instead of waiting 300 s for the lock)."""
    args = [
        "fit",
        "--config",
        str(config),
        f"--run_dir={tmp_path / 'run'}",
        *STRATEGY,
        "--trainer.strategy.expert_parallel_size=3",
    ]
    started = time.monotonic()
    proc = step35(
        [*args, "--trainer.devices=2"], builtin_cache, nproc=2, launcher="lightning", timeout=240, check=False
    )
    took = time.monotonic() - started
    assert proc.returncode != 0
    assert (
        "expert_parallel_size=3 must divide the world size 2 (sizes that divide the world size and the experts: "
        "[1, 2])" in proc.stderr
    ), proc.stderr[-3000:]
    assert "waited 300 s" not in proc.stderr and took < 200, (took, proc.stderr[-3000:])
    print(f"refused in {took:.0f} s")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_rank_whose_launcher_died_before_it_looked_ends_at_once(tmp_path):
    """A rank Lightning's launcher started, whose launcher (rank 0) was gone before the rank imported step35:
    its parent is then already init, so only the pid in the inherited job id tells; it exits 77 at once. A
    job id naming a live process that is not its parent (inherited from elsewhere) is not taken for it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ended, not reaped yet (as a rank 0 whose parent
    deadline = time.monotonic() + 60  # waits for the job's output pipes)
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code = "from step35 import faults; import time; print(faults.watch_launcher(), flush=True); time.sleep(3)"
    for job_id, expected in ((f"{dead.pid}-x", 77), (f"{zombie.pid}-x", 77), (f"{os.getpid()}-x", 0)):
        env = environment(tmp_path, LOCAL_RANK="1", **{job.JOB_VARIABLE: job_id})
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == expected, (job_id, proc.returncode, proc.stderr[-2000:])
    assert (
        f"the launcher (pid {dead.pid}) is gone"
        in subprocess.run(
            [sys.executable, "-c", code],
            env=environment(tmp_path, LOCAL_RANK="1", **{job.JOB_VARIABLE: f"{dead.pid}-x"}),
            capture_output=True,
            text=True,
            timeout=120,
        ).stderr
    )
    zombie.wait()
