"""The Lightning-private names step35 depends on, in one file, each checked at import so that a
Lightning upgrade that moves one fails at start with its name, not silently mid-run.

Here (used by step35/callbacks/checkpointing.py, RunCheckpoint):
- `ModelCheckpoint._save_checkpoint(trainer, filepath)`: overridden, the one point after a save
  has completed (write the manifest, switch `last.ckpt`, prune); Lightning has no public hook there.
- `ModelCheckpoint._should_skip_saving_checkpoint`, `_save_topk_checkpoint`, `_monitor_candidates`:
  the save at the end of training at a step not yet saved (Lightning saves only on step/epoch/time).

Elsewhere, still to move here: `Trainer._signal_connector` (callbacks/fault_tolerance.py) and
`fit_loop.epoch_loop._batches_that_stepped` (callbacks/reporting.py).
(LightningCLI._parse_ckpt_path is no longer used: the CLI holds --ckpt_path back in the public
`parse_arguments`.)
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint

_MODEL_CHECKPOINT = ("_save_checkpoint", "_should_skip_saving_checkpoint", "_save_topk_checkpoint",
                     "_monitor_candidates")


def _check(cls: type, names: tuple[str, ...], user: str) -> None:
    import lightning

    missing = [n for n in names if not callable(getattr(cls, n, None))]
    if missing:
        raise ImportError(f"lightning {lightning.__version__}: {cls.__name__} has no {', '.join(missing)}, which {user} "
                          f"relies on; adapt step35/lightning_private.py to this Lightning")


_check(ModelCheckpoint, _MODEL_CHECKPOINT, "step35.callbacks.RunCheckpoint")


def save_now(callback: ModelCheckpoint, trainer) -> bool:
    """Save through `callback` now, as its own schedule would; False when Lightning says not to
    (sanity check, fast_dev_run, a trainer that is stopping on an exception...)."""
    if callback._should_skip_saving_checkpoint(trainer):
        return False
    callback._save_topk_checkpoint(trainer, callback._monitor_candidates(trainer))
    return True
