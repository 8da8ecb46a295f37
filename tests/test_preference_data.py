"""Preference pairs (`format: preference`, issue 26's data side): records to pairs of sequences, packing pairs
side by side with the DPO batch contract's `preference` ids, overlong pairs, bad records, exact resume, sharding,
detection and the refusals, the built-in pairs.

The word-level tokenizer and chat template of tests/helpers/chat.py make every token traceable: a conversation
renders as `<role> <words>` per turn, an assistant turn as `assistant <words> <eos>` with the words and the
EOS trained; so the expected tokens of a pair are written down here with CHAT_IDS, without the template.
"""

import copy
import json
import random
import warnings
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from step35.data import Step35DataModule
from step35.data.bad_records import BadRecordError, BadRecordWarning, OverlongWarning
from step35.data.builtin_chat import builtin_conversations, builtin_preference_pairs
from step35.data.packing import document_positions
from step35.data.preference import Pair, fit_pair
from step35.data.sft import Example
from step35.data.sources import FileSource
from step35.data.stream import TokenWindows
from tests.helpers import CHAT_IDS, WORD_EOS, write_jsonl

IGNORE = -100


def pair_source(files: list[Path], **kwargs) -> FileSource:
    source = FileSource("pairs", files, whole_records=True, **kwargs)
    source.format = "preference"
    return source


def words(n: int, rng: random.Random, low: int = 0) -> str:
    return " ".join(f"w{rng.randrange(low, 50)}" for _ in range(n))


def standard_pair(i: int, rng: random.Random) -> dict:
    """Pair i: its prompt starts with c<i>, so a window's tokens name their pair; rejected replies use w25..w49."""
    record = {"chosen": words(rng.randint(1, 5), rng), "rejected": words(rng.randint(1, 5), rng, 25)}
    return {"prompt": f"c{i} " + words(rng.randint(0, 3), rng), **record} if i % 4 else record


def conversational_pair(i: int, rng: random.Random) -> dict:
    """A prompt of one or two turns (the earlier assistant turn is context), replies as message lists or strings."""
    prompt = [{"role": "user", "content": f"c{i} " + words(2, rng)}]
    if rng.random() < 0.5:
        prompt += [{"role": "assistant", "content": words(2, rng)}, {"role": "user", "content": words(1, rng)}]
    chosen, rejected = words(rng.randint(1, 4), rng), words(rng.randint(1, 4), rng, 25)
    if i % 2:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}  # fmt: skip


def ids(text: str) -> list[int]:
    return [CHAT_IDS[w] for w in text.split()]


def expected_sequences(record: dict) -> list[tuple[list[int], list[bool]]]:
    """(ids, trained) of the chosen and the rejected sequence, written down from the record."""
    out = []
    prompt = record.get("prompt")
    for side in ("chosen", "rejected"):
        reply = record[side]
        if isinstance(prompt, list) or isinstance(reply, list):
            reply = [{"role": "assistant", "content": reply}] if isinstance(reply, str) else reply
            seq, trained = [], []
            for m in prompt or []:  # context: never trained, assistant turns included
                end = [WORD_EOS] if m["role"] == "assistant" else []
                seq += [CHAT_IDS[m["role"]], *ids(m["content"]), *end]
                trained += [False] * (1 + len(ids(m["content"])) + len(end))
            for m in reply:
                seq += [CHAT_IDS["assistant"], *ids(m["content"]), WORD_EOS]
                trained += [False] + [True] * (len(ids(m["content"])) + 1)
        else:
            seq = ids(prompt or "") + ids(reply) + [WORD_EOS]
            trained = [False] * len(ids(prompt or "")) + [True] * (len(ids(reply)) + 1)
        out.append((seq, trained))
    return out


def expected_windows(pairs: list[list[tuple[list[int], list[bool]]]], window: int) -> list[dict[str, list[int]]]:
    """Greedy packing of whole pairs written out: chosen then rejected, padding (EOS) where the next pair does not
    fit; labels only inside a sequence, positions from each sequence's start, preference 2p / 2p + 1 / -1."""
    out, current = [], []

    def close():
        tokens, labels, positions, preference = [], [], [], []
        for q, (seq, trained) in enumerate(s for pair in current for s in pair):
            tokens += seq
            labels += [seq[k] if trained[k] else IGNORE for k in range(1, len(seq))] + [IGNORE]
            positions += list(range(len(seq)))
            preference += [q] * len(seq)
        pad = window - len(tokens)
        tokens += [WORD_EOS] * pad
        labels += [IGNORE] * pad
        positions += list(range(pad))
        preference += [-1] * pad
        cut = window - 1
        out.append({"input_ids": tokens, "labels": labels[:cut], "position_ids": positions[:cut],
                    "preference": preference[:cut]})  # fmt: skip

    for pair in pairs:
        if sum(len(s) for p in current for s, _ in p) + sum(len(s) for s, _ in pair) > window:
            close()
            current = []
        current.append(pair)
    if current:
        close()
    return out


