"""Issue 42 (reliability round 4), the data slice: a chat template's own size buys no rendering budget and is
capped; a deeply nested JSON record is a bad record named by file:line in every format that parses JSON; a
preference pair whose replies are identical, as given or once cut to the window, is a bad record."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import pytest

from step35.data import Step35DataModule
from step35.data.bad_records import BadRecordError, BadRecords, BadRecordWarning
from step35.data.chat_messages import ChatTemplateError
from step35.data.chat_template import TEMPLATE_MAX_CHARS, ChatTemplate
from step35.data.sft import resolve_template
from step35.data.sources import Cursor, FileSource
from step35.data.stream import TokenWindows
from tests.helpers import write_jsonl

CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
# Outputs 2,000,000 characters: over the budget of a two-message rendering (1 MiB + 100 x its input), well
# under the budget the old rule gave a template with a 900 KB comment (1 MiB + 100 x 900 KB).
LOOP = "{% for i in range(2000) %}{{ 'y' * 1000 }}{% endfor %}"


# ---------------------------------------------------------------------------- item 1: the template's size


def test_a_huge_comment_buys_no_rendering_budget():
    """The budget was 1 MiB + 100 x (template + input): a 50 MB comment bought a 5 GB string (a fit reached
    4.2 GB before its watchdog). Now the budget counts what is rendered only."""
    comment = "{# " + "c" * (900 * 1024) + " #}"
    with pytest.raises(ChatTemplateError, match=r"^chat template from padded\.jinja refused: the output would make"):
        ChatTemplate(comment + LOOP, "padded.jinja").render(CONVERSATION)


def test_ordinary_templates_still_render_with_a_comment():
    comment = "{# " + "c" * (900 * 1024) + " #}"
    source = comment + "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert ChatTemplate(source, "padded.jinja").render(CONVERSATION) == "user: Hi\nassistant: Hello.\n"


def over_cap_template() -> str:
    return "{# " + "c" * TEMPLATE_MAX_CHARS + " #}{{ messages[0].content }}"


def test_a_template_over_the_cap_is_refused_naming_its_source(tmp_path):
    source = over_cap_template()
    cap = f"{len(source)} characters, over step35's cap of {TEMPLATE_MAX_CHARS} for a chat template"
    (tmp_path / "chat_template.jinja").write_text(source)
    with pytest.raises(ChatTemplateError, match=re.escape(f"{tmp_path / 'chat_template.jinja'}: {cap}")):
        ChatTemplate.from_folder(tmp_path)

    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with pytest.raises(ChatTemplateError, match=re.escape(f"{tmp_path / 'tokenizer_config.json'} (its chat_template")):
        ChatTemplate.from_folder(tmp_path)

    override = tmp_path / "override.jinja"
    override.write_text(source)
    with pytest.raises(ChatTemplateError, match=re.escape(f"data.chat_template: chat template from {override}: {cap}")):
        resolve_template(tmp_path, str(override))


def test_a_template_at_the_cap_is_accepted():
    source = "{{ messages[0].content }}"
    source += "{# " + "c" * (TEMPLATE_MAX_CHARS - len(source) - 6) + " #}"
    assert len(source) == TEMPLATE_MAX_CHARS
    assert ChatTemplate(source, "big.jinja").render(CONVERSATION) == "Hi"


# ---------------------------------------------------------------------------- item 2: deeply nested JSON

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raised RecursionError: the run ended naming no record
GOOD = {
    "text": {"text": " ".join(f"w{k}" for k in range(20))},
    "chat": {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"}]},
    "prompt_completion": {"prompt": "w1", "completion": "w2 w3"},
    "preference": {"prompt": "w1", "chosen": "w2", "rejected": "w3"},
}
DEEP_FIELD = {"text": "text", "chat": "messages", "prompt_completion": "completion", "preference": "chosen"}


def source_of(path: Path, format: str) -> FileSource:
    source = FileSource("s", [path], shuffle=False, whole_records=format != "text")
    source.format = format
    return source


def stream(path: Path, format: str, tok, template, strict: bool) -> TokenWindows:
    return TokenWindows([source_of(path, format)], tok, seq_len=30, endless=False, template=template, strict=strict)


def skipped_reports(windows: TokenWindows) -> tuple[list[str], int, int]:
    """(the bad-record reports, the windows made, the skipped count) of reading `windows` to its end."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = len(list(windows))
    reports = [str(w.message) for w in caught if issubclass(w.category, BadRecordWarning)]
    return reports, made, windows.state_dict()["sources"][0]["skipped"]


