"""Where documents come from: local files (jsonl, json, txt, md, parquet) or a `datasets` stream.

A source is read as a sequence of *items* (a line, a paragraph, a file, a JSON array element, a parquet row,
a streamed record). Every item has an `ordinal`, its index in the current epoch; shard `s` of `n` owns the items
with `ordinal % n == s`, so every shard reads the item sequence but parses only its own items, and each
document lands in exactly one shard. A `Cursor` names an item, so reading can resume at any document.
"""

import glob
import hashlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from step35.data.bad_records import BadRecords

TxtMode = Literal["file", "line", "paragraph"]
FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".txt": "txt", ".md": "txt", ".parquet": "parquet"}


@dataclass(frozen=True)
class Cursor:
    """The position of one item in a source's stream; a list of ints in saved state."""

    epoch: int = 0
    file: int = 0  # index into the epoch's file order
    item: int = 0  # index of the item within that file
    offset: int = 0  # byte offset of the item, for line-based files: a resume seeks instead of re-reading
    ordinal: int = 0  # index of the item within the epoch: decides the shard

    def to_list(self) -> list[int]:
        return list(astuple(self))


@dataclass(frozen=True)
class Holdout:
    """A fixed fraction of documents kept out of training for validation, chosen by a hash of their position.

    The hash covers the source key, the file name and the item index, so the split is the same on every run,
    rank and worker, survives moving the corpus, and train and validation never share a document.
    """

    fraction: float
    keep: Literal["train", "val"]

    def keeps(self, key: str) -> bool:
        digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
        held_out = int.from_bytes(digest, "little") < self.fraction * 2**64
        return held_out == (self.keep == "val")


class _Unreadable:
    """An item whose raw content could not even be split into records (a broken JSON array file)."""

    def __init__(self, why: str) -> None:
        self.why = why


class _BadRecord(Exception):
    pass


Document = tuple[Cursor, Cursor, str]  # where the document starts, where the next item starts, its text


# A record of one epoch: where it starts, where the next starts, its holdout key, and two callables
# (its location for a warning, its text: None to pass over it silently, _BadRecord when malformed).
Record = tuple[Cursor, Cursor, str, Callable[[], str], Callable[[], Optional[str]]]


def owned_documents(
    name: str,
    epoch_records: Callable[[Cursor], Iterator[Record]],
    start: Cursor,
    shard: int,
    num_shards: int,
    holdout: Optional[Holdout],
    bad: BadRecords,
    endless: bool,
) -> Iterator[Document]:
    """The documents of `shard` (round-robin over record ordinals), kept by the holdout, from `start` on,
    epoch after epoch when `endless`; bad records are reported to `bad` and skipped."""
    cursor = start
    while True:
        whole_epoch = cursor == Cursor(epoch=cursor.epoch)
        found = 0
        for here, after, key, where, read in epoch_records(cursor):
            if here.ordinal % num_shards != shard:
                continue
            if holdout is not None and not holdout.keeps(key):
                continue
            try:
                text = read()
            except _BadRecord as error:
                bad(where(), str(error))
                continue
            if text is None:
                continue
            found += 1
            yield here, after, text
        if endless and whole_epoch and found == 0:  # a finite stream may be empty; an endless one would spin
            raise RuntimeError(empty_epoch_message(name, shard, num_shards, bad.count))
        if not endless:
            return
        cursor = Cursor(epoch=cursor.epoch + 1)


