"""The one place the tests start step35: a job as a subprocess (`python -m step35`, under torchrun, Lightning's
own launcher or an emulated srun), a tests/dist script, a long-running job followed from outside (`Job`), and
the CLI in this process (`cli`, `run_plan`) where the process boundary is not what a test checks.

Every job gets the same environment (`environment`): the builtin cache given, one OpenMP thread per rank
unless asked, this checkout first on the path, and none of the launcher variables of the test process
(an in-process Lightning run sets MASTER_PORT, CI may run under SLURM), which would make a child job join
or imitate a job that is not its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).parent.parent

# Variables a launcher sets for its ranks (torchrun, Lightning, SLURM, LSF, jsrun) and step35's job identity
# (step35.job.JOB_VARIABLE): none of them reaches a job a test starts, nor an in-process case of step35.job.
LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "LSB_JOBID",
    "STEP35_JOB",
)
LAUNCH_PREFIXES = ("SLURM_", "LSB_", "JSM_")
LAUNCHERS = ("lightning", "torchrun", "slurm")
# OpenMP threads of a one-process job: two, as on a user's two cores, but one beside the other pytest-xdist worker
# (a job of two threads beside a busy worker on CI's two cores oversubscribes them: small matmuls slow down many
# times). A rank of a multi-rank job has one.
ONE_PROCESS_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def environment(cache: Path | None = None, threads: int = 1, **extra: str) -> dict[str, str]:
    """os.environ without launcher variables (LAUNCH_VARIABLES, LAUNCH_PREFIXES), with STEP35_CACHE=`cache` (when
    given), OMP_NUM_THREADS=`threads`, the repository on PYTHONPATH, then `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if cache is not None:
        env["STEP35_CACHE"] = str(cache)
    env.update(extra)
    return env


def command(args: list[str], nproc: int = 1, launcher: str = "torchrun") -> list[str]:
    """The argv of `step35 <args>` on `nproc` ranks of one node, started the way `launcher` starts a job:
    "torchrun" (torch.distributed.run --standalone), "lightning" (one process; Lightning starts the other
    ranks from `--trainer.devices`, which the caller passes), "slurm" (tests/dist/fake_srun.py, with the
    variables srun gives its tasks). One rank is one plain process whatever the launcher."""
    step35_ = ["-m", "step35", *args]
    if nproc == 1 or launcher == "lightning":
        return [sys.executable, *step35_]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *step35_]
    if launcher == "slurm":
        return [
            sys.executable,
            str(ROOT / "tests" / "dist" / "fake_srun.py"),
            f"--ntasks={nproc}",
            "--",
            sys.executable,
            *step35_,
        ]
    raise ValueError(f"unknown launcher {launcher!r}, expected one of {LAUNCHERS}")


def run_process_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run for commands that start children (torchrun and its ranks): the command runs in
    its own session and, on timeout, the whole group is killed, so a rank hung in a collective can
    never outlive its test. Returns a CompletedProcess; raises subprocess.TimeoutExpired after the kill."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_at_gate(cmd: list[str], cache: Path | None, gate: Path) -> subprocess.Popen:
    """The job `cmd` started in its own session, its output captured, and waited on until it is held at its
    tests.dist.hooks.Gate (which waits for the file `gate`, and marks its arrival with gate.reached beside it). A job
    that ends first, or is not there within 600 s, fails the test with the tail of its stderr."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=environment(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while not (gate.parent / "gate.reached").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            gate.touch()  # a job still waiting goes on to its end, so that its stderr can be read
            raise AssertionError(proc.communicate()[1][-5000:])
        time.sleep(0.2)
    return proc


def step35(
    args: list[str],
    cache: Path | None,
    *,
    nproc: int = 1,
    launcher: str = "torchrun",
    timeout: float = 600,
    threads: int | None = None,
    env: dict | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`step35 <args>` as a job (see `command`) with the builtin cache at `cache`, in the repository root, with
    `threads` OpenMP threads per process (default: ONE_PROCESS_THREADS for one process, 1 per rank of a job).
    With `check` it must succeed (the output's tails are the assertion's message); `env` adds variables."""
    threads = threads if threads is not None else (ONE_PROCESS_THREADS if nproc == 1 else 1)
    proc = run_process_group(
        command(args, nproc, launcher), timeout=timeout, cwd=ROOT, env=environment(cache, threads, **(env or {}))
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def python(code: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -c <code>` in the repository root, output captured, in `env` (default: `environment()`), for a
    process whose own end is what a test checks (an exit code, a signal, a watchdog)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environment() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_script(script: Path, nproc: int | None, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """A tests/dist script in one plain process (nproc None) or under torchrun with `nproc` ranks, in the repository
    root; it must succeed (the output's tails are the assertion's message)."""
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = run_process_group(
        [sys.executable, *launcher, str(script), *args], cwd=ROOT, env=environment(), timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_dist_script(script: Path, out: Path, nproc: int | None, *args: str, timeout: float) -> dict:
    """`run_script` for a script that writes its results to `out` (`--out`), returned loaded (torch.load)."""
    run_script(script, nproc, "--out", str(out), *args, timeout=timeout)
    return torch.load(out)


# ------------------------------------------------------------------------------ a job followed from outside
class Job:
    """A command (torchrun, the CLI, a script) in its own session, output to `log`, followed while it runs.
    Leaving the `with` block kills it and every process it started (torchrun's workers live in sessions of
    their own, so killing torchrun's process group alone would leave them running)."""

    def __init__(self, cmd: list[str], log: Path, cache: Path | None, env: dict | None = None, threads: int = 1):
        self.log = log
        self._out = open(log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=environment(cache, threads, **(env or {})),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._seen: dict[int, psutil.Process] = {}

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.workers()  # remember the last set
        for p in [*self._seen.values(), psutil.Process(self.proc.pid) if self.proc.poll() is None else None]:
            if p is None:
                continue
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)
        self._out.close()

    def workers(self) -> list[psutil.Process]:
        """The training processes (the launcher's children running step35), ordered by rank."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            try:
                if "step35" in " ".join(child.cmdline()):
                    self._seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
        ranks = []
        for p in self._seen.values():
            try:
                ranks.append((int(p.environ().get("RANK", 0)), p))
            except psutil.NoSuchProcess:
                pass
        return [p for _, p in sorted(ranks, key=lambda t: t[0])]

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.output()[-6000:]}") from None


def ended(process: psutil.Process) -> bool:
    """Whether `process` is gone (or a zombie nobody reaped yet)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(condition, timeout: float, job: Job, what: str):
    """`condition()`'s first true value, polled every 0.2 s; fails naming `what` (with the job's output)
    when the job ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        if job.proc.poll() is not None:
            result = condition()  # it may have come true just before the end
            if result:
                return result
            raise AssertionError(f"ended (rc {job.proc.returncode}) before {what}:\n{job.output()[-6000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout} s:\n{job.output()[-6000:]}")


def stop_job(job: Job, sig: int) -> tuple[int, float]:
    """Send `sig` to the job's process; its exit code and the seconds it took to end (120 s at most)."""
    sent = time.monotonic()
    job.proc.send_signal(sig)
    rc = job.wait(timeout=120)
    return rc, time.monotonic() - sent


def descendants(pid: int) -> list[int]:
    """Child processes of `pid`, recursively (torchrun starts each rank in a session of its own)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def signal_job(proc: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the launcher and every process below it (torchrun starts each rank in a
    session of its own, so the launcher's process group does not hold them)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the whole job at once, as a node failure would: every rank, then the launcher."""
    signal_job(proc, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ------------------------------------------------------------------------------ the CLI in this process
def cli(capture, *args: str) -> tuple[int, str, str]:
    """`step35 <args>` in this process (step35.cli.main): (exit code, stdout, stderr), for a run or a refusal whose
    process is not what a test checks. `capture` is the test's capfd (step35.faults and Lightning write below
    sys.stderr, which only fd capture sees) or capsys, or None (nothing captured: "" and "", e.g. in a
    module-scoped fixture). The exit code is SystemExit's (0 for a return; a SystemExit("message") prints the
    message and is 1, as Python does). Any other exception is raised as it is: a step35 command must never end
    in a traceback."""
    from step35.cli import main
    from step35.commands import fit

    if capture is not None:
        capture.readouterr()
    # fit.say's default stream is the sys.stderr of its first import, maybe an earlier test's closed capture
    said_to = fit.say.__defaults__
    fit.say.__defaults__ = (sys.stderr,)
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr, flush=True)
    finally:
        fit.say.__defaults__ = said_to
    if capture is None:
        return code, "", ""
    out = capture.readouterr()
    return code, out.out, out.err


def step35_in_process(
    capture, args: list[str], cache: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`cli` with STEP35_CACHE=`cache` while it runs, as a CompletedProcess like `step35`'s (a drop-in for a job
    whose process is not what a test checks); with `check` it must succeed."""
    before = os.environ.get("STEP35_CACHE")
    if cache is not None:
        os.environ["STEP35_CACHE"] = str(cache)
    try:
        code, out, err = cli(capture, *args)
    finally:
        if before is None:
            os.environ.pop("STEP35_CACHE", None)
        else:
            os.environ["STEP35_CACHE"] = before
    if check:
        assert code == 0, out[-3000:] + err[-5000:]
    return subprocess.CompletedProcess(["step35", *args], code, out, err)


def cli_fit(
    capture, config: Path, run: Path, cache: Path | None, *extra: str, check: bool = True
) -> subprocess.CompletedProcess:
    """`step35 fit --config <config> --run_dir=<run> <extra>` in this process (see `step35_in_process`)."""
    return step35_in_process(capture, ["fit", "--config", str(config), f"--run_dir={run}", *extra], cache, check)


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    """`step35 plan <args>` in this process: (exit code, stdout, stderr). It must end by SystemExit (the plan
    always exits with its verdict's code); the fake process group it opens is closed again when it returns."""
    from step35.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *args])
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def fit(config: Path, run: Path, cache: Path | None, *extra: str, **options) -> subprocess.CompletedProcess:
    """`step35 fit --config <config> --run_dir=<run> <extra>` as a job (`step35`'s options: nproc, launcher,
    timeout, threads, env, check)."""
    return step35(["fit", "--config", str(config), f"--run_dir={run}", *extra], cache, **options)
