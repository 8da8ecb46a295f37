"""Failures, pre-emption and hangs of a (multi-rank) run: the plain mechanics, no Lightning here
(`step35.callbacks.fault_tolerance` wires them into the training loop, `step35.strategy` into the
process group's life).

- Exit codes the launchers and schedulers can act on (`EXIT_PREEMPTED`, `EXIT_STALLED`,
  `EXIT_ORPHANED`).
- `StopSignals`: SIGTERM / SIGUSR1 only set a flag. The decision to stop is taken at a step
  boundary, agreed by all ranks with one tiny all_reduce, never inside a signal handler (a
  collective started from a handler meets other ranks inside a different collective and hangs).
- Phases and the `Watchdog`: the code records what it is doing (`phase("expert all-to-all")`);
  a thread ends the process, naming the phase and the rank, when nothing has progressed for the
  timeout. It is the one bound that holds whatever the backend (a SIGSTOPped peer, a collective on
  a device-mesh subgroup that has torch's default 30-minute timeout, a stuck data loader).
- `watch_launcher`: a rank started by a launcher (torchrun) ends within a second when the launcher
  dies (SIGKILL, an OOM kill), instead of training on beside the restarted job.
- `report_failure` / `abort_process_groups`: an exception is printed with its rank at once, and
  the process groups are aborted instead of waited on, so no rank enters another collective.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist

from step35 import job

EXIT_FAILED = 1
"""An exception on this rank (printed with the rank and its traceback)."""
EXIT_PREEMPTED = 75
"""Stopped on SIGTERM / SIGUSR1 at a step boundary after writing a checkpoint (EX_TEMPFAIL: run again
with `--ckpt_path auto` to continue)."""
EXIT_STALLED = 76
"""The watchdog ended the process: nothing progressed for the timeout (no checkpoint written)."""

EXIT_ORPHANED = 77
"""The launcher that started this rank (torchrun) died without ending it; the rank ended itself, no
checkpoint. Whoever restarts the launcher restarts the ranks from their last checkpoint."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""SIGTERM: scancel, `timeout`, torchrun's shutdown, Kubernetes. SIGUSR1: SLURM's `--signal` warning."""


def write_stderr(message: str) -> None:
    """`message` on fd 2, on a line of its own: after a newline when a progress bar holds the terminal line."""
    # os.write: safe from signal handlers and from a thread while the main thread holds sys.stderr's lock.
    if bar_on_screen():
        message = "\n" + message.lstrip("\n")
    try:
        os.write(2, message.encode(errors="replace"))
    except OSError:
        pass


def bar_on_screen() -> bool:
    """Whether a tqdm progress bar of this process is drawn (Lightning's: the training, validation and sanity
    check bars): the cursor then sits at the end of its line, and a line written there would be spliced into
    it. Reads tqdm's set of open bars without a lock, so it is safe in a signal handler; False without tqdm."""
    tqdm_std = sys.modules.get("tqdm.std")
    try:
        bars = list(tqdm_std.tqdm._instances) if tqdm_std is not None else []
    except (AttributeError, RuntimeError):  # no bar made yet; the set changed while copied
        return False
    return any(getattr(bar, "disable", True) is False and hasattr(bar, "last_print_t") for bar in bars)


# ----------------------------------------------------------------------------------- phases
class _Phase:
    """What the main thread is doing now and since when (written by the main thread, read by the watchdog)."""

    def __init__(self) -> None:
        self.name = "start-up"
        self.since = time.monotonic()
        self.step: int | None = None
        self.patient = False  # a phase allowed the full timeout even while stopping (checkpoint I/O)
        self.failed_in: str | None = None  # the phase of the first failure, kept while exiting


_PHASE = _Phase()


def set_phase(name: str, step: int | None = None, patient: bool = False) -> None:
    """Records that the main thread entered `name` (and, when given, the optimizer step it belongs to).
    Every call counts as progress for the watchdog. `patient`: a phase that may legitimately take long
    while the run is stopping (a checkpoint save): the signal grace does not apply to it."""
    _PHASE.name = name
    _PHASE.patient = patient
    if step is not None:
        _PHASE.step = step
    _PHASE.since = time.monotonic()


def begin_run() -> None:
    """Forgets the failure of an earlier run in this process (an in-process `step35 fit` after a
    failed one, a notebook's second `Trainer.fit`): without it the new run's failure was reported in
    the phase where the old one failed, or a refusal before the first step as a failure of the old one's
    last step. Called as a fit starts (`step35 fit`'s entry point, Step35Strategy.setup_environment,
    FaultTolerance.setup)."""
    _PHASE.failed_in = None
    _PHASE.step = None
    set_phase("start-up")


