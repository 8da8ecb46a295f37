"""Prompt records (`format: prompt`, the data side of online RL): records to the start token and the prompt's
ids (a text tokenized, messages rendered with the generation prompt), the GRPO batch contract (`prompt`,
`prompt_record`), overlong prompts, bad records, the record bytes, exact resume, detection, the holdout, the
mixing refusal, the built-in verifiable task.

A word-level tokenizer makes every token traceable: the template below renders `tool <names>` for the tools,
`<role> <words>` per turn, `assistant <words> <eos>` for an assistant turn and `assistant` as the generation
prompt, so the expected ids are written down here with CHAT_IDS, without the template.
"""

import copy
import json
import logging
import re
import warnings

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from step35.data import Step35DataModule
from step35.data.bad_records import BadRecordError, OverlongWarning
from step35.data.builtin_chat import builtin_conversations
from step35.data.chat_template import ChatTemplate
from step35.data.formats import detect_format, format_of_fields
from step35.data.prompts import PROMPT_KEYS, PROMPT_RECORD_BYTES, builtin_prompt_records, decode_prompt_records
from step35.data.sources import FileSource
from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer
from tests.helpers import CHAT_IDS, CHAT_WORD_TEMPLATE, CHAT_WORDS, WORD_EOS, write_jsonl
from tests.helpers.tokenizers import word_tokenizer_folder

