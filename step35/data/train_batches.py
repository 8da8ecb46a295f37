"""The training batches as Lightning sees them: one endless StatefulDataLoader iterator, with a length.

Two facts from the installed Lightning 2.6 decide this shape:

* `lightning/pytorch/loops/fetchers.py`, `_PrefetchDataFetcher`: when the train loader has no length, Lightning
  fetches one batch ahead (to know which batch is the last). A loader state read when a checkpoint is saved
  (in `on_train_batch_end`) is then one batch past the batch just trained on, and a resume would skip a
  batch (tests/test_data_module.py shows it: without a length, the first batch after a resume is wrong).
  With a length it does not prefetch ("ignore pre-fetching, it's not necessary"). So this object reports
  the batches the run will draw, `max_steps * accumulate_grad_batches`; the stream itself never ends.

* `lightning/pytorch/loops/fit_loop.py` (`on_save_checkpoint`, `_load_combined_loader_states`) and
  `utilities/combined_loader.py` (`_state_dicts`, `_load_state_dicts`): Lightning saves the state of every
  train loader that passes `isinstance(loader, _Stateful)` (`lightning/fabric/utilities/types.py`, a runtime
  protocol: any object with `state_dict` and `load_state_dict` methods) into the fit-loop state, and
  restores it after `train_dataloader()` on every rank. Only rank 0 writes that part of a checkpoint (the
  whole file under DDP; `meta.pt`, saved under `global_rank == 0` by `save_checkpoint` in
  `strategies/model_parallel.py` and `strategies/fsdp.py`, for distributed checkpoints), so every rank
  would get rank 0's stream position. The DataModule keeps per-rank states instead (datamodule.py). So that
  Lightning neither saves nor restores a second, wrong copy, this object deliberately has no
  `state_dict`/`load_state_dict` methods: its methods are `stream_state`/`restore_stream_state`.
"""

from typing import Any, Optional

from torchdata.stateful_dataloader import StatefulDataLoader


class TrainBatches:
    """Iterating this again (a new Lightning epoch) continues the same stream instead of restarting it."""

    def __init__(self, loader: StatefulDataLoader, num_batches: Optional[int] = None) -> None:
        self.loader = loader
        self.num_batches = num_batches
        self._batches: Optional[Any] = None  # the loader's iterator, created on first use
        self._state: dict[str, Any] = {}  # the position to start from, until iteration starts

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the training stream is endless")  # how Lightning's sized_len() learns "no length"
        return self.num_batches

    def __iter__(self) -> Any:
        if self._batches is None:
            self.loader.load_state_dict(self._state)
            self._batches = iter(self.loader)
        return self._batches

    def stream_state(self) -> dict[str, Any]:
        """The loader state right after the last batch handed out (per worker, as StatefulDataLoader tracks it)."""
        if self._batches is None:
            return self._state  # asking the loader would start its workers
        return self.loader.state_dict()

    def restore_stream_state(self, state: dict[str, Any]) -> None:
        """Start (or restart) the stream at `state`, a `stream_state()` of an identically built loader."""
        self.close()
        self._state = state

    def close(self) -> None:
        """Stop the worker processes; the position is kept and iteration would resume there."""
        if self._batches is not None:
            self._state = self.loader.state_dict()
            shutdown = getattr(self._batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._batches = None
            self.loader.load_state_dict({})