def current_phase() -> str:
    step = f" (step {_PHASE.step})" if _PHASE.step is not None else ""
    return f"{_PHASE.name}{step}"


def mark_failure(exiting_phase: str = "exit after an error") -> None:
    """Remembers where the first failure happened (for `report_failure`), then records the exit as
    the current phase: the watchdog keeps bounding the way out."""
    if _PHASE.failed_in is None:
        _PHASE.failed_in = current_phase()
    set_phase(exiting_phase)


class _PhaseScope:
    def __init__(self, name: str, patient: bool | None = None):
        self.name, self.patient = name, patient
        self.previous = ""

    def __enter__(self) -> None:
        self.previous = (_PHASE.name, _PHASE.patient)
        set_phase(self.name, patient=self.previous[1] if self.patient is None else self.patient)

    def __exit__(self, *exc) -> None:
        set_phase(self.previous[0], patient=self.previous[1])


def phase(name: str, patient: bool | None = None):
    """`with phase("expert all-to-all"):` marks a region; the previous phase resumes after it. `patient`
    (default: the enclosing phase's): see set_phase.
    Nothing is recorded inside torch.compile'd code (no side effect to trace; the enclosing loop
    phase stands for it)."""
    if torch.compiler.is_compiling():
        return nullcontext()
    return _PhaseScope(name, patient)


