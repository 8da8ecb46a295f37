"""A source: documents from a list of parts (local files, or the shards of a `datasets` stream), split into
shards, with a holdout, bad-record handling and endless epochs.

Sharding: the stream has `num_shards` = ranks x DataLoader workers shards. Two ways to split a source:

* round-robin over records: every record has an `ordinal`, its index in the current epoch; shard `s` owns the
  records with `ordinal % num_shards == s`. Every shard lists every record (cheap: a line, a row index) but
  turns only its own into text. Exact balance, any number of files; used for local files.
* by part: shard `s` reads only the parts `s, s + num_shards, ...` of the epoch's part order and owns all their
  records (what `datasets.distributed.split_dataset_by_node` does). Used for hub streams when
  `parts_suffice`: every shard gets equally many parts, or at least `PARTS_PER_SHARD_FOR_UNEVEN` each (then
  the shards' part counts differ by at most 1/10); with fewer parts a hub stream falls back to round-robin.

A `Cursor` names a record, so reading resumes at any document. Each shard runs its own epochs.
"""

import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from step35.data.bad_records import BadRecords
from step35.data.readers import (
    FIELD_CHECK_RECORDS,
    BadRecord,
    MissingField,
    Reader,
    Record,
    TxtMode,
    missing_field_message,
    reader_for,
    too_deep,
)
from step35.data.resume import Cursor

__all__ = ["Cursor", "FileSource", "Holdout", "Source", "parts_suffice"]

PARTS_PER_SHARD_FOR_UNEVEN = 10

# where the document starts, where the next record starts, the document: its text, or what `read` made of it
Document = tuple[Cursor, Cursor, Any]


@dataclass(frozen=True)
class Holdout:
    """A fixed fraction of documents kept out of training for validation, chosen by a hash of their position.

    The hash covers the part's key (a file name) and the record's index in it, so the split is the same on every
    run, rank and worker, survives moving the corpus, and train and validation never share a document.
    """

    fraction: float
    keep: Literal["train", "val"]

    def keeps(self, key: str) -> bool:
        digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
        held_out = int.from_bytes(digest, "little") < self.fraction * 2**64
        return held_out == (self.keep == "val")


class Part(Protocol):
    """One file of a source, or one shard of a stream."""

    key: str  # stable name: the holdout hashes it

    def open(self) -> Reader: ...

    def stamp(self) -> list | None:
        """A cheap fingerprint of the part's content, or None where there is none to take (a stream's part)."""
        ...


STAMP_BYTES = 1 << 16  # a file's stamp hashes this many bytes at each end, with its size


class FilePart:
    def __init__(self, path: str | Path, text_field: str, txt_mode: TxtMode, whole_records: bool = False) -> None:
        self.path = str(path)
        self.key = Path(path).name
        self.text_field = text_field
        self.txt_mode = txt_mode
        self.whole_records = whole_records
        self._reader: Reader | None = None

    def open(self) -> Reader:
        if self._reader is None:
            self._reader = reader_for(self.path, self.text_field, self.txt_mode, self.whole_records)
        return self._reader

    def stamp(self) -> list:
        """[size, hash of the first and last 64 KiB]: catches a line deleted or added anywhere (the size) and
        most rewrites, reads 128 KiB, and survives a copy that changes modification times."""
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(STAMP_BYTES)
            f.seek(max(0, size - STAMP_BYTES))
            tail = f.read(STAMP_BYTES)
        return [size, hashlib.blake2b(head + tail, digest_size=8).hexdigest()]


def parts_suffice(num_parts: int, num_shards: int) -> bool:
    """Whether sharding by part keeps the shards balanced: equal part counts, or at least 10 parts each."""
    return num_parts % num_shards == 0 or num_parts >= PARTS_PER_SHARD_FOR_UNEVEN * num_shards


