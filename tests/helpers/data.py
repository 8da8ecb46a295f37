"""Data files and token streams: JSON-lines files of records, documents that name themselves (DOC_WORDS: every
token traces back to its document), the first batches of a loader, and the check that a StatefulDataLoader
restored from a saved state replays the rest of the stream exactly; and a record as a reader hands it to the
encoders."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests.helpers.tokenizers import word_tokenizer_folder


def write_jsonl(path: Path, records: list) -> Path:
    """`records` as JSON lines at `path`: a dict as it is, a string as {"text": string}."""
    import json

    path.write_text("".join(json.dumps({"text": r} if isinstance(r, str) else r) + "\n" for r in records))
    return path


# Documents that name themselves (the token stream tests): document i starts with the word `d{i}`, so every
# token of every window traces back to its document.
DOC_WORDS = [f"d{i}" for i in range(2000)] + [f"w{i}" for i in range(50)] + ["a", "b"]


def make_word_tokenizer(folder: Path):
    """The TextTokenizer of DOC_WORDS, saved at `folder`."""
    from step35.data.tokenizer import TextTokenizer

    return TextTokenizer.from_folder(word_tokenizer_folder(folder, DOC_WORDS))


def doc_id(token: int) -> int:
    """The document a token of DOC_WORDS comes from (its `d{i}` word)."""
    return int(DOC_WORDS[token - 2][1:])


def take(loader, n: int) -> list[torch.Tensor]:
    """The input_ids of the first `n` batches of `loader`."""
    batches = []
    for batch in loader:
        batches.append(batch["input_ids"])
        if len(batches) == n:
            break
    return batches


def worker_stack_on_hang(worker_id: int) -> None:
    """A DataLoader `worker_init_fn`: a worker still alive 50 s after it started prints every thread's stack to
    stderr (the test's captured output), once. With the loader's `timeout` of 70 s, a hung forked worker (seen
    once in a full parallel run, never reproduced alone) fails its test showing where it hangs."""
    import faulthandler

    faulthandler.dump_traceback_later(50.0)


def resume_matches(make_stream, num_batches: int, save_at: list[int], batch_size: int = 2) -> list[dict]:
    """Run once recording a state after `save_at` batches; every restored run must replay the rest exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader_of(stream):
        return StatefulDataLoader(
            stream, batch_size=batch_size, num_workers=2, worker_init_fn=worker_stack_on_hang, timeout=70
        )

    reference, states = [], {}
    loader = loader_of(make_stream())
    for batch in loader:
        reference.append(batch["input_ids"])
        if len(reference) in save_at:
            states[len(reference)] = copy.deepcopy(loader.state_dict())
        if len(reference) == num_batches:
            break
    for k, state in states.items():
        restored = loader_of(make_stream())
        restored.load_state_dict(state)
        replay = take(restored, num_batches - k)
        assert len(replay) == num_batches - k
        for i, (a, b) in enumerate(zip(replay, reference[k:])):
            assert torch.equal(a, b), f"state after batch {k}: batch {k + i} differs"
    return list(states.values())


class RecordAt:
    """A record of `value` read at `where`, as a reader hands it to the encoders (step35.data.readers.Record's
    value() and where(), without a file)."""

    def __init__(self, value, where: str = "data.jsonl:3"):
        self._value, self._where = value, where

    def value(self):
        return self._value

    def where(self) -> str:
        return self._where
