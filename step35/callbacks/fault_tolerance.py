"""FaultTolerance: pre-emption (SIGTERM / SIGUSR1 -> checkpoint -> exit code) and the hang watchdog
in the Lightning loop. The mechanics live in `step35.faults`; this file decides where they run.

- Signals only set a flag (`faults.StopSignals`). At the end of every optimizer step (the same
  point on every rank) the flags of all ranks are combined by one all_reduce(MAX) of a single
  number, so all ranks stop after the same step: each writes its part of the checkpoint
  `<checkpoint dir>/step=NNNNNN-preempt.ckpt` (trainer.save_checkpoint, the same path
  ModelCheckpoint saves through, so resuming from it is as exact as from any checkpoint), then
  raises `faults.Preempted`: the process exits with `faults.EXIT_PREEMPTED` (75).
- During a validation the same agreement runs before every validation batch (every rank runs the
  same batches: validation_step has collectives of its own), so a signal does not wait for the
  rest of a long validation (at 196B it can outlast torchrun's or Kubernetes' 30 s grace). The
  validation is cut short (its partial metrics are not logged) and the checkpoint of the step it
  followed is written, its training-loop state as at that step's boundary
  (`lightning_private.record_as_at_step_end`): a resume goes on as from a stop at the step boundary
  before the validation (which it does not redo), whatever its own validation settings.
- No second checkpoint of one step: when this run has already written a complete checkpoint of
  the step it stops after (a periodic save at that step, the signal often arriving during it), the
  pre-emption save is skipped and said; the exit code is 75 all the same. Every rank takes part in
  every save, so "a save of this step returned" is known alike on every rank; rank 0 confirms on
  disk that it is complete (manifest) and broadcasts the answer.
- Lightning's own SIGTERM handler is switched off: it broadcasts from rank 0 inside the handler,
  where other ranks may be inside the expert all-to-all (a deadlock), and stops only at rank 0's
  word. `step35.lightning_private.disable_signal_handlers` is the one place that touches that private API.
- The watchdog (`faults.Watchdog`) follows the loop's phases (forward, backward, optimizer step,
  step-boundary agreement, checkpoint save, data, validation; the expert all-to-all marks its own)
  and ends a rank that has made no progress for the timeout, naming the phase. Timeout: the
  strategy's `timeout_minutes` (Step35Strategy, default 10), else this callback's. Each step's
  duration (data to the end of the optimizer step, without validation and checkpoint saves; not
  the first step of a start, which carries compile and warm-up) is given to the watchdog, which
  derives the signal grace from it.
- Phases are set by a small callback put first in the trainer's list (`PhaseMarks`), so a phase is
  entered before any other callback's hook for it runs (an error raised there is reported in the
  right phase); this callback runs last (after every ModelCheckpoint), at the step boundary.
- A failure is printed with its rank and phase (`faults.report_failure`) by whichever of this
  callback and Step35Strategy sees it first; the launcher of a rank started by one is watched
  (`faults.watch_launcher`).
- Before the pre-emption exit, the loggers get the stopped step's metrics and are flushed.

`step35 fit` adds this callback by itself; list it under trainer.callbacks to set its options.
It subclasses `Checkpoint` so Lightning runs it after every ModelCheckpoint at the end of a step.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint

from step35 import faults, lightning_private
from step35.callbacks.checkpointing import RunCheckpoint
from step35.callbacks.reporting import StepEnds, all_reduce_
from step35.checkpoint.training import catalog
from step35.checkpoint.training.plugin import refuse_asynchronous_io
from step35.run.layout import RunFolder, preempt_checkpoint

DEFAULT_TIMEOUT_MINUTES = 10.0


def preempt_checkpoint_dir(trainer: pl.Trainer) -> str:
    """Where the pre-emption checkpoint goes: the ModelCheckpoint folder (so `--ckpt_path last|auto`
    finds it among the others), else the run folder's checkpoints/ (step35.run.layout)."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    return str(dirpath) if dirpath else str(RunFolder(trainer.default_root_dir).checkpoints)


