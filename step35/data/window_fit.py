"""Do a run's conversations fit its window? Said at setup, before training reads a record.

A conversation longer than the window (`data.seq_len` + 1 tokens) is cut to it (`data.overlong: truncate`) or
dropped (`drop`, and also when the cut would leave none of its trained tokens: agent records whose tool schemas,
rendered before the first turn, fill the window). The packer counts and reports each one as training meets it,
so a run whose data is mostly dropped used to start, report the first few, turn validation off when the held-out
records were dropped too, and end with exit code 0 having trained on what was left.

`check_window_fit` encodes the first `WINDOW_CHECK_RECORDS` records a conversation source trains on (the
validation holdout left out) with the encoder training uses, allowed `MEASURE_WINDOWS` windows of tokens, and
applies the packer's rule to each (packing.PackedConversations), counting the records it would drop and measuring
the longest, so that the report can name the `data.seq_len` that holds them all. `check_sources_fit` runs it on
every such source of a run: a warning at start where some would be dropped, and a refusal (`WindowFitError`, said
in one line) where their share is above `data.max_dropped_share`.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from step35.data.bad_records import BadRecords
from step35.data.formats import format_of
from step35.data.packing import PackedConversations
from step35.data.resume import Cursor

WINDOW_CHECK_RECORDS = 200  # records read from the start of each conversation source
MEASURE_WINDOWS = 8  # a record is encoded up to this many windows of tokens; a longer one is "more than" that


class WindowFitError(ValueError):
    """More of a source's conversations would be dropped than data.max_dropped_share allows."""

    step35_refusal = True  # at fit start: said in one line, without a traceback (step35.faults)


@dataclass
class WindowFit:
    """What the first `checked` records of source `source` do in a window of `window` tokens: `dropped` of them
    would be dropped; the longest has `longest` tokens (more than that when `measured` is false)."""

    source: str
    window: int
    checked: int = 0
    dropped: int = 0
    longest: int = 0
    measured: bool = True

    @property
    def share(self) -> float:
        return self.dropped / self.checked if self.checked else 0.0

    def seq_len_for_all(self) -> str:
        """The data.seq_len whose window holds every record checked whole: "1100", or "more than 2567"."""
        return str(self.longest - 1) if self.measured else f"more than {self.longest - 1}"

    def describe(self, overlong: str) -> str:
        why = (
            "data.overlong: drop"
            if overlong == "drop"
            else "cut to the window, they would keep none of their trained tokens: what comes first (a system"
            " prompt, tool schemas) fills it"
        )
        return (
            f"source {self.source!r}: {self.dropped} of the first {self.checked} conversations ({self.share:.0%}) do"
            f" not fit a window of {self.window} tokens (data.seq_len {self.window - 1}) and would be dropped"
            f" ({why}); data.seq_len {self.seq_len_for_all()} holds them all"
        )


def check_window_fit(
    source: Any, encode: Callable[[Any], Any], window: int, overlong: str, limit: int = WINDOW_CHECK_RECORDS
) -> WindowFit:
    """The first `limit` records of `source` (shard 0 of 1, from the start, as read for training) through
    `encode` (an sft.SftEncoder allowed more than a window), with the packer's rule for a record longer than
    `window`: dropped under `overlong` "drop", else when none of its first `window` tokens past the first is
    trained. Bad records are left to training to skip, count and report."""
    fit = WindowFit(source.name, window)
    bad = BadRecords(source.name, strict=False)
    documents = source.documents(Cursor(), 0, 1, bad, endless=False, read=encode)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bad records and dropped tool schemas: training reports them
            for _, _, example in itertools.islice(documents, limit):
                fit.checked += 1
                length = len(example.ids)
                fit.longest = max(fit.longest, length)
                fit.measured = fit.measured and example.complete
                if length > window and (overlong == "drop" or not any(example.trained[1:window])):
                    fit.dropped += 1
    finally:
        documents.close()
    return fit


def check_sources_fit(
    sources: list[Any], tokenizer: Any, seq_len: int, options: dict[str, Any], max_share: float, warn: Callable
) -> list[WindowFit]:
    """`check_window_fit` on every conversation source of `sources` (`options`: the stream's chat template and
    choices), each answered by `warn(line)` where some would be dropped; a WindowFitError names the first whose
    share is above `max_share`. A source the check cannot read is left to training, which says why."""
    window = seq_len + 1
    template_options = (
        options.get("template"),
        options.get("train_on", "assistant"),
        options.get("template_missing", ""),
        options.get("train_reasoning", True),
    )
    overlong = options.get("overlong", "truncate")
    fits = []
    for source in sources:
        data_format = format_of(source)
        if data_format.packer is not PackedConversations:
            continue
        encode = data_format.encoder(tokenizer, *template_options, window=window * MEASURE_WINDOWS)
        try:
            fit = check_window_fit(source, encode, window, overlong)
        except (ValueError, RuntimeError, OSError):
            continue  # a source training cannot read either: its first batch says why, as before
        fits.append(fit)
        if fit.share > max_share:
            raise WindowFitError(
                f"{fit.describe(overlong)}. That is above data.max_dropped_share={max_share:g}: raise data.seq_len,"
                f" or set data.max_dropped_share {fit.share:.2f} to train on the rest"
            )
        if fit.dropped:
            warn(f"{fit.describe(overlong)}. Training goes on without them (data.max_dropped_share={max_share:g})")
    return fits
