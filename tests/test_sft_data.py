"""Conversation and prompt/completion sources: format detection, packing whole examples without cross-talk,
labels and positions, overlong examples, bad records, exact resume with workers and ranks, validation.

A word-level tokenizer and a word-level chat template make every token traceable: a conversation renders as
`<role> <words>` per turn, an assistant turn as `assistant <words> <eos>` with the words and the EOS trained,
so the expected tokens and trained flags of a record are written down here without the template.
"""

import copy
import json
import logging
import pickle
import random
import warnings
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from step35.data import Step35DataModule
from step35.data.bad_records import BadRecordError, BadRecordWarning, OverlongWarning
from step35.data.chat_template import ChatTemplate
from step35.data.sources import FileSource
from step35.data.stream import TokenWindows
from tests.helpers import CHAT_IDS, CHAT_WORD_TEMPLATE, WORD_EOS, chat_source, make_chat_tokenizer, write_jsonl

IGNORE = -100


def conversation(i: int, rng: random.Random, turns: int = 2, words: tuple[int, int] = (1, 6)) -> list[dict]:
    """Conversation `i`: its first word is c<i>, so a window's tokens name their conversation."""
    messages = [{"role": "system", "content": f"c{i}"}] if rng.random() < 0.5 else []
    for t in range(turns):
        for role in ("user", "assistant"):
            said = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(*words)))
            messages.append({"role": role, "content": said if messages else f"c{i} {said}"})
        if rng.random() < 0.3 and t < turns - 1:
            messages.append({"role": "tool", "content": f"w{rng.randrange(50)}"})
    return messages


def expected_example(messages: list[dict], train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """The tokens and trained flags of a conversation under CHAT_WORD_TEMPLATE, written down directly."""
    ids, trained = [], []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        words = [CHAT_IDS[w] for w in m["content"].split()]
        if m["role"] == "assistant":
            on = train_on == "all" or train_on == "assistant" or i == last
            ids += [CHAT_IDS["assistant"], *words, WORD_EOS]
            trained += [train_on == "all", *[on] * (len(words) + 1)]
        else:
            ids += [CHAT_IDS[m["role"]], *words]
            trained += [train_on == "all"] * (len(words) + 1)
    return ids, trained


def expected_windows(examples: list[tuple[list[int], list[bool]]], window: int) -> list[dict[str, list[int]]]:
    """Greedy packing written out: whole examples per window, padding (EOS) where the next does not fit, labels
    only inside an example, positions counted from each example's start (and from the padding's start)."""
    out, current = [], []

    def close():
        tokens, labels, positions = [], [], []
        for ids, trained in current:
            tokens += ids
            labels += [ids[k] if trained[k] else IGNORE for k in range(1, len(ids))] + [IGNORE]
            positions += list(range(len(ids)))
        pad = window - len(tokens)
        tokens += [WORD_EOS] * pad
        labels += [IGNORE] * pad
        positions += list(range(pad))
        out.append({"input_ids": tokens, "labels": labels[: window - 1], "position_ids": positions[: window - 1]})

    for example in examples:
        if sum(len(ids) for ids, _ in current) + len(example[0]) > window:
            close()
            current = []
        current.append(example)
    if current:
        close()
    return out


def as_lists(item: dict) -> dict[str, list[int]]:
    return {key: value.tolist() for key, value in item.items()}


# -- detection ---------------------------------------------------------------------------------------------


def test_each_source_format_is_detected_and_said(tmp_path, tok_dir, caplog):
    rng = random.Random(0)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i, rng)} for i in range(20)])
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "user w1", "completion": f"w{i}"} for i in range(20)])
    write_jsonl(tmp_path / "text.jsonl", [{"text": f"w{i} w2"} for i in range(20)])
    sources = [{"path": str(tmp_path / n), "name": n} for n in ("chat.jsonl", "pairs.jsonl", "text.jsonl")]
    sources.append({"path": str(tmp_path / "pairs.jsonl"), "name": "stated", "format": "text", "text_field": "prompt"})
    caplog.set_level(logging.INFO)
    dm = Step35DataModule(sources=sources, tokenizer=str(tok_dir), seq_len=16, micro_batch_size=2, val_batches=0)
    dm.setup("fit")
    assert [s.format for s in dm._train_sources] == ["chat", "prompt_completion", "text", "text"]
    assert "source 'chat.jsonl': format chat (records have 'messages')" in caplog.text
    assert "source 'pairs.jsonl': format prompt_completion (records have 'prompt' and 'completion')" in caplog.text
    assert "source 'text.jsonl': format text (records have the text field 'text')" in caplog.text
    assert "source 'stated': format text (as asked)" in caplog.text
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 17) and batch["labels"].shape == batch["position_ids"].shape == (2, 16)
    dm.teardown("fit")