class Source:
    """Documents from `parts`, one epoch after another, the part order reshuffled every epoch when `shuffle`."""

    def __init__(
        self,
        name: str,
        parts: Sequence[Part],
        shuffle: bool = True,
        seed: int = 0,
        holdout: Holdout | None = None,
        split_by_part: bool = False,
    ) -> None:
        self.name = name
        self.parts = list(parts)
        self.shuffle = shuffle
        self.seed = seed
        self.holdout = holdout
        self.split_by_part = split_by_part  # when parts_suffice; else round-robin over records
        self.format = "text"  # or "chat", "prompt_completion": set by spec.open_source (records read whole)
        self._order: tuple[int, list[Part]] = (-1, [])  # the last epoch's part order

    def epoch_parts(self, epoch: int) -> list[Part]:
        if self._order[0] != epoch:
            order = list(self.parts)
            if self.shuffle:
                random.Random(f"{self.seed}-{epoch}").shuffle(order)  # str seeds hash with sha512: same everywhere
            self._order = (epoch, order)
        return list(self._order[1])

    def digest(self) -> str:
        """A hash of the source's part list (file names, in the order given): a saved position is only
        meaningful for the same list, since the epoch's part order and the cursor's file index derive from it."""
        keys = "\n".join(part.key for part in self.parts)
        return hashlib.blake2b(keys.encode("utf-8"), digest_size=8).hexdigest()

    def stamp(self, cursor: Cursor) -> list | None:
        """The stamp of the part `cursor` points into (None past the last part)."""
        parts = self.epoch_parts(cursor.epoch)
        return parts[cursor.file].stamp() if cursor.file < len(parts) else None

    def part_name(self, cursor: Cursor) -> str:
        parts = self.epoch_parts(cursor.epoch)
        part = parts[cursor.file] if cursor.file < len(parts) else None
        return str(getattr(part, "path", None) or getattr(part, "key", f"part {cursor.file}"))

    def by_part(self, num_shards: int) -> bool:
        return self.split_by_part and parts_suffice(len(self.parts), num_shards)

    def documents(
        self,
        start: Cursor,
        shard: int,
        num_shards: int,
        bad: BadRecords,
        endless: bool,
        read: Callable[[Record], Any] | None = None,
    ) -> Iterator[Document]:
        """The documents of `shard`, kept by the holdout, from the record at `start` on, epoch after epoch
        when `endless`; bad records are reported to `bad` and skipped. A stream from the start whose first
        `FIELD_CHECK_RECORDS` records all lack the text field raises (a wrong `text_field`, not bad records).
        `read` turns a record into its document (default: its text; None passes it over silently; it raises
        `BadRecord` or `MissingField` as `Record.text` does)."""
        read = read or Record.text
        cursor = start
        missing: set[str] = set()  # fields of the records lacking the text field, while no document was found
        missed, field, what = 0, "", "text field"
        while True:
            whole_epoch = cursor == Cursor(epoch=cursor.epoch)
            found = held_out = 0
            for here, after, key, record in self._owned_records(cursor, shard, num_shards):
                if self.holdout is not None and not self.holdout.keeps(key):
                    held_out += 1
                    continue
                try:
                    text = read(record)
                except MissingField as error:
                    missed, missing, field, what = missed + 1, missing | set(error.fields), error.field, error.what
                    if missed >= FIELD_CHECK_RECORDS and found == 0 and start == Cursor():
                        raise ValueError(
                            missing_field_message(self.name, field, missed, sorted(missing), what)
                        ) from None
                    bad(record.where(), str(error))
                    continue
                except BadRecord as error:
                    bad(record.where(), str(error))
                    continue
                except RecursionError:  # a walk over a deeply nested record (rendering, comparing replies)
                    bad(record.where(), str(too_deep("the record")))
                    continue
                if text is None:
                    continue
                found += 1
                yield here, after, text
            if endless and whole_epoch and found == 0:  # a finite stream may be empty; an endless one would spin
                if missed:  # fewer records than FIELD_CHECK_RECORDS, and the usable ones lack the field
                    raise ValueError(missing_field_message(self.name, field, missed, sorted(missing), what)) from None
                raise RuntimeError(empty_epoch_message(self.name, shard, num_shards, bad.count, held_out))
            if not endless:
                return
            cursor = Cursor(epoch=cursor.epoch + 1)

    def _owned_records(
        self, cursor: Cursor, shard: int, num_shards: int
    ) -> Iterator[tuple[Cursor, Cursor, str, Record]]:
        """(where the record is, where the next one is, its holdout key, the record) for the records of `shard`."""
        by_part = self.by_part(num_shards)
        ordinal = cursor.ordinal
        for index, part in enumerate(self.epoch_parts(cursor.epoch)):
            if index < cursor.file or (by_part and index % num_shards != shard):
                continue
            start, offset = (cursor.item, cursor.offset) if index == cursor.file else (0, 0)
            for record in part.open().records(start, offset):
                here = Cursor(cursor.epoch, index, record.index, record.offset, ordinal)
                ordinal += 1
                if by_part or here.ordinal % num_shards == shard:
                    after = Cursor(cursor.epoch, index, record.index + 1, record.end, ordinal)
                    yield here, after, f"{part.key}:{record.index}", record


class FileSource(Source):
    """Documents from local files (see readers.py for the formats), split round-robin over records."""

    def __init__(
        self,
        name: str,
        files: Sequence[str | Path],
        text_field: str = "text",
        txt_mode: TxtMode = "file",
        shuffle: bool = True,
        seed: int = 0,
        holdout: Holdout | None = None,
        whole_records: bool = False,
    ) -> None:
        parts = [FilePart(f, text_field, txt_mode, whole_records) for f in files]
        super().__init__(name, parts, shuffle, seed, holdout)
        self.text_field = text_field

    def epoch_files(self, epoch: int) -> list[str]:
        return [part.path for part in self.epoch_parts(epoch)]  # type: ignore[attr-defined]


def empty_epoch_message(name: str, shard: int, num_shards: int, skipped: int, held_out: int = 0) -> str:
    held = f", {held_out} held out for validation" if held_out else ""
    return (
        f"source {name!r}: shard {shard} of {num_shards} found no usable document in a whole epoch"
        f" ({skipped} bad records skipped so far{held}). Training on it would spin forever: fix the data, or use"
        " fewer ranks x workers than the source has documents"
    )
