"""The Lightning-private names step35 depends on, in one file, each checked at import so that a
Lightning upgrade that moves one fails at start with its name, not silently mid-run.

Here (used by step35/callbacks/checkpointing.py, RunCheckpoint):
- `ModelCheckpoint._save_checkpoint(trainer, filepath)`: overridden, the one point after a save
  has completed (write the manifest, switch `last.ckpt`, prune); Lightning has no public hook there.
- `ModelCheckpoint._should_skip_saving_checkpoint`, `_save_topk_checkpoint`, `_monitor_candidates`:
  the save at the end of training at a step not yet saved (Lightning saves only on step/epoch/time).
- `ModelCheckpoint._last_global_step_saved`, `_last_checkpoint_saved` (instance attributes): set as
  Lightning's `_save_checkpoint` sets them, for a background save that RunCheckpoint makes itself.

Used by the other callbacks (instance attributes of a Trainer: checked when first used, with the
same kind of error):
- `Trainer._signal_connector.register_signal_handlers`: switched off for a run (FaultTolerance), since
  Lightning's SIGTERM handler broadcasts from rank 0 inside the handler and can deadlock multi-rank runs.
- `Trainer._logger_connector.update_train_step_metrics`: the metrics of a step that a pre-emption
  stops after reach the loggers (Lightning logs a step only after every on_train_batch_end returned).
- `fit_loop.epoch_loop._batches_that_stepped`: the step index Lightning writes its own training
  metrics at, so that callbacks' metrics share its x axis.
- the `loops.fit_loop["epoch_loop.batch_progress"]` entry of a checkpoint dict: a pre-emption save
  during a validation records the training loop as it was at the end of the step (FaultTolerance).
(LightningCLI._parse_ckpt_path is no longer used: the CLI holds --ckpt_path back in the public
`parse_arguments`.)
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint

from step35.checkpoint.training import keys

_MODEL_CHECKPOINT = (
    "_save_checkpoint",
    "_should_skip_saving_checkpoint",
    "_save_topk_checkpoint",
    "_monitor_candidates",
)


def _check(cls: type, names: tuple[str, ...], user: str) -> None:
    import lightning

    missing = [n for n in names if not callable(getattr(cls, n, None))]
    if missing:
        raise ImportError(
            f"lightning {lightning.__version__}: {cls.__name__} has no {', '.join(missing)}, which {user} "
            f"relies on; adapt step35/lightning_private.py to this Lightning"
        )


_check(ModelCheckpoint, _MODEL_CHECKPOINT, "step35.callbacks.RunCheckpoint")


def save_now(callback: ModelCheckpoint, trainer) -> bool:
    """Save through `callback` now, as its own schedule would; False when Lightning says not to
    (sanity check, fast_dev_run, a trainer that is stopping on an exception...)."""
    if callback._should_skip_saving_checkpoint(trainer):
        return False
    callback._save_topk_checkpoint(trainer, callback._monitor_candidates(trainer))
    return True


def record_saved(callback: ModelCheckpoint, trainer, filepath: str) -> None:
    """What ModelCheckpoint._save_checkpoint records after its trainer.save_checkpoint call, for a save that
    RunCheckpoint makes itself (a background save, which passes its writer as storage_options): the step
    and path saved, which Lightning's schedule reads (no second save of one step)."""
    for name in ("_last_global_step_saved", "_last_checkpoint_saved"):
        if not hasattr(callback, name):
            raise _missing(f"ModelCheckpoint.{name}", "step35.callbacks.RunCheckpoint (async_save)")
    callback._last_global_step_saved = trainer.global_step
    callback._last_checkpoint_saved = filepath


def _missing(what: str, user: str) -> RuntimeError:
    import lightning

    return RuntimeError(
        f"lightning {lightning.__version__} has no {what}, which {user} relies on; adapt "
        f"step35/lightning_private.py to this Lightning"
    )


def disable_signal_handlers(trainer) -> None:
    """Stop Lightning from installing its SIGTERM / SLURM-requeue handlers for this run (it installs
    them after the callbacks' setup)."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not callable(getattr(connector, "register_signal_handlers", None)):
        raise _missing("Trainer._signal_connector.register_signal_handlers", "step35.callbacks.FaultTolerance")
    connector.register_signal_handlers = lambda: None  # the instance attribute hides the method


def log_step_metrics_now(trainer) -> None:
    """Hand the current step's metrics to the loggers now, whatever log_every_n_steps says."""
    connector = getattr(trainer, "_logger_connector", None)
    if not callable(getattr(connector, "update_train_step_metrics", None)):
        raise _missing("Trainer._logger_connector.update_train_step_metrics", "step35.callbacks.FaultTolerance")
    trainer.should_stop = True  # Lightning logs the step that stops the run whatever the interval
    connector.update_train_step_metrics()


def batches_that_stepped(trainer) -> int:
    """The step index Lightning writes its own training metrics at (0-based optimizer steps)."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_batches_that_stepped"):
        raise _missing("fit_loop.epoch_loop._batches_that_stepped", "step35.callbacks (metric steps)")
    return loop._batches_that_stepped


def record_as_at_step_end(checkpoint: dict) -> None:
    """Rewrite the training loop's progress in `checkpoint` (a dict being saved during the validation
    that follows a step) to what it was at that step's on_train_batch_end, where every other
    pre-emption save is taken. Lightning counts the batch completed only after those hooks; a
    checkpoint saved later resumes through its "restarted on last" path, which counts the logging
    step right only when the resumed run validates at that step too (seen: every metric one step
    early after a resume with another val_check_interval)."""
    try:
        progress = checkpoint[keys.LOOPS]["fit_loop"]["epoch_loop.batch_progress"]
        counts = [progress["total"], progress["current"]]
        consistent = all(c["completed"] == c["processed"] >= 1 for c in counts)
    except (KeyError, TypeError):
        consistent = False
    if not consistent:
        raise _missing(
            "a checkpoint entry loops.fit_loop['epoch_loop.batch_progress'] with the step's batch completed",
            "step35.callbacks.FaultTolerance (a stop during validation)",
        )
    for count in counts:
        count["completed"] -= 1
