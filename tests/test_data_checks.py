"""Data that cannot work fails fast and by name: a resume into changed data, a wrong text field, a holdout that
takes a source's only document."""

import json
import shutil
import warnings
from pathlib import Path

import pytest

from step35.data import Step35DataModule
from step35.data.readers import FIELD_CHECK_RECORDS
from step35.data.resume import DataChangedError, DataChangedWarning
from step35.data.sources import FileSource, Holdout
from step35.data.stream import TokenWindows
from tests.helpers import doc_id, make_word_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_word_tokenizer(tmp_path_factory.mktemp("word_tokenizer"))


def docs(first: int, count: int) -> list[str]:
    """Documents of 5 tokens: with EOS, each fills one window of seq_len=5 (+1), so a window names its document."""
    return [f"d{i} " + " ".join(f"w{(i + k) % 50}" for k in range(4)) for i in range(first, first + count)]


def windows(stream: TokenWindows, n: int) -> list[list[int]]:
    it = iter(stream)
    return [next(it)["input_ids"].tolist() for _ in range(n)]


def saved_after(files: list[Path], tok, n: int, **kwargs) -> dict:
    stream = TokenWindows([FileSource("corpus", files, shuffle=False)], tok, seq_len=5, **kwargs)
    windows(stream, n)
    return stream.state_dict()


def resumed(files: list[Path], tok, state: dict, n: int, **kwargs) -> list[list[int]]:
    stream = TokenWindows([FileSource("corpus", files, shuffle=False)], tok, seq_len=5, **kwargs)
    stream.load_state_dict(state)
    return windows(stream, n)


def test_a_line_deleted_before_the_cursor_restarts_the_source_and_says_so(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", docs(0, 30))
    state = saved_after([a], tok, 10)  # every document is one window: the cursor is at document 10
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataChangedWarning)
        assert doc_id(resumed([a], tok, state, 1)[0][0]) == 10  # unchanged data: exact resume, no warning

    write_jsonl(a, docs(0, 3) + docs(4, 26))  # document 3 deleted: byte offset 10 is now inside document 11
    with pytest.warns(DataChangedWarning, match=r"source 'corpus': .*a\.jsonl changed .* restarts from its beginning"):
        after = resumed([a], tok, state, 2)
    assert [doc_id(w[0]) for w in after] == [0, 1]  # the source's stream restarted, not mid-document

    with pytest.raises(DataChangedError, match=r"a\.jsonl changed .*strict=True"):
        resumed([a], tok, state, 1, strict=True)


@pytest.mark.timeout(120)
def test_the_datamodule_checkpoint_carries_the_check_through_a_worker(tmp_path, tok):
    """The whole chain: the DataModule's checkpoint entry (saved, loaded weights-only), a DataLoader worker."""
    import torch

    a = write_jsonl(tmp_path / "a.jsonl", docs(0, 40))
    options = dict(files=str(a), tokenizer=str(tok.path), seq_len=5, micro_batch_size=2, val_fraction=0)
    saved = {}
    for workers in (0, 1):  # a position saved by each layout
        dm = Step35DataModule(num_workers=workers, **options)
        drawn = [b["input_ids"] for _, b in zip(range(4), dm.train_dataloader())]
        torch.save(dm.state_dict(), tmp_path / "data.pt")
        dm.teardown()
        saved[workers] = torch.load(tmp_path / "data.pt", weights_only=True)

    write_jsonl(a, docs(0, 2) + docs(3, 37))  # a line deleted before the cursor (document 8)
    strict = Step35DataModule(num_workers=1, strict=True, **options)
    strict.load_state_dict(saved[1])
    with pytest.raises(DataChangedError, match=r"a\.jsonl changed \(\d+ bytes then, \d+ now\)"):
        next(iter(strict.train_dataloader()))
    strict.teardown()

    lenient = Step35DataModule(num_workers=0, **options)
    lenient.load_state_dict(saved[0])
    with pytest.warns(DataChangedWarning, match="restarts from its beginning"):
        first = next(iter(lenient.train_dataloader()))["input_ids"]
    assert torch.equal(first, drawn[0])  # documents 0 and 1, as at the very start