# ----------------------------------------------------------------------------------- signals
class StopSignals:
    """Records SIGTERM / SIGUSR1 and nothing else (no collective, no I/O but one line on stderr);
    `requested` is read at the next step boundary. Installed from the main thread only.

    Python runs signal handlers in the main thread only, between bytecodes: a main thread blocked in
    native code (a collective whose peer is gone) never runs them, and the signal would wait for
    the launcher's SIGKILL. So the signal is also written to a wakeup pipe by the interpreter's C
    handler (`signal.set_wakeup_fd`), which the watchdog reads (`delivered`): a signal that the main
    thread has not handled within a grace period means the main thread is stuck."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, rank: int = 0):
        self.signals = tuple(int(s) for s in signals)
        self.rank = rank
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._pipe_lock = threading.Lock()  # the watchdog reads the pipe while the main thread may close it

    @property
    def requested(self) -> bool:
        return self.received is not None

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "none"

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handler)
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._pipe = (read, write)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            with self._pipe_lock:
                pipe, self._pipe = self._pipe, None
                for fd in pipe:
                    os.close(fd)

    def delivered(self) -> list[int]:
        """Stop signals that reached the process since the last call, handled or not (any thread)."""
        with self._pipe_lock:
            if self._pipe is None:
                return []
            try:
                data = os.read(self._pipe[0], 4096)
            except OSError:  # nothing there (non-blocking read)
                return []
        return [b for b in data if b in self.signals]

    def _handler(self, signum: int, frame) -> None:
        first = self.received is None
        if first:
            self.received = signum
        write_stderr(
            f"[rank {self.rank}] step35: received {signal.Signals(signum).name} during '{current_phase()}'; "
            + (
                "stopping at the next step boundary (or validation batch) after writing a checkpoint\n"
                if first
                else "already stopping\n"
            )
        )


def ignore_at_exit(signals: tuple[int, ...]) -> None:
    """Ignores `signals` from the start of the interpreter's exit (atexit) on. A Python handler does
    not cover the whole exit: finalization resets it to the default action, while SIG_IGN stays."""

    def ignore() -> None:
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)

    atexit.register(ignore)


# ----------------------------------------------------------------------------------- watchdog
# The watchdogs started in this process and not stopped: a fit that failed leaves its own running on purpose (it
# watches the process's way out); `end_in_caller` stops them when the process goes on instead.
_RUNNING_WATCHDOGS: set[Watchdog] = set()


def end_in_caller() -> None:
    """The end of a fit run inside a process that goes on (`step35.cli.main([...])` from a test, a notebook, a
    driver script), however it ended: its watchdog and launcher watch stop. After a failure both stay for a
    command's own way out; left running in a caller, the watchdog ended that process (`os._exit`, exit 76)
    once its timeout passed without a fit marking progress."""
    for watchdog in list(_RUNNING_WATCHDOGS):
        watchdog.stop()
    stop_watching_launcher()


class Watchdog:
    """A daemon thread that ends the process (printing the rank, the phase and every thread's stack,
    exit code `EXIT_STALLED`, no cleanup: a process stuck in a collective cannot clean up) when
    - the recorded phase has not changed for `timeout_s`, or
    - a stop signal reached the process and, since, one phase has lasted the signal grace (a
      checkpoint save excepted): the rank cannot reach the step boundary, typically blocked in a
      collective whose peer failed or was stopped; without this, a rank that has handled the signal
      (or is blocked in native code and cannot) waits for the launcher's SIGKILL.
    The signal grace is `GRACE_STEPS` times the slowest of the last `RECENT_STEPS` steps given to
    `record_step`, never below `signal_grace_s`: a stop signal must not end a rank that is only in
    a slow step. With `world_size` > 1 the messages point at the peers; in a one-process run there
    are none. The launcher (torchrun) then ends the other ranks and, with restarts configured,
    starts the job again from its last checkpoint."""

    GRACE_STEPS = 3.0
    RECENT_STEPS = 20

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        hint: str = "",
        signals: StopSignals | None = None,
        signal_grace_s: float = 20.0,
        world_size: int = 1,
    ):
        if timeout_s <= 0 or signal_grace_s <= 0:
            raise ValueError(
                f"watchdog timeout and signal grace must be > 0 seconds, got {timeout_s}, {signal_grace_s}"
            )
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.hint = hint
        self.signals = signals
        self.signal_grace_s = float(signal_grace_s)
        self.world_size = world_size
        self._steps: tuple[float, ...] = ()  # replaced, never mutated: the watchdog thread reads it
        self._signal_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        set_phase(_PHASE.name)  # the clock starts now
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="step35-watchdog", daemon=True)
        _RUNNING_WATCHDOGS.add(self)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        _RUNNING_WATCHDOGS.discard(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def record_step(self, seconds: float) -> None:
        """The duration of one finished optimizer step (called by the main thread)."""
        self._steps = (*self._steps[-(self.RECENT_STEPS - 1) :], float(seconds))

    def grace_s(self) -> float:
        """How long one phase may last after a stop signal: several times the slowest recent step, at
        least the `signal_grace_s` option (the only bound before the first step has finished)."""
        return max(self.signal_grace_s, self.GRACE_STEPS * max(self._steps, default=0.0))

    def _grace_text(self) -> str:
        steps = self._steps
        grace = max(self.signal_grace_s, self.GRACE_STEPS * max(steps, default=0.0))
        if grace > self.signal_grace_s:
            return (
                f"signal grace {grace:.0f} s: {self.GRACE_STEPS:g} x the slowest of the last {len(steps)} "
                f"steps ({max(steps):.1f} s)"
            )
        return f"signal grace {grace:.0f} s"

    def _run(self) -> None:
        poll = min(1.0, max(0.1, self.timeout_s / 20))
        while not self._stop.wait(poll):
            now = time.monotonic()
            signals = self.signals
            if signals is not None and signals.delivered() and self._signal_at is None:
                self._signal_at = now
            if self._signal_at is not None and not _PHASE.patient:
                stuck = now - max(_PHASE.since, self._signal_at)
                grace = self.grace_s()
                if stuck > grace:
                    handled = "" if signals.received is not None else ", the main thread never handled it"
                    why = " (a peer failed or stopped?)" if self.world_size > 1 else ""
                    self._fire(
                        f"a stop signal arrived {now - self._signal_at:.0f} s ago{handled}, and '{current_phase()}' "
                        f"has made no progress for {stuck:.0f} s since ({self._grace_text()}): "
                        f"this rank cannot reach the step boundary{why}, no checkpoint"
                    )
            idle = now - _PHASE.since
            if idle > self.timeout_s:
                cause = (
                    "another rank stopped responding or died, or this phase is slower than the timeout"
                    if self.world_size > 1
                    else "this phase is stuck (data, I/O, a deadlock) or slower than the timeout"
                )
                self._fire(
                    f"no progress for {idle:.0f} s (timeout {self.timeout_s:.0f} s) while in "
                    f"'{current_phase()}'. Waiting there means {cause}{self.hint}"
                )

    def _fire(self, reason: str) -> None:
        write_stderr(
            f"\n[rank {self.rank}] step35 watchdog: {reason}. Ending this process with exit code "
            f"{EXIT_STALLED}; stacks of rank {self.rank}:\n"
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
        os._exit(EXIT_STALLED)


# ----------------------------------------------------------------------------------- the launcher
_PARENT_AT_START = os.getppid()  # at import, before any model build: the launcher if there is one


def started_by_launcher() -> bool:
    """True in a rank that torchrun or Lightning's own launcher (its local ranks 1..N-1) started as its
    child (step35.job). A process started from a shell is not (Lightning's local rank 0 among them): when
    the shell goes, the terminal's SIGHUP ends it, or it was detached on purpose (nohup, tmux) to keep
    going. SLURM's srun ends the tasks of a step itself."""
    return job.this_process().started_by_launcher


class LauncherWatch:
    """A daemon thread that ends the process with `EXIT_ORPHANED` within `poll_s` of its launcher's
    death: the parent process id then changes (the orphan is re-parented to init or a subreaper).

    Without it, ranks whose torchrun was SIGKILLed (an OOM kill of the launcher, `kill -9`, a
    supervisor) train on, re-parented, writing checkpoints beside the restarted job. Polling
    `os.getppid()` was chosen over Linux's `prctl(PR_SET_PDEATHSIG)`: that signal fires when the
    *thread* that forked the rank ends (not the launcher process), is Linux-only, and a signal can
    only say why in a Python handler, which runs in the main thread between bytecodes (not while
    it waits in a collective). One getppid() per `poll_s` costs nothing."""

    def __init__(self, rank: int, parent: int | None = None, poll_s: float = 0.5):
        self.rank = rank
        self.parent = _PARENT_AT_START if parent is None else parent
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step35-launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        self._check()  # the launcher may already be gone
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._check()

    def _check(self) -> None:
        now = os.getppid()
        if now == self.parent or self._stop.is_set():
            return
        write_stderr(
            f"[rank {self.rank}] step35: the launcher (pid {self.parent}) is gone (this rank's parent is "
            f"now pid {now}) while in '{current_phase()}': ending this rank with exit code {EXIT_ORPHANED}, "
            "no checkpoint, so that it does not run beside a restarted job\n"
        )
        os._exit(EXIT_ORPHANED)


_LAUNCHER_WATCH: LauncherWatch | None = None


def _launcher_gone_before_import(launcher_pid: int | None) -> int | None:
    """The pid to watch instead of the parent seen at import: the Lightning-launched rank's launcher named
    by its job id, when that process had died before this one looked at its parent (it was then already
    re-parented). A job id naming another process that still lives was inherited from elsewhere: the
    parent seen at import is the launcher then (None)."""
    if launcher_pid is None or launcher_pid == _PARENT_AT_START:
        return None
    return launcher_pid if _ended(launcher_pid) else None  # ended: the watch's first check ends this rank


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie its own parent has not reaped yet (Lightning's rank
    0 under a parent that waits for the job's output pipes, which this rank still holds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def watch_launcher(rank: int | None = None) -> bool:
    """Starts the one `LauncherWatch` of this process when a launcher started it (`started_by_launcher`);
    a later call only updates the rank its message names (None: the rank the launcher gave, step35.job).
    Returns whether the launcher is watched."""
    global _LAUNCHER_WATCH
    if _LAUNCHER_WATCH is None and started_by_launcher():
        place = job.this_process()
        _LAUNCHER_WATCH = LauncherWatch(
            (place.global_rank or 0) if rank is None else rank, parent=_launcher_gone_before_import(place.launcher_pid)
        ).start()
    elif _LAUNCHER_WATCH is not None and rank is not None:
        _LAUNCHER_WATCH.rank = rank
    return _LAUNCHER_WATCH is not None


def check_launcher() -> None:
    """Ends the process as `LauncherWatch` does if the launcher is gone; call it first on a failure, so
    that a rank whose peer ended for that reason (a closed connection) names the cause, not the symptom."""
    if _LAUNCHER_WATCH is not None:
        _LAUNCHER_WATCH._check()


def stop_watching_launcher() -> None:
    """On success, before the final barrier: a launcher may then end before this rank does (Lightning's
    launcher is rank 0 itself), which is no failure."""
    global _LAUNCHER_WATCH
    if _LAUNCHER_WATCH is not None:
        _LAUNCHER_WATCH.stop()
        _LAUNCHER_WATCH = None


# ----------------------------------------------------------------------------------- failures
class Preempted(SystemExit):
    """Raised by every rank together, after the pre-emption checkpoint is written: a clean stop with
    `EXIT_PREEMPTED`, not a failure (the process group is torn down normally)."""

    def __init__(self, message: str):
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


def is_refusal(exception: BaseException) -> bool:
    """One of step35's refusals of its input (a config, a checkpoint, a run folder, a chat template): the message
    names what is wrong and what to do, and the code that raised it is no news to the user. Such error classes
    say so themselves (`step35_refusal = True`: ConfigError, CheckpointError, RunFolderBusy, ChatTemplateError),
    so this module, below them all, imports none of them."""
    return bool(getattr(exception, "step35_refusal", False))


class RunStopped(RuntimeError):
    """A stop that step35 decided and explained in its message (e.g. the divergence guard's): reported as its
    one line, with the rank and phase, without the traceback of the loop that raised it."""


def report_failure(exception: BaseException, rank: int) -> None:
    """Prints the exception with its rank, the phase and the traceback, every line prefixed by the rank
    (ranks share one terminal), at once (a peer may end this process soon). A refusal raised before the
    first step (while the module is built, the run folder locked, the checkpoint loaded) is its one line,
    as the CLI prints the refusals that come before the Trainer. `was_reported` then tells the entry
    point not to print it a second time."""
    if _PHASE.step is None and is_refusal(exception):
        write_stderr(f"{'' if rank == 0 else f'[rank {rank}] '}step35: {exception}\n")
        _mark_reported(exception, rank)
        return
    prefix = f"[rank {rank}] "
    where = _PHASE.failed_in or current_phase()
    if isinstance(exception, RunStopped):
        write_stderr(f"{prefix}step35: run stopped during '{where}': {exception}\n")
        _mark_reported(exception, rank)
        return
    lines = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
    body = "".join(prefix + line + "\n" for line in lines.rstrip("\n").split("\n"))
    head = (
        f"{prefix}step35: run failed during '{where}': {type(exception).__name__}: "
        f"{str(exception).splitlines()[0] if str(exception) else ''}\n"
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    write_stderr(head + body + head)
    _mark_reported(exception, rank)


def _mark_reported(exception: BaseException, rank: int) -> None:
    try:
        exception.step35_reported = True
        exception.step35_rank = rank
    except AttributeError:
        pass


def was_reported(exception: BaseException) -> bool:
    return bool(getattr(exception, "step35_reported", False))


def report_aftermath(exception: BaseException) -> bool:
    """When `exception` was raised while handling a reported failure (its __context__ / __cause__
    chain holds one), prints it as one line after the report and returns True (the entry point then
    exits with EXIT_FAILED, no second traceback). Lightning's clean-up after a failure (the loggers'
    finalize, teardown) can fail again for the same reason: on a full disk the CSV logger's flush
    raised ENOSPC once more after the reported failure, and the output ended in that bare traceback
    instead of a `step35:` line. False when no reported failure is in the chain."""
    seen: set[int] = set()
    earlier = exception.__cause__ or exception.__context__
    while earlier is not None and id(earlier) not in seen and not was_reported(earlier):
        seen.add(id(earlier))
        earlier = earlier.__cause__ or earlier.__context__
    if earlier is None or id(earlier) in seen:
        return False
    text = str(exception).splitlines()[0] if str(exception) else ""
    write_stderr(
        f"[rank {getattr(earlier, 'step35_rank', 0)}] step35: ending the run after that failure failed too: "
        f"{type(exception).__name__}: {text}\n"
    )
    return True


def abort_process_groups(timeout_s: float = 10.0) -> bool:
    """Aborts every process group of this process so no collective can wait on the failed job (the
    peers see a closed connection with gloo; NCCL/HCCL communicators are aborted instead of flushed).
    Bounded: runs in a thread that is abandoned after `timeout_s`. Returns whether an abort ran.

    torch 2.13 offers this only as the private `distributed_c10d._abort_process_group` (it aborts
    the default group and every subgroup, inside one NCCL group call); it is used here and nowhere else."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is None:
        write_stderr(
            f"step35: torch {torch.__version__} has no torch.distributed.distributed_c10d._abort_process_group; "
            "the process groups are left to the process exit (update step35/faults.py)\n"
        )
        return False
    errors: list[BaseException] = []

    def run() -> None:
        try:
            abort()
        except BaseException as error:  # noqa: BLE001 - reported below, the original failure matters more
            errors.append(error)

    thread = threading.Thread(target=run, name="step35-abort", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        write_stderr(f"step35: aborting the process groups did not finish within {timeout_s:.0f} s; exiting anyway\n")
        return False
    if errors:
        write_stderr(f"step35: aborting the process groups failed: {errors[0]!r}\n")
        return False
    return True
