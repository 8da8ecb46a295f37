"""The data formats, one entry each: what a format's records look like, how one becomes tokens, how they are
packed, what its batches add, its built-in records. The pipeline asks the entry (`DATA_FORMATS[name]`, or
`format_of(source)`) and never compares format names, so a new format is its own file plus one line below.

* `text`: a text field per record, or plain text files; packed across window borders (packing.PackedSource).
* `chat`, `prompt_completion`: conversations and prompt/completion pairs (sft.py), packed whole with labels
  and positions (packing.PackedConversations).
* `preference`: preference pairs for `--model.objective dpo` (preference.py), packed side by side with the
  `preference` ids of the DPO batch contract (packing.PackedPairs).
* `unpaired`: labelled prompt/completion records for `--model.objective kto` (unpaired.py).
* `prompt`: prompts alone for `--model.objective grpo` (prompts.py), one per window, the record itself carried
  along as JSON bytes for the reward.

`auto` (the default `data.format`) picks a format from a source's first records (`detect_format`): the one
whose `fields` a record has all of (and none of its `unless`), the most specific when several match (one whose
fields include another's), else the first in the registry's order; else the text field means text.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from step35.data.builtin_chat import builtin_chat_path, builtin_preference_path
from step35.data.packing import PackedConversations, PackedPairs
from step35.data.preference import PreferenceEncoder
from step35.data.prompts import (
    PROMPT_FIELDS,
    PROMPT_KEYS,
    PROMPT_NOT_WITH,
    PackedPrompts,
    PromptEncoder,
    builtin_prompt_path,
)
from step35.data.readers import FIELD_CHECK_RECORDS, BadRecord, reader_for
from step35.data.sft import PLAIN_TEXT_SUFFIXES, SftEncoder, preference_error
from step35.data.unpaired import UNPAIRED_FIELDS, UNPAIRED_KEYS, PackedUnpaired, UnpairedEncoder, builtin_unpaired_path


@dataclass(frozen=True)
class DataFormat:
    """One data format (`data.format`, or `format` of a `data.sources` entry).

    `fields`: a record with all of them is of this format (`auto`); a parquet or arrow file stated as this
    format must have these columns (`optional` names the ones it may have too, for the error). `encoder`:
    called as (tokenizer, template, train_on, template_missing, train_reasoning, window=...) it gives the
    picklable callable that turns a readers.Record into the packer's item; None for text, which is tokenized
    as it streams. `packer`: the packing.PackedConversations subclass packing those items; its windows are
    (tokens, labels, positions, *the tensors `batch_keys` names). `builtin`: the built-in records' jsonl
    (cache folder -> path) for `data.format: <name>` with no files. `objective`: the `model.objective` its
    batches are for ("": the language model's); `records` what its records are, in messages. `needs_template`:
    its sources are refused at setup without a chat template (other formats find out per record).
    `train_on_all_refused`: the error for `data.train_on: all` ("" where it is allowed). `misread`: the error
    for a source of this format stated as another (file or record, the other format's name). `unless`: a record
    with one of these fields, or with the text field, is not of this format (`auto`), for a format whose
    `fields` other formats' records hold too (`prompt` alone: those records stay what they were before).
    `images`: its records may hold images (data.images; image_records.py): its encoder takes `images=`."""

    name: str
    fields: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    encoder: Callable[..., Any] | None = None
    packer: type | None = None
    batch_keys: tuple[str, ...] = ()
    builtin: Callable[[Any], Path] | None = None
    objective: str = ""
    records: str = ""
    needs_template: bool = False
    train_on_all_refused: str = ""
    misread: Callable[[Any, str], Exception] | None = None
    unless: tuple[str, ...] = ()
    images: bool = False

    @property
    def whole_records(self) -> bool:
        """Whether records are read whole, as fields (every format but text)."""
        return self.encoder is not None

    @property
    def trained_by(self) -> str:
        return f"--model.objective {self.objective}" if self.objective else "the language model objective"


DATA_FORMATS: dict[str, DataFormat] = {
    f.name: f
    for f in (
        DataFormat("text"),
        DataFormat("chat", ("messages",), (), partial(SftEncoder, "chat"), PackedConversations,
                   builtin=builtin_chat_path, needs_template=True, images=True),
        DataFormat("prompt_completion", ("prompt", "completion"), (), partial(SftEncoder, "prompt_completion"),
                   PackedConversations, images=True),
        DataFormat("preference", ("chosen", "rejected"), ("prompt",), PreferenceEncoder, PackedPairs, ("preference",),
                   builtin_preference_path, "dpo", "preference pairs",
                   train_on_all_refused=PreferenceEncoder.TRAIN_ON_ALL_REFUSED, misread=preference_error),
        DataFormat("unpaired", UNPAIRED_FIELDS, (), UnpairedEncoder, PackedUnpaired, UNPAIRED_KEYS, builtin_unpaired_path,
                   "kto", "unpaired records", train_on_all_refused=UnpairedEncoder.TRAIN_ON_ALL_REFUSED),
        DataFormat("prompt", PROMPT_FIELDS, (), PromptEncoder, PackedPrompts, PROMPT_KEYS, builtin_prompt_path, "grpo",
                   "prompt records", unless=PROMPT_NOT_WITH),
    )
}  # fmt: skip
FORMATS = ("auto", *DATA_FORMATS)  # the values `data.format` takes


def format_of(source: Any) -> DataFormat:
    """The format of an opened source (spec.open_source sets `source.format`; text when it has none)."""
    return DATA_FORMATS[getattr(source, "format", "text")]


def listed(names: Sequence[str]) -> str:
    """'a', "'a' and 'b'", "'a', 'b' and 'c'": names as messages list them."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def format_of_fields(fields: Iterable[str], text_field: str) -> tuple[str, str] | None:
    """(format, reason) decided by a record's field names, or None when they decide nothing. A format's fields
    win over the text field even when it names one of them (training the chosen answer alone as text is not
    what a preference file is for; `format: text` says so when it is)."""
    names = set(fields)
    matched = [
        f
        for f in DATA_FORMATS.values()
        if f.fields and set(f.fields) <= names and not (f.unless and names & {*f.unless, text_field})
    ]
    best = next((f for f in matched if not any(set(f.fields) < set(g.fields) for g in matched)), None)
    if best is not None:
        return best.name, f"records have {listed(best.fields)}"
    if text_field in names:
        return "text", f"records have the text field {text_field!r}"
    return None


def detect_format(files: Sequence[Path], text_field: str) -> tuple[str, str]:
    """(format, reason) of local files: plain text files are text; columnar files by their column names;
    json by the fields of the first record (of the first `FIELD_CHECK_RECORDS`) that decides. Nothing
    decides: text (the text-field check then names the fields found)."""
    looked = 0
    for path in files:
        if path.suffix.lower() in PLAIN_TEXT_SUFFIXES:
            return "text", f"{path.suffix} files are plain text"
        reader = reader_for(path, text_field, whole_records=True)
        if hasattr(reader, "field_names"):
            found = format_of_fields(reader.field_names(), text_field)
            if found is not None:
                return found[0], found[1].replace("records have", "columns include")
            continue
        for record in reader.records():
            looked += 1
            if looked > FIELD_CHECK_RECORDS:
                return "text", f"none of the first {FIELD_CHECK_RECORDS} records tells"
            try:
                value = record.value()
            except BadRecord:
                continue
            found = format_of_fields(value or {}, text_field)
            if found is not None:
                return found
    return "text", "no record tells"


def check_columns(path: Path, columns: list[str], format: DataFormat) -> None:
    """Refuse a parquet or arrow file stated as `format` that lacks its columns, naming the file; a file of a
    format with a `misread` error (preference pairs) is refused with it."""
    if set(format.fields) <= set(columns):
        return
    for other in DATA_FORMATS.values():
        if other.misread is not None and other is not format and set(other.fields) <= set(columns):
            raise other.misread(path, format.name)
    a = f"{'an' if format.name[0] in 'aeiou' else 'a'} {format.name} source"
    if len(format.fields) == 1:
        raise ValueError(f"{path}: no column {format.fields[0]!r} (columns: {columns}); {a} needs it")
    may = f", and may have {listed(format.optional)}" if format.optional else ""
    raise ValueError(f"{path}: {a} needs columns {listed(format.fields)}{may} (columns: {columns})")


def check_not_mixed(sources: list[Any]) -> None:
    """Refuse a stream whose sources make batches for different objectives: a batch carries one format's
    tensors (`batch_keys`, which its objective reads) or none (the language model objective's), never two."""
    formats = [format_of(s) for s in sources]
    own = next((f for f in formats if f.batch_keys), None)
    if own is None:
        return
    mine = [s.name for s, f in zip(sources, formats) if f.batch_keys == own.batch_keys]
    others = [(s.name, f) for s, f in zip(sources, formats) if f.batch_keys != own.batch_keys]
    if not others:
        return
    kinds = "/".join(sorted({f.name for _, f in others}))
    theirs = " / ".join(sorted({f.trained_by for _, f in others}))
    raise ValueError(
        f"{own.name} source(s) {mine} cannot be mixed with the {kinds} source(s) {[n for n, _ in others]} in one run:"
        f" {own.records} train {own.trained_by}, the others {theirs}; give them to separate runs (e.g. SFT first,"
        f" then {own.objective.upper()} on its export)"
    )
