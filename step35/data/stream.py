"""The token-window stream: sharded across ranks and DataLoader workers, mixed across sources, resumable."""

import copy
import hashlib
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from step35.data.formats import check_not_mixed, format_of
from step35.data.image_records import IMAGE_KEYS, ImageOptions, window_image_tensors
from step35.data.packing import PackedSource, fresh_packing_state, text_window_targets
from step35.data.resume import STATE_FORMAT, check_stream_state
from step35.data.sft import OVERLONG
from step35.data.tokenizer import TextTokenizer


class TokenWindows(IterableDataset):
    """Yields {"input_ids": LongTensor [seq_len + 1]} windows packed from the documents of `sources`.

    Sources of records (`source.format`, formats.py: conversations, prompt/completion pairs, preference
    pairs, ...) are encoded by their format's encoder (rendered with `template`, trained per `train_on` and
    `train_reasoning`) and packed whole by its packer (overlong ones handled per `overlong`); when any source is
    one, every window also has "labels" [seq_len] (the targets of input_ids[:-1], -100 where not trained) and
    "position_ids" [seq_len] (0 where a document starts), text windows included (every next token a target,
    positions restarting after each EOS). A format's packer may add tensors (its `batch_keys`: "preference"
    [seq_len] for preference pairs, the DPO batch contract); such sources cannot be mixed with sources whose
    batches are for another objective (`formats.check_not_mixed`).

    Images (`images`, data.images: an image_records.ImageOptions): conversations' images are read, placed and
    packed with their records, and every window, text windows included, also has the image tensors of
    image_records.IMAGE_KEYS (fixed shapes; `num_images` 0 where it holds none), so that any windows collate.

    Sharding: the stream is split into `world_size * num_workers` shards, shard `rank * num_workers + worker`;
    documents go round-robin to shards, or whole files of a hub stream that has enough (see sources.py), so
    within an epoch no document is read twice or skipped.
    Shards end up with slightly different token counts; an endless stream (training) makes that
    harmless, since every rank can always produce its next batch and Lightning stops all ranks at the same
    `max_steps`. Each shard of each source runs its own epochs: epoch e+1 starts, with a fresh file order,
    when that shard has read its part of epoch e, and the leftover tokens of epoch e open epoch e+1.
    A shard that finds no usable document in a whole epoch raises instead of spinning forever.
    A finite stream (`endless=False`: one epoch, last partial window of each source dropped) is for
    validation and tests; validation equalises ranks separately (validation.py).

    Mixing: before each window a seeded hash of (seed, shard, window index) picks the source, with
    probabilities `weights`; so the weights are shares of windows, i.e. of tokens, and the choice needs no
    RNG state. Every source keeps its own packing state, so a window never mixes two sources.

    State (`state_dict`/`load_state_dict`, as torchdata's StatefulDataLoader expects of an IterableDataset):
    the window count and per source a cursor, a piece and token skip, a bad-record count and a fingerprint of
    the data the cursor points into (checked on resume); a handful of values (resume.py describes the whole
    chain from here to a checkpoint).
    `__iter__` continues from the current state, and the state advances before every window leaves, so the
    state read right after a batch is the exact position after that batch.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        tokenizer: TextTokenizer,
        seq_len: int,
        weights: Sequence[float] | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        endless: bool = True,
        strict: bool = False,
        template: Any = None,
        train_on: str = "assistant",
        overlong: str = "truncate",
        template_missing: str = "",
        train_reasoning: bool = True,
        images: ImageOptions | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        weights = list(weights) if weights is not None else [1.0] * len(sources)
        if len(weights) != len(sources) or not sources:
            raise ValueError(f"{len(weights)} weights for {len(sources)} sources; give one weight per source")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
        self.sources = list(sources)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.weights = [w / sum(weights) for w in weights]
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.endless = endless
        self.strict = strict
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong must be one of {OVERLONG}, got {overlong!r}")
        self.overlong = overlong
        check_not_mixed(self.sources)
        self.formats = [format_of(source) for source in self.sources]
        options = (template, train_on, template_missing, train_reasoning)
        self.images = ImageOptions.of(images)
        if self.images is not None:
            refused = sorted({f.name for f in self.formats if f.encoder is not None and not f.images})
            if refused:
                raise ValueError(f"data.images: {refused} records cannot hold images; train them in a run without it")
        with_images = {"images": self.images} if self.images is not None else {}
        self.encoders = [
            None if f.encoder is None else f.encoder(tokenizer, *options, window=seq_len + 1, **with_images)
            for f in self.formats
        ]
        self.labelled = any(encoder is not None for encoder in self.encoders) or self.images is not None
        self._state = {
            "format": STATE_FORMAT,
            "windows": 0,
            "sources": [fresh_packing_state() for _ in self.sources],
        }

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_stream_state(state_dict, len(self.sources))
        self._state = copy.deepcopy(state_dict)

    def shard(self) -> tuple[int, int]:
        """(this process's shard, number of shards), from the rank and the DataLoader worker running us."""
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        return self.rank * workers + worker_id, self.world_size * workers

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        shard, num_shards = self.shard()
        state = self._state
        window = self.seq_len + 1
        packers = [
            PackedSource(source, self.tokenizer, window, shard, num_shards, self.endless, self.strict, s)
            if encoder is None
            else f.packer(source, encoder, window, shard, num_shards, self.endless, self.strict, s, self.overlong)
            for source, f, encoder, s in zip(self.sources, self.formats, self.encoders, state["sources"])
        ]
        windows = [packer.windows() for packer in packers]
        while True:
            alive = [i for i, s in enumerate(state["sources"]) if not s["done"] and self.weights[i] > 0]
            if not alive:
                return
            i = alive[0] if len(alive) == 1 else self._pick(shard, state["windows"], alive)
            window = next(windows[i], None)
            if window is None:  # only a finite stream runs dry; its source is now marked done
                continue
            state["windows"] += 1
            yield self._batch_item(window, self.formats[i].batch_keys)

    def _batch_item(self, window: Any, batch_keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if isinstance(window, tuple):  # a window of records: (tokens, labels, positions, *its format's tensors)
            keys = ("input_ids", "labels", "position_ids", *batch_keys, *(IMAGE_KEYS if self.images else ()))
            return {  # int64 from lists and numbers; a packer's own tensor (its dtype: prompt bytes) as it is
                key: values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
                for key, values in zip(keys, window, strict=True)
            }
        if not self.labelled:
            return {"input_ids": torch.tensor(window, dtype=torch.long)}
        labels, positions = text_window_targets(window, self.tokenizer.eos_token_id)
        item = {
            "input_ids": torch.tensor(window, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": torch.tensor(positions, dtype=torch.long),
        }
        if self.images is not None:  # a text window of a run with images: no image, the same tensors
            item.update(zip(IMAGE_KEYS, window_image_tensors([], self.images)))
        return item

    def _pick(self, shard: int, index: int, alive: list[int]) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{shard}:{index}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "little") / 2**64
        bounds = list(accumulate(self.weights[i] for i in alive))
        return alive[min(bisect_right(bounds, u * bounds[-1]), len(alive) - 1)]
