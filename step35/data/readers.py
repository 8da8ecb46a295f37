"""One small reader per file format; every reader yields the same `Record` type.

A reader turns one file into a sequence of records (a line, a paragraph, a whole file, a JSON array element, a
parquet or arrow row). Listing records is cheap and done by every shard; turning a record into text (decoding,
JSON parsing, converting an arrow value) happens in `Record.text()`, which only the shard owning the record
calls. A record can be found again from its `index` (and `offset`, for formats that can seek), which is what a
resume needs.

Columnar files (parquet, arrow) are read with pyarrow one record batch at a time, only the text column;
arrow files are memory-mapped, so skipping batches on resume reads nothing but their row counts. Line-based
files are read here rather than with `pyarrow.json` / `datasets`' json builder: those parse a block at a
time and fail the whole block on one bad line, while a record here needs its own line number (reports),
its byte offset (a resume seeks there) and its own fate (a bad line is skipped, the rest is kept).
"""

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TxtMode = Literal["file", "line", "paragraph"]

BATCH_ROWS = 1024  # rows per record batch read from a columnar file


class BadRecord(Exception):
    """A record that cannot be trained on; the message says why (the reader's `where` says where)."""


def too_deep(what: str = "JSON") -> BadRecord:
    """The bad record of a value nested past Python's recursion limit: parsing it, or a walk over it (rendering,
    comparing), raised RecursionError. A bad record like any other (named by file:line, skipped or refused),
    instead of a RecursionError that ends the run without naming the record."""
    limit = sys.getrecursionlimit()
    return BadRecord(f"{what} nested too deeply (past Python's recursion limit of {limit} levels)")


class MissingField(BadRecord):
    """A record without the text field; `fields` are the fields it has."""

    def __init__(self, field: str, fields: list[str], what: str = "text field") -> None:
        hint = did_you_mean(field, fields) if what == "text field" else ""
        super().__init__(f"no {field!r} field (fields: {fields[:10]}){hint}")
        self.field = field
        self.fields = fields
        self.what = what  # "text field", or "field" for the fields of conversation records


# A source whose first this many records all lack the text field is a wrong `text_field`, not bad records.
FIELD_CHECK_RECORDS = 100


def did_you_mean(field: str, fields: list[str]) -> str:
    """ "; did you mean 'x'? (set text_field)" for the closest of `fields` to `field`, or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.5) or difflib.get_close_matches(
        field.lower(), [f.lower() for f in fields], n=1, cutoff=0.5
    )
    if not close:
        return ""
    match = next(f for f in fields if f == close[0] or f.lower() == close[0])
    return f"; did you mean {match!r}? (set text_field)"


def missing_field_message(source: str, field: str, records: int, fields: list[str], what: str = "text field") -> str:
    hint = (did_you_mean(field, fields) or "; set text_field") if what == "text field" else "; set the source's format"
    return (
        f"source {source!r}: none of the first {records} records read has the {what} {field!r};"
        f" their fields: {fields[:20]}{hint}"
    )


@dataclass(frozen=True)
class Record:
    """One record of one file: its index in the file, its byte span (for formats that seek) and its raw content."""

    reader: "Reader"
    index: int
    offset: int = 0  # byte offset of the record; a resume seeks there instead of re-reading the file
    end: int = 0  # byte offset where the next record starts
    raw: Any = None

    def text(self) -> str | None:
        """The document text; None for an empty record (passed over silently); `BadRecord` if it cannot be used."""
        return self.reader.text(self)

    def value(self) -> dict | None:
        """The whole record as a dict (a conversation, a prompt/completion pair); None for a blank line;
        `BadRecord` if it is not an object. Only for readers opened with `whole_records`."""
        return self.reader.value(self)

    def where(self) -> str:
        """The record's location for a report: file:line, file:row, ..."""
        return self.reader.where(self)


class Reader:
    """The records of one file, from record `start` on (at byte `offset` where the format seeks).

    `whole_records`: the records are read whole (`Record.value`: every field or column), for conversation and
    prompt/completion data; otherwise only `text_field` is read (`Record.text`)."""

    def __init__(self, path: str | Path, text_field: str = "text", whole_records: bool = False) -> None:
        self.path = str(path)
        self.text_field = text_field
        self.whole_records = whole_records

    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        raise NotImplementedError

    def text(self, record: Record) -> str | None:
        raise NotImplementedError

    def value(self, record: Record) -> dict | None:
        raise BadRecord(f"{self.path}: plain text holds no records with fields (conversations need json or columns)")

    def where(self, record: Record) -> str:
        return f"{self.path}:{record.index + 1}"

    def check(self) -> None:
        """Errors that make the whole file useless, raised before training starts (by name)."""


