"""One live job per run folder: an exclusive `flock` on `<run_dir>/.step35.lock`, taken by global rank 0.

Two jobs in one folder destroy each other: the newcomer's start-up tidy deletes the other's save in
progress, retention prunes the other's checkpoints and `last.ckpt` flips between them. So:

- rank 0 takes the lock before the Trainer exists (before any tidy-up, log or config is written);
  the lock file then names the holder: host, pid, start time and the launcher's job key;
- a second job is refused at start, naming the live holder and `--run_dir`;
- the kernel drops a flock when its holder dies (any death, SIGKILL included), so a lock whose
  holder is gone is simply free; the file still names that holder (a clean exit empties it), and
  taking it over says so;
- the other ranks do not start until the lock file names their own job (`wait_for_rank0`): rank 0
  was refused or failed when it never does, and they end with a message saying so.

flock works on local filesystems and on NFS (Linux emulates it with POSIX byte-range locks); on a
filesystem without working locks (some FUSE mounts) two jobs are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from step35.run.layout import RunFolder

# The launcher's variables that are the same on every rank of one job and differ between jobs.
_JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT",
                  "SLURM_JOB_ID", "SLURM_RESTART_COUNT")
_HELD: dict[Path, "RunLock"] = {}  # this process's locks (a second flock from the same process would fail)


def _close_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file description: while it lived on,
    # a holder killed with SIGKILL would keep the folder locked. Its copies are closed at once, so the
    # lock lives exactly as long as its holder (closing a copy does not drop the parent's flock).
    for lock in _HELD.values():
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunFolderBusy(RuntimeError):
    """Another live job owns the run folder."""


def job_key() -> str:
    """What identifies this job on every one of its ranks (the launcher's variables), e.g.
    'MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 TORCHELASTIC_RESTART_COUNT=0 ...'."""
    return " ".join(f"{k}={os.environ[k]}" for k in _JOB_VARIABLES if os.environ.get(k))


def describe(holder: dict) -> str:
    """'pid 123 on host n1, started 2026-01-01 10:00:00 UTC' from a lock file's record."""
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def read_holder(path: str | Path) -> dict | None:
    """The record the lock file holds (None when empty, absent or half written)."""
    try:
        text = Path(path).read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


class RunLock:
    """The lock of one run folder, held by this process from `acquire` until `release` or its death."""

    def __init__(self, folder: RunFolder):
        self.folder = folder
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; raise RunFolderBusy naming the live holder. Returns a line to print when a
        lock left by a job that died was taken over (else None)."""
        self.folder.root.mkdir(parents=True, exist_ok=True)
        path = self.folder.lock_file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(path)
            who = describe(holder) if holder else "a job that has not written its name yet"
            raise RunFolderBusy(
                f"{self.folder.root} is in use by a live run ({who}; lock {path}): a second run in the same folder "
                f"would delete its saves in progress and its checkpoints. Wait for it to end or stop it, or give "
                f"this run its own folder with --run_dir") from None
        previous = read_holder(path)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                  "job": job_key(), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        if previous:
            return (f"took over the lock of {self.folder.root} from a run that is no longer running "
                    f"({describe(previous)}; it did not end cleanly)")
        return None

    def release(self) -> None:
        """Empty the record (a clean end) and drop the lock."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # closing the only descriptor drops the flock
        self.fd = None


def acquire(folder: RunFolder) -> str | None:
    """Take `folder`'s lock for this process (a no-op when it holds it already); see RunLock.acquire."""
    key = folder.root.resolve()
    if key in _HELD:
        return None
    lock = RunLock(folder)
    note = lock.acquire()
    _HELD[key] = lock
    return note


def held(folder: RunFolder) -> bool:
    return folder.root.resolve() in _HELD


def release(folder: RunFolder) -> None:
    lock = _HELD.pop(folder.root.resolve(), None)
    if lock is not None:
        lock.release()


def wait_for_rank0(folder: RunFolder, rank: int, timeout_s: float = 300.0, poll_s: float = 0.2) -> None:
    """On a rank other than 0: return once the lock file names this job (rank 0 holds the folder).
    When rank 0 was refused (or died) it never does: the launcher's SIGTERM (torchrun ends the other
    ranks when one fails) or the timeout then ends this rank with a line saying why."""
    key = job_key()
    message = (f"[rank {rank}] step35: stopped before training: rank 0 did not take the lock of the run folder "
               f"{folder.root} (its own message says why, e.g. another live run owns the folder)")

    def stop(signum, frame):
        sys.stderr.write(f"{message}; ended by {signal.Signals(signum).name}\n")
        sys.stderr.flush()
        os._exit(1)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            holder = read_holder(folder.lock_file)
            if holder is not None and holder.get("job") == key:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"{message}; waited {timeout_s:.0f} s")
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGTERM, previous)


def release_all() -> None:
    """Release every lock this process holds (the end of a `step35 fit`)."""
    for key in list(_HELD):
        _HELD.pop(key).release()