def test_a_stated_format_the_files_cannot_hold_is_refused_by_name(tmp_path, tok_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("w1 w2\n")
    pq.write_table(pa.table({"text": ["w1"]}), tmp_path / "t.parquet")
    for path, fmt, message in [
        ("a.txt", "chat", r"a\.txt is plain text; a chat source reads json, parquet or arrow records"),
        ("t.parquet", "chat", r"t\.parquet: no column 'messages' \(columns: \['text'\]\)"),
        ("t.parquet", "prompt_completion", r"t\.parquet: a prompt_completion source needs columns 'prompt' and"),
    ]:
        dm = Step35DataModule(sources=[{"path": str(tmp_path / path), "format": fmt}], tokenizer=str(tok_dir),
                              val_batches=0)  # fmt: skip
        with pytest.raises(ValueError, match=message):
            dm.setup("fit")
    with pytest.raises(
        ValueError,
        match=r"format must be one of \('auto', 'text', 'chat', 'prompt_completion', 'preference', 'unpaired', 'prompt'\)",
    ):
        Step35DataModule(sources=[{"path": "x", "format": "sharegpt"}])
    with pytest.raises(
        ValueError, match=r"data: train_on='assistants'; expected one of assistant, last_assistant, all"
    ):
        Step35DataModule(train_on="assistants")
    with pytest.raises(ValueError, match="data: train_reasoning='no'; expected true or false"):
        Step35DataModule(train_reasoning="no")


def test_chat_template_kwargs_reach_every_conversation_and_a_misspelt_one_is_refused(tmp_path, tok_dir):
    """data.chat_template_kwargs are variables of every rendering: a template that opens with `system <effort>`
    when given one puts those two tokens before the first conversation, which follows unchanged; a name the
    template does not read is refused at setup naming the field; on plain text they are said to change nothing."""
    template = tmp_path / "effort.jinja"
    template.write_text("{% if effort is defined %}system {{ effort }} {% endif %}" + CHAT_WORD_TEMPLATE)
    rng = random.Random(0)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i, rng)} for i in range(8)])
    write_jsonl(tmp_path / "text.jsonl", [{"text": f"w{i} w2"} for i in range(8)])

    def first_window(name: str = "chat.jsonl", **options) -> list[int]:
        dm = Step35DataModule(sources=[{"path": str(tmp_path / name)}], tokenizer=str(tok_dir), seq_len=32,
                              micro_batch_size=1, val_batches=0, chat_template=str(template), **options)  # fmt: skip
        dm.setup("fit")
        try:
            return next(iter(dm.train_dataloader()))["input_ids"][0].tolist()
        finally:
            dm.teardown("fit")

    plain, effort = first_window(), first_window(chat_template_kwargs={"effort": "w7"})
    assert plain[:2] != effort[:2] == [CHAT_IDS["system"], CHAT_IDS["w7"]]
    assert effort[2:12] == plain[:10]  # the conversation itself (10 tokens at least) as without the variable
    with pytest.raises(ValueError, match=r"data\.chat_template_kwargs\.efort: the chat template from .*effort\.jinja"):
        first_window(chat_template_kwargs={"efort": "w7"})
    with pytest.warns(UserWarning, match=r"data.chat_template_kwargs \['effort'\]: no source holds conversations"):
        first_window("text.jsonl", chat_template_kwargs={"effort": "w7"})


# -- tokens, labels, positions -----------------------------------------------------------------------------