class _LineReader(Reader):
    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        with open(self.path, "rb") as f:
            f.seek(offset)
            for index, line in enumerate(f, start):
                yield Record(self, index, offset, offset + len(line), line)
                offset += len(line)


class JsonlReader(_LineReader):
    """JSON Lines: one JSON object per line, the text in `text_field`; blank lines are no records."""

    def text(self, record: Record) -> str | None:
        value = self._parsed(record)
        return None if value is None else _field_text(value, self.text_field)

    def value(self, record: Record) -> dict | None:
        return _object(self._parsed(record))

    def _parsed(self, record: Record) -> Any:
        line = _decoded(record.raw)
        if not line.strip():
            return None
        try:
            return json.loads(line)
        except json.JSONDecodeError as error:
            raise BadRecord(f"invalid JSON ({error.msg} at column {error.colno})") from None
        except RecursionError:
            raise too_deep() from None


class TextLineReader(_LineReader):
    """Plain text, one document per non-blank line."""

    def text(self, record: Record) -> str | None:
        line = _decoded(record.raw)
        return line.rstrip("\r\n") if line.strip() else None


class TextParagraphReader(Reader):
    """Plain text, one document per block of non-blank lines; the blank lines between belong to no document."""

    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        index = start
        with open(self.path, "rb") as f:
            f.seek(offset)
            block: list[bytes] = []
            first = offset
            for line in f:
                if line.strip():
                    if not block:
                        first = offset
                    block.append(line)
                elif block:
                    yield Record(self, index, first, offset, b"".join(block))
                    index += 1
                    block = []
                offset += len(line)
            if block:
                yield Record(self, index, first, offset, b"".join(block))

    def text(self, record: Record) -> str | None:
        return _decoded(record.raw).rstrip("\r\n")

    def where(self, record: Record) -> str:
        return f"{self.path}: paragraph {record.index + 1} (byte {record.offset})"


class TextFileReader(Reader):
    """Plain text, the whole file one document; only the shard owning it reads its bytes."""

    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        if start == 0:
            yield Record(self, 0)

    def text(self, record: Record) -> str | None:
        text = _decoded(Path(self.path).read_bytes())
        return text if text.strip() else None

    def where(self, record: Record) -> str:
        return self.path


class JsonArrayReader(Reader):
    """A JSON array of objects. It has to be parsed whole to count its elements, and every shard parses it:
    keep such files small (or convert them to JSON Lines)."""

    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        try:
            with open(self.path, encoding="utf-8") as f:
                elements = json.load(f)
        except UnicodeDecodeError as error:
            problem = f"not valid UTF-8 ({error.reason} at byte {error.start})"
        except json.JSONDecodeError as error:
            problem = f"invalid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        except RecursionError:
            problem = str(too_deep())
        else:
            if isinstance(elements, list):
                for index in range(start, len(elements)):
                    yield Record(self, index, raw=elements[index])
                return
            problem = "not a JSON array of records"
        if start == 0:  # the whole file is one bad record
            yield Record(self, 0, raw=BadRecord(problem))

    def text(self, record: Record) -> str | None:
        if isinstance(record.raw, BadRecord):
            raise record.raw
        return _field_text(record.raw, self.text_field)

    def value(self, record: Record) -> dict | None:
        if isinstance(record.raw, BadRecord):
            raise record.raw
        return _object(record.raw)

    def where(self, record: Record) -> str:
        if isinstance(record.raw, BadRecord):  # the file as a whole could not be read: no element to name
            return self.path
        return f"{self.path}: element {record.index}"