def complete_checkpoint_of(trainer: pl.Trainer, step: int) -> str | None:
    """The newest complete checkpoint (manifest on disk) of global step `step` in the folders of the
    trainer's checkpoint callbacks and the pre-emption folder, or None. Reads this rank's view of the
    filesystem: call it on one rank and broadcast."""
    folders = [getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks]
    folders = [Path(f) for f in [*folders, preempt_checkpoint_dir(trainer)] if f]
    found = [
        c for folder in dict.fromkeys(folders) for c in catalog.complete_checkpoints(folder) if c.global_step == step
    ]
    return str(max(found, key=lambda c: c.saved_ns).path) if found else None


def _of_val_batches(trainer: pl.Trainer) -> str:
    """' of N' for the validation batches of this validation, '' when their number is not known."""
    total = sum(trainer.num_val_batches or [float("inf")])
    return f" of {int(total)}" if total != float("inf") else ""


def _log_stopped_step(trainer: pl.Trainer) -> None:
    """Hands the metrics of the step being stopped after to the loggers and flushes them: Lightning
    logs a step's metrics only after every on_train_batch_end hook has returned, and the pre-emption
    exit raises from one. Losing them is said, not fatal: the checkpoint matters more."""
    try:
        lightning_private.log_step_metrics_now(trainer)
    except RuntimeError as error:
        faults.write_stderr(f"step35: the stopped step's metrics are not logged: {error}\n")
        return
    for logger in trainer.loggers:
        logger.save()


