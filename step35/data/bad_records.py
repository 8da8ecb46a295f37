"""What happens to a record that cannot be trained on: skipped, counted and reported, or an error;
and how the counts of all ranks and workers reach the loggers and the end-of-fit summary."""

import warnings
from typing import Any

import torch.distributed as dist


class BadRecordWarning(UserWarning):
    """A record was skipped: invalid JSON, bytes that are not UTF-8, a missing or non-string text field."""


class BadRecordError(ValueError):
    """Raised instead of skipping a bad record when the DataModule runs with ``strict=True``."""


METRIC_PREFIX = "data/skipped_records/"

# Enough individual reports to diagnose a broken file; a corpus that is mostly garbage must not bury the log.
REPORTS_PER_SOURCE = 10


class BadRecords:
    """Skips, counts and reports the bad records of one source within one process (a shard of the stream).

    Each document belongs to exactly one shard, so counts summed over shards count every bad record once.
    """

    def __init__(self, source_name: str, strict: bool, count: int = 0) -> None:
        self.source_name = source_name
        self.strict = strict
        self.count = count  # bad records skipped so far, resumed from the stream state
        self.reported = 0  # reports issued by this process; a resumed run may report again

    def __call__(self, where: str, why: str) -> None:
        if self.strict:
            raise BadRecordError(f"bad record at {where}: {why} (strict=True; set strict=False to skip bad records)")
        self.count += 1
        if self.reported < REPORTS_PER_SOURCE:
            self.reported += 1
            message = f"skipping bad record at {where}: {why}"
            if self.reported == REPORTS_PER_SOURCE:
                message += (
                    f" (further bad records of {self.source_name!r} in this process are skipped without a report;"
                    f" the logged metric {METRIC_PREFIX}<source> and the summary at the end of fit count them)"
                )
            warnings.warn(message, BadRecordWarning, stacklevel=2)


class OverlongWarning(UserWarning):
    """A conversation longer than a window was truncated or dropped (`data.overlong`)."""


class OverlongRecords:
    """Counts and reports the conversations of one source, within one process, that do not fit a window:
    truncated to the window (`truncate`) or dropped (`drop`, and when truncation would leave no trained
    token). Like bad records, the counts live in the stream state and reach the logs
    (`data/truncated/<source>`, `data/dropped/<source>`)."""

    def __init__(self, source_name: str, truncated: int = 0, dropped: int = 0, what: str = "conversation") -> None:
        self.source_name = source_name
        self.what = what  # what a record is, in the reports: "conversation", "preference pair"
        self.truncated = truncated
        self.dropped = dropped
        self.reported = 0

    def truncate(self, where: str, length: int, window: int) -> None:
        self.truncated += 1
        self._report(f"truncating the {self.what} at {where}: {length} tokens, a window holds {window}")

    def drop(self, where: str, why: str) -> None:
        self.dropped += 1
        self._report(f"dropping the {self.what} at {where}: {why}")

    def _report(self, message: str) -> None:
        if self.reported < REPORTS_PER_SOURCE:
            self.reported += 1
            if self.reported == REPORTS_PER_SOURCE:
                message += (
                    f" (further ones of {self.source_name!r} in this process without a report; the logged metrics"
                    " data/truncated/<source> and data/dropped/<source> count them)"
                )
            warnings.warn(message, OverlongWarning, stacklevel=3)


COUNT_KINDS = ("skipped_records", "truncated", "dropped")  # the stream state's per-source counts, as metrics


class SkippedRecordsLog:
    """The running count of skipped records per source, over all ranks and DataLoader workers, logged
    as `data/skipped_records/<source>` and summed up in one line at the end of fit; with the counts of
    truncated and dropped conversations (`data/truncated/<source>`, `data/dropped/<source>`) alongside.
    Counts are keyed "<kind>/<source>" (kinds: `COUNT_KINDS`).

    The counts live in the stream states: one per (rank, worker) shard of the training stream, each
    document owned by exactly one shard, so their sum counts every bad record once (ranks that share a
    data-parallel replica read the same shards and count once). Validation is different: every rank
    reads the held-out stream from its start (validation.py), so the ranks' counts overlap and the
    largest is the number of held-out bad records read.

    `sync` is a collective: the DataModule calls it on every rank at the same training batches.
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] | None = None  # as of `step`, the last sync
        self.step: int | None = None
        self.final = False  # synced at the last batch of the run: nothing can be added after it

    def sync(self, train: dict[str, int], val: dict[str, int], dp_rank: int, step: int, final: bool) -> dict[str, int]:
        mine = (dp_rank, train, val)
        gathered: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        totals = {name: 0 for _, t, v in gathered for name in (*t, *v)}
        for counts in {rank: t for rank, t, _ in gathered}.values():  # one entry per data-parallel replica
            for name, n in counts.items():
                totals[name] += n
        for name in totals:
            totals[name] += max((v.get(name, 0) for _, _, v in gathered), default=0)
        self.totals, self.step, self.final = totals, step, final
        return totals

    @staticmethod
    def metrics(totals: dict[str, int]) -> dict[str, float]:
        return {"data/" + key: float(n) for key, n in totals.items()}

    def summary(self) -> str | None:
        """One line for the end of fit (and one per kind of overlong record counted), or None when
        nothing was counted yet."""
        if self.totals is None:
            return None
        when = "" if self.final else f" (as of step {self.step})"
        lines = []
        # (records longer than a window: conversations, prompt/completion records, preference pairs, unpaired ones)
        for kind, what in zip(
            COUNT_KINDS, ("bad records skipped", "overlong records truncated", "overlong records dropped")
        ):
            counts = {key.split("/", 1)[1]: n for key, n in self.totals.items() if key.split("/", 1)[0] == kind}
            if kind != "skipped_records" and not any(counts.values()):
                continue
            listed = ", ".join(f"{name!r}: {n}" for name, n in counts.items())
            total = sum(counts.values())
            verdict = "none" if total == 0 else f"{total} in all"
            lines.append(f"{what}, all ranks and workers{when}: {verdict} ({listed})")
        return "\n".join(lines)
