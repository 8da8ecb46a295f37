"""What happens to a record that cannot be trained on: skipped, counted and reported, or an error."""

import warnings


class BadRecordWarning(UserWarning):
    """A record was skipped: invalid JSON, bytes that are not UTF-8, a missing or non-string text field."""


class BadRecordError(ValueError):
    """Raised instead of skipping a bad record when the DataModule runs with ``strict=True``."""


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
                    " Step35DataModule.skipped_records counts them)"
                )
            warnings.warn(message, BadRecordWarning, stacklevel=2)
