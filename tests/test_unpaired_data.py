"""Unpaired feedback (`format: unpaired`, the data side of KTO, issue 43): records to a matched and a KL
sequence, the KTO batch contract (`unpaired`, `unpaired_label`), the partner rule, overlong records, bad
records, exact resume, detection, the built-in set.

The word-level tokenizer and chat template of tests/helpers/chat.py make every token traceable: the expected
windows are written down here from the records with CHAT_IDS, without the packer or the template.
"""

import copy
import json
import random
import warnings

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from step35.data import Step35DataModule
from step35.data.bad_records import BadRecordError, BadRecordWarning, OverlongWarning
from step35.data.builtin_chat import builtin_conversations, builtin_preference_pairs
from step35.data.sources import FileSource
from step35.data.stream import TokenWindows
from step35.data.unpaired import builtin_unpaired_records
from tests.helpers import CHAT_IDS, WORD_EOS, resume_matches, write_jsonl

IGNORE = -100
E = WORD_EOS
KEYS = {"input_ids", "labels", "position_ids", "unpaired", "unpaired_label"}


def unpaired_source(files, **kwargs) -> FileSource:
    source = FileSource("fb", files, whole_records=True, **kwargs)
    source.format = "unpaired"
    return source


def ids(text: str) -> list[int]:
    return [CHAT_IDS[w] for w in text.split()]