def as_lists(item: dict) -> dict[str, list[int]]:
    return {key: value.tolist() for key, value in item.items()}


# -- tokens, labels, positions, preference ids -------------------------------------------------------------


def test_standard_pairs_pack_as_a_direct_construction(tmp_path, tok):
    rng = random.Random(0)
    records = [standard_pair(i, rng) for i in range(40)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    window = 41
    got = [as_lists(w) for w in TokenWindows([pair_source([path], shuffle=False)], tok, seq_len=40, endless=False)]
    pairs = [expected_sequences(r) for r in records]
    assert got == expected_windows(pairs, window)
    assert max(max(w["preference"]) for w in got) >= 5  # several pairs share a window
    # The first record has no prompt: the whole reply is trained but its first token, which starts the sequence.
    first = records[0]
    assert got[0]["input_ids"][: len(ids(first["chosen"])) + 1] == ids(first["chosen"]) + [WORD_EOS]
    assert got[0]["labels"][: len(ids(first["chosen"])) + 1] == ids(first["chosen"])[1:] + [WORD_EOS, IGNORE]


def test_conversational_pairs_are_rendered_and_only_the_replies_trained(tmp_path, tok, template):
    rng = random.Random(1)
    records = [conversational_pair(i, rng) for i in range(30)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    stream = TokenWindows([pair_source([path], shuffle=False)], tok, seq_len=50, endless=False, template=template)
    got = [as_lists(w) for w in stream]
    assert got == expected_windows([expected_sequences(r) for r in records], 51)

    # The same text as SFT renders: a sequence is the conversation prompt + reply through the same template.
    record = next(r for r in records if len(r["prompt"]) == 3 and isinstance(r["chosen"], list))
    conversation = record["prompt"] + record["chosen"]
    assert template.encode(tok, conversation, train_on="last_assistant")[0] == expected_sequences(record)[0][0]


def test_implicit_prompts_tools_inside_replies_and_last_assistant(tmp_path, tok, template):
    """No `prompt`: the messages both replies share are context. A tool result inside a reply is context; under
    train_on: last_assistant only the reply's final assistant turn is trained."""
    shared = [{"role": "user", "content": "c1 w1"}, {"role": "assistant", "content": "w2"},
              {"role": "user", "content": "w3"}]  # fmt: skip
    record = {
        "chosen": shared + [{"role": "assistant", "content": "w4 w5"}, {"role": "tool", "content": "w6"},
                            {"role": "assistant", "content": "w7"}],
        "rejected": shared + [{"role": "assistant", "content": "w30"}],
    }  # fmt: skip
    path = write_jsonl(tmp_path / "p.jsonl", [record])
    prompt = [CHAT_IDS["user"], *ids("c1 w1"), CHAT_IDS["assistant"], CHAT_IDS["w2"], WORD_EOS, CHAT_IDS["user"],
              CHAT_IDS["w3"]]  # fmt: skip
    A, T = CHAT_IDS["assistant"], CHAT_IDS["tool"]
    chosen = prompt + [A, *ids("w4 w5"), WORD_EOS, T, CHAT_IDS["w6"], A, CHAT_IDS["w7"], WORD_EOS]
    rejected = prompt + [A, CHAT_IDS["w30"], WORD_EOS]
    for train_on, chosen_trained in [
        ("assistant", [False] * 8 + [False, True, True, True, False, False, False, True, True]),
        ("last_assistant", [False] * 8 + [False] * 7 + [True, True]),
    ]:
        stream = TokenWindows([pair_source([path])], tok, seq_len=40, endless=False, template=template,
                              train_on=train_on)  # fmt: skip
        got = [as_lists(w) for w in stream]
        expected = [[(chosen, chosen_trained), (rejected, [False] * 9 + [True, True])]]
        assert got == expected_windows(expected, 41)
    with pytest.raises(ValueError, match="data.train_on: all trains prompt tokens"):
        TokenWindows([pair_source([path])], tok, seq_len=40, template=template, train_on="all")


# -- overlong pairs ------------------------------------------------------------------------------------------


def greedy_cut(starts: list[int], lengths: list[int], window: int) -> list[int] | None:
    """The independent rule: cut one token at a time off the longer reply (the rejected's on a tie, so that the
    chosen keeps the odd token) until the pair fits; None when a reply would keep no token."""
    lengths = list(lengths)
    while sum(lengths) > window:
        replies = [lengths[0] - starts[0], lengths[1] - starts[1]]
        k = 0 if replies[0] > replies[1] else 1
        if replies[k] <= 1:
            return None
        lengths[k] -= 1
    return lengths


def test_fit_pair_cuts_the_longer_reply_first_and_keeps_a_reply_token_each():
    rng = random.Random(2)
    checked = 0
    for _ in range(400):
        starts = [rng.randint(1, 12), rng.randint(1, 12)]
        lengths = [s + rng.randint(1, 30) for s in starts]
        window = rng.randint(4, 60)
        pair = Pair(*[Example(list(range(n)), [False] * s + [True] * (n - s), "x:1") for s, n in zip(starts, lengths)],
                    "x:1")  # fmt: skip
        fitted = fit_pair(pair, window)
        expected = greedy_cut(starts, lengths, window)
        got = None if fitted is None else [len(fitted.chosen.ids), len(fitted.rejected.ids)]
        assert got == expected, (starts, lengths, window)
        if fitted is not None and sum(lengths) > window:
            checked += 1
            assert fitted.chosen.ids == pair.chosen.ids[: got[0]]  # a tail cut: the prompt stays whole
    assert checked > 50


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_overlong_pairs_are_cut_or_dropped_and_counted(tmp_path, tok, mode):
    rng = random.Random(3)
    records = [standard_pair(i, rng) for i in range(1, 13)]
    records[3] = {"prompt": "c4 w1", "chosen": " ".join(["w2"] * 20), "rejected": " ".join(["w30"] * 8)}
    records[8] = {"prompt": "c9 " + " ".join(["w3"] * 30), "chosen": "w4", "rejected": "w31"}  # no room for replies
    path = write_jsonl(tmp_path / "p.jsonl", records)
    window = 25
    stream = TokenWindows([pair_source([path], shuffle=False)], tok, seq_len=window - 1, endless=False, overlong=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [as_lists(w) for w in stream]
    reports = [str(w.message) for w in caught if issubclass(w.category, OverlongWarning)]
    pairs = [expected_sequences(r) for r in records]
    state = stream.state_dict()["sources"][0]
    if mode == "truncate":
        # 2 + 21 and 2 + 9 tokens: the chosen reply (21) is cut to 12 tokens, the rejected keeps its 9.
        (c, ct), (r, rt) = pairs[3]
        cut = [(c[:14], ct[:14]), (r, rt)]
        assert got == expected_windows([*pairs[:3], cut, *pairs[4:8], *pairs[9:]], window)
        assert (state["truncated"], state["dropped"]) == (1, 1)
        assert reports[0].startswith(f"truncating the preference pair at {path}:4: 23 + 11 (chosen + rejected)")
        assert reports[1].startswith(f"dropping the preference pair at {path}:9: ")
        assert "a reply would keep no trained token" in reports[1]
    else:
        assert got == expected_windows([*pairs[:3], *pairs[4:8], *pairs[9:]], window)
        assert (state["truncated"], state["dropped"]) == (0, 2)
    for w in got:  # the contract: every pair of a row has both sequences with a label
        for q in range(max(w["preference"]) + 1):
            assert any(p == q and label != IGNORE for p, label in zip(w["preference"], w["labels"])), (q, w)


def test_an_endless_stream_that_drops_every_pair_stops_with_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1", "chosen": "w2 " * 30, "rejected": "w3"}] * 3)
    stream = TokenWindows([pair_source([path])], tok, seq_len=9, overlong="drop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlongWarning)
        with pytest.raises(RuntimeError, match="source 'pairs': shard 0 of 1 dropped every preference pair"):
            next(iter(stream))


# -- bad records ------------------------------------------------------------------------------------------------


BAD = [
    ({"prompt": "w1", "chosen": "w2"}, "no 'rejected' field"),
    ({"prompt": "w1", "chosen": "w2", "rejected": 3}, "'rejected' is int; a reply is a string or a list"),
    ({"prompt": 7, "chosen": "w2", "rejected": "w3"}, "'prompt' is int; a prompt is a string or a list"),
    ({"prompt": "w1", "chosen": "w2", "rejected": [{"role": "assistant", "content": "w3"}]}, "'prompt' is a string"),
    ({"prompt": "w1", "chosen": "", "rejected": "w3"}, "'chosen' is empty"),
    ({"prompt": [{"role": "user", "content": "w1"}], "chosen": [], "rejected": "w3"}, "'chosen' is empty"),
    (
        {
            "prompt": [{"role": "user", "content": "w1"}],
            "chosen": [{"role": "user", "content": "w2"}],
            "rejected": "w3",
        },
        "'chosen' has no assistant message",
    ),  # fmt: skip
    ({"prompt": [{"role": "robot", "content": "w1"}], "chosen": "w2", "rejected": "w3"}, "unknown role 'robot'"),
    ({"prompt": "w1", "chosen": "w2 w3", "rejected": "w2  w3"}, "'chosen' and 'rejected' are the same tokens"),
    ({"prompt": [{"role": "user", "content": "w1"}], "chosen": "w2", "rejected": "w2"}, "are the same messages"),
]


def test_each_bad_record_kind_is_skipped_with_its_line_or_refused_when_strict(tmp_path, tok, template):
    rng = random.Random(4)
    good = [standard_pair(i, rng) for i in range(1, 7)]
    path = write_jsonl(tmp_path / "p.jsonl", good[:3] + [record for record, _ in BAD] + good[3:])

    def stream(strict: bool, records_path: Path = path) -> TokenWindows:
        return TokenWindows([pair_source([records_path], shuffle=False)], tok, seq_len=30, endless=False,
                            template=template, strict=strict)  # fmt: skip

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lenient = stream(False)
        got = [as_lists(w) for w in lenient]
    reports = [str(w.message) for w in caught if issubclass(w.category, BadRecordWarning)]
    assert got == expected_windows([expected_sequences(r) for r in good], 31)
    assert lenient.state_dict()["sources"][0]["skipped"] == len(BAD)
    assert len(reports) == len(BAD)
    for k, (_, why) in enumerate(BAD):
        assert reports[k].startswith(f"skipping bad record at {path}:{4 + k}: ") and why in reports[k], reports[k]
    for k, (record, why) in enumerate(BAD):
        alone = write_jsonl(tmp_path / f"bad{k}.jsonl", [good[0], record])
        with pytest.raises(BadRecordError, match=rf"bad record at {alone}:2: .*{why[:12]}"):
            list(stream(True, alone))


# -- resume, shards, validation, the datamodule --------------------------------------------------------------


def test_exact_resume_mid_stream_across_epochs(tmp_path, tok, template):
    rng = random.Random(5)
    files = [write_jsonl(tmp_path / f"p{k}.jsonl", [conversational_pair(20 * k + i, rng) for i in range(20)])
             for k in range(2)]  # fmt: skip

    def make() -> TokenWindows:
        return TokenWindows([pair_source(files, seed=3)], tok, seq_len=40, template=template, seed=1)

    reference, states = [], {}
    loader = StatefulDataLoader(make(), batch_size=2, num_workers=0)
    for batch in loader:
        reference.append(batch)
        if len(reference) in (3, 9):
            states[len(reference)] = copy.deepcopy(loader.state_dict())
        if len(reference) == 16:  # about 2 pairs a window: past the first epoch of 40 pairs
            break
    for k, state in states.items():
        restored = StatefulDataLoader(make(), batch_size=2, num_workers=0)
        restored.load_state_dict(state)
        replay = [b for _, b in zip(range(16 - k), restored)]
        assert len(replay) == 16 - k
        for i, (a, b) in enumerate(zip(replay, reference[k:])):
            assert a.keys() == b.keys() == {"input_ids", "labels", "position_ids", "preference"}
            assert all(torch.equal(a[key], b[key]) for key in a), f"state after batch {k}: batch {k + i} differs"


def pair_firsts(window: dict[str, list[int]]) -> list[int]:
    """The c<i> word after the role header that starts each chosen sequence of a window (the pair's index)."""
    return [window["input_ids"][i + 1] for i, p in enumerate(window["preference"])
            if p % 2 == 0 and p >= 0 and window["position_ids"][i] == 0]  # fmt: skip


def test_two_ranks_share_the_pairs_and_never_split_one(tmp_path, tok, template):
    rng = random.Random(6)
    records = [conversational_pair(i + 2, rng) for i in range(40)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    seen = []
    for rank in range(2):
        stream = TokenWindows([pair_source([path])], tok, seq_len=45, rank=rank, world_size=2, endless=False,
                              template=template)  # fmt: skip
        for w in map(as_lists, stream):
            ids_of = {q: [t for t, p in zip(w["input_ids"], w["preference"]) if p == q] for q in set(w["preference"])}
            for q in range(max(w["preference"]) + 1):
                assert ids_of[q][1] == ids_of[q ^ 1][1]  # chosen and rejected of a pair: the same c<i> in one window
            seen += [(rank, token) for token in pair_firsts(w)]
    firsts = [CHAT_IDS[f"c{i + 2}"] for i in range(40)]
    assert sorted(token for _, token in seen) == sorted(firsts)  # every pair once, over both ranks
    assert {rank for rank, _ in seen} == {0, 1}


def test_auto_detection_validation_and_the_datamodule(tmp_path, tok_dir, caplog):
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    records = [standard_pair(i, rng) for i in range(1, 201)]
    write_jsonl(tmp_path / "p.jsonl", records)
    pq.write_table(pa.Table.from_pylist([{k: r.get(k, "") for k in ("prompt", "chosen", "rejected")} for r in records]),
                   tmp_path / "p.parquet")  # fmt: skip
    caplog.set_level(logging.INFO)
    sources = [{"path": str(tmp_path / "p.jsonl"), "name": "jsonl"}, {"path": str(tmp_path / "p.parquet")}]
    dm = Step35DataModule(sources=sources, tokenizer=str(tok_dir), seq_len=30, micro_batch_size=2,
                          val_fraction=0.2, val_batches=2)  # fmt: skip
    dm.setup("fit")
    assert [s.format for s in dm._train_sources] == ["preference", "preference"] and dm.preference
    assert "source 'jsonl': format preference (records have 'chosen' and 'rejected')" in caplog.text
    assert "format preference (columns include 'chosen' and 'rejected')" in caplog.text
    val = list(dm.val_dataloader())
    train = next(iter(dm.train_dataloader()))
    for batch in [*val, train]:
        assert batch["preference"].shape == batch["labels"].shape == (2, 30)
        assert (batch["preference"][:, 0] == 0).all()  # every row starts with its first pair's chosen
    assert len(val) == 2
    dm.teardown("fit")

    # A language-model batch never carries `preference`.
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"c{i}", "completion": "w1 w2"} for i in range(20)])
    sft = Step35DataModule(files=str(tmp_path / "c.jsonl"), tokenizer=str(tok_dir), seq_len=12, val_batches=0)
    sft.setup("fit")
    assert "preference" not in next(iter(sft.train_dataloader())) and not sft.preference
    sft.teardown("fit")

    # Mixed sources: refused, naming them.
    mixed = Step35DataModule(sources=[sources[0], {"path": str(tmp_path / "c.jsonl"), "name": "sft"}],
                             tokenizer=str(tok_dir), val_batches=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"preference source\(s\) \['jsonl'\] cannot be mixed with the"
                                         r" prompt_completion source\(s\) \['sft'\]"):  # fmt: skip
        mixed.setup("fit")
    with pytest.raises(ValueError, match="data.train_on: all trains prompt tokens"):
        Step35DataModule(sources=sources[:1], tokenizer=str(tok_dir), train_on="all", val_batches=0).setup("fit")


def test_preference_files_read_as_sft_say_to_use_dpo(tmp_path, tok_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": f"c{i}", "chosen": "w1 w2", "rejected": "w3"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    write_jsonl(tmp_path / "p.jsonl", records)
    dm = Step35DataModule(sources=[{"path": str(tmp_path / "p.parquet"), "format": "chat"}], tokenizer=str(tok_dir),
                          val_batches=0)  # fmt: skip
    with pytest.raises(ValueError, match="preference pairs .* not chat records: train on them with --model.objective"
                                         " dpo and data.format: preference"):  # fmt: skip
        dm.setup("fit")
    dm = Step35DataModule(sources=[{"path": str(tmp_path / "p.jsonl"), "format": "prompt_completion"}],
                          tokenizer=str(tok_dir), seq_len=8, val_batches=0)  # fmt: skip
    dm.setup("fit")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'p.jsonl'}:1: the records are preference pairs .* not"
                                         " prompt_completion records: train on them with --model.objective dpo"):  # fmt: skip
        next(iter(dm.train_dataloader()))
    dm.teardown("fit")
    with pytest.raises(ValueError, match="a preference source needs columns 'chosen' and 'rejected'"):
        pq.write_table(pa.table({"text": ["w1"]}), tmp_path / "t.parquet")
        Step35DataModule(sources=[{"path": str(tmp_path / "t.parquet"), "format": "preference"}],
                         tokenizer=str(tok_dir), val_batches=0).setup("fit")  # fmt: skip


# -- the built-in pairs ----------------------------------------------------------------------------------------


def test_the_builtin_pairs_prefer_the_sft_reply_to_another_questions(builtin_cache, caplog):
    conversations = [c["messages"] for c in builtin_conversations()]
    pairs = builtin_preference_pairs()
    assert pairs == builtin_preference_pairs()  # deterministic
    assert len(pairs) == len(conversations) > 400
    answers = {json.dumps(m[-1]) for m in conversations}
    for messages, pair in zip(conversations, pairs):
        assert pair["prompt"] + pair["chosen"] == messages  # chosen: the SFT reply, after the same prompt
        assert pair["rejected"] != pair["chosen"] and json.dumps(pair["rejected"][0]) in answers
    assert sum(len(p["prompt"]) > 1 for p in pairs) > 100  # multi-turn prompts: an earlier answer as context

    caplog.set_level("INFO")
    dm = Step35DataModule(format="preference", seq_len=320, micro_batch_size=2, cache_dir=str(builtin_cache),
                          val_batches=1)  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    assert dm._train_sources[0].name == "builtin-preference" and dm.preference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlongWarning)
        batch = next(iter(dm.train_dataloader()))
    tokenizer = dm.tokenizer
    replies = {m[-1]["content"] for m in conversations}
    for row in range(2):
        labels, preference = batch["labels"][row], batch["preference"][row]
        for q in range(int(preference.max()) + 1):
            text = tokenizer.decode(labels[(preference == q) & (labels != IGNORE)].tolist())
            assert any(text.rstrip("\n") in reply or reply[1:] in text for reply in replies), text
    dm.teardown("fit")


