"""A `datasets` stream as a source: `load_dataset(path, subset, split=split, streaming=True)`, a hub dataset or a
local folder of data files.

The stream's data files are its parts (`IterableDataset.n_shards`; `IterableDataset.shard(n_shards, j)` streams
file j alone). With enough files (sources.py, `parts_suffice`), each rank x worker shard streams only its own
files, as `datasets.distributed.split_dataset_by_node` would; with too few, every shard streams every file and
keeps its round-robin share of the records. A resume re-streams the current file up to the saved record
(`IterableDataset.skip`), never the files before it.
"""

from collections.abc import Iterator
from typing import Any

from step35.data.readers import Reader, Record, checked_text, did_you_mean
from step35.data.sources import Holdout, Source

BATCH_ROWS = 256  # records per `IterableDataset.iter` batch


class HubStream:
    """The `datasets` IterableDataset of one source, opened once per process (not pickled to workers)."""

    def __init__(self, path: str, subset: str | None, split: str) -> None:
        self.path = path
        self.subset = subset
        self.split = split
        self._dataset: Any = None

    def open(self) -> Any:
        if self._dataset is None:
            from datasets import load_dataset

            self._dataset = load_dataset(self.path, self.subset, split=self.split, streaming=True)
        return self._dataset

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None}


class HubPart(Reader):
    """One data file of a stream, as a reader of its records."""

    def __init__(
        self, stream: HubStream, index: int, count: int, name: str, text_field: str, whole_records: bool = False
    ) -> None:
        super().__init__(name, text_field, whole_records)
        self.stream = stream
        self.index = index
        self.count = count
        self.key = f"{name}:{index}"

    def open(self) -> Reader:
        return self

    def stamp(self) -> None:
        return None  # reading a stream's part to fingerprint it would cost a download; its index is in `key`

    def records(self, start: int = 0, offset: int = 0) -> Iterator[Record]:
        dataset = self.stream.open()
        if self.count > 1:
            dataset = dataset.shard(num_shards=self.count, index=self.index)
        if start:
            dataset = dataset.skip(start)
        index = start
        # `.iter()` rather than `for record in dataset`: iterating a `datasets` stream inside a DataLoader worker
        # splits it across workers on its own, which would fight the sharding here.
        for batch in dataset.iter(batch_size=BATCH_ROWS):
            values = batch.get(self.text_field)
            size = len(next(iter(batch.values()))) if batch else 0
            for k in range(size):
                if self.whole_records:
                    raw = {name: column[k] for name, column in batch.items()}
                else:
                    raw = None if values is None else values[k]
                yield Record(self, index, raw=raw)
                index += 1

    def text(self, record: Record) -> str | None:
        return checked_text(record.raw, self.text_field)

    def value(self, record: Record) -> dict | None:
        return record.raw

    def where(self, record: Record) -> str:
        return f"{self.path}: file {self.index} of {self.count}, record {record.index}"


class HubSource(Source):
    """Documents of a `datasets` stream; opening it here (at setup) fails by name for a wrong path, subset or
    split, or a stream without `text_field`."""

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        text_field: str = "text",
        holdout: Holdout | None = None,
        shuffle: bool = False,
        seed: int = 0,
        source_name: str | None = None,
        whole_records: bool = False,
    ) -> None:
        self.stream = HubStream(path, name, split)
        self.text_field = text_field
        display = source_name or f"{path}" + (f"/{name}" if name else "") + f"[{split}]"
        dataset = self.stream.open()
        count = max(1, dataset.n_shards)
        parts = [HubPart(self.stream, j, count, display, text_field, whole_records) for j in range(count)]
        super().__init__(display, parts, shuffle, seed, holdout, split_by_part=True)

    def field_names(self) -> list[str]:
        """The fields of the stream's first record (format detection reads them)."""
        first = next(iter(self.stream.open().take(1)), None)
        if first is None:
            raise ValueError(f"hub dataset {self.name} is empty")
        return sorted(first)

    def check(self) -> None:
        first = next(iter(self.stream.open().take(1)), None)
        if first is None:
            raise ValueError(f"hub dataset {self.name} is empty")
        if self.format != "text":
            return  # records are read whole; sft.py checks each record's fields
        if self.text_field not in first:
            fields = sorted(first)
            hint = did_you_mean(self.text_field, fields) or "; set text_field"
            raise ValueError(f"hub dataset {self.name} has no field {self.text_field!r} (fields: {fields}){hint}")
