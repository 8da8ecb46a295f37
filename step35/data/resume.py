"""Where the training stream stands, for every data-parallel rank and DataLoader worker, and how that position
goes into a checkpoint and comes back out. Everything the exact resume needs lives here:

* `Cursor`: the position of one record in one source's stream (a few ints).
* The stream state (`STATE_FORMAT`): per shard (rank x worker) the window count and, per source, a cursor,
  the piece of a long document and a token skip, a bad-record count (and for conversation sources the
  truncated and dropped counts, read as 0 from states saved before them), and which data the cursor points into
  (a digest of the source's file list, a stamp of the cursor's file); `TokenWindows` (stream.py) keeps it,
  `PackedSource` (packing.py) advances it before every window leaves and checks the data on resume
  (`DataChangedWarning`, or `DataChangedError` when strict). torchdata's StatefulDataLoader collects it per
  worker.
* `TrainBatches`: the endless loader as Lightning sees it, hiding the loader state from Lightning.
* `TrainStreamResume`: the loader states of all ranks in one checkpoint entry, and each rank's own back.

Two facts from the installed Lightning 2.6 decide this shape:

* `lightning/pytorch/loops/fetchers.py`, `_PrefetchDataFetcher`: when the train loader has no length, Lightning
  fetches one batch ahead (to know which batch is the last). A loader state read when a checkpoint is saved
  (in `on_train_batch_end`) is then one batch past the batch just trained on, and a resume would skip a
  batch (tests/test_data_module.py shows it: without a length, the first batch after a resume is wrong).
  With a length it does not prefetch ("ignore pre-fetching, it's not necessary"). So `TrainBatches` reports
  the batches the run will draw, `max_steps * accumulate_grad_batches`; the stream itself never ends.

* `lightning/pytorch/loops/fit_loop.py` (`on_save_checkpoint`, `_load_combined_loader_states`) and
  `utilities/combined_loader.py` (`_state_dicts`, `_load_state_dicts`): Lightning saves the state of every
  train loader that passes `isinstance(loader, _Stateful)` (`lightning/fabric/utilities/types.py`, a runtime
  protocol: any object with `state_dict` and `load_state_dict` methods) into the fit-loop state, and
  restores it after `train_dataloader()` on every rank. Only rank 0 writes that part of a checkpoint (the
  whole file under DDP; `meta.pt`, saved under `global_rank == 0` by `save_checkpoint` in
  `strategies/model_parallel.py` and `strategies/fsdp.py`, for distributed checkpoints), so every rank
  would get rank 0's stream position. The DataModule's `state_dict` (also called on every rank, also written
  by rank 0 only) therefore carries the states of all ranks, gathered here; and so that Lightning neither
  saves nor restores a second, wrong copy, `TrainBatches` deliberately has no `state_dict`/`load_state_dict`
  methods: its methods are `stream_state`/`restore_stream_state`.
"""

import warnings
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from typing import Any

import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader


class DataChangedWarning(UserWarning):
    """A saved stream position belongs to data that has changed since; that source's stream restarts."""


class DataChangedError(ValueError):
    """Raised instead of `DataChangedWarning` when the DataModule runs with ``strict=True``."""


STATE_FORMAT = "step35.token_windows/1"  # marks our state inside a StatefulDataLoader's state dict
CHECKPOINT_FORMAT = "step35.datamodule/1"


@dataclass(frozen=True)
class Cursor:
    """The position of one record in a source's stream; a list of ints in saved state."""

    epoch: int = 0
    file: int = 0  # index into the epoch's order of files (or hub parts)
    item: int = 0  # index of the record within that file
    offset: int = 0  # byte offset of the record, for line-based files: a resume seeks instead of re-reading
    ordinal: int = 0  # index of the record within the epoch: decides the shard (round-robin sharding)

    def to_list(self) -> list[int]:
        return list(astuple(self))


def check_stream_state(state: dict[str, Any], num_sources: int) -> None:
    if state.get("format") != STATE_FORMAT or len(state.get("sources", [])) != num_sources:
        raise ValueError(
            f"stream state does not fit: saved for {len(state.get('sources', []))} sources"
            f" ({state.get('format')}), the stream has {num_sources} ({STATE_FORMAT})"
        )


def worker_stream_states(loader_state: Any) -> list[dict[str, Any]]:
    """The stream states inside a StatefulDataLoader state: one per worker, or one without workers."""
    if isinstance(loader_state, dict):
        if loader_state.get("format") == STATE_FORMAT and "sources" in loader_state:
            return [loader_state]
        return [s for value in loader_state.values() for s in worker_stream_states(value)]
    return []