class _ColumnarReader(Reader):
    """Rows of a column-oriented file; `raw` is (a record batch, the row within it). The batches hold the
    text column alone, or every column when `whole_records`."""

    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        for first, batch in self._batches(start):
            for k in range(max(0, start - first), batch.num_rows):
                yield Record(self, first + k, raw=(batch, k))

    def text(self, record: Record) -> str | None:
        batch, k = record.raw
        return checked_text(batch.column(self.text_field)[k].as_py(), self.text_field)

    def value(self, record: Record) -> dict | None:
        batch, k = record.raw
        return {name: batch.column(name)[k].as_py() for name in batch.schema.names}

    def columns(self) -> list[str] | None:
        """The columns to read: None (all) for whole records."""
        return None if self.whole_records else [self.text_field]

    def where(self, record: Record) -> str:
        return f"{self.path}: row {record.index}"

    def check(self) -> None:
        import pyarrow as pa

        schema = self._schema()
        if self.whole_records:
            return  # which fields a record needs depends on its format: sft.py checks them
        if self.text_field not in schema.names:
            hint = did_you_mean(self.text_field, schema.names) or "; set text_field"
            raise ValueError(f"{self.path}: no column {self.text_field!r} (columns: {schema.names}){hint}")
        kind = schema.field(self.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise ValueError(f"{self.path}: column {self.text_field!r} holds {kind}, not strings; set text_field")

    def _schema(self) -> Any:
        raise NotImplementedError

    def field_names(self) -> list[str]:
        """The file's column names (format detection reads them)."""
        return list(self._schema().names)

    def _batches(self, start: int) -> Iterator[tuple[int, Any]]:
        """(index of the first row, record batch) per record batch, from the batch holding row `start` on."""
        raise NotImplementedError


class ParquetReader(_ColumnarReader):
    """Parquet, read one row group at a time; a resume skips whole row groups without reading them."""

    def _schema(self) -> Any:
        import pyarrow.parquet as pq

        return pq.read_schema(self.path)

    def _batches(self, start: int) -> Iterator[tuple[int, Any]]:
        import pyarrow.parquet as pq

        self.check()
        parquet = pq.ParquetFile(self.path)
        row = 0
        for group in range(parquet.num_row_groups):
            rows = parquet.metadata.row_group(group).num_rows
            if row + rows <= start:
                row += rows
                continue
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=self.columns()):
                yield row, batch
                row += batch.num_rows


class ArrowReader(_ColumnarReader):
    """Arrow IPC, in both layouts: the file format (`pyarrow.ipc.new_file`, Feather v2) and the stream format
    (what `datasets` writes: `Dataset.save_to_disk` shards, its cache files). Memory-mapped, batch by batch."""

    FILE_MAGIC = b"ARROW1"

    def _open(self) -> Any:
        import pyarrow as pa

        source = pa.memory_map(self.path)
        if source.read(len(self.FILE_MAGIC)) == self.FILE_MAGIC:
            source.seek(0)
            return pa.ipc.open_file(source)
        source.seek(0)
        return pa.ipc.open_stream(source)

    def _schema(self) -> Any:
        try:
            return self._open().schema
        except Exception as error:  # pyarrow raises ArrowInvalid; keep the file name in the message
            raise ValueError(f"{self.path}: not an Arrow IPC file or stream ({error})") from None

    def _batches(self, start: int) -> Iterator[tuple[int, Any]]:
        self.check()
        reader = self._open()
        if hasattr(reader, "num_record_batches"):  # file format: random access to batches
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        row = 0
        for batch in batches:  # zero-copy views of the mapped file: skipping one costs nothing
            if row + batch.num_rows > start:
                yield row, batch
            row += batch.num_rows


# The file types a source may name, by suffix; `.json` is a JSON array or JSON Lines, told apart by a peek.
READABLE_SUFFIXES = (".jsonl", ".json", ".txt", ".md", ".parquet", ".arrow")


def reader_for(
    path: str | Path, text_field: str = "text", txt_mode: TxtMode = "file", whole_records: bool = False
) -> Reader:
    """The reader for one file, chosen by its suffix; `whole_records` reads every field (see `Reader`)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return JsonlReader(path, text_field, whole_records)
    if suffix == ".json":  # a JSON array of records, or JSON Lines under a .json name: both occur
        with open(path, "rb") as f:
            is_array = f.read(4096).lstrip().startswith(b"[")
        return (JsonArrayReader if is_array else JsonlReader)(path, text_field, whole_records)
    if suffix in (".txt", ".md"):
        return {"file": TextFileReader, "line": TextLineReader, "paragraph": TextParagraphReader}[txt_mode](path)
    if suffix == ".parquet":
        return ParquetReader(path, text_field, whole_records)
    if suffix == ".arrow":
        return ArrowReader(path, text_field, whole_records)
    kind = suffix or "extensionless"
    raise ValueError(f"{path}: cannot read {kind} files; expected one of {sorted(READABLE_SUFFIXES)}")


def _decoded(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRecord(f"not valid UTF-8 ({error.reason} at byte {error.start})") from None


def _object(value: Any) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise BadRecord(f"not a JSON object but {type(value).__name__}")
    return value


def _field_text(value: Any, field: str) -> str | None:
    if not isinstance(value, dict):
        raise BadRecord(f"not a JSON object but {type(value).__name__}")
    if field not in value:
        raise MissingField(field, sorted(value))
    return checked_text(value[field], field)


def checked_text(value: Any, field: str) -> str | None:
    if value is None:
        raise BadRecord(f"{field!r} is missing or null")
    if not isinstance(value, str):
        raise BadRecord(f"{field!r} is {type(value).__name__}, not a string")
    return value if value.strip() else None
