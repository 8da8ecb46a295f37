"""A conversation costs what its window needs, not what its length is; preference files stated as conversations
are refused (chat_template.py's `ChatTemplate.encode_prefix`, sft.py's `SftEncoder(window=...)` and format
detection).

Measured on the shared 2-core test machine (7 users at once), in this process:

- A 20 MB assistant message through the stream (seq_len 1024, ChatML-style template without marks, this
  file's byte-level BPE): 2-4 s and 0.12-0.15 GB of peak RSS growth (with marks: 2.8 s, 0.14 GB). Encoded whole
  as before, the same stream took 52 s and 2.8 GB here (the issue measured 31 s and 5.1 GB with its tokenizer).
- Masking without `{% generation %}` marks, a window of 512 tokens, `rounds` below: Step-3.5-style template
  (step-b) 1,000 assistant turns 0.8 s, 2,000 1.4 s, 10,000 3.0 s (of which 1.8 s is the one rendering of the
  whole conversation); ChatML-style 0.8 s, 1.0 s, 2.2 s. Before, every turn was located on the whole
  rendering: 1,000 turns 3.0 s, 2,000 11.9 s on a quiet machine (244 s for 1,000 here), and 10,000 ran into
  the 10-minute watchdog.
- The labels of the window are those the whole conversation gives: compared here on 30-round conversations
  (about 100 messages) for every test template, with and without marks, every `train_on`, with reasoning
  trained or not, at several window sizes (the whole computation being quadratic, 300 turns would take
  minutes here).
"""

from __future__ import annotations

import json
import resource
import time
import warnings

import psutil
import pytest

from step35.data import Step35DataModule
from step35.data.bad_records import OverlongWarning
from step35.data.chat_template import ChatTemplate
from step35.data.packing import conversation_window
from step35.data.sft import SftEncoder
from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer
from tests.helpers import (
    CONVERSATION,
    SOURCES,
    SPECIAL,
    TOOLS,
    RecordAt,
    chat_source,
    make_chat_tokenizer,
    marked,
    plain,
    train_byte_bpe,
    write_jsonl,
)

SENTENCE = "The quick brown fox jumps over the lazy dog. "
BIG = SENTENCE * (20_000_000 // len(SENTENCE))  # 20 MB of text


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    """A byte-level BPE trained here (as in test_chat_template.py), EOS = the templates' `<|im_end|>`."""
    folder = tmp_path_factory.mktemp("cost-tokenizer")
    tokenizer = train_byte_bpe(
        [json.dumps(CONVERSATION), json.dumps(TOOLS), SENTENCE * 20], ["<|endoftext|>", *SPECIAL], folder
    )
    return TextTokenizer.from_folder(folder, eos_token_id=tokenizer.token_to_id("<|im_end|>"))


def measured(run):
    """(run(), peak RSS growth in bytes, seconds). The growth is the process's peak after the call less its
    RSS before it, so an earlier, higher peak can only make it read larger."""
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return result, max(0, peak - before), seconds


# -- item 1: one huge message --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_a_20mb_assistant_message_costs_a_window(tmp_path, tok, mode):
    """Through the stream, as training reads it: the 20 MB conversation is truncated to its window (the same
    tokens and labels as a short conversation with the same start, tokenized whole) or dropped, and counted
    either way, within ~1 GB and seconds. Before the fix the encoder tokenized it whole: 2.8 GB, 52 s here."""
    template = ChatTemplate(plain("chatml"), "chatml")
    seq_len = 1024
    start = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a lot."}]
    small = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    path = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [*start, {"role": "assistant", "content": BIG}]}, {"messages": small},
    ])  # fmt: skip
    stream = TokenWindows([chat_source("chat", [path], shuffle=False)], tok, seq_len=seq_len, endless=False,
                          template=template, overlong=mode)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        windows, grown, seconds = measured(lambda: list(stream))
    state = stream.state_dict()["sources"][0]
    reports = [str(w.message) for w in caught if issubclass(w.category, OverlongWarning)]
    assert grown < 1 << 30, f"peak RSS grew by {grown / 2**20:.0f} MB"
    assert seconds < 60, f"{seconds:.1f} s"

    window = seq_len + 1
    eos = tok.eos_token_id
    short = template.encode(tok, [*start, {"role": "assistant", "content": SENTENCE * 4000}])  # > a window, whole
    assert len(short[0]) > window
    expected_small = template.encode(tok, small)
    if mode == "truncate":
        assert (state["truncated"], state["dropped"]) == (1, 0)
        expected = [
            conversation_window([(short[0][:window], short[1][:window])], window, eos),
            conversation_window([expected_small], window, eos),
        ]
        assert reports[0].startswith(f"truncating the conversation at {path}:1: more than {window} tokens")
    else:
        assert (state["truncated"], state["dropped"]) == (0, 1)
        expected = [conversation_window([expected_small], window, eos)]
        assert reports[0].startswith(f"dropping the conversation at {path}:1: more than {window} tokens")
    got = [(w["input_ids"].tolist(), w["labels"].tolist(), w["position_ids"].tolist()) for w in windows]
    assert got == [tuple(map(list, e)) for e in expected]


