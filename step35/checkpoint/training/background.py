"""Training checkpoints written in the background (`RunCheckpoint(async_save=True)`): the training loop waits
only while the state is copied into host memory (staging); a thread then writes it as `trainer_io` writes
any checkpoint (temporary sibling, checksums, manifest, atomic publish) while training goes on.

A thread, not a process: the write is file I/O and CRC32 checksums (both release the interpreter over large
buffers) and DCP's planning, so the loop keeps its speed; a thread reads the staged buffers where they
are, while a process needs them in shared memory, costs a process start per run and a process group of its
own in that process. The collectives of a background write (DCP's plan exchange, the gather of each
rank's checksums and failures, the last barrier) run on a gloo group of their own (`group`), never on the
groups the training loop uses meanwhile.

At most one save is in flight: `stage` of the next save is called only after `wait` (the staging buffers
are reused, torch's `DefaultStager`). Imports nothing of Lightning.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from step35.checkpoint.errors import CheckpointError


@dataclass
class SaveOutcome:
    """A completed save: `blocking_s` the training loop was held (staging), `save_s` until the checkpoint
    was complete (manifest written, published), `bytes` its files (rank 0: every rank's; 0 elsewhere)."""

    path: Path
    step: int
    blocking_s: float
    save_s: float
    bytes: int
    background: bool


class BackgroundSaveFailed(CheckpointError):
    """A background write failed: the message names the checkpoint (the previous one is intact)."""


class PendingSave:
    """The save in flight: its path, step, the time the loop was held, and the thread's outcome."""

    def __init__(self, path: Path, step: int, started: float):
        self.path, self.step, self.started = path, step, started
        self.blocking_s = time.monotonic() - started  # the caller adds what follows the hand-over
        self.future: Future[tuple[int, float]] = Future()  # (bytes, time.monotonic() at completion)

    def done(self) -> bool:
        return self.future.done()

    def outcome(self, timeout: float | None = None) -> SaveOutcome:
        """Wait for the write (at most `timeout` s: TimeoutError); a failed write raises
        BackgroundSaveFailed naming the checkpoint."""
        try:
            size, finished = self.future.result(timeout)
            return SaveOutcome(self.path, self.step, self.blocking_s, finished - self.started, size, True)
        except TimeoutError:
            raise
        except BaseException as e:  # noqa: B036 (whatever ended the thread is the run's error)
            raise BackgroundSaveFailed(
                f"{self.path}: the background write of the step-{self.step} checkpoint failed ({e}); the "
                f"previous checkpoint is intact"
            ) from e


class BackgroundWriter:
    """Stages a checkpoint's state into host memory and writes it on a thread; one per RunCheckpoint.

    `group`: the process group of the write's collectives (set by the caller on every rank at the same
    point; None in a one-process run). `after_publish(path, step)`: run on rank 0 by the thread once the
    checkpoint is complete, before the other ranks' waits return (RunCheckpoint: `last.ckpt`, retention)."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self.group = None
        self.after_publish: Callable[[Path, int], None] | None = None
        self.pending: PendingSave | None = None
        self._stager = None
        self._preparing: threading.Thread | None = None
        self._started = time.monotonic()

    def _get_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            options = StagingOptions(
                use_pinned_memory=self.pin_memory,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        return self._stager

    @property
    def prepared(self) -> bool:
        """Whether the staging buffers were allocated (or are being allocated) ahead of the first save."""
        return self._stager is not None

    def prepare(self, state: dict) -> None:
        """Allocate the staging buffers of `state`'s tensors now, on a thread, so that the first save holds the
        loop only for its copy, as every later save does: the stager keeps one host buffer per source storage
        and reuses it. `state`: what the saves will stage (the same parameters' and optimizer states' tensors).
        A failure here is left to the first save, which says so and saves synchronously."""
        stager = self._get_stager()

        def run() -> None:
            try:
                stager.stage(state)  # the values copied are discarded: only the buffers matter
            except (MemoryError, RuntimeError):
                pass

        self._preparing = threading.Thread(target=run, name="step35-staging-buffers", daemon=True)
        self._preparing.start()

    def stage(self, state: dict) -> dict | None:
        """A copy of `state` in host memory (pinned when `pin_memory`), tensors and all: what the next
        optimizer step changes cannot reach it. None (with a message) when it cannot be allocated: the
        caller saves synchronously instead."""
        if self.pending is not None:
            raise RuntimeError("a background save is in flight: wait() for it before staging the next one")
        if self._preparing is not None:  # buffers being allocated ahead (prepare): this save copies into them
            self._preparing.join()
            self._preparing = None
        try:
            return self._get_stager().stage(state)
        except (MemoryError, RuntimeError) as e:  # host memory (or pinned memory) exhausted
            self.close()
            print(
                f"step35: the checkpoint's state could not be staged in host memory ({str(e)[:200]}); this "
                f"save is synchronous",
                file=sys.stderr,
                flush=True,
            )
            return None

    def begin(self) -> None:
        """Mark the start of a save (before the state is gathered: what the loop waits for counts from here)."""
        self._started = time.monotonic()

    def start(self, path: Path, step: int, write: Callable[[], int], collective: bool = True) -> PendingSave:
        """Run `write()` (returns the bytes written) on a daemon thread: a hung write (a dead peer in
        its collectives) cannot hold the process at exit. `collective`: every rank writes (sharded) and
        ends with a barrier of `group`; else rank 0 alone (a single file)."""
        pending = PendingSave(Path(path), step, self._started)

        def run() -> None:
            try:
                size = write()
                if self.after_publish is not None and size:  # (rank 0: it published)
                    self.after_publish(pending.path, step)
                if collective and self.group is not None:
                    import torch.distributed as dist

                    dist.barrier(group=self.group)  # every rank's wait returns once rank 0 has published
            except BaseException as e:  # noqa: B036
                pending.future.set_exception(e)
                return
            pending.future.set_result((size, time.monotonic()))

        self.pending = pending
        threading.Thread(target=run, name=f"step35-save-{step}", daemon=True).start()
        return pending

    def wait(self, timeout: float | None = None) -> SaveOutcome | None:
        """The outcome of the save in flight (None when there is none); it is no longer in flight after
        this returns or raises, except on TimeoutError."""
        pending = self.pending
        if pending is None:
            return None
        try:
            return pending.outcome(timeout)
        finally:
            if pending.done():  # (not after a TimeoutError: still in flight)
                self.pending = None

    def close(self) -> None:
        """Free the staging buffers (after the last wait)."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def writer_of(storage_options, owner: str) -> BackgroundWriter | None:
    """The BackgroundWriter passed as a save's `storage_options` (RunCheckpoint passes it), or None for a
    synchronous save; anything else is refused, naming `owner`."""
    if storage_options is None or isinstance(storage_options, BackgroundWriter):
        return storage_options
    raise TypeError(f"{owner}.save_checkpoint takes no storage_options (given {type(storage_options).__name__})")
