"""RunCheckpoint: the periodic checkpoints of a run folder (`<run_dir>/checkpoints/step=NNNNNN.ckpt`).

Lightning's ModelCheckpoint with three changes that make unattended restarts safe:
- after each save has completed (its manifest is on disk), `last.ckpt` is switched to it in one
  atomic step (Lightning's `save_last` re-saves or re-links `last.ckpt` in place: there is a
  moment without it, and a kill then leaves none);
- the newest `keep_last` complete checkpoints are kept, older ones deleted (never the newest, never
  the one this run resumed from);
- at start, rank 0 makes sure it owns the run folder (step35.run.lock: the CLI took the lock
  already; a Trainer built without it takes it here), then tidies what killed saves left in the
  folder (and says so: under the lock every leftover is from a writer that is gone), points
  `last.ckpt` at the newest complete checkpoint (pre-emption saves are written without this
  callback), and lists checkpoints whose save did not finish. A refusal reaches every rank.
- `async_save=True` writes in the background (`checkpoint.training.background`): the loop waits while
  the state is staged in host memory; `last.ckpt` and retention follow when the write is complete.
  Lightning's AsyncCheckpointIO is refused at start (`plugin.refuse_asynchronous_io`): it returns
  before the file exists, while its caller vouches for the checkpoint at once.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from step35 import faults, lightning_private
from step35.checkpoint.integrity import is_complete, recorded_damage, remove_manifest, write_manifest
from step35.checkpoint.training import catalog, keys
from step35.checkpoint.training.background import BackgroundWriter, SaveOutcome
from step35.checkpoint.training.plugin import refuse_asynchronous_io
from step35.run import RunFolder, RunFolderBusy, checkpoint_to_load, lock


def say(message: str) -> None:
    print(f"step35: {message}", file=sys.stderr, flush=True)


class RunCheckpoint(ModelCheckpoint):
    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "step={step:06d}",
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        keep_last: int = 3,
        save_on_train_end: bool = True,
        save_weights_only: bool = False,
        verbose: bool = False,
        async_save: bool = False,
    ):
        """
        Args:
            dirpath: where checkpoints go (default: `<run_dir>/checkpoints`, run_dir = trainer.default_root_dir).
            filename: name pattern (Lightning's format: `{step}`, `{epoch}`); `.ckpt` is appended.
            every_n_train_steps: save every N optimizer steps.
            train_time_interval: save at most this often (wall clock), e.g. "00:30:00".
            every_n_epochs: save every N epochs (the data stream has no epochs: prefer steps).
            keep_last: complete checkpoints kept in the folder (the newest K by global step,
                pre-emption saves included); older ones are deleted after each save.
            save_on_train_end: also save when training ends (max_steps, early stop) at a step not yet
                saved by this callback or another writer (e.g. a pre-emption save).
            save_weights_only: save the model only (such a checkpoint cannot resume training).
            verbose: print each save.
            async_save: write in the background: the training loop waits only while the state is copied
                into host memory (about one rank's checkpoint share per rank, pinned on GPUs), a thread writes
                the files. The checkpoint counts (manifest, `last.ckpt`, retention) once every rank's files
                are written; the next save, the end of fit, a pre-emption and an error wait for it first.
                Falls back to a synchronous save, saying so, when the state cannot be staged.
        """
        if keep_last < 1:
            raise ValueError(
                f"RunCheckpoint.keep_last={keep_last}: must be >= 1 (the newest checkpoint is always kept)"
            )
        # save_top_k=-1: Lightning deletes nothing (retention is ours); no save_last (not atomic);
        # no version counter: a save whose earlier attempt was killed overwrites what it left.
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=None,
            verbose=verbose,
            save_last=False,
            save_top_k=-1,
            save_weights_only=save_weights_only,
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            enable_version_counter=False,
        )
        self.keep_last = keep_last
        self.save_on_train_end = save_on_train_end
        self.async_save = async_save
        self._writer: BackgroundWriter | None = None
        self._resumed_from: Path | None = None
        self._own_lock: RunFolder | None = None
        self._dirpath_lock: RunFolder | None = None  # the lock of a dirpath outside the run folder

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        run = RunFolder(trainer.default_root_dir)
        if self.dirpath is None:
            self.dirpath = str(run.checkpoints)
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        refuse_asynchronous_io(trainer.strategy)  # the same on every rank: before the folder is touched
        refusal = None
        if trainer.is_global_zero:
            try:
                self._own_lock = None if lock.held(run) else run  # under the CLI it is held already
                note = lock.acquire(run)
                if note:
                    say(note)
                self._lock_checkpoint_folder(run)
                self._tidy(checkpoint_to_load(trainer))
            except RunFolderBusy as error:
                refusal = str(error)
        # One collective for the outcome: nobody writes before the folder is owned and tidy, and a
        # refusal ends every rank instead of leaving the others in a barrier.
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal:
            raise RunFolderBusy(refusal)
        if self.async_save:
            self._writer = background_writer(trainer)
            self._writer.after_publish = self._after_save

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self.wait_for_save(trainer)
        self._close_writer()
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        if self._writer is not None and self._writer.pending is not None:
            pending = self._writer.pending
            try:  # bounded: after a peer's failure the write's collectives may never complete
                outcome = self._writer.wait(timeout=ON_ERROR_WAIT_S)
                say(f"the background save of step {outcome.step} completed before the run ended: {outcome.path}")
            except TimeoutError:
                say(f"{pending.path}: the background save did not complete within {ON_ERROR_WAIT_S:.0f} s of the error")
            except Exception as e:  # the run's own error is the one raised; this one is reported
                say(str(e))
        self._close_writer()
        self._release()

    # ------------------------------------------------------------------------------- background saves
    def wait_for_save(self, trainer: pl.Trainer) -> SaveOutcome | None:
        """Wait for the save in flight, if any; its failure is raised here (naming the checkpoint), its
        times and bytes logged (rank 0). The next save, the end of fit and a pre-emption call it first."""
        if self._writer is None or self._writer.pending is None:
            return None
        # a long write is no hang, and a stop signal meanwhile must not end the wait: patient, as a save is
        with faults.phase(f"checkpoint: waiting for the background save of step {self._writer.pending.step}", True):
            outcome = self._writer.wait()
        self._report(trainer, outcome)
        return outcome

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._writer is not None and self._writer.pending is not None and self._writer.pending.done():
            self.wait_for_save(trainer)  # done: a failure is this run's error now, not at the next save
        prepare = self._writer is not None and not self._writer.prepared and trainer.global_step >= 1
        if prepare and trainer.strategy.root_device.type == "cpu":
            # After the first optimizer step its state exists: the staging buffers are allocated now, off the
            # loop's path, instead of while the first save holds it. The same tensors the saves will stage. Only
            # on the CPU: on an accelerator Lightning hands the save fresh CPU copies (cpu_offload), a new
            # storage each time, so no buffer allocated ahead would be reused and preparing would copy for nothing.
            strategy = trainer.strategy
            optimizers = [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers]
            self._writer.prepare({"model": strategy.lightning_module_state_dict(), "optimizers": optimizers})
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _report(self, trainer: pl.Trainer, outcome: SaveOutcome) -> None:
        if not trainer.is_global_zero:
            return
        metrics = {
            "checkpoint/blocking_s": outcome.blocking_s,
            "checkpoint/save_s": outcome.save_s,
            "checkpoint/bytes": float(outcome.bytes),
        }
        step = lightning_private.batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if outcome.background:  # (Lightning notifies them when a synchronous save returns)
                logger.after_save_checkpoint(self)
        if self.verbose:
            kind = "in the background" if outcome.background else "synchronously"
            say(
                f"saved {outcome.path} {kind}: {outcome.bytes / 2**20:.1f} MiB, training held "
                f"{outcome.blocking_s:.2f} s, complete after {outcome.save_s:.2f} s"
            )

    def _close_writer(self) -> None:
        if self._writer is not None and self._writer.pending is None:
            self._writer.close()

    def _lock_checkpoint_folder(self, run: RunFolder) -> None:
        """A `dirpath` outside the run folder gets its own lock: two runs given one checkpoint folder (one
        YAML with `dirpath: /scratch/ckpts` launched twice) would otherwise prune and tidy each other's
        saves. The second run is refused, naming the first."""
        folder = Path(self.dirpath).resolve()
        if folder == run.root.resolve() or run.root.resolve() in folder.parents or lock.held(RunFolder(folder)):
            return
        note = lock.acquire(
            RunFolder(folder),
            what="the checkpoint folder (RunCheckpoint.dirpath) ",
            remedy="give this run its own RunCheckpoint.dirpath",
        )
        self._dirpath_lock = RunFolder(folder)
        if note:
            say(note)

    def _release(self) -> None:
        # A lock this callback took (a Trainer built without the CLI) ends with the run, not the process.
        if self._own_lock is not None:
            lock.release(self._own_lock)
            self._own_lock = None
        if self._dirpath_lock is not None:
            lock.release(self._dirpath_lock)
            self._dirpath_lock = None

    def _tidy(self, resuming: Path | None) -> None:
        folder = Path(self.dirpath)
        for line in catalog.clean_leftovers(folder):
            say(line)
        resumed = resuming.resolve() if resuming is not None else None
        for path in catalog.incomplete_checkpoints(folder):
            if path.resolve() != resumed:  # loaded on purpose (--allow_unverified_checkpoint)
                say(f"ignoring {path}: its save did not finish (no manifest)")
        catalog.point_last_to_newest(folder)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Only now is the checkpoint known whichever way it was given (trainer.fit(ckpt_path=...) too).
        if (resumed := checkpoint_to_load(trainer)) is not None:
            self._resumed_from = resumed.resolve()
        elif trainer.is_global_zero and (newest := catalog.newest_complete([self.dirpath])) is not None:
            say(
                f"{self.dirpath} already holds checkpoints up to step {newest.global_step}, but this run starts "
                f"from scratch: its saves join them, and --ckpt_path last|auto picks the highest step "
                f"(--ckpt_path auto resumes instead; a new --run_dir keeps runs apart)"
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.wait_for_save(trainer)
        if self.save_on_train_end:
            newest = catalog.newest_complete([self.dirpath])
            done = newest is not None and newest.global_step == trainer.global_step
            if not (done and recorded_damage(newest.path) is None):  # (saved already, e.g. by a pre-emption save)
                lightning_private.save_now(self, trainer)
        self.wait_for_save(trainer)  # fit returns with every checkpoint complete

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:  # Lightning-private: lightning_private.py
        self.wait_for_save(trainer)  # at most one in flight: the staging buffers are the previous save's
        path = Path(filepath)
        if trainer.is_global_zero and path.is_file():
            remove_manifest(path)  # an earlier save of this name: its manifest must not vouch for the new bytes
        started = time.monotonic()
        if self._writer is None:
            super()._save_checkpoint(trainer, filepath)
        else:
            self._writer.begin()
            trainer.save_checkpoint(filepath, self.save_weights_only, storage_options=self._writer)
            lightning_private.record_saved(self, trainer, filepath)
            if self._writer.pending is not None:  # in the background: _after_save runs on its thread
                self._writer.pending.blocking_s = time.monotonic() - started
                return
        if not trainer.is_global_zero:
            return
        if not is_complete(path):
            # A strategy whose save writes no manifest (Lightning's own single-file save): the file
            # is in place, so the manifest can be written now; until then the checkpoint is incomplete.
            write_manifest(path, extra={keys.MANIFEST_GLOBAL_STEP: trainer.global_step})
        self._after_save(path, trainer.global_step)
        took = time.monotonic() - started
        size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
        self._report(trainer, SaveOutcome(path, trainer.global_step, took, took, size, False))

    def _after_save(self, path: Path, step: int) -> None:
        """Rank 0, once the checkpoint `path` is complete: `last.ckpt` to the newest finite one (this save,
        unless the folder holds later steps or this one is not finite), then retention."""
        last = catalog.point_last_to_newest(path.parent)
        if catalog.recorded_non_finite(path):
            say(
                f"{path}: saved with NaN/Inf in its weights or optimizer state; it is kept only while newer than "
                f"the newest finite checkpoint, which `last.ckpt` ({last.resolve().name if last else 'none'}) names "
                f"and retention keeps"
            )
        protect = [self._resumed_from] if self._resumed_from is not None else []
        for removed in catalog.prune(path.parent, self.keep_last, protect=protect):
            if self.verbose:
                say(f"removed {removed} (keep_last={self.keep_last})")


ON_ERROR_WAIT_S = 60.0  # how long a failing run waits for its background save before it ends


def background_writer(trainer: pl.Trainer) -> BackgroundWriter:
    """The BackgroundWriter of a run with `async_save`, on every rank at the same point (setup): its own gloo
    group for the write's collectives. Refused (CheckpointError naming the option) where the save does not
    go through step35's writers (Step35Strategy, or Step35CheckpointIO, which the CLI installs)."""
    import torch.distributed as dist

    from step35.checkpoint.errors import CheckpointError
    from step35.checkpoint.training.plugin import Step35CheckpointIO

    strategy = trainer.strategy
    if not (getattr(strategy, "writes_in_background", False) or isinstance(strategy.checkpoint_io, Step35CheckpointIO)):
        raise CheckpointError(
            f"RunCheckpoint(async_save=true) needs step35's checkpoint writers: Step35Strategy, or "
            f"Step35CheckpointIO in trainer.plugins (step35 fit installs it); {type(strategy).__name__} with "
            f"{type(strategy.checkpoint_io).__name__} saves synchronously only"
        )
    writer = BackgroundWriter(pin_memory=strategy.root_device.type == "cuda")
    if dist.is_available() and dist.is_initialized():  # (one rank too: the loop uses the default group meanwhile)
        writer.group = dist.new_group(backend="gloo")  # collective: every rank's setup calls it here
    return writer
