"""One live job per run folder: an exclusive `flock` on `<run_dir>/.step35.lock`, taken by global rank 0.

Two jobs in one folder destroy each other: the newcomer's start-up tidy deletes the other's save in
progress, retention prunes the other's checkpoints and `last.ckpt` flips between them. So:

- the job's global rank 0 (step35.job: however the job was started) takes the lock before the Trainer
  exists (before any tidy-up, log or config is written); the lock file then names the holder: host, pid,
  start time, the launcher and the variables that identify its job;
- a second job is refused at start, naming the live holder and `--run_dir`; so is a folder inside a folder
  another live job holds, or holding one (a checkpoint dirpath inside another run's folder, or a run
  folder around another run's checkpoint dirpath): one run's tidy and retention would delete the other's saves;
- the kernel drops a flock when its holder dies (any death, SIGKILL included), so a lock whose
  holder is gone is simply free; the file still names that holder (a clean exit empties it), and
  taking it over says so;
- the other ranks do not start until the lock file names their own job and holds what rank 0 decided
  for the job (`publish`, `wait_for_rank0`: the checkpoint to resume): rank 0 was refused or failed when
  it never does, and they end with a message saying so.

flock works on local filesystems and on NFS (Linux emulates it with POSIX byte-range locks); on a
filesystem without working locks (some FUSE mounts) two jobs are not kept apart.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from step35 import job
from step35.run.layout import LOCK, RunFolder

_HELD: dict[Path, RunLock] = {}  # this process's locks (a second flock from the same process would fail)


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

    step35_refusal = True  # said in one line, without a traceback (step35.faults)


class RunFolderFull(RunFolderBusy):
    """The run folder's filesystem has no room for its lock file: refused as a busy folder is (one line, on every
    rank), before anything else is written there."""


def describe(holder: dict) -> str:
    """'pid 123 on host n1, started 2026-01-01 10:00:00 UTC, a torchrun job: step35 fit --config ...' from a
    lock file's record."""
    text = f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
    if holder.get("launcher"):
        text += f", a {holder['launcher']} job"
    if holder.get("command"):
        text += f": {holder['command'][:200]}"
    return text


def read_holder(path: str | Path) -> dict | None:
    """The record the lock file holds (None when empty, absent or half written)."""
    try:
        text = Path(path).read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _who(lock_file: Path) -> str:
    holder = read_holder(lock_file)
    return describe(holder) if holder else "a job that has not written its name yet"


def _held_elsewhere(lock_file: Path) -> bool:
    """Whether another process holds the lock `lock_file` now (tried with a shared lock, dropped at once;
    nothing is created or written). A folder this process holds is not."""
    if lock_file.parent in _HELD:
        return False
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: nobody ever held it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _held_locks_in(root: Path) -> Iterator[Path]:
    """The lock files in `root` and the folders below it that another live process holds (symbolic links are
    not followed; nothing is written)."""
    for inside, _, files in os.walk(root):
        lock_file = Path(inside) / LOCK
        if LOCK in files and _held_elsewhere(lock_file):
            yield lock_file


def live_holder(folder: str | Path) -> str | None:
    """Who holds, as a live job, the lock of `folder` or of a folder inside it ("pid 123 on host n1, started
    ...; lock <file>"), else None. What would replace or delete `folder` asks first; nothing is written."""
    lock_file = next(_held_locks_in(Path(os.path.realpath(folder))), None)
    return f"{_who(lock_file)}; lock {lock_file}" if lock_file else None