@pytest.mark.parametrize("format", list(GOOD))
@pytest.mark.parametrize("line", ["top", "field"])
def test_a_deeply_nested_json_line_is_a_bad_record_in_every_format(tmp_path, tok, template, format, line):
    deep = DEEP if line == "top" else '{"' + DEEP_FIELD[format] + '": ' + DEEP + "}"
    good = json.dumps(GOOD[format]) + "\n"
    clean = tmp_path / "clean.jsonl"
    clean.write_text(good * 2)
    path = tmp_path / "deep.jsonl"
    path.write_text(good + deep + "\n" + good)

    reports, made, skipped = skipped_reports(stream(path, format, tok, template, strict=False))
    assert (made, skipped) == (len(list(stream(clean, format, tok, template, strict=True))), 1)
    limit = sys.getrecursionlimit()
    assert reports == [f"skipping bad record at {path}:2: JSON nested too deeply (past Python's recursion limit of"
                       f" {limit} levels)"]  # fmt: skip
    with pytest.raises(BadRecordError, match=rf"^bad record at {re.escape(str(path))}:2: JSON nested too deeply"):
        list(stream(path, format, tok, template, strict=True))


def test_a_deeply_nested_whole_json_file_is_a_bad_record_named_by_the_file(tmp_path, tok):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    good = tmp_path / "good.json"
    good.write_text(json.dumps([GOOD["text"]] * 3))
    source = FileSource("s", [deep, good], shuffle=False)
    bad = BadRecords("s", strict=False)
    with pytest.warns(BadRecordWarning, match=rf"^skipping bad record at {re.escape(str(deep))}: JSON nested too"):
        texts = [text for _, _, text in source.documents(Cursor(), 0, 1, bad, False)]
    assert (texts, bad.count) == ([GOOD["text"]["text"]] * 3, 1)
    with pytest.raises(BadRecordError, match=rf"^bad record at {re.escape(str(deep))}: JSON nested too deeply"):
        list(source.documents(Cursor(), 0, 1, BadRecords("s", strict=True), False))


def test_deep_json_in_a_parquet_string_column_is_a_bad_record(tmp_path, tok, template):
    """Tool-call arguments given as a JSON string are parsed (chat_messages._parsed_arguments)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    call = {"type": "function", "function": {"name": "f", "arguments": DEEP}}
    deep = {"messages": [{"role": "user", "content": "w1"},
                         {"role": "assistant", "content": "w2", "tool_calls": [call]}]}  # fmt: skip
    good = {"messages": [*GOOD["chat"]["messages"][:1], {**GOOD["chat"]["messages"][1], "tool_calls": None}]}
    path = tmp_path / "deep.parquet"
    pq.write_table(pa.Table.from_pylist([good, deep, good]), path)

    reports, made, skipped = skipped_reports(stream(path, "chat", tok, template, strict=False))
    assert (made, skipped) == (1, 1)
    assert len(reports) == 1 and reports[0].startswith(f"skipping bad record at {path}: row 1: ")
    assert "nested too deeply" in reports[0]
    with pytest.raises(BadRecordError, match=rf"^bad record at {re.escape(str(path))}: row 1: .*nested too deeply"):
        list(stream(path, "chat", tok, template, strict=True))


def test_a_walk_too_deep_over_a_parsed_record_is_a_bad_record(tmp_path):
    """A value that parses may still be too deep for what walks it next (comparing replies, rendering): the
    RecursionError of reading a record is that record's, named by file:line."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}])

    def walk(record):
        if record.index == 1:
            raise RecursionError("maximum recursion depth exceeded in comparison")
        return record.text()

    source = FileSource("s", [path], shuffle=False)
    bad = BadRecords("s", strict=False)
    with pytest.warns(BadRecordWarning, match=rf"at {re.escape(str(path))}:2: the record nested too deeply"):
        texts = [text for _, _, text in source.documents(Cursor(), 0, 1, bad, False, read=walk)]
    assert (texts, bad.count) == (["a"], 1)