class FileSource:
    """Documents from local files, one epoch after another, file order reshuffled every epoch when `shuffle`."""

    def __init__(
        self,
        name: str,
        files: Sequence[str | Path],
        text_field: str = "text",
        txt_mode: TxtMode = "file",
        shuffle: bool = True,
        seed: int = 0,
        holdout: Optional[Holdout] = None,
    ) -> None:
        self.name = name
        self.files = [str(f) for f in files]
        self.text_field = text_field
        self.txt_mode = txt_mode
        self.shuffle = shuffle
        self.seed = seed
        self.holdout = holdout
        self._kinds: dict[str, str] = {}  # path -> how to read it; .json files need a peek to tell

    def epoch_files(self, epoch: int) -> list[str]:
        order = list(self.files)
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)  # str seeds hash with sha512: same in every process
        return order

    def documents(
        self, start: Cursor, shard: int, num_shards: int, bad: BadRecords, endless: bool
    ) -> Iterator[Document]:
        """Documents owned by `shard`, from the item at `start` on; endless streams roll into the next epoch."""
        return owned_documents(self.name, self._records, start, shard, num_shards, self.holdout, bad, endless)

    def _records(self, cursor: Cursor) -> Iterator[Record]:
        ordinal = cursor.ordinal
        for file_index, path in enumerate(self.epoch_files(cursor.epoch)):
            if file_index < cursor.file:
                continue
            item, offset = (cursor.item, cursor.offset) if file_index == cursor.file else (0, 0)
            for item, offset, next_offset, raw in self._items(path, item, offset):
                here = Cursor(cursor.epoch, file_index, item, offset, ordinal)
                ordinal += 1
                yield (here, Cursor(cursor.epoch, file_index, item + 1, next_offset, ordinal),
                       f"{Path(path).name}:{item}",
                       lambda path=path, item=item, offset=offset: self._where(path, item, offset),
                       lambda path=path, raw=raw: self._text(path, raw))

    def _kind(self, path: str) -> str:
        if path not in self._kinds:
            kind = FILE_TYPES[Path(path).suffix.lower()]
            if kind == "txt":
                kind = f"txt-{self.txt_mode}"
            elif kind == "json":  # a JSON array of records, or JSON Lines under a .json name: both occur
                with open(path, "rb") as f:
                    kind = "json-array" if f.read(4096).lstrip().startswith(b"[") else "jsonl"
            self._kinds[path] = kind
        return self._kinds[path]

    def _items(self, path: str, item: int, offset: int) -> Iterator[tuple[int, int, int, Any]]:
        """(item index, byte offset, byte offset of the next item, raw item) from item `item` on."""
        kind = self._kind(path)
        if kind in ("jsonl", "txt-line"):
            yield from _lines(path, item, offset)
        elif kind == "txt-paragraph":
            yield from _paragraphs(path, item, offset)
        elif kind == "txt-file":
            if item == 0:
                yield 0, 0, 0, Path(path)  # read only by the owning shard
        elif kind == "json-array":
            yield from _array_elements(path, item)
        else:
            yield from _parquet_rows(path, self.text_field, item)

    def _text(self, path: str, raw: Any) -> Optional[str]:
        """The document text of an item, None for an empty item, `_BadRecord` for one that cannot be used."""
        kind = self._kind(path)
        if isinstance(raw, _Unreadable):
            raise _BadRecord(raw.why)
        if kind == "parquet":
            return _checked_text(raw, self.text_field)
        if kind == "json-array":
            return _record_text(raw, self.text_field)
        if isinstance(raw, Path):
            raw = raw.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise _BadRecord(f"not valid UTF-8 ({error.reason} at byte {error.start})") from None
        if not text.strip():
            return None
        if kind == "jsonl":
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise _BadRecord(f"invalid JSON ({error.msg} at column {error.colno})") from None
            return _record_text(record, self.text_field)
        return text.rstrip("\r\n") if kind != "txt-file" else text

    def _where(self, path: str, item: int, offset: int) -> str:
        kind = self._kind(path)
        if kind in ("jsonl", "txt-line"):
            return f"{path}:{item + 1}"
        if kind == "txt-paragraph":
            return f"{path}: paragraph {item + 1} (byte {offset})"
        if kind == "json-array":
            return f"{path}: element {item}"
        if kind == "parquet":
            return f"{path}: row {item}"
        return path


class HubSource:
    """Documents from `datasets.load_dataset(path, name, split=split, streaming=True)`: a hub dataset or a folder.

    Every shard streams the whole split and keeps its own records (the round-robin rule above), and a resume
    re-streams up to its cursor; fine for modest streams, wasteful for a huge hub corpus, which is better
    downloaded once and read as parquet `files`. Records come in the dataset's published order every epoch.
    """

    def __init__(
        self,
        path: str,
        name: Optional[str] = None,
        split: str = "train",
        text_field: str = "text",
        holdout: Optional[Holdout] = None,
    ) -> None:
        self.path = path
        self.config_name = name
        self.split = split
        self.text_field = text_field
        self.holdout = holdout
        self.name = f"{path}" + (f"/{name}" if name else "") + f"[{split}]"

    def open(self, skip: int = 0) -> Any:
        from datasets import load_dataset

        stream = load_dataset(self.path, self.config_name, split=self.split, streaming=True)
        return stream.skip(skip) if skip else stream

    def documents(
        self, start: Cursor, shard: int, num_shards: int, bad: BadRecords, endless: bool
    ) -> Iterator[Document]:
        return owned_documents(self.name, self._records, start, shard, num_shards, self.holdout, bad, endless)

    def _records(self, cursor: Cursor) -> Iterator[Record]:
        item = cursor.item
        # `.iter()` rather than `for record in stream`: iterating a `datasets` stream inside a DataLoader
        # worker splits it across workers on its own, which would fight the round-robin sharding here.
        for batch in self.open(skip=cursor.item).iter(batch_size=256):
            values = batch.get(self.text_field)
            size = len(next(iter(batch.values()))) if batch else 0
            for k in range(size):
                here = Cursor(cursor.epoch, 0, item, 0, item)
                item += 1
                yield (here, Cursor(cursor.epoch, 0, item, 0, item), f"{self.name}:{here.item}",
                       lambda here=here: f"{self.name}: record {here.item}",
                       lambda k=k, values=values: _checked_text(None if values is None else values[k], self.text_field))