def test_a_changed_file_list_restarts_and_a_copied_corpus_resumes(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", docs(0, 20))
    b = write_jsonl(tmp_path / "b.jsonl", docs(20, 20))
    state = saved_after([a, b], tok, 25)
    with pytest.warns(DataChangedWarning, match="its list of files changed"):
        resumed([a], tok, state, 1)

    # A copy (new modification times, new folder) holds the same data: the resume continues exactly.
    copy = tmp_path / "copy"
    copy.mkdir()
    moved = [Path(shutil.copy(f, copy / f.name)) for f in (a, b)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataChangedWarning)
        assert doc_id(resumed(moved, tok, state, 1)[0][0]) == 25


def test_records_without_the_text_field_fail_within_the_first_records(tmp_path, tok):
    rows = [{"content": text, "id": i} for i, text in enumerate(docs(0, 500))]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = (
        rf"none of the first {FIELD_CHECK_RECORDS} records read has the text field 'text'"
        r".*'content', 'id'.*did you mean 'content'"
    )

    # The stream stops after FIELD_CHECK_RECORDS records, not after an epoch of 500 skipped records.
    stream = TokenWindows([FileSource("c", [tmp_path / "c.jsonl"])], tok, seq_len=5)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match=expected):
        windows(stream, 1)
    assert sum("no 'text' field" in str(w.message) for w in caught) <= 10  # not a whole epoch of reports

    # The DataModule says it at setup, before any loader exists.
    dm = Step35DataModule(files=str(tmp_path / "c.jsonl"), tokenizer=str(tok.path), seq_len=5)
    with pytest.raises(ValueError, match=expected):
        dm.setup()
    # Strict mode names the field on the first record.
    with pytest.raises(ValueError, match="no 'text' field .*did you mean 'content'"):
        windows(TokenWindows([FileSource("c", [tmp_path / "c.jsonl"])], tok, seq_len=5, strict=True), 1)

    # A source smaller than that: the end of its first epoch says it, not the advice about ranks x workers.
    (tmp_path / "small.jsonl").write_text(json.dumps({"txt": "d1"}) + "\n" + "{oops\n" * 4)
    with warnings.catch_warnings(record=True), pytest.raises(ValueError, match=r"first 1 records read .*'txt'"):
        windows(TokenWindows([FileSource("small", [tmp_path / "small.jsonl"])], tok, seq_len=5), 1)

    # A few bad records among good ones are still skipped, not a wrong field.
    good = "".join(json.dumps({"text": t}) + "\n" for t in docs(0, 50))
    (tmp_path / "mixed.jsonl").write_text('{"body": "x"}\n' * 5 + good)
    Step35DataModule(files=str(tmp_path / "mixed.jsonl"), tokenizer=str(tok.path), seq_len=5).setup()


def held_out_name(fraction: float) -> str:
    """A file name whose only document the holdout of `fraction` keeps for validation."""
    return next(f"book{i}.txt" for i in range(10_000) if Holdout(fraction, "val").keeps(f"book{i}.txt:0"))


def test_the_default_holdout_taking_the_only_document_is_said(tmp_path, tok):
    book = tmp_path / held_out_name(0.01)
    book.write_text("\n".join(docs(0, 40)))
    dm = Step35DataModule(files=str(book), tokenizer=str(tok.path), seq_len=5)  # txt_mode: file, val_fraction unset
    expected = rf"holdout \(val_fraction=0.01\) takes its only document, .*{book.name}.*val_fraction: 0"
    with pytest.raises(ValueError, match=expected):
        dm.setup()
    # The ways out the message names work.
    Step35DataModule(files=str(book), tokenizer=str(tok.path), seq_len=5, val_fraction=0).setup()
    Step35DataModule(files=str(book), tokenizer=str(tok.path), seq_len=5, txt_mode="line").setup()