def test_prompt_completion_trains_the_completion_and_eos(tmp_path, tok):
    pairs = [{"prompt": "user w1 w2", "completion": "w3 w4"}, {"prompt": "w5", "completion": "w6"}]
    source = FileSource("pairs", [write_jsonl(tmp_path / "p.jsonl", pairs)], whole_records=True, shuffle=False)
    source.format = "prompt_completion"
    got = [as_lists(w) for w in TokenWindows([source], tok, seq_len=9, endless=False)]
    first = [CHAT_IDS["user"], CHAT_IDS["w1"], CHAT_IDS["w2"], CHAT_IDS["w3"], CHAT_IDS["w4"], WORD_EOS]
    second = [CHAT_IDS["w5"], CHAT_IDS["w6"], WORD_EOS]
    assert got == expected_windows([(first, [False] * 3 + [True] * 3), (second, [False, True, True])], 10)
    assert got[0]["labels"] == [
        -100,
        -100,
        CHAT_IDS["w3"],
        CHAT_IDS["w4"],
        WORD_EOS,
        -100,
        CHAT_IDS["w6"],
        WORD_EOS,
        -100,
    ]

    # Message lists on both sides: one conversation, rendered with the template.
    listed = [{"prompt": [{"role": "user", "content": "w1"}], "completion": [{"role": "assistant", "content": "w2"}]}]
    source = FileSource("pairs", [write_jsonl(tmp_path / "l.jsonl", listed)], whole_records=True)
    source.format = "prompt_completion"
    template = ChatTemplate.from_file(_word_template(tmp_path))
    got = [as_lists(w) for w in TokenWindows([source], tok, seq_len=5, endless=False, template=template)]
    assert got == expected_windows([expected_example(listed[0]["prompt"] + listed[0]["completion"])], 6)


def _word_template(folder: Path) -> Path:
    (folder / "word.jinja").write_text(CHAT_WORD_TEMPLATE)
    return folder / "word.jinja"


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_packed_windows_equal_a_direct_construction(tmp_path, tok, template, train_on):
    rng = random.Random(1)
    chats = [conversation(i, rng, turns=rng.randint(1, 3)) for i in range(60)]
    source = chat_source("chat", [write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in chats])], shuffle=False)
    window = 51
    stream = TokenWindows([source], tok, seq_len=window - 1, endless=False, template=template, train_on=train_on)
    got = [as_lists(w) for w in stream]
    examples = [expected_example(m, train_on) for m in chats]
    assert max(len(ids) for ids, _ in examples) <= window  # none overlong here
    assert got == expected_windows(examples, window)
    assert sum(len(ids) for ids, _ in examples) < len(got) * window  # padding happened: a real test of it

    # No label crosses a border: a label is only where the next token continues the same conversation.
    for w in got:
        positions = w["position_ids"] + [None]
        for i, label in enumerate(w["labels"]):
            if label != IGNORE and i + 1 < window - 1:
                assert positions[i + 1] == positions[i] + 1
            if i + 1 < window - 1 and positions[i + 1] == 0:
                assert label == IGNORE  # the last token of a conversation predicts nothing


def test_text_windows_in_a_stream_with_conversations_carry_the_same_keys(tmp_path, tok, template):
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(["w1"] * (3 + i % 5))}) + "\n" for i in range(30)))
    rng = random.Random(11)
    records = [{"messages": conversation(i, rng)} for i in range(9)]
    chats = chat_source("chat", [write_jsonl(tmp_path / "c.jsonl", records)])
    windows = list(TokenWindows([FileSource("text", [text]), chats], tok, seq_len=11, endless=False, template=template))
    text_windows = [
        w for w in windows if CHAT_IDS["w1"] in w["input_ids"].tolist() and CHAT_IDS["user"] not in w["input_ids"]
    ]
    assert text_windows and all(w.keys() == {"input_ids", "labels", "position_ids"} for w in windows)
    for w in text_windows:  # every next token a target; positions restart after each EOS
        ids = w["input_ids"].tolist()
        assert w["labels"].tolist() == ids[1:]
        expected, p = [], -1
        for i in range(11):
            p = 0 if i == 0 or ids[i - 1] == WORD_EOS else p + 1
            expected.append(p)
        assert w["position_ids"].tolist() == expected