def test_the_checks_before_training_pass_over_a_deep_first_record(tmp_path, tok_dir):
    """Format detection and the text-field check read the first records before training: a deep one among them
    is passed over as any bad record, instead of a RecursionError at setup."""
    path = tmp_path / "c.jsonl"
    path.write_text(DEEP + "\n" + "".join(json.dumps(GOOD["chat"]) + "\n" for _ in range(20)))
    dm = Step35DataModule(files=str(path), tokenizer=str(tok_dir), seq_len=12, val_batches=0)
    dm.setup("fit")
    assert [s.format for s in dm._train_sources] == ["chat"]
    with pytest.warns(BadRecordWarning, match=rf"at {re.escape(str(path))}:1: JSON nested too deeply"):
        assert next(iter(dm.train_dataloader()))["labels"].shape[1] == 12
    dm.teardown("fit")


# ---------------------------------------------------------------------------- item 3: long identical DPO pairs

LONG = " ".join(f"w{k % 40}" for k in range(60))  # 60 tokens: longer than the window of 31 on its own


def conversational(record: dict) -> dict:
    return {"prompt": [{"role": "user", "content": record["prompt"]}],
            **{side: [{"role": "assistant", "content": record[side]}] for side in ("chosen", "rejected")}}  # fmt: skip


PAIRS = {
    "identical and short": (
        {"prompt": "w1", "chosen": "w2 w3", "rejected": "w2 w3"},
        "'chosen' and 'rejected' are the same",
    ),
    "identical": ({"prompt": "w1", "chosen": LONG, "rejected": LONG}, "'chosen' and 'rejected' are the same"),
    "beyond the window": (
        {"prompt": "w1", "chosen": LONG + " w41", "rejected": LONG + " w42"},
        "'chosen' and 'rejected' differ only past the window: cut to fit the window of 31 tokens, they are the same"
        " tokens",
    ),
}


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("shape", ["standard", "conversational"])
def test_a_long_pair_the_same_within_the_window_is_a_bad_record(tmp_path, tok, template, kind, shape):
    """Identical replies longer than the window, or replies that differ only past it, trained as zero-margin
    pairs even under data.strict: the identity was only checked on pairs that fit."""
    record, why = PAIRS[kind]
    record = record if shape == "standard" else conversational(record)
    good = {"prompt": "w1", "chosen": "w2 w3", "rejected": "w4"}
    path = write_jsonl(tmp_path / "p.jsonl", [good, record, good])

    windows = stream(path, "preference", tok, template, strict=False)
    reports, made, skipped = skipped_reports(windows)
    assert (made, skipped, windows.state_dict()["sources"][0]["truncated"]) == (1, 1, 0)
    assert len(reports) == 1 and reports[0].startswith(f"skipping bad record at {path}:2: {why}"), reports
    with pytest.raises(BadRecordError, match=rf"^bad record at {re.escape(str(path))}:2: {re.escape(why)}"):
        list(stream(path, "preference", tok, template, strict=True))


@pytest.mark.parametrize("shape", ["standard", "conversational"])
def test_a_long_pair_that_differs_within_the_window_still_trains(tmp_path, tok, template, shape):
    record = {"prompt": "w1", "chosen": "w41 " + LONG, "rejected": "w42 " + LONG}
    path = write_jsonl(tmp_path / "p.jsonl", [record if shape == "standard" else conversational(record)])
    windows = stream(path, "preference", tok, template, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(windows)
    assert len(got) == 1 and windows.state_dict()["sources"][0]["truncated"] == 1
    tokens, labels = got[0]["input_ids"].tolist(), got[0]["labels"].tolist()
    assert tok.encode("w41")[0] in labels and tok.encode("w42")[0] in labels  # each reply's first token trained
    assert len(tokens) == 31


@pytest.mark.timeout(300)
def test_fit_refuses_an_over_cap_template_in_one_line(tmp_path, step35_here):
    template = tmp_path / "huge.jinja"
    template.write_text(over_cap_template())
    code, out, err = step35_here(
        "fit", "--config", "configs/tiny.yaml", f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=1",
        f"--data.chat_template={template}", "--data.format=chat",
    )  # fmt: skip
    assert code != 0
    refusal = f"step35: data.chat_template: chat template from {template}: {len(template.read_text())} characters"
    assert refusal in err.splitlines()[-1] and "Traceback" not in err, err[-3000:]
