"""What a user asks for: `data.sources`, a list of sources each with its own text field and weight, or the
short form (`data.files` + `data.weights` + `data.text_field`, or `data.hub_dataset`); and how a request
becomes a readable source.

    data:
      sources:
        - path: /data/web/*.jsonl            # files, folders, globs; a save_to_disk folder; .arrow files
          weight: 3
        - path: [/data/code/a.parquet, /data/code/b.parquet]
          text_field: content
          weight: 1
        - hub: HuggingFaceFW/fineweb-edu     # a datasets.load_dataset path, streamed
          subset: sample-10BT
          split: train
          weight: 1
        - path: /data/sft/*.parquet          # conversations (`messages`) or prompt/completion pairs
          format: chat                       # default auto: decided from the first records (sft.py)

The formats a source may have are formats.py's; sources whose batches are for different objectives
(preference pairs for `--model.objective dpo`, say, and conversations) cannot share a run.
"""

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from step35.data.files import check_files, expand_files, is_saved_dataset, saved_dataset_files
from step35.data.formats import DATA_FORMATS, FORMATS, check_columns, detect_format, format_of_fields
from step35.data.hub import HubSource
from step35.data.readers import TxtMode, reader_for
from step35.data.sources import FileSource, Holdout, Source

TXT_MODES = ("file", "line", "paragraph")