class TrainBatches:
    """The training batches as Lightning sees them: one endless StatefulDataLoader iterator, with a length.
    Iterating this again (a new Lightning epoch) continues the same stream instead of restarting it."""

    def __init__(self, loader: StatefulDataLoader, num_batches: int | None = None) -> None:
        self.loader = loader
        self.num_batches = num_batches
        self._batches: Any | None = None  # the loader's iterator, created on first use
        self._state: dict[str, Any] = {}  # the position to start from, until iteration starts
        self._repeat: tuple[int, int, Callable[[], int]] | None = None  # repeat_steps' (times, per step, first step)
        self._group: list[Any] = []  # the current step's batches, while they repeat
        self._served: int | None = None  # batches handed out, counted from the first step's

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the training stream is endless")  # how Lightning's sized_len() learns "no length"
        return self.num_batches

    def __iter__(self) -> Any:
        if self._batches is None:
            self.loader.load_state_dict(self._state)
            self._batches = iter(self.loader)
        return self._batches if self._repeat is None else self._repeated()

    def repeat_steps(self, times: int, batches_per_step: int, first_step: Callable[[], int]) -> None:
        """Hand each optimizer step's `batches_per_step` batches `times` steps in a row (online RL's mu: the same
        prompts, their rollouts kept). The steps count from `first_step()` (the step training starts or resumes
        at); a step that is a multiple of `times` reads new batches, so a resume lands on the same phase, and the
        stream's position is that after the last step's batches read."""
        self._repeat = (times, batches_per_step, first_step)

    def _repeated(self) -> Iterator[Any]:
        times, per_step, first_step = self._repeat
        if self._served is None:
            self._served = first_step() * per_step
        while True:
            step, position = divmod(self._served, per_step)
            if position == 0 and (step % times == 0 or not self._group):
                self._group = [next(self._batches) for _ in range(per_step)]
            self._served += 1
            yield self._group[position]

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
        self._group, self._served = [], None  # a restarted stream starts a fresh repetition


class TrainStreamResume:
    """The training stream's position across loaders and checkpoints, for the DataModule.

    The shards are (data-parallel rank, worker) pairs, so a position is only meaningful for the same number of
    ranks and workers; a checkpoint saved with another layout restarts the stream, with a warning.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.batches: TrainBatches | None = None
        self._saved: dict[str, Any] | None = None  # from a checkpoint, until a loader exists to apply it to

    def attach(self, batches: TrainBatches, rank: int, world_size: int) -> None:
        """A new loader: it continues where the previous one stopped, or at a checkpoint's position."""
        previous, self.batches = self.batches, batches
        if previous is not None:  # asked again (reload_dataloaders_every_n_epochs): continue, do not restart
            previous.close()
            batches.restore_stream_state(previous.stream_state())
        if self._saved is not None:
            self._apply_saved(rank, world_size)

    def state_dict(self, rank: int, world_size: int) -> dict[str, Any]:
        """Every rank's loader state, keyed by data-parallel rank. A collective: call it on every rank."""
        if self.batches is None:
            return self._saved or {}  # no training yet in this process: pass a loaded state through
        mine = (rank, self.batches.stream_state())
        gathered: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        return {
            "format": CHECKPOINT_FORMAT,
            "data_parallel_size": world_size,
            "num_workers": self.num_workers,
            "train_stream_by_rank": dict(gathered),  # ranks sharing a replica hold the same state
        }

    def load_state_dict(self, state: dict[str, Any], rank: int, world_size: int) -> None:
        self._saved = state or None
        if self.batches is not None and self._saved is not None:
            self._apply_saved(rank, world_size)  # the loader was built first (some strategies set up before restoring)

    def worker_states(self) -> list[dict[str, Any]]:
        """This rank's stream state per worker (the bad-record counts live there)."""
        return worker_stream_states(self.batches.stream_state()) if self.batches is not None else []

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()

    def _apply_saved(self, rank: int, world_size: int) -> None:
        saved, self._saved = self._saved, None
        assert saved is not None and self.batches is not None
        by_rank = saved.get("train_stream_by_rank", {})
        state = by_rank.get(rank, by_rank.get(str(rank)))
        layout = (saved.get("data_parallel_size"), saved.get("num_workers"))
        if layout != (world_size, self.num_workers) or state is None:
            # Another layout splits documents differently, so no saved position means anything. Restarting the
            # stream repeats data, which beats a crash on resume.
            warnings.warn(
                f"the checkpoint's data stream was saved with {layout[0]} data-parallel ranks x {layout[1]} workers,"
                f" this run has {world_size} x {self.num_workers}: the training stream starts from the beginning",
                stacklevel=3,
            )
            return
        self.batches.restore_stream_state(state)
        # Lightning (training_epoch_loop.py, reset) warns that a mid-epoch resume is unreliable when it sees no
        # stateful train loader; ours is hidden from it on purpose (TrainBatches) and was just restored.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