class RunLock:
    """The lock of one run folder, held by this process from `acquire` until `release` or its death."""

    def __init__(self, folder: RunFolder, what: str = "", remedy: str = "give this run its own folder with --run_dir"):
        self.folder = folder
        self.what, self.remedy = what, remedy  # how the refusal names the folder and what to do
        self.fd: int | None = None
        self.record: dict = {}

    def acquire(self) -> str | None:
        """Take the lock; raise RunFolderBusy naming the live holder (of this folder, or of a folder above
        or below it). Returns a line to print when a lock left by a job that died was taken over (else None)."""
        self._refuse_nested(below=False)  # before anything is created inside another run's folder
        path = self.folder.lock_file
        try:
            self.folder.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            self._refuse_if_full(error)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderBusy(self._refusal(f"is in use by a live run ({_who(path)}; lock {path})")) from None
        try:  # again now that this lock is held: of two jobs starting together, the later one sees the other
            self._refuse_nested(below=True)
        except RunFolderBusy:
            os.close(fd)
            raise
        previous = read_holder(path)
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "launcher": job.this_process().launcher,
            "job": job.start_job_identity(),
            "command": " ".join(sys.argv)[:500],
        }
        self.fd = fd
        try:
            self._write()
        except BaseException:
            self.release()  # not held by this process after all
            raise
        if previous:
            return (
                f"took over the lock of {self.folder.root} from a run that is no longer running "
                f"({describe(previous)}; it did not end cleanly)"
            )
        return None

    def _refusal(self, problem: str) -> str:
        return (
            f"{self.what}{self.folder.root} {problem}: a second run there would delete its saves in progress and its "
            f"checkpoints. Wait for it to end or stop it, or {self.remedy}"
        )

    def _refuse_nested(self, below: bool) -> None:
        """RunFolderBusy when a folder above this one (and with `below`, one inside it) is held by another live
        job: a checkpoint dirpath set to another run's checkpoints/ would otherwise tidy and prune that run's
        saves, and a run folder around another run's dirpath the same."""
        root = self.folder.root.resolve()
        for above in root.parents:
            if _held_elsewhere(above / LOCK):
                raise RunFolderBusy(
                    self._refusal(
                        f"is inside {above}, a folder a live run owns ({_who(above / LOCK)}; lock {above / LOCK})"
                    )
                )
        if not below:
            return
        for lock_file in _held_locks_in(root):
            if lock_file.parent != root:  # (its own lock: this acquire's, not yet recorded as held)
                raise RunFolderBusy(
                    self._refusal(
                        f"holds {lock_file.parent}, a folder a live run owns ({_who(lock_file)}; lock {lock_file})"
                    )
                )

    def _write(self) -> None:
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(self.record).encode(), 0)
            os.fsync(self.fd)
        except OSError as error:
            self._refuse_if_full(error)
            raise

    def _refuse_if_full(self, error: OSError) -> None:
        """RunFolderFull for a lock file that cannot be written because its filesystem is full (or over quota)."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunFolderFull(
                f"{self.what}{self.folder.root}: cannot write its lock file {self.folder.lock_file}: "
                f"{os.strerror(error.errno).lower()} ({errno.errorcode[error.errno]}), the disk is full; free space "
                f"there, or {self.remedy} on another filesystem"
            ) from None

    def publish(self, **items) -> None:
        """Add items to the record for the job's other ranks (`wait_for_rank0` returns the record)."""
        self.record.update(items)
        self._write()

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


def acquire(folder: RunFolder, **refusal) -> str | None:
    """Take `folder`'s lock for this process (a no-op when it holds it already); see RunLock.acquire
    (`refusal`: RunLock's `what` and `remedy`)."""
    key = folder.root.resolve()
    if key in _HELD:
        return None
    lock = RunLock(folder, **refusal)
    note = lock.acquire()
    _HELD[key] = lock
    return note


def held(folder: RunFolder) -> bool:
    return folder.root.resolve() in _HELD


def publish(folder: RunFolder, **items) -> None:
    """On the job's rank 0, holding `folder`'s lock: hand `items` (JSON values) to the job's other ranks."""
    _HELD[folder.root.resolve()].publish(**items)


def release(folder: RunFolder) -> None:
    lock = _HELD.pop(folder.root.resolve(), None)
    if lock is not None:
        lock.release()


# How long a rank other than 0 waits for rank 0's lock, and after how long it says what it waits for (a rank of a
# healthy job finds rank 0's answer within a second or two; a process made a non-zero rank by variables left in
# a shell waits for a rank 0 that does not exist).
RANK0_WAIT_S = 300.0
RANK0_WAIT_SAID_AFTER_S = 5.0


def wait_for_rank0(folder: RunFolder, until: str, poll_s: float = 0.2) -> dict:
    """On a rank other than the job's rank 0: wait until the lock file names this process's own job (rank 0
    holds the folder) and holds the item `until` that rank 0 publishes (`publish`), and return the record.
    When rank 0 was refused (or died) it never does: the launcher's SIGTERM (torchrun ends the other ranks
    when one fails) or the timeout (RANK0_WAIT_S) then ends this rank with a line saying why. A wait longer
    than RANK0_WAIT_SAID_AFTER_S is said, with the variables that made this process a non-zero rank."""
    place = job.this_process()
    why = f"this process is {place.describe()} of {place.origin()}, and the launcher is expected to start rank 0"
    message = (
        f"[{place.describe()}] step35: stopped before training: the job's rank 0 did not take the lock of "
        f"the run folder {folder.root} (its own message says why, e.g. another live run owns the folder; {why}: "
        f"a one-process run with these variables left in its shell has no rank 0, unset them)"
    )

    def stop(signum, frame):
        sys.stderr.write(f"{message}; ended by {signal.Signals(signum).name}\n")
        sys.stderr.flush()
        os._exit(1)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        started = time.monotonic()
        said = False
        while True:
            holder = read_holder(folder.lock_file)
            if holder is not None and until in holder and place.same_job(holder.get("job") or {}):
                return holder
            waited = time.monotonic() - started
            if waited > RANK0_WAIT_S:
                raise SystemExit(f"{message}; waited {RANK0_WAIT_S:.0f} s")
            if not said and waited >= RANK0_WAIT_SAID_AFTER_S:
                said = True
                sys.stderr.write(
                    f"[{place.describe()}] step35: waiting up to {RANK0_WAIT_S:.0f} s for the job's rank 0 to take the "
                    f"lock of the run folder {folder.root}: {why} (started by hand as one process? unset these "
                    f"variables)\n"
                )
                sys.stderr.flush()
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGTERM, previous)


def release_all() -> None:
    """Release every lock this process holds (the end of a `step35 fit`)."""
    for key in list(_HELD):
        _HELD.pop(key).release()
