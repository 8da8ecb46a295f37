"""Which files a source's `path` names: files, folders, globs, and folders written by `datasets`' `save_to_disk`.

A `save_to_disk` folder holds `state.json` (its arrow shards, in order), `dataset_info.json` and the shards
`data-0000x-of-0000n.arrow` (Arrow IPC streams); a `DatasetDict` folder holds `dataset_dict.json` and one such
folder per split. Either is read as its arrow shards; the json files beside them are metadata, never data.
"""

import glob
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from step35.data.readers import (
    FIELD_CHECK_RECORDS,
    READABLE_SUFFIXES,
    BadRecord,
    MissingField,
    TxtMode,
    missing_field_message,
    reader_for,
)

SAVED_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return folder.is_dir() and (
        ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())
        or (folder / "dataset_dict.json").is_file()
    )


def saved_dataset_files(folder: Path, split: str = "train") -> list[Path]:
    """The arrow shards of a `save_to_disk` folder, in the dataset's order; of `split` for a DatasetDict."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ValueError(f"{folder}: a DatasetDict with splits {splits}, no {split!r}; set the source's split")
        folder = folder / split
    state = json.loads((folder / "state.json").read_text())
    if state.get("_indices"):  # save_to_disk flattens indices; a hand-made folder might not have
        raise ValueError(f"{folder}: an indices mapping is not supported; save it with Dataset.flatten_indices()")
    files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise FileNotFoundError(f"{folder}: state.json lists no arrow files or missing ones ({missing})")
    return files


def expand_files(patterns: Sequence[str], split: str = "train") -> list[Path]:
    """The files named by `patterns` (paths, folders, globs; `**` recurses), each pattern's matches sorted;
    a `save_to_disk` folder, named or found inside a folder, stands for its arrow shards (of `split`).

    A pattern matching nothing, or a matched file of a type we cannot read, is an error naming it.
    """
    found: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_dir():
            matches = list(_folder_files(path, split))
        elif path.is_file():
            matches = [path]
        else:
            matches = []
            for match in sorted(Path(p) for p in glob.glob(str(path), recursive=True)):
                if is_saved_dataset(match):
                    matches += saved_dataset_files(match, split)
                elif match.is_file() and not _is_saved_metadata(match):
                    matches.append(match)
        if not matches:
            raise FileNotFoundError(f"no files match {pattern!r}")
        for match in matches:
            if match.suffix.lower() not in READABLE_SUFFIXES:
                kind = match.suffix or "extensionless"
                raise ValueError(f"{match}: cannot read {kind} files; expected one of {sorted(READABLE_SUFFIXES)}")
            if match not in found:
                found.append(match)
    return found


def check_files(name: str, files: Sequence[Path], text_field: str, txt_mode: TxtMode = "file") -> None:
    """Errors that make a source useless, found before training starts: all files empty, a columnar file
    without the text column (or with a non-string one), json records without the text field."""
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"source {name!r}: every matched file is empty ({', '.join(map(str, files[:5]))}...)")
    for f in files:
        if f.suffix.lower() in (".parquet", ".arrow"):
            reader_for(f, text_field, txt_mode).check()
    check_text_field(name, [f for f in files if f.suffix.lower() in (".jsonl", ".json")], text_field)


def check_text_field(name: str, files: Sequence[Path], text_field: str) -> None:
    """Raise, naming the fields found and the closest one, when the first `FIELD_CHECK_RECORDS` json records
    (or all of them, if fewer) lack `text_field`: a wrong field name, which would otherwise surface only
    after a whole epoch of skipped records. Records that are bad for other reasons are passed over."""
    missed, fields = 0, set()
    for f in files:
        for record in reader_for(f, text_field).records():
            try:
                record.text()
            except MissingField as error:
                missed, fields = missed + 1, fields | set(error.fields)
                if missed >= FIELD_CHECK_RECORDS:
                    raise ValueError(missing_field_message(name, text_field, missed, sorted(fields))) from None
            except BadRecord:
                continue
            else:
                return
    if missed:
        raise ValueError(missing_field_message(name, text_field, missed, sorted(fields)))


def _folder_files(folder: Path, split: str) -> Iterator[Path]:
    """Readable files under `folder` in sorted path order; saved datasets inside stand for their shards."""
    if is_saved_dataset(folder):
        yield from saved_dataset_files(folder, split)
        return
    for entry in sorted(folder.iterdir()):
        if entry.is_dir():
            yield from _folder_files(entry, split)
        elif entry.is_file() and entry.suffix.lower() in READABLE_SUFFIXES:
            yield entry


def _is_saved_metadata(path: Path) -> bool:
    return path.name in SAVED_METADATA and is_saved_dataset(path.parent)