# -- overlong conversations ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, tok, template, mode):
    rng = random.Random(2)
    chats = [conversation(i, rng) for i in range(12)]
    chats[3] = [{"role": "user", "content": "c3"}, {"role": "assistant", "content": " ".join(["w7"] * 40)}]
    chats[8] = [{"role": "user", "content": "c8 " + " ".join(["w8"] * 40)}, {"role": "assistant", "content": "w9"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in chats])
    window = 25
    stream = TokenWindows([chat_source("chat", [path], shuffle=False)], tok, seq_len=window - 1, endless=False,
                          template=template, overlong=mode)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [as_lists(w) for w in stream]
    messages = [str(w.message) for w in caught if issubclass(w.category, OverlongWarning)]
    examples = [expected_example(m) for m in chats]
    state = stream.state_dict()["sources"][0]
    if mode == "truncate":
        # Conversation 3 is cut to the window; conversation 8 would keep nothing trained: dropped, said so.
        cut = (examples[3][0][:window], examples[3][1][:window])
        assert got == expected_windows([*examples[:3], cut, *examples[4:8], *examples[9:]], window)
        assert (state["truncated"], state["dropped"]) == (1, 1)
        assert messages[0].startswith(f"truncating the conversation at {path}:4: 44 tokens, a window holds 25")
        assert messages[1].startswith(f"dropping the conversation at {path}:9: ")
        assert "nothing trained would be left" in messages[1]
    else:
        assert got == expected_windows([*examples[:3], *examples[4:8], *examples[9:]], window)
        assert (state["truncated"], state["dropped"]) == (0, 2)
        assert [m.split(":")[-2:] for m in messages] == [["4", " 44 tokens, a window holds 25"],
                                                         ["9", " 45 tokens, a window holds 25"]]  # fmt: skip


def test_an_endless_stream_that_drops_every_conversation_stops_with_an_error(tmp_path, tok, template):
    long = [{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 " * 30}]}] * 3
    source = chat_source("long", [write_jsonl(tmp_path / "c.jsonl", long)])
    stream = TokenWindows([source], tok, seq_len=9, template=template, overlong="drop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlongWarning)
        with pytest.raises(RuntimeError, match="source 'long': shard 0 of 1 dropped every conversation of a whole"):
            next(iter(stream))


# -- bad input ---------------------------------------------------------------------------------------------


BAD = [
    ({"text": "w1"}, "no 'messages' field"),
    (
        {"messages": [{"role": "robot", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
        "unknown role 'robot'",
    ),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "w1"}]}, "no assistant turn"),
    ({"messages": "w1 w2"}, "'messages' must be a list"),
]


def test_bad_conversations_are_skipped_and_counted_or_refused(tmp_path, tok, template):
    rng = random.Random(3)
    good = [{"messages": conversation(i, rng)} for i in range(6)]
    records = good[:3] + [record for record, _ in BAD] + good[3:]
    path = write_jsonl(tmp_path / "c.jsonl", records)

    def stream(strict: bool) -> TokenWindows:
        return TokenWindows([chat_source("chat", [path], shuffle=False)], tok, seq_len=30, endless=False,
                            template=template, strict=strict)  # fmt: skip

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lenient = stream(False)
        got = [as_lists(w) for w in lenient]
    reports = [str(w.message) for w in caught if issubclass(w.category, BadRecordWarning)]
    assert got == expected_windows([expected_example(r["messages"]) for r in good], 31)
    assert lenient.state_dict()["sources"][0]["skipped"] == len(BAD)
    for k, (_, why) in enumerate(BAD):
        assert reports[k].startswith(f"skipping bad record at {path}:{4 + k}: ") and why in reports[k], reports[k]

    with pytest.raises(BadRecordError, match=rf"bad record at {path}:4: no 'messages' field"):
        list(stream(True))

    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1"}, {"prompt": "w1", "completion": 3}])
    source = FileSource("pairs", [pairs], whole_records=True, shuffle=False)
    source.format = "prompt_completion"
    with pytest.raises(BadRecordError, match=rf"{pairs}:1: no 'completion' field"):
        list(TokenWindows([source], tok, seq_len=4, endless=False, strict=True))
    with pytest.warns(BadRecordWarning, match=rf"{pairs}:2: 'completion' is int; prompt and completion are both"):
        assert list(TokenWindows([source], tok, seq_len=4, endless=False)) == []


def test_a_template_that_fails_to_render_names_the_jinja_error_and_the_record(tmp_path, tok):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}")
    rng = random.Random(4)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i, rng)} for i in range(3)])
    stream = TokenWindows([chat_source("chat", [path], shuffle=False)], tok, seq_len=30, endless=False,
                          template=ChatTemplate.from_file(tmp_path / "t.jinja"), strict=True)  # fmt: skip
    with pytest.raises(BadRecordError, match=rf"bad record at {path}:1: .*no_such_filter"):
        list(stream)