@pytest.mark.parametrize("source", ["chatml", "marked-chatml"])
def test_encode_prefix_of_a_20mb_message_equals_the_whole_encoding_of_a_short_one(tok, source):
    """Both ways of finding spans (marks, sentinels): the first tokens and their mask are those of the whole
    encoding of a conversation with the same start; the count is said unknown (None)."""
    template = ChatTemplate(marked("chatml") if source.startswith("marked") else plain("chatml"), source)
    head = [{"role": "user", "content": "Write a lot."}]
    (ids, mask, total), grown, seconds = measured(
        lambda: template.encode_prefix(tok, [*head, {"role": "assistant", "content": BIG}], 3000)
    )
    short_ids, short_mask = template.encode(tok, [*head, {"role": "assistant", "content": SENTENCE * 4000}])
    assert (ids, mask, total) == (short_ids[:3000], short_mask[:3000], None)
    assert grown < 1 << 30 and seconds < 60, (grown, seconds)
    # A short conversation is counted exactly, and the same with or without a limit.
    assert template.encode_prefix(tok, [*head, {"role": "assistant", "content": "Done."}], 3000)[2] == len(
        template.encode(tok, [*head, {"role": "assistant", "content": "Done."}])[0]
    )


def test_prompt_completion_strings_cost_a_window(tok):
    """A 20 MB prompt string is tokenized only as far as the window needs (in pieces, as text documents)."""
    encoder = SftEncoder("prompt_completion", tok, window=100)

    example, grown, seconds = measured(
        lambda: encoder(RecordAt({"prompt": BIG, "completion": "Done."}, "pairs.jsonl:1"))
    )
    assert (len(example.ids), example.complete, example.size) == (101, False, "more than 100")
    assert example.ids == tok.encode(SENTENCE * 100)[:101] and not any(example.trained)
    assert grown < 1 << 30 and seconds < 60, (grown, seconds)
    small = encoder(
        RecordAt({"prompt": SENTENCE * 20, "completion": "Done."}, "pairs.jsonl:1")
    )  # over the window, counted exactly
    whole = tok.encode(SENTENCE * 20) + tok.encode("Done.") + [tok.eos_token_id]
    assert (small.ids, small.size) == (whole[:101], str(len(whole)))


# -- item 2: many turns ----------------------------------------------------------------------------------------


def rounds(n: int) -> list[dict]:
    """`n` rounds of the shapes the templates treat differently: reasoning as a field and inline, tool calls and
    their results, a user message that is a tool result in disguise (Step-style templates do not count it as
    the last user message), turns after the last user message (whose reasoning Step-style templates keep)."""
    messages = [{"role": "system", "content": "You are a careful helper."}]
    for i in range(n):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} plus {i}?"})
        if i % 3 == 0:
            messages.append({"role": "assistant", "reasoning_content": f"Add {i} to itself.", "content": f"{2 * i}."})
        elif i % 3 == 1:
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": i, "b": i}}}
            messages.append({"role": "assistant", "content": "", "reasoning": "Use the tool.", "tool_calls": [call]})
            messages.append({"role": "tool", "content": f"{2 * i}"})
            messages.append(
                {"role": "assistant", "content": f"<think>\nThe tool said {2 * i}.\n</think>\nIt is {2 * i}."}
            )
        else:
            messages.append({"role": "assistant", "content": f"It is {2 * i}."})
            messages.append({"role": "user", "content": f"<tool_response>{i}</tool_response>"})
            messages.append({"role": "assistant", "reasoning_content": "A late result.", "content": "Noted."})
    return messages


CASES = (
    [(name, "assistant", True) for name in SOURCES]
    + [(name, "last_assistant", True) for name in SOURCES]
    + [(name, train_on, False) for name in SOURCES for train_on in ("assistant", "all")]
)