class PhaseMarks(Callback):
    """Sets the phase at the start of the training loop's hooks. Put first in the trainer's callbacks by
    FaultTolerance (which Lightning runs last, as a Checkpoint): a phase is entered before the other
    callbacks' hooks for it, which then run, and fail, inside it. Also marks where each step's work
    ends (before the ModelCheckpoint saves) for the step time."""

    def __init__(self) -> None:
        self.batch_end_at = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        faults.set_phase("batch start hooks", step=trainer.global_step + 1)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        faults.set_phase("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        faults.set_phase("optimizer step (grad norm, clipping, update)")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batch_end_at = time.monotonic()
        faults.set_phase("batch end hooks (metrics, checkpoints)")

    def on_validation_start(self, trainer, pl_module) -> None:
        faults.set_phase("validation")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        faults.set_phase("validation")


class FaultTolerance(Checkpoint):
    def __init__(
        self,
        timeout_minutes: float | None = None,
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        signal_grace_s: float = 20.0,
        watchdog: bool = True,
    ):
        """
        Args:
            timeout_minutes: watchdog: a rank that makes no progress for this long ends with exit code
                76, naming what it waited for. None: the strategy's `timeout_minutes` if it has one
                (Step35Strategy), else 10 minutes. Must exceed the slowest single phase (compile of
                the first step, a checkpoint save or load).
            signals: signals that stop the run at the next step boundary with a checkpoint and exit
                code 75.
            signal_grace_s: after a stop signal, a phase (other than a checkpoint save) that lasts
                longer than this and than 3 x the slowest of the last 20 steps (the first step of a
                start not counted) means the rank cannot reach the step boundary (blocked in a
                collective whose peer failed or stopped): the watchdog ends it (exit code 76), not
                the launcher's SIGKILL.
            watchdog: False switches the watchdog off.
        """
        self.timeout_minutes = timeout_minutes
        try:
            self.signals = tuple(
                signal.Signals[name] if isinstance(name, str) else signal.Signals(name) for name in signals
            )
        except KeyError as error:
            raise ValueError(
                f"FaultTolerance.signals: unknown signal {error.args[0]!r} (e.g. SIGTERM, SIGUSR1)"
            ) from None
        if signal_grace_s <= 0:
            raise ValueError(f"FaultTolerance.signal_grace_s must be > 0, got {signal_grace_s}")
        self.signal_grace_s = signal_grace_s
        self.watchdog_enabled = watchdog
        self.stop_signals: faults.StopSignals | None = None
        self.watchdog: faults.Watchdog | None = None
        self.preempt_path: str | None = None
        self._step_ends = StepEnds()
        self._marks = PhaseMarks()
        self._step_started = 0.0  # when the current step's work began (data included)
        self._timed = False  # whether this step's time counts for the signal grace
        self._saved_step: int | None = None  # the global step of this run's last resumable save
        self._saving_in_validation = False  # a pre-emption save during a validation is being written

    # ------------------------------------------------------------------------------- life cycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        lightning_private.disable_signal_handlers(trainer)
        if stage != "fit":
            return
        faults.begin_run()  # (again after Step35Strategy's: another strategy may run this callback)
        refuse_asynchronous_io(trainer.strategy)  # the pre-emption save must be on disk before the exit
        self._saved_step = None
        rank = trainer.global_rank
        faults.watch_launcher(rank)
        # A new list (Lightning iterates the old one for this very hook): PhaseMarks first.
        trainer.callbacks = [self._marks, *[c for c in trainer.callbacks if c is not self._marks]]
        self.stop_signals = faults.StopSignals(self.signals, rank=rank)
        self.stop_signals.install()
        if self.watchdog_enabled:
            minutes, option = self.timeout_minutes, "FaultTolerance.timeout_minutes"
            if minutes is None and getattr(trainer.strategy, "timeout_minutes", None):
                minutes, option = trainer.strategy.timeout_minutes, "trainer.strategy.timeout_minutes"
            if minutes is None:
                minutes = DEFAULT_TIMEOUT_MINUTES
            self.watchdog = faults.Watchdog(
                minutes * 60,
                rank,
                signals=self.stop_signals,
                signal_grace_s=self.signal_grace_s,
                world_size=trainer.world_size,
                hint=f" (raise {option} if it is slow, not stuck)",
            )
            faults.set_phase("setup: model build, checkpoint load", patient=True)
            self.watchdog.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The success path only (Lightning calls no teardown hook after an exception): after a failure
        # the watchdog keeps watching the way out.
        faults.stop_watching_launcher()
        self._close()

    def _close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.stop_signals is not None:
            self.stop_signals.restore()
            self.stop_signals = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, faults.Preempted):
            # The handlers stay: torchrun sends SIGTERM to the other ranks as soon as one has exited
            # with 75, and a rank that is itself leaving with 75 must not be killed by it. Python
            # resets its handlers to the default (death) while the interpreter finalizes, so from
            # the exit on these signals are ignored (seen: a rank that had saved ended by SIGTERM, -15).
            faults.set_phase("exit after the pre-emption checkpoint")
            if self.stop_signals is not None:
                faults.ignore_at_exit(self.stop_signals.signals)
            return
        faults.check_launcher()  # a dead launcher (exit 77) is the cause of a peer's closed connection
        faults.mark_failure()
        # Printed with rank and phase at once (Step35Strategy.on_exception, called next, then skips
        # it; without Step35Strategy nothing else would). Not Ctrl-C: Lightning says it was that.
        if isinstance(exception, Exception) and not faults.was_reported(exception):
            faults.report_failure(exception, trainer.global_rank)
        if self.stop_signals is not None:  # after a failure, SIGTERM (torchrun ending the job) ends at once
            self.stop_signals.restore()
            self.stop_signals = None

    # ------------------------------------------------------------------------------- phases
    # (the others are set by PhaseMarks, first in the list; these run after every other callback)
    def on_train_start(self, trainer, pl_module) -> None:
        self._step_ends.reset(trainer)
        self._step_started, self._timed = time.monotonic(), False
        faults.set_phase("data: first batch", step=trainer.global_step + 1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        faults.set_phase("forward", step=trainer.global_step + 1)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._step_started = time.monotonic()  # validation is no part of the next step's time
        faults.set_phase("data: next batch")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Lightning calls this for full (resumable) checkpoints only, on every rank, while the save is
        # being prepared; the write follows in the same call, so once this rank is back in one of
        # this callback's hooks the save has returned (a failed one raises and ends the run).
        self._saved_step = trainer.global_step
        if self._saving_in_validation:  # resumed as a save at the step boundary before the validation
            lightning_private.record_as_at_step_end(checkpoint)
        faults.set_phase("checkpoint save", step=trainer.global_step, patient=True)

    def on_train_end(self, trainer, pl_module) -> None:
        faults.set_phase("end of training (final hooks, teardown)")

    # ------------------------------------------------------------------------------- the step boundary
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._step_ends(trainer):
            faults.set_phase("data: next micro-batch")
            return
        step = trainer.global_step
        if self.watchdog is not None and self._timed:  # (the first step of a start: compile and warm-up)
            self.watchdog.record_step(self._marks.batch_end_at - self._step_started)
        self._timed = True
        faults.set_phase("step boundary: stop-signal agreement", step=step)
        local = self._stop_requested_here()
        if self._any_rank(trainer, local):
            self._stop(trainer, step, local)
        self._step_started = time.monotonic()
        faults.set_phase("data: next batch", step=step + 1)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        # Before every batch of a validation inside fit (the sanity check before the first step
        # excepted: a stop then waits for the first step boundary, as before).
        if self.stop_signals is None or trainer.sanity_checking:
            return
        step = trainer.global_step
        faults.set_phase("validation: stop-signal agreement", step=step)
        local = self._stop_requested_here()
        if self._any_rank(trainer, local):
            self._stop(
                trainer,
                step,
                local,
                during=f"during the validation after step {step} (cut short "
                f"before batch {batch_idx + 1}{_of_val_batches(trainer)}, "
                f"its metrics not logged)",
            )
        faults.set_phase("validation", step=step)

    def _stop_requested_here(self) -> bool:
        return self.stop_signals is not None and self.stop_signals.requested

    @staticmethod
    def _any_rank(trainer: pl.Trainer, local: bool) -> bool:
        """Whether a stop signal reached any rank: one all_reduce(MAX) of one number, the same answer
        on every rank (all of them call it at the same point)."""
        flag = torch.tensor([1.0 if local else 0.0], device=trainer.strategy.root_device)
        return all_reduce_(flag, "max").item() > 0

    def _saved_already(self, trainer: pl.Trainer, step: int) -> str | None:
        """The complete checkpoint of `step` this run wrote (a periodic save at this very step), or
        None: the same answer on every rank (the in-memory step is the same on all, rank 0 reads the
        disk and broadcasts)."""
        if self._saved_step != step:
            return None
        faults.set_phase("pre-emption: is this step saved already", step=step)
        found = complete_checkpoint_of(trainer, step) if trainer.is_global_zero else None
        return trainer.strategy.broadcast(found, src=0)

    def _stop(self, trainer: pl.Trainer, step: int, local: bool, during: str | None = None) -> None:
        """Writes the pre-emption checkpoint of `step` (unless this step is saved already) and raises
        `faults.Preempted`. `during`: the validation being cut short, if the stop comes in one."""
        cause = self.stop_signals.name() if local else "a stop signal on another rank"
        when = during or f"after step {step}"
        faults.set_phase("pre-emption: logging the step's metrics", step=step)
        if during is None:
            _log_stopped_step(trainer)
        else:  # the step's metrics are with the loggers already (Lightning logs them before validating)
            for logger in trainer.loggers:
                logger.save()
        for callback in trainer.checkpoint_callbacks:  # a save in flight completes (or fails) first (a patient phase)
            if isinstance(callback, RunCheckpoint):
                callback.wait_for_save(trainer)
        saved = self._saved_already(trainer, step)
        if saved is not None:
            message = (
                f"step35: stopped by {cause} {when}; step {step} is saved already ({saved}), so no "
                f"second checkpoint of it is written; exit code {faults.EXIT_PREEMPTED} (continue with "
                f"--ckpt_path auto, or --ckpt_path {saved})"
            )
        else:
            path = str(preempt_checkpoint(preempt_checkpoint_dir(trainer), step))
            faults.set_phase("pre-emption checkpoint save", step=step, patient=True)
            self._saving_in_validation = during is not None
            try:
                with torch.inference_mode(False):  # (validation runs under inference mode) as any save
                    trainer.save_checkpoint(path)
            finally:
                self._saving_in_validation = False
            self.preempt_path = path
            message = (
                f"step35: stopped by {cause} {when}; checkpoint {path}; exit code "
                f"{faults.EXIT_PREEMPTED} (continue with --ckpt_path auto, or --ckpt_path {path})"
            )
        faults.write_stderr(f"[rank {trainer.global_rank}] {message}\n")
        raise faults.Preempted(message)