def test_chat_data_needs_a_template(tmp_path):
    folder = make_chat_tokenizer(tmp_path / "plain_tokenizer")  # no chat template
    rng = random.Random(5)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i, rng)} for i in range(5)])
    dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), tokenizer=str(folder), seq_len=16, val_batches=0)
    with pytest.raises(ValueError, match=rf"tokenizer folder '{folder}' has no chat template.*data.chat_template"):
        dm.setup("fit")
    # data.chat_template supplies one.
    dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), tokenizer=str(folder), seq_len=16, val_batches=0,
                          chat_template=str(_word_template(tmp_path)))  # fmt: skip
    dm.setup("fit")
    assert dm._train_sources[0].format == "chat"


# -- files --------------------------------------------------------------------------------------------------


def test_jsonl_parquet_save_to_disk_and_hub_conversations_give_the_same_windows(tmp_path, tok, template):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rng = random.Random(6)
    records = [{"messages": conversation(i, rng), "id": i} for i in range(30)]
    write_jsonl(tmp_path / "c.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet", row_group_size=7)
    Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"), num_shards=1)
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "train.jsonl", records)  # a local dataset folder, streamed by `datasets`
    given = {"jsonl": {"path": str(tmp_path / "c.jsonl")}, "parquet": {"path": str(tmp_path / "c.parquet")},
             "saved": {"path": str(tmp_path / "saved")}, "hub": {"hub": str(tmp_path / "hub")}}  # fmt: skip
    windows = {}
    for suffix, spec in given.items():
        dm = Step35DataModule(sources=[spec], tokenizer=str(tok.path), seq_len=30,
                              micro_batch_size=1, val_batches=0, seed=3)  # fmt: skip
        dm.setup("fit")
        assert dm._train_sources[0].format == "chat"
        batches = dm.train_dataloader()
        windows[suffix] = [as_lists(b) for _, b in zip(range(12), batches)]
        dm.teardown("fit")
    assert windows["jsonl"] == windows["parquet"] == windows["saved"] == windows["hub"]
    assert any(label != IGNORE for w in windows["parquet"] for label in w["labels"][0])


# -- resume ---------------------------------------------------------------------------------------------------


def replay_matches(make_stream, num_batches: int, save_at: list[int], num_workers: int = 2) -> None:
    """Every state saved after `save_at` batches, loaded into a new loader, replays the rest exactly."""
    reference, states = [], {}
    loader = StatefulDataLoader(make_stream(), batch_size=2, num_workers=num_workers)
    for batch in loader:
        reference.append(batch)
        if len(reference) in save_at:
            states[len(reference)] = copy.deepcopy(loader.state_dict())
        if len(reference) == num_batches:
            break
    for k, state in states.items():
        restored = StatefulDataLoader(make_stream(), batch_size=2, num_workers=num_workers)
        restored.load_state_dict(state)
        replay = [b for _, b in zip(range(num_batches - k), restored)]
        assert len(replay) == num_batches - k
        for i, (a, b) in enumerate(zip(replay, reference[k:])):
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), f"after {k}: batch {k + i}"