@pytest.mark.parametrize("marks", [False, True], ids=["plain", "marked"])
@pytest.mark.parametrize("name,train_on,train_reasoning", CASES)
def test_the_window_of_a_long_conversation_has_the_labels_of_the_whole(tok, name, train_on, train_reasoning, marks):
    """encode_prefix (located on a cut of the conversation) gives, for every window size, the tokens and mask
    the whole conversation gives (located on the whole rendering), including windows that end inside a turn,
    right after one, and in a history-rewriting template's dropped reasoning."""
    if marks and train_reasoning:
        pytest.skip("marked templates find their spans in one rendering: nothing is cut")
    template = ChatTemplate(marked(name) if marks else plain(name), name)
    messages = rounds(30)
    options = {"train_on": train_on, "train_reasoning": train_reasoning, "tools": TOOLS}
    ids, mask = template.encode(tok, messages, **options)
    for window in (7, 40, 97, 256, 600, 1500):
        assert window < len(ids)
        got = template.encode_prefix(tok, messages, window, **options)
        assert got == (ids[:window], mask[:window], len(ids)), f"window {window}"
    assert any(mask[:600]) or train_on == "last_assistant"


@pytest.mark.parametrize("name", ["chatml", "step-b"])
def test_10000_turns_mask_in_seconds(tok, name):
    """Before: every turn was located on the whole rendering, ~4 renderings of all messages per turn, so a
    10,000-turn record stalled (1,000 turns took 3 s on a quiet machine, 244 s on this one)."""
    template = ChatTemplate(plain(name), name)
    messages = rounds(6000)  # 10,000 assistant turns
    assert sum(m["role"] == "assistant" for m in messages) == 10_000
    (ids, mask, total), _, seconds = measured(lambda: template.encode_prefix(tok, messages, 512, tools=TOOLS))
    assert seconds < 60, f"{seconds:.1f} s"
    assert len(ids) == 512 and any(mask)
    small = rounds(40)  # the same first messages: the whole computation gives the same window
    whole_ids, whole_mask = template.encode(tok, small, tools=TOOLS)
    assert (ids, mask) == (whole_ids[:512], whole_mask[:512])


# -- item 3: preference files ----------------------------------------------------------------------------------


PAIRS = [{"prompt": f"w{i}", "chosen": "w1 w2", "rejected": "w3"} for i in range(5)]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_preference_file_is_refused_naming_it(tmp_path, suffix):
    """Before: no format told, so the source was text and the text-field check said 'set text_field'; set to
    `chosen`, it trained on the chosen answers as plain text and ignored the rejected ones. Now (issue 26) `auto`
    reads such a file as preference pairs (tests/test_preference_data.py), and a file stated as a conversation
    format is refused, naming it and the way to train on it (DPO)."""
    tok_dir = make_chat_tokenizer(tmp_path / "tok", template=True)
    path = tmp_path / f"pairs.{suffix}"
    if suffix == "jsonl":
        write_jsonl(path, PAIRS)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(PAIRS), path)
    for source in ({"path": str(path)}, {"path": str(path), "text_field": "chosen"}):
        dm = Step35DataModule(sources=[source], tokenizer=str(tok_dir), seq_len=8, val_batches=0)
        dm.setup("fit")
        assert dm._train_sources[0].format == "preference"
    named = f"{path}:1" if suffix == "jsonl" else str(path)
    dm = Step35DataModule(sources=[{"path": str(path), "format": "chat"}], tokenizer=str(tok_dir), seq_len=8,
                          val_batches=0)  # fmt: skip
    with pytest.raises(ValueError) as error:
        dm.setup("fit")  # parquet: by its columns
        next(iter(dm.train_dataloader()))  # jsonl: at its first record
    message = str(error.value)
    assert message.startswith(f"{named}: the records are preference pairs (prompt/chosen/rejected), not chat")
    assert "train on them with --model.objective dpo and data.format: preference" in message
    # Stated as text, one field is trained as plain text: the way out the message names.
    dm = Step35DataModule(sources=[{"path": str(path), "format": "text", "text_field": "chosen"}],
                          tokenizer=str(tok_dir), seq_len=4, micro_batch_size=1, val_batches=0)  # fmt: skip
    dm.setup("fit")
    assert dm._train_sources[0].format == "text"
    dm.teardown("fit")