def expand_files(patterns: Sequence[str]) -> list[Path]:
    """The files named by `patterns` (paths, folders, globs; `**` recurses), each pattern's matches sorted.

    A pattern matching nothing, or a matched file of a type we cannot read, is an error naming it.
    """
    found: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_TYPES)
        elif path.is_file():
            matches = [path]
        else:
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not matches:
            raise FileNotFoundError(f"no files match {pattern!r}")
        for match in matches:
            if match.suffix.lower() not in FILE_TYPES:
                kind = match.suffix or "extensionless"
                raise ValueError(f"{match}: cannot read {kind} files; expected one of {sorted(FILE_TYPES)}")
            if match not in found:
                found.append(match)
    return found


def check_files(name: str, files: Sequence[Path], text_field: str) -> None:
    """Errors that make a source useless, found before training starts: all files empty, parquet without the field."""
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"source {name!r}: every matched file is empty ({', '.join(map(str, files[:5]))}...)")
    for f in files:
        if f.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(f).names
            if text_field not in columns:
                raise ValueError(f"{f}: no column {text_field!r} (columns: {columns}); set text_field")


def empty_epoch_message(name: str, shard: int, num_shards: int, skipped: int) -> str:
    return (
        f"source {name!r}: shard {shard} of {num_shards} found no usable document in a whole epoch"
        f" ({skipped} bad records skipped so far). Training on it would spin forever: fix the data, or use fewer"
        " ranks x workers than the source has documents"
    )


def _lines(path: str, item: int, offset: int) -> Iterator[tuple[int, int, int, bytes]]:
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            yield item, offset, offset + len(line), line
            item += 1
            offset += len(line)


def _paragraphs(path: str, item: int, offset: int) -> Iterator[tuple[int, int, int, bytes]]:
    """Blocks of non-blank lines; the blank lines between them belong to no paragraph."""
    with open(path, "rb") as f:
        f.seek(offset)
        block: list[bytes] = []
        start = offset
        for line in f:
            if line.strip():
                if not block:
                    start = offset
                block.append(line)
            elif block:
                yield item, start, offset, b"".join(block)
                item += 1
                block = []
            offset += len(line)
        if block:
            yield item, start, offset, b"".join(block)


def _array_elements(path: str, item: int) -> Iterator[tuple[int, int, int, Any]]:
    # A JSON array has to be parsed whole to count its elements, so every shard parses it: keep such files small.
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except UnicodeDecodeError as error:
        records = _Unreadable(f"not valid UTF-8 ({error.reason} at byte {error.start})")
    except json.JSONDecodeError as error:
        records = _Unreadable(f"invalid JSON ({error.msg} at line {error.lineno}, column {error.colno})")
    if isinstance(records, _Unreadable) or not isinstance(records, list):
        if item == 0:
            yield 0, 0, 0, records if isinstance(records, _Unreadable) else _Unreadable("not a JSON array of records")
        return
    for index in range(item, len(records)):
        yield index, 0, 0, records[index]


def _parquet_rows(path: str, column: str, item: int) -> Iterator[tuple[int, int, int, Any]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if column not in parquet.schema_arrow.names:
        raise ValueError(f"{path}: no column {column!r} (columns: {parquet.schema_arrow.names}); set text_field")
    row = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if row + rows <= item:  # a resume skips whole row groups without reading them
            row += rows
            continue
        for batch in parquet.iter_batches(batch_size=1024, row_groups=[group], columns=[column]):
            for value in batch.column(0).to_pylist():
                if row >= item:
                    yield row, 0, 0, value
                row += 1


def _record_text(record: Any, field: str) -> Optional[str]:
    if not isinstance(record, dict):
        raise _BadRecord(f"not a JSON object but {type(record).__name__}")
    if field not in record:
        raise _BadRecord(f"no {field!r} field (fields: {sorted(record)[:10]})")
    return _checked_text(record[field], field)


def _checked_text(value: Any, field: str) -> Optional[str]:
    if value is None:
        raise _BadRecord(f"{field!r} is missing or null")
    if not isinstance(value, str):
        raise _BadRecord(f"{field!r} is {type(value).__name__}, not a string")
    return value if value.strip() else None