@pytest.mark.timeout(180)
def test_exact_resume_mid_epoch_with_two_workers_and_two_ranks(tmp_path, tok, template):
    rng = random.Random(7)
    files = [write_jsonl(tmp_path / f"c{k}.jsonl", [{"messages": conversation(20 * k + i, rng)} for i in range(20)])
             for k in range(2)]  # fmt: skip
    files[1].write_text(files[1].read_text() + json.dumps({"messages": []}) + "\n")  # a bad record, counted
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(["w1"] * rng.randint(2, 30))}) + "\n" for _ in range(30)))

    for rank in range(2):

        def make(rank=rank):
            sources = [chat_source("chat", files, seed=5), FileSource("text", [text])]
            return TokenWindows(sources, tok, seq_len=23, weights=[3, 1], rank=rank, world_size=2, seed=2,
                                template=template)  # fmt: skip

        # About 40 conversations over 4 shards, 2 per window: the saves fall mid-epoch and the replays cross epochs.
        replay_matches(make, 24, save_at=[3, 7, 12])


# -- validation and the DataModule ---------------------------------------------------------------------------


def test_validation_batches_carry_labels_and_the_builtin_tokenizer_gets_the_default_template(
    tmp_path, builtin_cache, caplog
):
    rng = random.Random(8)
    records = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                             {"role": "assistant", "content": f"Answer {i}, done."}]} for i in range(200)]  # fmt: skip
    write_jsonl(tmp_path / "c.jsonl", records)
    rng.shuffle(records)
    dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), seq_len=48, micro_batch_size=2, val_fraction=0.2,
                          val_batches=2, cache_dir=str(builtin_cache), document_masking=True)  # fmt: skip
    dm.setup("fit")
    val = list(dm.val_dataloader())
    assert len(val) == 2 and all(b["labels"].shape == (2, 48) for b in val)
    tokenizer = dm.tokenizer
    for batch in [*val, next(iter(dm.train_dataloader()))]:
        batch = dm.on_before_batch_transfer(batch, 0)  # document masking keeps the conversations' positions
        for row in range(2):
            labels = batch["labels"][row]
            trained = tokenizer.decode(labels[labels != IGNORE].tolist())
            assert "Answer" in trained and "Question" not in trained and "user" not in trained, trained
            assert (batch["position_ids"][row] == 0).sum() >= 2  # several conversations, positions restarted
    dm.teardown("fit")


def test_document_masking_keeps_a_multi_turn_conversation_one_document(tmp_path, builtin_cache):
    # An assistant turn ends with EOS; positions restarted after every EOS would cut a multi-turn conversation
    # into documents at each turn, and the second reply could not attend to the first question.
    records = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes."},
                             {"role": "user", "content": "Why?"}, {"role": "assistant", "content": f"Because {i}."}]}
               for i in range(40)]  # fmt: skip
    write_jsonl(tmp_path / "c.jsonl", records)
    batches = {}
    for masking in (False, True):
        dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), seq_len=64, micro_batch_size=2, val_fraction=0,
                              cache_dir=str(builtin_cache), document_masking=masking)  # fmt: skip
        dm.setup("fit")
        batches[masking] = dm.on_before_batch_transfer(next(iter(dm.train_dataloader())), 0)
        dm.teardown("fit")
    assert torch.equal(batches[True]["position_ids"], batches[False]["position_ids"])
    eos = (batches[True]["input_ids"][:, :-1] == dm.eos_token_id).sum(1)
    starts = (batches[True]["position_ids"] == 0).sum(1)
    assert (eos >= 2 * (starts - 1)).all() and (starts < eos).all(), (eos, starts)  # two EOS per conversation