def text_sides(record: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids + EOS) of a string record, as the contract tokenizes them."""
    return ids(record["prompt"]), ids(record["completion"]) + [E]


def expected_window(sequences: list[tuple[list[int], list[bool]]], desirable: list[bool], window: int) -> dict:
    """A window written out from its sequences (matched 0, KL 0, matched 1, ...): padding (EOS) after them,
    labels only inside a sequence where trained, positions from each sequence's start, unpaired ids q of
    sequence q, unpaired_label 1 / 0 per record then -1."""
    tokens, labels, positions, unpaired = [], [], [], []
    for q, (seq, trained) in enumerate(sequences):
        tokens += seq
        labels += [seq[k] if trained[k] else IGNORE for k in range(1, len(seq))] + [IGNORE]
        positions += list(range(len(seq)))
        unpaired += [q] * len(seq)
    pad = window - len(tokens)
    tokens += [E] * pad
    labels += [IGNORE] * pad
    positions += list(range(pad))
    unpaired += [-1] * pad
    cut, slots = window - 1, (window - 1) // 2 + 1
    label = [int(d) for d in desirable] + [-1] * (slots - len(desirable))
    return {"input_ids": tokens, "labels": labels[:cut], "position_ids": positions[:cut], "unpaired": unpaired[:cut],
            "unpaired_label": label}  # fmt: skip


def as_lists(item: dict) -> dict:
    return {key: value.tolist() for key, value in item.items()}


def stream_of(path, window: int, **kwargs) -> TokenWindows:
    return TokenWindows([unpaired_source([path], shuffle=False)], kwargs.pop("tok"), seq_len=window - 1,
                        endless=False, **kwargs)  # fmt: skip


# -- the batch contract on hand-made records -------------------------------------------------------------------


def test_text_records_make_the_contracts_tensors(tmp_path, tok):
    """Window 0 holds r0 and r1 (each KL sequence takes the other's completion); r2 is too long to share a window,
    so it is alone and its KL sequence takes the next record's (r3's) completion; r3 and r4 end the stream, r4
    with an empty prompt (its KL sequence is r3's completion alone)."""
    records = [
        {"prompt": "c0", "completion": "w1 w2", "label": True},
        {"prompt": "c1 w3", "completion": "w4", "label": False},
        {"prompt": "c2", "completion": "w5 w6 w7 w8 w9 w10 w11", "label": True},
        {"prompt": "c3", "completion": "w12", "label": True},
        {"prompt": "", "completion": "w13 w14", "label": False},
    ]
    path = write_jsonl(tmp_path / "u.jsonl", records)
    got = [as_lists(w) for w in stream_of(path, 21, tok=tok)]
    c0, w1, w2, c1, w3, w4, c2, c3 = (CHAT_IDS[w] for w in "c0 w1 w2 c1 w3 w4 c2 c3".split())
    T, F = True, False
    window0 = [([c0, w1, w2, E], [F, T, T, T]), ([c0, w4, E], [F, T, T]),
               ([c1, w3, w4, E], [F, F, T, T]), ([c1, w3, w1, w2, E], [F, F, T, T, T])]  # fmt: skip
    long = ids("w5 w6 w7 w8 w9 w10 w11")
    window1 = [([c2, *long, E], [F] + [T] * 8), ([c2, CHAT_IDS["w12"], E], [F, T, T])]
    window2 = [([c3, CHAT_IDS["w12"], E], [F, T, T]), ([c3, *ids("w13 w14"), E], [F, T, T, T]),
               ([*ids("w13 w14"), E], [T, T, T]), ([CHAT_IDS["w12"], E], [T, T])]  # fmt: skip
    assert got == [
        expected_window(window0, [True, False], 21),
        expected_window(window1, [True], 21),
        expected_window(window2, [True, False], 21),
    ]
    # Spelled out once: the first window's ids, labels and record labels.
    assert got[0]["unpaired"] == [0] * 4 + [1] * 3 + [2] * 4 + [3] * 5 + [-1] * 4
    assert got[0]["labels"][:16] == [w1, w2, E, IGNORE, w4, E, IGNORE, IGNORE, w4, E, IGNORE, IGNORE, w1, w2, E,
                                     IGNORE]  # fmt: skip
    assert got[0]["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert got[0]["unpaired_label"] == [1, 0] + [-1] * 9 and len(got[0]["unpaired_label"]) == 20 // 2 + 1


def test_conversational_records_splice_the_prompt_and_its_header_with_the_partners_reply(tmp_path, tok, template):
    A, U = CHAT_IDS["assistant"], CHAT_IDS["user"]
    records = [
        {"prompt": [{"role": "user", "content": "c1 w1"}], "completion": "w2", "label": False},
        {"prompt": [{"role": "user", "content": "c2"}, {"role": "assistant", "content": "w3"},
                    {"role": "user", "content": "w4"}],
         "completion": [{"role": "assistant", "content": "w5 w6"}, {"role": "tool", "content": "w7"},
                        {"role": "assistant", "content": "w8"}], "label": True},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "u.jsonl", records)
    prompt0 = [U, *ids("c1 w1"), A]  # the assistant header is the prompt's side of the splice
    prompt1 = [U, CHAT_IDS["c2"], A, CHAT_IDS["w3"], E, U, CHAT_IDS["w4"], A]
    reply0 = ([CHAT_IDS["w2"], E], [True, True])
    reply1 = (
        [*ids("w5 w6"), E, CHAT_IDS["tool"], CHAT_IDS["w7"], A, CHAT_IDS["w8"], E],
        [True, True, True, False, False, False, True, True],
    )  # a tool result inside the reply is context
    # Under last_assistant the completion's side starts at its first trained token, the final turn's.
    for train_on, side1, r1 in [("assistant", prompt1, reply1),
                                ("last_assistant", prompt1 + reply1[0][:6], (reply1[0][6:], [True, True]))]:  # fmt: skip
        got = [as_lists(w) for w in stream_of(path, 61, tok=tok, template=template, train_on=train_on)]
        sequences = [
            (prompt0 + reply0[0], [False] * 4 + reply0[1]),
            (prompt0 + r1[0], [False] * 4 + r1[1]),
            (side1 + r1[0], [False] * len(side1) + r1[1]),
            (side1 + reply0[0], [False] * len(side1) + reply0[1]),
        ]
        assert got == [expected_window(sequences, [False, True], 61)], train_on
    # The matched sequence is the text SFT renders: the conversation through the same template.
    conversation = records[1]["prompt"] + records[1]["completion"]
    assert template.encode(tok, conversation)[0] == prompt1 + reply1[0]
    with pytest.raises(ValueError, match="data.train_on: all trains prompt tokens, but an unpaired record"):
        TokenWindows([unpaired_source([path])], tok, seq_len=40, template=template, train_on="all")


def test_random_records_pack_greedily_with_the_partner_rule(tmp_path, tok):
    """An independent greedy writer: records in order, a window closed when the next record's two sequences do
    not fit; partner (p + 1) mod n, or the next record for a record alone; a lone last record left out."""
    rng = random.Random(0)
    words = lambda n, low=0: " ".join(f"w{rng.randrange(low, 50)}" for _ in range(n))  # noqa: E731
    records = [{"prompt": f"c{i} " + words(rng.randint(0, 3)), "completion": words(rng.randint(1, 6)),
                "label": rng.random() < 0.5} for i in range(60)]  # fmt: skip
    records[7].update(prompt="c7", completion=words(20))  # 2 x 22 tokens > a window of 41: alone
    path = write_jsonl(tmp_path / "u.jsonl", records)
    window = 41
    got = [as_lists(w) for w in stream_of(path, window, tok=tok)]

    sides = [text_sides(r) for r in records]
    expected, current = [], []

    def close(members: list[int], following: int | None) -> None:
        partners = members[1:] + members[:1] if len(members) > 1 else [following]
        sequences = []
        for p, q in zip(members, partners):
            (prompt, completion), (_, other) = sides[p], sides[q]
            sequences += [(prompt + completion, [False] * len(prompt) + [True] * len(completion)),
                          (prompt + other, [False] * len(prompt) + [True] * len(other))]  # fmt: skip
        expected.append(expected_window(sequences, [records[p]["label"] for p in members], window))

    for i, (prompt, completion) in enumerate(sides):
        size = 2 * (len(prompt) + len(completion))
        if current and sum(2 * sum(map(len, sides[j])) for j in current) + size > window:
            close(current, i)
            current = []
        current.append(i)
    if len(current) > 1:
        close(current, None)
    assert got == expected
    assert sum(max(w["unpaired"]) >= 5 for w in got) > 5  # three records or more share a window
    assert any(w["unpaired_label"][1] == -1 for w in got)  # and a record is alone in one


def test_a_last_record_alone_has_no_partner_in_a_finite_stream_and_the_next_epochs_first_in_an_endless_one(
    tmp_path, tok
):
    records = [{"prompt": f"c{i}", "completion": f"w{i} w{i}", "label": i != 1} for i in range(3)]
    records[2]["completion"] = "w2 w2 w2 w2"  # 2 x 6 tokens: no room beside another record
    path = write_jsonl(tmp_path / "u.jsonl", records)
    finite = [as_lists(w) for w in stream_of(path, 17, tok=tok)]  # two records (2 x 8 tokens) fill a window
    assert [w["unpaired_label"][:3] for w in finite] == [[1, 0, -1]]
    endless = TokenWindows([unpaired_source([path], shuffle=False)], tok, seq_len=16)
    windows = [as_lists(w) for _, w in zip(range(3), endless)]
    c2, w0, w2 = CHAT_IDS["c2"], CHAT_IDS["w0"], CHAT_IDS["w2"]
    lone = [([c2, w2, w2, w2, w2, E], [False] + [True] * 5), ([c2, w0, w0, E], [False, True, True, True])]
    assert windows[1] == expected_window(lone, [True], 17)  # r2's partner: r0, read again in the next epoch


# -- overlong records ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_a_record_alone_is_cut_to_fit_kl_first_or_dropped(tmp_path, tok, mode):
    """Window 25. r0 is alone (r1 does not fit beside it); r1 is overlong (33 tokens, encoded as far as 26);
    r2 (17) and r3 (22) fit alone but not with their partners' long completions; r4's prompt leaves no room."""
    records = [
        {"prompt": "c1", "completion": "w1 w2", "label": True},
        {"prompt": "c2 w3", "completion": " ".join(["w4"] * 30), "label": False},
        {"prompt": "c3", "completion": " ".join(["w5"] * 15), "label": True},
        {"prompt": "c4", "completion": " ".join(["w6"] * 20), "label": True},
        {"prompt": "c5 " + " ".join(["w7"] * 24), "completion": "w8", "label": False},
        {"prompt": "c6", "completion": "w9", "label": True},
        {"prompt": "c7", "completion": "w10", "label": False},
    ]
    path = write_jsonl(tmp_path / "u.jsonl", records)
    window = 25
    stream = stream_of(path, window, tok=tok, overlong=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [as_lists(w) for w in stream]
    reports = [str(w.message) for w in caught if issubclass(w.category, OverlongWarning)]
    state = stream.state_dict()["sources"][0]
    c = {k: CHAT_IDS[f"c{k}"] for k in range(1, 8)}
    w = {k: CHAT_IDS[f"w{k}"] for k in range(1, 11)}
    F, T = False, True
    # r0 (4 tokens) + its KL sequence, c1 and r1's completion (24 of its tokens were encoded): cut to 21 tokens.
    lone0 = [([c[1], w[1], w[2], E], [F, T, T, T]), ([c[1], *[w[4]] * 20], [F] + [T] * 20)]
    # r2 (17) + c3 and r3's completion (21): the KL sequence alone is cut, to 8 tokens.
    lone2 = [([c[3], *[w[5]] * 15, E], [F] + [T] * 16), ([c[3], *[w[6]] * 7], [F] + [T] * 7)]
    # r3 (22) + c4 and r4's completion as far as r4 was encoded (w8; its EOS lay past r4's 26 tokens): fits.
    lone3 = [([c[4], *[w[6]] * 20, E], [F] + [T] * 21), ([c[4], w[8]], [F, T])]
    tail = [([c[6], w[9], E], [F, T, T]), ([c[6], w[10], E], [F, T, T]),
            ([c[7], w[10], E], [F, T, T]), ([c[7], w[9], E], [F, T, T])]  # fmt: skip
    if mode == "truncate":
        # r1: 26 encoded + KL c2 w3 and r2's completion (18): the KL sequence down to one trained token (3), then
        # r1 itself to the 22 tokens left.
        lone1 = [([c[2], w[3], *[w[4]] * 20], [F, F] + [T] * 20), ([c[2], w[3], w[5]], [F, F, T])]
        expected = [(lone0, [T]), (lone1, [F]), (lone2, [T]), (lone3, [T]), (tail, [T, F])]
        assert (state["truncated"], state["dropped"]) == (1, 1)
        assert reports[0].startswith(f"truncating the unpaired record at {path}:2: 33 + 18 (the record + its KL")
    else:
        expected = [(lone0, [T]), (lone2, [T]), (lone3, [T]), (tail, [T, F])]  # r1 dropped: it would be cut
        assert (state["truncated"], state["dropped"]) == (0, 2)
        assert reports[0].startswith(f"dropping the unpaired record at {path}:2: 33 + 18 (the record + its KL")
    assert got == [expected_window(sequences, labels, window) for sequences, labels in expected]
    assert reports[-1].startswith(f"dropping the unpaired record at {path}:5: ") and "no trained token" in reports[-1]
    assert len(reports) == 2


# -- bad records --------------------------------------------------------------------------------------------------


BAD = [
    ({"prompt": "w1", "completion": "w2"}, "no 'label' field"),
    ({"prompt": "w1", "completion": "w2", "label": "yes"}, "'label' is 'yes'; a label is true (desirable) or false"),
    ({"prompt": "w1", "completion": "w2", "label": 1}, "'label' is 1; a label is true"),
    ({"prompt": "w1", "completion": "", "label": True}, "'completion' is empty"),
    ({"prompt": [{"role": "user", "content": "w1"}], "completion": [], "label": True}, "'completion' is empty"),
    (
        {
            "prompt": [{"role": "user", "content": "w1"}],
            "completion": [{"role": "user", "content": "w2"}],
            "label": False,
        },
        "'completion' has no assistant message",
    ),  # fmt: skip
    ({"prompt": 7, "completion": "w2", "label": True}, "'prompt' is int"),
    ({"prompt": "w1", "completion": [{"role": "assistant", "content": "w2"}], "label": True}, "'prompt' is a string"),
    ({"prompt": [{"role": "robot", "content": "w1"}], "completion": "w2", "label": True}, "unknown role 'robot'"),
]


def test_each_bad_record_kind_is_skipped_with_its_line_or_refused_when_strict(tmp_path, tok, template):
    good = [{"prompt": f"c{i}", "completion": f"w{i}", "label": i % 2 == 0} for i in range(1, 7)]
    path = write_jsonl(tmp_path / "u.jsonl", good[:3] + [record for record, _ in BAD] + good[3:])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lenient = stream_of(path, 31, tok=tok, template=template)
        got = [as_lists(w) for w in lenient]
    reports = [str(w.message) for w in caught if issubclass(w.category, BadRecordWarning)]
    clean = [as_lists(w) for w in stream_of(write_jsonl(tmp_path / "good.jsonl", good), 31, tok=tok)]
    assert got == clean and lenient.state_dict()["sources"][0]["skipped"] == len(BAD) == len(reports)
    for k, (_, why) in enumerate(BAD):
        assert reports[k].startswith(f"skipping bad record at {path}:{4 + k}: ") and why in reports[k], reports[k]
    for k, (record, why) in enumerate(BAD):
        alone = write_jsonl(tmp_path / f"bad{k}.jsonl", [good[0], record])
        with pytest.raises(BadRecordError, match=rf"bad record at {alone}:2: .*{why[:12]}"):
            list(stream_of(alone, 31, tok=tok, template=template, strict=True))


# -- resume, detection, the datamodule, the built-in set --------------------------------------------------------


def test_exact_resume_mid_stream_across_epochs_with_records_alone(tmp_path, tok, template):
    rng = random.Random(5)

    def record(i: int) -> dict:
        completion = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.choice([1, 2, 3, 14])))
        prompt = [{"role": "user", "content": f"c{i}"}]
        return {"prompt": prompt if i % 3 else f"c{i}", "completion": completion, "label": rng.random() < 0.5}

    files = [write_jsonl(tmp_path / f"u{k}.jsonl", [record(20 * k + i) for i in range(20)]) for k in range(2)]

    def make() -> TokenWindows:
        return TokenWindows([unpaired_source(files, seed=3)], tok, seq_len=30, template=template, seed=1)

    reference, states = [], {}
    loader = StatefulDataLoader(make(), batch_size=2, num_workers=0)
    for batch in loader:
        reference.append(batch)
        if len(reference) in (3, 11):
            states[len(reference)] = copy.deepcopy(loader.state_dict())
        if len(reference) == 24:  # about 2 records a window: past the first epoch of 40 records
            break
    assert any((b["unpaired_label"][:, 1] == -1).any() for b in reference)  # some records are alone
    for k, state in states.items():
        restored = StatefulDataLoader(make(), batch_size=2, num_workers=0)
        restored.load_state_dict(state)
        replay = [b for _, b in zip(range(24 - k), restored)]
        assert len(replay) == 24 - k
        for i, (a, b) in enumerate(zip(replay, reference[k:])):
            assert a.keys() == b.keys() == KEYS
            assert all(torch.equal(a[key], b[key]) for key in a), f"state after batch {k}: batch {k + i} differs"
    # With two DataLoader workers too (the shared check: input_ids, which hold both sequences of every record).
    resume_matches(make, num_batches=12, save_at=[3, 7])


def test_auto_detection_the_datamodule_and_the_refusals(tmp_path, tok_dir, caplog):
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": f"c{i}", "completion": "w1 w2", "label": i % 3 > 0} for i in range(200)]
    write_jsonl(tmp_path / "u.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "u.parquet")
    caplog.set_level(logging.INFO)
    sources = [{"path": str(tmp_path / "u.jsonl"), "name": "jsonl"}, {"path": str(tmp_path / "u.parquet")}]
    dm = Step35DataModule(sources=sources, tokenizer=str(tok_dir), seq_len=30, micro_batch_size=2,
                          val_fraction=0.2, val_batches=2)  # fmt: skip
    dm.setup("fit")
    assert [s.format for s in dm._train_sources] == ["unpaired", "unpaired"]
    assert dm.batch_keys == ("unpaired", "unpaired_label") and not dm.preference
    assert "source 'jsonl': format unpaired (records have 'prompt', 'completion' and 'label')" in caplog.text
    assert "format unpaired (columns include 'prompt', 'completion' and 'label')" in caplog.text
    for batch in [*dm.val_dataloader(), next(iter(dm.train_dataloader()))]:
        assert batch.keys() == KEYS
        assert batch["unpaired"].shape == batch["labels"].shape == (2, 30)
        assert batch["unpaired_label"].shape == (2, 16) and (batch["unpaired_label"][:, 0] >= 0).all()
    dm.teardown("fit")

    write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"c{i}", "completion": "w1 w2"} for i in range(20)])
    write_jsonl(tmp_path / "p.jsonl", [{"chosen": f"c{i}", "rejected": "w1 w2"} for i in range(20)])
    for other, kind in [("c.jsonl", "prompt_completion"), ("p.jsonl", "preference")]:
        mixed = Step35DataModule(sources=[sources[0], {"path": str(tmp_path / other), "name": "other"}],
                                 tokenizer=str(tok_dir), val_batches=0)  # fmt: skip
        with pytest.raises(ValueError, match=rf"unpaired source\(s\) \['jsonl'\] cannot be mixed with the {kind}"):
            mixed.setup("fit")
    with pytest.raises(ValueError, match="data.train_on: all trains prompt tokens"):
        Step35DataModule(sources=sources[:1], tokenizer=str(tok_dir), train_on="all", val_batches=0).setup("fit")
    pq.write_table(pa.table({"prompt": ["w1"], "completion": ["w2"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"an? unpaired source needs columns 'prompt', 'completion' and 'label'"):
        Step35DataModule(sources=[{"path": str(tmp_path / "t.parquet"), "format": "unpaired"}],
                         tokenizer=str(tok_dir), val_batches=0).setup("fit")  # fmt: skip


def test_the_builtin_set_labels_the_true_answer_desirable_and_another_undesirable(builtin_cache):
    records = builtin_unpaired_records()
    pairs = builtin_preference_pairs()
    assert records == builtin_unpaired_records()  # deterministic
    assert len(records) == len(pairs) == len(builtin_conversations()) > 400
    desirable = sum(r["label"] for r in records)
    assert abs(2 * desirable - len(records)) <= 1  # half and half
    for record, pair in zip(records, pairs):
        assert record["prompt"] == pair["prompt"]
        assert record["completion"] == (pair["chosen"] if record["label"] else pair["rejected"])
        assert record["label"] or record["completion"] != pair["chosen"]  # an undesirable one answers another question

    dm = Step35DataModule(format="unpaired", seq_len=320, micro_batch_size=2, cache_dir=str(builtin_cache),
                          val_batches=1)  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    assert dm._train_sources[0].name == "builtin-unpaired" and dm.batch_keys == ("unpaired", "unpaired_label")
    written = [json.loads(line) for line in open(dm._train_sources[0].parts[0].path)]
    assert written == records
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlongWarning)
        batch = next(iter(dm.train_dataloader()))
    assert batch.keys() == KEYS and set(batch["unpaired_label"].unique().tolist()) <= {-1, 0, 1}
    dm.teardown("fit")