def test_the_datamodule_checkpoint_entry_resumes_pairs_exactly_with_workers(tmp_path, tok_dir):
    """state_dict / load_state_dict of the DataModule (two DataLoader workers, as a checkpoint holds it) give the
    same following batches; document_masking keeps the packer's positions for pairs (an EOS inside a prompt
    starts no document)."""
    rng = random.Random(8)
    write_jsonl(tmp_path / "p.jsonl", [conversational_pair(i, rng) for i in range(40)])

    def datamodule() -> Step35DataModule:
        dm = Step35DataModule(files=str(tmp_path / "p.jsonl"), tokenizer=str(tok_dir), seq_len=40,
                              micro_batch_size=2, num_workers=2, val_batches=0, document_masking=True)  # fmt: skip
        dm.setup("fit")
        return dm

    dm = datamodule()
    batches = iter(dm.train_dataloader())
    [next(batches) for _ in range(4)]
    torch.save(dm.state_dict(), tmp_path / "datamodule_state.pt")
    entry = torch.load(tmp_path / "datamodule_state.pt", weights_only=True)
    expected = [as_lists(next(batches)) for _ in range(8)]  # past an epoch of each worker's 20 pairs
    dm.teardown("fit")
    masked = dm.on_before_batch_transfer({key: torch.tensor(v) for key, v in expected[0].items()}, 0)
    assert masked["position_ids"].tolist() == expected[0]["position_ids"]
    by_eos = [document_positions(torch.tensor(b["input_ids"])[:, :-1], [WORD_EOS]).tolist() for b in expected]
    assert any(p != b["position_ids"] for p, b in zip(by_eos, expected))  # restarts after a two-turn prompt's EOS

    resumed = datamodule()
    resumed.load_state_dict(entry)
    replay = iter(resumed.train_dataloader())
    assert [as_lists(next(replay)) for _ in range(8)] == expected
    resumed.teardown("fit")