def test_overlong_counts_reach_the_logged_metrics_and_the_summary(tmp_path, tok_dir):
    rng = random.Random(9)
    chats = [conversation(i, rng) for i in range(20)]
    for i in range(2, 20, 4):
        chats[i] = [{"role": "user", "content": f"c{i}"}, {"role": "assistant", "content": " ".join(["w7"] * 30)}]
    write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in chats])
    dm = Step35DataModule(sources=[{"path": str(tmp_path / "c.jsonl"), "name": "sft"}], tokenizer=str(tok_dir),
                          seq_len=19, micro_batch_size=2, val_fraction=0.2, val_batches=1, num_workers=2)  # fmt: skip
    dm.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlongWarning)
        assert len(dm.val_dataloader()) == 1  # renders in this process first: the workers still get the template
        batches = [b for _, b in zip(range(12), dm.train_dataloader())]  # 24 windows: past one epoch of 20 records
    # Workers started by spawn (not fork) receive the stream pickled: the template rendered above must go too.
    stream = pickle.loads(pickle.dumps(TokenWindows(dm._train_sources, dm.tokenizer, 19, **dm._stream_options)))
    assert next(iter(stream))["labels"].shape == (19,)
    totals = dm._skipped_log.sync(dm._train_skipped(), {}, dp_rank=0, step=12, final=True)
    metrics = dm._skipped_log.metrics(totals)
    assert metrics["data/truncated/sft"] >= 2 and metrics["data/dropped/sft"] == 0
    assert metrics["data/skipped_records/sft"] == 0
    assert dm.overlong_records["truncated"] == {"sft": metrics["data/truncated/sft"]}
    assert "overlong records truncated, all ranks and workers: " in dm._skipped_log.summary()
    assert len(batches) == 12
    dm.teardown("fit")


# Reasoning between c0 and c1 (standing in for <think> and </think>), inside the generation block.
REASONING_TEMPLATE = CHAT_WORD_TEMPLATE.replace(
    "{% generation %}", "{% generation %}{% if m.reasoning_content %}c0 {{ m.reasoning_content }} c1 {% endif %}"
)


@pytest.mark.parametrize("train_reasoning", [True, False])
def test_train_reasoning_reaches_the_batches(tmp_path, tok_dir, train_reasoning):
    """data.train_reasoning goes through the datamodule to the stream: with false, no label is a reasoning word
    (w10..w19), while the wrappers (c0, c1), the answers (w1..w9) and the EOS stay labels."""
    rng = random.Random(11)
    records = []
    for i in range(12):
        thought = " ".join(f"w{rng.randrange(10, 20)}" for _ in range(3))
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"c{i + 2} w30"},
                    {"role": "assistant", "reasoning_content": thought, "content": f"w{i % 9 + 1}"},
                ]
            }
        )
    write_jsonl(tmp_path / "c.jsonl", records)
    (tmp_path / "r.jinja").write_text(REASONING_TEMPLATE)
    dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), tokenizer=str(tok_dir), seq_len=31, micro_batch_size=2,
                          chat_template=str(tmp_path / "r.jinja"), val_batches=0, train_reasoning=train_reasoning)  # fmt: skip
    dm.setup("fit")
    labels = torch.cat([b["labels"].flatten() for _, b in zip(range(4), dm.train_dataloader())])
    dm.teardown("fit")
    labelled = set(labels[labels != IGNORE].tolist())
    thoughts = {CHAT_IDS[f"w{k}"] for k in range(10, 20)}
    assert {CHAT_IDS["c0"], CHAT_IDS["c1"], WORD_EOS} <= labelled
    assert labelled & {CHAT_IDS[f"w{k}"] for k in range(1, 10)}
    assert bool(labelled & thoughts) == train_reasoning
    assert CHAT_IDS["w30"] not in labelled


def test_the_datamodule_checkpoint_entry_resumes_conversations_exactly(tmp_path, tok_dir):
    rng = random.Random(10)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i, rng)} for i in range(40)])

    def datamodule() -> Step35DataModule:
        dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), tokenizer=str(tok_dir), seq_len=23,
                              micro_batch_size=2, num_workers=2, val_batches=0)  # fmt: skip
        dm.setup("fit")
        return dm

    dm = datamodule()
    batches = iter(dm.train_dataloader())
    [next(batches) for _ in range(5)]
    entry = torch.load(_saved(dm.state_dict(), tmp_path), weights_only=True)  # as a checkpoint holds it
    expected = [as_lists(next(batches)) for _ in range(8)]  # batches 6 to 13, mid-epoch (an epoch: 20)
    dm.teardown("fit")

    resumed = datamodule()
    resumed.load_state_dict(entry)
    replay = iter(resumed.train_dataloader())
    assert [as_lists(next(replay)) for _ in range(8)] == expected
    resumed.teardown("fit")


def _saved(state: dict, folder: Path) -> Path:
    torch.save(state, folder / "datamodule_state.pt")
    return folder / "datamodule_state.pt"