E = WORD_EOS
KEYS = {"input_ids", "labels", "position_ids", *PROMPT_KEYS}
TEMPLATE = (
    "{% if tools %}tool {% for t in tools %}{{ t.name }} {% endfor %}{% endif %}"
    + CHAT_WORD_TEMPLATE
    + "{% if add_generation_prompt %}assistant {% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return word_tokenizer_folder(tmp_path_factory.mktemp("prompt_tokenizer"), CHAT_WORDS, TEMPLATE)


@pytest.fixture(scope="module")
def tok(folder):
    return TextTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def template(folder):
    return ChatTemplate.from_folder(folder)


def ids(text: str) -> list[int]:
    return [CHAT_IDS[w] for w in text.split()]


def prompt_source(files, name: str = "p", **kwargs) -> FileSource:
    source = FileSource(name, files, whole_records=True, **kwargs)
    source.format = "prompt"
    return source


def stream_of(path, window: int, tok, **kwargs) -> TokenWindows:
    return TokenWindows([prompt_source([path], shuffle=False)], tok, seq_len=window - 1, endless=False, **kwargs)


def expected_row(prompt_ids: list[int], window: int) -> dict:
    """One row of the contract written out: ids then EOS padding, no label, positions 0.., the count."""
    return {
        "input_ids": prompt_ids + [E] * (window - len(prompt_ids)),
        "labels": [-100] * (window - 1),
        "position_ids": list(range(window - 1)),
        "prompt": len(prompt_ids),
    }


def as_row(item: dict) -> dict:
    return {key: item[key].tolist() for key in ("input_ids", "labels", "position_ids", "prompt")}


def read_all(stream) -> tuple[list[dict], list[dict], list[str]]:
    """(rows, the records they carry, the warnings) of a finite stream."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(stream)
    records = [decode_prompt_records({"prompt_record": item["prompt_record"][None]})[0] for item in items]
    return [as_row(item) for item in items], records, [f"{w.category.__name__}: {w.message}" for w in caught]


# -- the batch contract ------------------------------------------------------------------------------------------


def test_text_and_message_prompts_are_the_start_token_and_the_rendered_generation_prompt(tmp_path, tok, template):
    tools = [{"name": "w40", "parameters": {"type": "object"}}, {"name": "w41"}]
    records = [
        {"prompt": "c1 w2 w3", "answer": "w3"},
        {"prompt": [{"role": "system", "content": "c4"}, {"role": "user", "content": "c5 w6"}], "id": 7},
        {"prompt": [{"role": "user", "content": "c8"}], "tools": tools},
        {"prompt": [{"role": "user", "content": "c9"}, {"role": "assistant", "content": "w1"},
                    {"role": "tool", "content": "w2"}], "meta": {"k": [1, None, True]}},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "p.jsonl", records)
    window = 12
    rows, carried, reports = read_all(stream_of(path, window, tok, template=template))
    A, S, U, T = (CHAT_IDS[w] for w in ("assistant", "system", "user", "tool"))
    expected = [
        [E, *ids("c1 w2 w3")],  # the start token (this tokenizer has no BOS: the EOS), then the text
        [E, S, CHAT_IDS["c4"], U, *ids("c5 w6"), A],
        [E, T, *ids("w40 w41"), U, CHAT_IDS["c8"], A],  # the tools reach the template
        [E, U, CHAT_IDS["c9"], A, CHAT_IDS["w1"], E, T, CHAT_IDS["w2"], A],  # a tool result asks for the reply
    ]
    assert rows == [expected_row(e, window) for e in expected]
    assert carried == records and reports == []
    # Rendering by hand, as inference would: the template's text with the generation prompt, tokenized.
    for record, row in zip(records[1:], rows[1:]):
        text = template.render(
            record["prompt"], add_generation_prompt=True, tools=record.get("tools"), eos_token="<eos>"
        )
        assert row["input_ids"][: row["prompt"]] == [E, *tok.encode(text)]
    # Batched, the tensors of the contract with their dtypes and shapes.
    batch = next(iter(StatefulDataLoader(stream_of(path, window, tok, template=template), batch_size=4)))
    assert batch.keys() == KEYS
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in batch.items()}
    assert shapes == {"input_ids": ((4, 12), torch.int64), "labels": ((4, 11), torch.int64),
                      "position_ids": ((4, 11), torch.int64), "prompt": ((4,), torch.int64),
                      "prompt_record": ((4, PROMPT_RECORD_BYTES), torch.uint8)}  # fmt: skip
    assert batch["prompt"].tolist() == [4, 7, 7, 9] and decode_prompt_records(batch) == records
    # train_on and train_reasoning change nothing: nothing is trained.
    same = stream_of(path, window, tok, template=template, train_on="all", train_reasoning=False)
    assert read_all(same)[0] == rows


def test_the_bos_starts_a_prompt_once_even_when_the_template_writes_it(tmp_path):
    folder = word_tokenizer_folder(tmp_path / "bos", CHAT_WORDS, "{{ bos_token }} " + TEMPLATE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "c399"}))
    tok, B = TextTokenizer.from_folder(folder), CHAT_IDS["c399"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1"}, {"prompt": [{"role": "user", "content": "w2"}]}])
    U, A = CHAT_IDS["user"], CHAT_IDS["assistant"]
    writes_bos, plain = ChatTemplate.from_folder(folder), ChatTemplate(TEMPLATE, "plain")
    user = [{"role": "user", "content": "w2"}]
    assert writes_bos.prompt_ids(tok, user) == [B, U, CHAT_IDS["w2"], A] and plain.prompt_ids(tok, user)[0] == U
    for template in (writes_bos, plain):
        rows, _, _ = read_all(stream_of(path, 6, tok, template=template))
        assert [r["input_ids"][: r["prompt"]] for r in rows] == [[B, CHAT_IDS["w1"]], [B, U, CHAT_IDS["w2"], A]]


# -- overlong prompts, bad records, the record's bytes -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_overlong_prompts_are_dropped_and_counted_whatever_data_overlong_says(tmp_path, tok, mode):
    lengths = [3, 8, 9, 2, 20, 7]  # with the start token: 4, 9, 10, 3, 21, 8 tokens; a window holds 8
    records = [{"prompt": " ".join(f"w{k}" for k in range(n)), "n": n} for n in lengths]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    stream = stream_of(path, 8, tok, overlong=mode)
    rows, carried, reports = read_all(stream)
    assert [r["prompt"] for r in rows] == [4, 3, 8] and [r["n"] for r in carried] == [3, 2, 7]
    state = stream.state_dict()["sources"][0]
    assert (state["truncated"], state["dropped"], state["skipped"]) == (0, 3, 0)
    assert reports == [
        f"OverlongWarning: dropping the prompt at {path}:{line}: {size} tokens, a window holds 8; a prompt is never"
        " cut (raise data.seq_len)"
        for line, size in [(2, 9), (3, 10), (5, 21)]
    ]


BAD = [
    ({"question": "w1"}, "no 'prompt' field (fields: ['question'])"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": "   "}, "'prompt' is empty"),
    ({"prompt": 7}, "'prompt' is int; a prompt is a non-empty string or a non-empty list of messages"),
    ({"prompt": []}, "'prompt' is []; a prompt is a non-empty string"),
    ({"prompt": {"role": "user", "content": "w1"}}, "'prompt' is dict"),
    ({"prompt": [{"role": "robot", "content": "w1"}]}, "unknown role 'robot'"),
    ({"prompt": [{"role": "user"}]}, "message 0 (user) has no 'content'"),
    ({"prompt": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
     "the prompt's last message is the assistant's; a prompt asks for the assistant's reply"),
    ({"prompt": "w1", "pad": "x" * PROMPT_RECORD_BYTES}, f"bytes as JSON, over the limit of {PROMPT_RECORD_BYTES}"),
]  # fmt: skip


def test_each_bad_record_is_skipped_with_its_line_or_refused_when_strict(tmp_path, tok, template):
    good = [{"prompt": f"c{i} w{i}"} for i in range(1, 5)]
    path = write_jsonl(tmp_path / "p.jsonl", good[:2] + [record for record, _ in BAD] + good[2:])
    lenient = stream_of(path, 10, tok, template=template)
    rows, carried, reports = read_all(lenient)
    assert carried == good and lenient.state_dict()["sources"][0]["skipped"] == len(BAD)
    bad_reports = [r for r in reports if r.startswith("BadRecordWarning")]
    assert len(bad_reports) == len(reports) == len(BAD)
    for k, (_, why) in enumerate(BAD):
        head = f"BadRecordWarning: skipping bad record at {path}:{3 + k}: "
        assert bad_reports[k].startswith(head) and why in bad_reports[k], bad_reports[k]
    for k, (record, why) in enumerate(BAD):
        alone = write_jsonl(tmp_path / f"bad{k}.jsonl", [good[0], record])
        with pytest.raises(BadRecordError, match=rf"bad record at {re.escape(str(alone))}:2: .*{re.escape(why[:14])}"):
            list(stream_of(alone, 10, tok, template=template, strict=True))
    # A message prompt without a chat template stops the run (not a bad record), naming the record and the fix.
    chat = write_jsonl(tmp_path / "chat.jsonl", [good[0], {"prompt": [{"role": "user", "content": "w1"}]}])
    with pytest.raises(ValueError, match=rf"{re.escape(str(chat))}:2: a conversation, and no template here"):
        list(stream_of(chat, 10, tok, template_missing="no template here"))


def test_the_record_bytes_round_trip_every_field_up_to_the_limit(tmp_path, tok, template):
    unicode = {"prompt": [{"role": "user", "content": "c1 w1"}], "answer": "é 中文 🙂 \u0000 \"q\" \\",
               "nested": {"list": [1, 2.5, -3, None, True, False], "empty": {}}, "n": 10**18}  # fmt: skip

    def sized(size: int) -> dict:
        """A record whose compact UTF-8 JSON takes exactly `size` bytes (é takes two)."""
        base = len(json.dumps({"prompt": "w1", "pad": ""}, separators=(",", ":")).encode())
        return {"prompt": "w1", "pad": "é" * ((size - base) // 2) + "x" * ((size - base) % 2)}

    exact, over = sized(PROMPT_RECORD_BYTES), sized(PROMPT_RECORD_BYTES + 1)
    path = write_jsonl(tmp_path / "p.jsonl", [unicode, exact, over])
    stream = stream_of(path, 8, tok, template=template)
    items = list(StatefulDataLoader(stream, batch_size=2))
    assert decode_prompt_records(items[0]) == [unicode, exact]
    rows = items[0]["prompt_record"]
    written = json.dumps(unicode, ensure_ascii=False, separators=(",", ":")).encode()
    assert bytes(rows[0, : len(written)].tolist()) == written and rows[0, len(written) :].eq(0).all()
    assert rows[1].ne(0).all()  # the exact fit fills its row: no 0 byte ends it
    assert stream.state_dict()["sources"][0]["skipped"] == 1  # the one byte over
    with pytest.raises(ValueError, match="prompt_record must be uint8"):
        decode_prompt_records({"prompt_record": rows.long()})


# -- resume, detection, the datamodule, the built-in task --------------------------------------------------------


def test_exact_resume_of_the_datamodule_mid_epoch_and_across_epochs(tmp_path, folder):
    records = [{"prompt": f"c{i} " + " ".join(["w1"] * (i % 7)), "i": i} for i in range(30)]
    records[4]["prompt"] = " ".join(["w2"] * 30)  # overlong: dropped, and counted across the resume
    messages = [{"prompt": [{"role": "user", "content": f"c{100 + i}"}], "i": 100 + i} for i in range(20)]
    files = [write_jsonl(tmp_path / "a.jsonl", records), write_jsonl(tmp_path / "b.jsonl", messages)]

    def datamodule() -> Step35DataModule:
        dm = Step35DataModule(files=[str(f) for f in files], tokenizer=str(folder), seq_len=12, micro_batch_size=3,
                              num_workers=2, val_batches=0, seed=4)  # fmt: skip
        dm.setup("fit")
        return dm

    def take(dm: Step35DataModule, n: int) -> list[dict]:
        got = []
        for batch in dm.train_dataloader():
            got.append(batch)
            if len(got) == n:
                return got
        raise AssertionError("the stream ended")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlongWarning)
        first = datamodule()
        reference = take(first, 24)  # 49 prompts an epoch over 2 workers: past the first epoch
        first.teardown("fit")
        saved = {}
        for k in (5, 17):
            dm = datamodule()
            take(dm, k)
            saved[k] = copy.deepcopy(dm.state_dict())
            dm.teardown("fit")
        for k, state in saved.items():
            dm = datamodule()
            dm.load_state_dict(state)
            replay = take(dm, 24 - k)
            for i, (a, b) in enumerate(zip(replay, reference[k:])):
                assert a.keys() == b.keys() == KEYS
                assert all(torch.equal(a[key], b[key]) for key in a), f"state after batch {k}: batch {k + i} differs"
            assert dm.overlong_records["dropped"][dm._train_sources[0].name] >= 1
            dm.teardown("fit")
    seen = [r["i"] for batch in reference for r in decode_prompt_records(batch)]  # 72 of 49 prompts: epochs 1, 2
    assert {i: seen.count(i) for i in seen}.keys() == {r["i"] for r in records + messages} - {4}
    assert {seen.count(i) for i in seen} == {1, 2}


def test_auto_detection_picks_prompt_records_and_keeps_the_other_formats(tmp_path, folder, caplog):
    cases = [
        ({"prompt": "w1"}, "prompt"),
        ({"prompt": [{"role": "user", "content": "w1"}], "answer": "w2", "tools": []}, "prompt"),
        ({"prompt": "w1", "completion": "w2"}, "prompt_completion"),
        ({"prompt": "w1", "completion": "w2", "label": True}, "unpaired"),
        ({"prompt": "w1", "chosen": "w2", "rejected": "w3"}, "preference"),
        ({"chosen": "w2", "rejected": "w3"}, "preference"),
        ({"messages": [], "prompt": "w1"}, "chat"),
        ({"prompt": "w1", "text": "w2"}, "text"),  # the text field: text, as before prompt records
        ({"prompt": "w1", "label": True}, None),  # an unpaired record without its completion: not a prompt record
        ({"prompt": "w1", "chosen": "w2"}, None),
    ]
    for k, (record, expected) in enumerate(cases):
        found = format_of_fields(record, "text")
        assert (found and found[0]) == expected, record
        detected = detect_format([write_jsonl(tmp_path / f"d{k}.jsonl", [record] * 3)], "text")[0]
        assert detected == (expected or "text"), record
    assert format_of_fields({"prompt": "w1"}, "prompt")[0] == "text"  # text_field: prompt trains the prompts as text
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["c1 w1", "c2"], "answer": ["w1", "w2"]}), tmp_path / "p.parquet")
    caplog.set_level(logging.INFO)
    dm = Step35DataModule(sources=[{"path": str(tmp_path / "d0.jsonl"), "name": "jsonl"},
                                   {"path": str(tmp_path / "p.parquet")}],
                          tokenizer=str(folder), seq_len=6, micro_batch_size=2, val_batches=0)  # fmt: skip
    dm.setup("fit")
    assert [s.format for s in dm._train_sources] == ["prompt", "prompt"] and dm.batch_keys == PROMPT_KEYS
    assert "source 'jsonl': format prompt (records have 'prompt')" in caplog.text
    assert "format prompt (columns include 'prompt')" in caplog.text
    batch = next(iter(dm.train_dataloader()))
    assert batch.keys() == KEYS and all(r.keys() <= {"prompt", "answer"} for r in decode_prompt_records(batch))
    dm.teardown("fit")


def test_the_holdout_validates_prompts_and_mixing_with_other_formats_is_refused(tmp_path, folder):
    records = [{"prompt": f"c{i}", "i": i} for i in range(200)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    dm = Step35DataModule(
        files=str(path),
        tokenizer=str(folder),
        seq_len=6,
        micro_batch_size=4,
        val_fraction=0.2,
        val_batches=3,
        train_on="all",
    )  # fmt: skip  (train_on: not refused, nothing is trained)
    dm.setup("fit")
    val = list(dm.val_dataloader())
    assert len(val) == 3 and all(b.keys() == KEYS and b["prompt_record"].shape == (4, PROMPT_RECORD_BYTES) for b in val)
    held = {r["i"] for b in val for r in decode_prompt_records(b)}
    trained = {r["i"] for _, b in zip(range(20), dm.train_dataloader()) for r in decode_prompt_records(b)}
    assert len(held) == 12 and len(trained) == 80 and not held & trained  # the holdout is no training prompt
    dm.teardown("fit")

    write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"c{i}", "completion": "w1"} for i in range(20)])
    write_jsonl(tmp_path / "t.jsonl", [{"text": f"c{i} w1"} for i in range(20)])
    for other, kind in [("c.jsonl", "prompt_completion"), ("t.jsonl", "text")]:
        mixed = Step35DataModule(sources=[{"path": str(path), "name": "rl"}, {"path": str(tmp_path / other)}],
                                 tokenizer=str(folder), val_batches=0)  # fmt: skip
        with pytest.raises(ValueError, match=rf"prompt source\(s\) \['rl'\] cannot be mixed with the {kind} source\(s\)"
                                             r" .*prompt records train --model.objective grpo"):  # fmt: skip
            mixed.setup("fit")


def test_the_builtin_task_asks_each_subject_once_with_a_regex_for_its_key_word(builtin_cache):
    records = builtin_prompt_records()
    assert records == builtin_prompt_records()  # deterministic
    # Independently: the subjects of the first question of each conversation, in order, once each.
    firsts = [next(m["content"] for m in c["messages"] if m["role"] == "user") for c in builtin_conversations()]
    subjects = [re.sub(r"^(What does the documentation say about |What is |In one sentence: |Tell me about )", "", q)
                for q in firsts]  # fmt: skip
    subjects = list(dict.fromkeys(re.sub(r"( for)?[?.]$", "", s) for s in subjects))
    assert [r["subject"] for r in records] == subjects and len(records) > 140
    by_answer = {r["answer"]: r for r in records}
    assert by_answer["fnmatch"]["answer_regex"] == r"(?is).*\bfnmatch\b.*" and by_answer["fnmatch"]["prompt"] == [
        {"role": "user", "content": "What is the fnmatch module for?"}
    ]
    assert by_answer['The "for" statement']["answer_regex"] == r"(?is).*\bfor\b.*"
    assert re.fullmatch(by_answer["fnmatch"]["answer_regex"], "It matches Unix shell patterns:\nFNMATCH does.")
    assert not re.fullmatch(by_answer["fnmatch"]["answer_regex"], "fnmatches glob patterns")  # a whole word only
    matches_another = 0
    for record in records:
        regex = re.compile(record["answer_regex"])
        assert regex.fullmatch(record["answer"]) and regex.fullmatch(record["subject"]), record
        assert record["prompt"][-1]["role"] == "user" and record.keys() == {
            "prompt",
            "answer",
            "answer_regex",
            "subject",
        }
        matches_another += any(regex.fullmatch(r["answer"]) for r in records if r is not record)
    assert matches_another < len(records) // 8  # key words tell subjects apart (a few topics share one)
    assert not re.fullmatch(by_answer["fnmatch"]["answer_regex"], 'The "for" statement')

    dm = Step35DataModule(format="prompt", seq_len=64, micro_batch_size=2, cache_dir=str(builtin_cache), val_batches=1)
    dm.prepare_data()
    dm.setup("fit")
    assert dm._train_sources[0].name == "builtin-prompt" and dm.batch_keys == PROMPT_KEYS
    assert [json.loads(line) for line in open(dm._train_sources[0].parts[0].path)] == records
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a small holdout is read again to fill validation
        val = list(dm.val_dataloader())
    batch = next(iter(dm.train_dataloader()))
    for b in [batch, *val]:
        assert b.keys() == KEYS and all(r in records for r in decode_prompt_records(b))
    dm.teardown("fit")