@dataclass
class SourceSpec:
    """One training source.

    Args:
        path: Local data: paths, folders or globs (`**` recurses) of .jsonl, .json, .txt, .md, .parquet and .arrow
            files, or folders written by `datasets`' `save_to_disk`. Give `path` or `hub`.
        hub: A `datasets.load_dataset` path (a hub name or a local dataset folder), streamed.
        subset: The configuration name of `hub` (`load_dataset(hub, subset)`).
        split: The split of `hub`, or of a `DatasetDict` folder written by `save_to_disk`.
        text_field: Field of json records, column of parquet/arrow data, holding the text; None: `data.text_field`.
        txt_mode: What a document is in .txt/.md files ("file", "line", "paragraph"); None: `data.txt_mode`.
        weight: Sampling weight, as a share of training tokens (weights are normalised over the sources).
        name: The source's name in logs and metrics; None: its path or hub name.
        format: A name of formats.FORMATS: "text", "chat" (records with `messages`), "prompt_completion"
            (records with `prompt` and `completion`), "preference" (records with `chosen`, `rejected` and an
            optional `prompt`, for `--model.objective dpo`), ... or "auto" (decided from the first records);
            None: `data.format`.
    """

    path: str | list[str] | None = None
    hub: str | None = None
    subset: str | None = None
    split: str = "train"
    text_field: str | None = None
    txt_mode: TxtMode | None = None
    weight: float = 1.0
    name: str | None = None
    format: str | None = None

    def __post_init__(self) -> None:
        where = f"data.sources entry {self.name or self.path or self.hub!r}"
        if (self.path is None) == (self.hub is None):
            raise ValueError(f"{where}: give exactly one of `path` (local data) and `hub` (a datasets stream)")
        if isinstance(self.path, list) and not self.path:
            raise ValueError(f"{where}: `path` is an empty list")
        if self.subset is not None and self.hub is None:
            raise ValueError(f"{where}: `subset` is a configuration of a `hub` dataset; this entry has a `path`")
        if not self.weight >= 0:
            raise ValueError(f"{where}: weight must be >= 0, got {self.weight}")
        if self.txt_mode is not None and self.txt_mode not in TXT_MODES:
            raise ValueError(f"{where}: txt_mode must be one of {TXT_MODES}, got {self.txt_mode!r}")
        if self.text_field is not None and not self.text_field:
            raise ValueError(f"{where}: text_field is empty")
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"{where}: format must be one of {FORMATS}, got {self.format!r}")

    @property
    def patterns(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path or [])

    @property
    def display_name(self) -> str:
        return self.name or (",".join(self.patterns) if self.path is not None else str(self.hub))

    @classmethod
    def parse(cls, entry: Any, index: int) -> "SourceSpec":
        """An entry of `data.sources`: a SourceSpec, or a dict with its fields."""
        if isinstance(entry, cls):
            return entry
        if not isinstance(entry, dict):
            raise ValueError(f"data.sources[{index}]: expected a mapping {{path: ..., weight: ...}}, not {entry!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(entry) - set(known))
        if unknown:
            raise ValueError(f"data.sources[{index}]: unknown keys {unknown}; a source takes {known}")
        return cls(**entry)


def open_source(
    spec: SourceSpec,
    text_field: str,
    txt_mode: TxtMode,
    holdout: Holdout | None,
    shuffle: bool,
    seed: int,
    name: str | None = None,
    format: str = "auto",
) -> Source:
    """The source `spec` asks for, checked: every way it cannot work fails here, naming the file or dataset.
    `text_field`, `txt_mode` and `format` apply where the spec names none. The source's `format` is set,
    and `format_reason` says why (detected, or asked for)."""
    field = spec.text_field or text_field
    mode = spec.txt_mode or txt_mode
    name = name or spec.display_name
    wanted = spec.format or format
    if spec.hub is not None and not is_saved_dataset(Path(spec.hub).expanduser()):
        source = HubSource(spec.hub, spec.subset, spec.split, field, holdout, shuffle, seed, source_name=name)
        if wanted == "auto":
            found = format_of_fields(source.field_names(), field)
            wanted, reason = found if found is not None else ("text", "no field tells")
        else:
            reason = "as asked"
        _set_format(source, wanted, reason)
        source.check()
        return source
    # A save_to_disk folder given as `hub` (load_dataset refuses those) is read like any local data.
    if spec.hub is not None:
        files = saved_dataset_files(Path(spec.hub).expanduser(), spec.split)
    else:
        files = expand_files(spec.patterns, spec.split)
    wanted, reason = detect_format(files, field) if wanted == "auto" else (wanted, "as asked")
    whole_records = DATA_FORMATS[wanted].whole_records
    if not whole_records:
        check_files(name, files, field, mode)
        check_holdout_leaves_documents(name, files, mode, holdout)
    else:
        check_record_files(name, files, wanted)
    source = FileSource(name, files, field, mode, shuffle, seed, holdout, whole_records=whole_records)
    _set_format(source, wanted, reason)
    return source


def _set_format(source: Source, format: str, reason: str) -> None:
    source.format = format
    source.format_reason = reason  # type: ignore[attr-defined]
    if DATA_FORMATS[format].whole_records and hasattr(source, "parts"):
        for part in source.parts:
            if hasattr(part, "whole_records"):
                part.whole_records = True


def check_record_files(name: str, files: list[Path], format: str) -> None:
    """A source of records with fields (every format but text) cannot be plain text files, and a columnar
    file must have the format's columns."""
    for f in files:
        suffix = f.suffix.lower()
        if suffix in (".txt", ".md"):
            raise ValueError(
                f"source {name!r}: {f} is plain text; a {format} source reads json, parquet or arrow records"
            )
        if suffix in (".parquet", ".arrow"):
            columns = reader_for(f, whole_records=True).field_names()  # type: ignore[attr-defined]
            check_columns(f, columns, DATA_FORMATS[format])


def check_holdout_leaves_documents(name: str, files: list[Path], txt_mode: TxtMode, holdout: Holdout | None) -> None:
    """Raise when the validation holdout takes every document of a training source whose documents are
    whole .txt/.md files (`txt_mode: file`): typically one file, whose only document the holdout hashes out."""
    whole_files = txt_mode == "file" and all(f.suffix.lower() in (".txt", ".md") for f in files)
    if holdout is None or holdout.keep != "train" or not whole_files:
        return
    if any(holdout.keeps(f"{f.name}:0") for f in files):  # the key FileSource's holdout hashes: file name, record 0
        return
    which = f"its only document, {files[0]}" if len(files) == 1 else f"all {len(files)} of its documents"
    raise ValueError(
        f"source {name!r}: the validation holdout (val_fraction={holdout.fraction}) takes {which} (txt_mode: file"
        " makes each file one document), leaving nothing to train on; set data.val_fraction: 0 (and data.val_files"
        " to validate), or txt_mode: paragraph or line to split the text into documents"
    )
