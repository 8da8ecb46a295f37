"""The held-out batches: a fixed, small set, the same batches at every validation, equally many on every rank."""

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer


class FixedBatches:
    """Batches built beforehand, handed to Lightning as a plain sized iterable: not a DataLoader, so Lightning
    neither slips a DistributedSampler in nor asks for more workers."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.batches)


def validation_batches(
    sources: Sequence[Any],
    tokenizer: TextTokenizer,
    seq_len: int,
    micro_batch_size: int,
    num_batches: int,
    rank: int,
    world_size: int,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    strict: bool = False,
    on_repeat: Callable[[str], None] | None = None,
    **stream_options: Any,
) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """`num_batches` batches for this rank, and the bad records skipped per source.

    Validation reads the held-out stream in one fixed order from its start: window j of that stream goes to
    rank j % world_size, so ranks never share a window and every rank gets exactly `num_batches` batches
    (unequal counts would hang the collectives at the end of validation). Each rank reads only as far as it
    needs, about num_batches * micro_batch_size * world_size windows. A held-out set smaller than that is read
    again from its start, said by `on_repeat(line)` (default: a warning; the DataModule has rank 0 say it once,
    as every rank finds the same); one too small for a single window is an error.
    `stream_options` go to `TokenWindows` (the chat template, `train_on`, `overlong`): conversation batches
    carry their labels and positions.
    """
    needed = num_batches * micro_batch_size
    mine: list[dict[str, torch.Tensor]] = []
    skipped = [0] * len(sources)
    index = 0  # of the window in the held-out stream, counted across repeated passes
    passes = 0
    while len(mine) < needed:
        stream = TokenWindows(
            sources, tokenizer, seq_len, weights, seed=seed, endless=False, strict=strict, **stream_options
        )  # fmt: skip
        produced = 0
        for window in stream:
            produced += 1
            if index % world_size == rank:
                mine.append(window)
            index += 1
            if len(mine) == needed:
                break
        if produced == 0:
            names = ", ".join(source.name for source in sources)
            raise ValueError(
                f"validation data ({names}) holds no window of seq_len + 1 = {seq_len + 1} tokens;"
                " add validation data, raise val_fraction or lower seq_len"
            )
        if passes == 0:
            skipped = [s["skipped"] for s in stream.state_dict()["sources"]]
            if len(mine) < needed:
                line = (
                    f"the validation data holds {produced} windows, fewer than val_batches x micro_batch_size x ranks"
                    f" = {needed * world_size}; its windows are repeated to fill the validation batches"
                )
                if on_repeat is None:
                    warnings.warn(line, stacklevel=2)
                else:
                    on_repeat(line)
        passes += 1
    batches = [
        {key: torch.stack([w[key] for w in mine[i : i + micro_batch_size]]) for key in mine[i]}
        for i in range(0, needed, micro_batch_size)
    ]
    return batches, skipped
