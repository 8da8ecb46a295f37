"""The token-window stream: sharding, packing, exact resume, mixing, file formats and bad records.

Documents are made identifiable with a word-level test tokenizer: document i starts with the word `d{i}`,
so every token of every window traces back to its document.
"""

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from step35.data.bad_records import REPORTS_PER_SOURCE, BadRecordError, BadRecords, BadRecordWarning
from step35.data.hub import HubSource
from step35.data.sources import Cursor, FileSource, Holdout
from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer
from tests.helpers import WORD_EOS, doc_id, make_word_tokenizer, resume_matches, take, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    return make_word_tokenizer(tmp_path_factory.mktemp("word_tokenizer"))


def make_docs(first: int, count: int, rng: random.Random, lengths: tuple[int, int]) -> list[str]:
    ids = range(first, first + count)
    return [f"d{i} " + " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(*lengths))) for i in ids]


@pytest.mark.timeout(120)
def test_two_ranks_two_workers_see_every_document_once_per_epoch(tmp_path, tok):
    # Every document is 7 tokens + EOS = one window, so a window names its document: no tail to account for.
    rng = random.Random(0)
    files = [write_jsonl(tmp_path / f"part{k}.jsonl", make_docs(20 * k, 20, rng, (6, 6))) for k in range(3)]
    source = FileSource("corpus", files)
    seen = {"finite": [], "epoch0": [], "epoch1": []}
    for rank in range(2):
        finite = TokenWindows([source], tok, seq_len=7, rank=rank, world_size=2, endless=False)
        batches = list(StatefulDataLoader(finite, batch_size=3, num_workers=2))
        seen["finite"] += [doc_id(t) for b in batches for t in b["input_ids"][:, 0].tolist()]
        assert all((b["input_ids"][:, -1] == WORD_EOS).all() for b in batches)

        # The endless stream: 60 documents / 4 shards = 15 windows per worker = 5 batches per worker per epoch,
        # and workers alternate batches, so 10 batches per rank make one epoch.
        endless = TokenWindows([source], tok, seq_len=7, rank=rank, world_size=2, endless=True)
        batches = take(StatefulDataLoader(endless, batch_size=3, num_workers=2), 20)
        seen["epoch0"] += [doc_id(t) for b in batches[:10] for t in b[:, 0].tolist()]
        seen["epoch1"] += [doc_id(t) for b in batches[10:] for t in b[:, 0].tolist()]
    for name, ids in seen.items():
        assert sorted(ids) == list(range(60)), name


def test_shards_split_documents_without_overlap_or_gap(tmp_path, tok):
    rng = random.Random(1)
    files = [write_jsonl(tmp_path / f"p{k}.jsonl", make_docs(13 * k, 13, rng, (1, 9))) for k in range(3)]
    source = FileSource("corpus", files)
    owned = []
    for shard in range(4):
        documents = source.documents(Cursor(), shard, 4, BadRecords("c", False), False)
        owned += [int(text.split()[0][1:]) for _, _, text in documents]
    assert sorted(owned) == list(range(39))


def test_packing_keeps_every_token(tmp_path, tok):
    rng = random.Random(2)
    texts = make_docs(0, 40, rng, (0, 30))
    (tmp_path / "a.txt").write_text("\n".join(texts[:25]) + "\n\n")  # line mode; blank lines are no documents
    write_jsonl(tmp_path / "b.jsonl", texts[25:])
    source = FileSource("mixed", [tmp_path / "a.txt", tmp_path / "b.jsonl"], txt_mode="line", shuffle=False)
    expected = [t for text in texts for t in tok.encode(text) + [WORD_EOS]]

    window = 17
    got = [w["input_ids"] for w in TokenWindows([source], tok, seq_len=window - 1, endless=False)]
    assert all(len(w) == window for w in got)
    flat = torch.cat(got).tolist()
    tail = len(expected) - len(flat)
    assert flat == expected[: len(flat)]
    assert 0 < tail < window  # only the final partial window is dropped (this corpus leaves one)

    # An endless stream carries the leftover of an epoch into the next one: nothing is dropped.
    shuffled = FileSource("mixed", [tmp_path / "a.txt", tmp_path / "b.jsonl"], txt_mode="line", seed=3)
    by_file = {str(tmp_path / "a.txt"): texts[:25], str(tmp_path / "b.jsonl"): texts[25:]}
    texts_in_order = [text for e in (0, 1) for f in shuffled.epoch_files(e) for text in by_file[f]]
    two_epochs = [t for text in texts_in_order for t in tok.encode(text) + [WORD_EOS]]
    stream = iter(TokenWindows([shuffled], tok, seq_len=window - 1, endless=True))
    n = len(two_epochs) // window
    flat = torch.cat([next(stream)["input_ids"] for _ in range(n)]).tolist()
    assert flat == two_epochs[: n * window]


def worker_epochs(loader_state: dict) -> list[int]:
    workers = loader_state["_snapshot"]["_worker_snapshots"].values()
    return [w["dataset_state"]["sources"][0]["cursor"][0] for w in workers]


@pytest.mark.timeout(120)
def test_resume_mid_epoch_and_across_epoch_boundaries(tmp_path, tok):
    rng = random.Random(4)
    files = [write_jsonl(tmp_path / f"p{k}.jsonl", make_docs(12 * k, 12, rng, (5, 30))) for k in range(2)]
    source = FileSource("corpus", files, seed=7)
    # About 14 batches per epoch here: the saves fall mid-epoch, and the replays cross one to three epochs.
    states = resume_matches(lambda: TokenWindows([source], tok, seq_len=15), 45, save_at=[5, 14, 23, 30])
    assert max(worker_epochs(states[-1])) >= 1  # the later saves are past an epoch boundary


@pytest.mark.timeout(120)
def test_resume_with_two_weighted_sources(tmp_path, tok):
    rng = random.Random(5)
    a = write_jsonl(tmp_path / "a.jsonl", [f"d{i} " + " ".join(["a"] * rng.randint(3, 20)) for i in range(15)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"d{i} " + " ".join(["b"] * rng.randint(3, 20)) for i in range(15, 30)])
    sources = [FileSource("a", [a]), FileSource("b", [b])]
    resume_matches(lambda: TokenWindows(sources, tok, seq_len=9, weights=[0.7, 0.3], seed=11), 40, save_at=[3, 17, 26])


def test_mixing_weights_give_token_shares(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [f"d{i} " + " ".join(["a"] * 40) for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"d{i} " + " ".join(["b"] * 40) for i in range(10, 20)])
    stream = iter(TokenWindows([FileSource("a", [a]), FileSource("b", [b])], tok, seq_len=7, weights=[3, 1], seed=1))
    n = 4000
    from_a = sum(tok.encode("a")[0] in next(stream)["input_ids"].tolist() for _ in range(n))
    # A window comes from one source, so its share of windows is its share of tokens. The binomial standard
    # deviation at n=4000 is 0.007; 0.03 is over four of them.
    assert abs(from_a / n - 0.75) < 0.03


def test_holdout_splits_train_and_validation_disjointly(tmp_path, tok):
    texts = make_docs(0, 200, random.Random(6), (1, 5))
    path = write_jsonl(tmp_path / "c.jsonl", texts)

    def ids(keep):
        source = FileSource("c", [path], holdout=Holdout(0.1, keep))
        return [int(t.split()[0][1:]) for _, _, t in source.documents(Cursor(), 0, 1, BadRecords("c", False), False)]

    train, val = ids("train"), ids("val")
    assert sorted(train + val) == list(range(200))
    assert not set(train) & set(val)
    assert 8 <= len(val) <= 35  # 10% of 200, give or take the hash
    assert ids("val") == val  # deterministic


def read_all(source, shard=0, num_shards=1, strict=False) -> tuple[list[str], BadRecords]:
    bad = BadRecords(source.name, strict)
    return [text for _, _, text in source.documents(Cursor(), shard, num_shards, bad, False)], bad


def test_file_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "array.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    (tmp_path / "lines.json").write_text('{"text": "three"}\n{"text": "four"}\n')
    (tmp_path / "doc.txt").write_text("first para\nstill first\n\n\nsecond para\n")
    (tmp_path / "note.md").write_text("# title\n\nbody\n")
    table = pa.table({"text": ["p0", "p1", "p2", "p3", "p4"], "n": [0, 1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)

    files = ["array.json", "lines.json", "doc.txt", "note.md", "t.parquet"]
    paths = [tmp_path / f for f in files]
    assert read_all(FileSource("s", paths, shuffle=False))[0] == [
        "one", "two", "three", "four", "first para\nstill first\n\n\nsecond para\n", "# title\n\nbody\n",
        "p0", "p1", "p2", "p3", "p4",
    ]  # fmt: skip
    assert read_all(FileSource("s", paths[2:4], txt_mode="paragraph", shuffle=False))[0] == [
        "first para\nstill first", "second para", "# title", "body",
    ]  # fmt: skip
    lines = read_all(FileSource("s", paths[2:3], txt_mode="line", shuffle=False))[0]
    assert lines == ["first para", "still first", "second para"]

    # Cursors resume inside a file: a paragraph by byte offset, a parquet row past skipped row groups.
    source = FileSource("s", paths[2:3] + paths[4:], txt_mode="paragraph", shuffle=False)
    docs = list(source.documents(Cursor(), 0, 1, BadRecords("s", False), False))
    for k, (start, _, _text) in enumerate(docs):
        again = [t for _, _, t in source.documents(start, 0, 1, BadRecords("s", False), False)]
        assert again == [t for _, _, t in docs[k:]]


def test_bad_records_are_skipped_counted_and_reported_with_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "d1 w1"}\n'
        b'{"text": "d2 w2"\n'  # line 2: invalid JSON
        b'{"text": "d3 \xff\xfe"}\n'  # line 3: not UTF-8
        b'{"body": "d4"}\n'  # line 4: no text field
        b'{"text": 5}\n'  # line 5: not a string
        b"\n"  # a blank line is no record at all
        b'["d7"]\n'  # line 7: not an object
        b'{"text": "d8 w8"}\n'
    )
    source = FileSource("bad", [path])
    with pytest.warns(BadRecordWarning) as caught:
        texts, bad = read_all(source)
    assert texts == ["d1 w1", "d8 w8"]
    assert bad.count == 5
    reports = [str(w.message) for w in caught]
    expected = [
        (2, "invalid JSON"),
        (3, "UTF-8"),
        (4, "no 'text' field"),
        (5, "not a string"),
        (7, "not a JSON object"),
    ]
    for line, why in expected:
        assert any(f"bad.jsonl:{line}:" in r and why in r for r in reports), (line, reports)

    with pytest.raises(BadRecordError, match=r"bad\.jsonl:2: invalid JSON"):
        read_all(source, strict=True)

    # The count is part of the stream state, so it survives workers and resumes.
    stream = TokenWindows([source], tok, seq_len=1, endless=False)
    with pytest.warns(BadRecordWarning):
        list(stream)
    assert stream.state_dict()["sources"][0]["skipped"] == 5


def test_non_utf8_text_file_is_skipped_by_name(tmp_path):
    (tmp_path / "good.txt").write_text("fine text")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.warns(BadRecordWarning, match=r"latin1\.txt: not valid UTF-8"):
        texts, bad = read_all(FileSource("t", [tmp_path / "good.txt", tmp_path / "latin1.txt"], shuffle=False))
    assert texts == ["fine text"] and bad.count == 1


def test_bad_record_reports_are_rate_limited(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_text("not json\n" * 500 + '{"text": "ok"}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        texts, bad = read_all(FileSource("g", [path]))
    assert texts == ["ok"] and bad.count == 500
    assert len([w for w in caught if issubclass(w.category, BadRecordWarning)]) == REPORTS_PER_SOURCE


@pytest.mark.timeout(60)
def test_a_corpus_of_nothing_raises_instead_of_spinning(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "garbage.jsonl").write_text("{oops\n" * 20 + "\n\n")
    source = FileSource("nothing", [tmp_path / "empty.jsonl", tmp_path / "garbage.jsonl"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadRecordWarning)
        with pytest.raises(RuntimeError, match="no usable document in a whole epoch"):
            next(iter(TokenWindows([source], tok, seq_len=4, endless=True)))


def test_invalid_stream_arguments(tok, tmp_path):
    source = FileSource("s", [write_jsonl(tmp_path / "s.jsonl", ["d1"])])
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows([source], tok, seq_len=0)
    with pytest.raises(ValueError, match="2 weights for 1 sources"):
        TokenWindows([source], tok, seq_len=4, weights=[1, 2])


def test_hub_source_streams_through_datasets(tmp_path):
    folder = tmp_path / "local_dataset"
    folder.mkdir()
    texts = [f"record {i}" for i in range(30)]
    write_jsonl(folder / "train.jsonl", texts)
    source = HubSource(str(folder), split="train")
    assert read_all(source)[0] == texts
    shards = [read_all(source, shard, 3)[0] for shard in range(3)]
    assert sorted(t for s in shards for t in s) == sorted(texts)
    docs = list(source.documents(Cursor(), 1, 3, BadRecords("h", False), False))
    again = [t for _, _, t in source.documents(docs[4][0], 1, 3, BadRecords("h", False), False)]
    assert again == [t for _, _, t in docs[4:]]


def test_eos_rule(tmp_path, tok):
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(tok.path, folder)
    assert TextTokenizer.from_folder(folder).eos_token_id == WORD_EOS  # tokenizer_config.json eos_token
    assert TextTokenizer.from_folder(folder, eos_token_id=5).eos_token_id == 5  # explicit override
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "w3"}}))
    assert TextTokenizer.from_folder(folder).eos_token_id == tok.encode("w3")[0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))  # model configs come before
    assert TextTokenizer.from_folder(folder).eos_token_id == 7
    for name in ("special_tokens_map.json", "generation_config.json"):
        (folder / name).unlink()
    with pytest.raises(ValueError, match="cannot tell the EOS token"):
        TextTokenizer.from_folder(folder)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TextTokenizer.from_folder(folder, eos_token_id=10**6)


def test_validation_batches_are_equal_per_rank_and_disjoint(tmp_path, tok):
    from step35.data.validation import validation_batches

    path = write_jsonl(tmp_path / "v.jsonl", make_docs(0, 30, random.Random(8), (3, 12)))
    source = FileSource("v", [path], shuffle=False)
    per_rank = [validation_batches([source], tok, 7, 2, 3, rank, 3)[0] for rank in range(3)]
    assert [len(b) for b in per_rank] == [3, 3, 3]
    windows = [tuple(w.tolist()) for batches in per_rank for b in batches for w in b["input_ids"]]
    assert len(set(windows)) == len(windows) == 18  # no window on two ranks
    assert per_rank[0][0]["input_ids"].shape == (2, 8)

    tiny = FileSource("tiny", [write_jsonl(tmp_path / "tiny.jsonl", ["d1 w1 w2 w3 w4 w5 w6 w7 w8 w9"])], shuffle=False)
    with pytest.warns(UserWarning, match="repeated"):
        batches, _ = validation_batches([tiny], tok, 7, 2, 2, rank=1, world_size=2)
    assert len(batches) == 2  # still every rank gets its batches
    with pytest.raises(ValueError, match="no window of seq_len"):
        validation_batches([tiny], tok, 63, 2, 2, rank=0, world_size=2)


# -- arrow files, save_to_disk folders and hub streams sharded by file ---------------------------------------


def write_arrow(path: Path, texts: list, field: str = "text", stream_format: bool = False, rows_per_batch: int = 3):
    """An Arrow IPC file (file format, as pyarrow/Feather v2 write it) or stream (as `datasets` writes it)."""
    import pyarrow as pa

    table = pa.table({field: pa.array(texts, pa.string()), "n": list(range(len(texts)))})
    open_writer = pa.ipc.new_stream if stream_format else pa.ipc.new_file
    with open_writer(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=rows_per_batch):
            writer.write_batch(batch)
    return path


def save_to_disk(folder: Path, texts: list[str], field: str = "text", num_shards: int = 3) -> Path:
    from datasets import Dataset

    Dataset.from_dict({field: texts, "n": list(range(len(texts)))}).save_to_disk(str(folder), num_shards=num_shards)
    return folder


def test_arrow_files_both_layouts_resume_inside_a_file_and_report_rows(tmp_path):
    from step35.data.files import check_files

    texts = [f"d{i} w1" for i in range(10)]
    texts[4] = None  # a null: a bad record, reported by row
    paths = [write_arrow(tmp_path / "f.arrow", texts), write_arrow(tmp_path / "s.arrow", texts, stream_format=True)]
    for path in paths:
        source = FileSource("a", [path], shuffle=False)
        with pytest.warns(BadRecordWarning, match=rf"{path.name}: row 4: 'text' is missing or null"):
            docs = list(source.documents(Cursor(), 0, 1, BadRecords("a", False), False))
        assert [t for _, _, t in docs] == [t for t in texts if t is not None]
        for k, (start, _, _) in enumerate(docs):  # resume at every document, across record batches of 3 rows
            again = [t for _, _, t in source.documents(start, 0, 1, BadRecords("a", False), False)]
            assert again == [t for _, _, t in docs[k:]]
    with pytest.raises(ValueError, match=r"f\.arrow: no column 'body'"):
        check_files("a", paths[:1], "body")
    with pytest.raises(ValueError, match=r"s\.arrow: column 'n' holds int64, not strings"):
        check_files("a", paths[1:], "n")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match=r"junk\.arrow: not an Arrow IPC file or stream"):
        check_files("a", [tmp_path / "junk.arrow"], "text")


def test_save_to_disk_folders_are_read_as_their_arrow_shards(tmp_path):
    from datasets import DatasetDict, load_from_disk

    from step35.data.files import expand_files

    texts = [f"d{i} w{i % 50}" for i in range(20)]
    saved = save_to_disk(tmp_path / "saved", texts, num_shards=3)
    files = expand_files([str(saved)])
    assert [f.name for f in files] == [f"data-0000{k}-of-00003.arrow" for k in range(3)]
    assert read_all(FileSource("s", files, shuffle=False))[0] == list(load_from_disk(str(saved))["text"]) == texts
    # Inside a folder, or matched by a glob: the metadata json files are never read as data.
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "extra"}) + "\n")
    assert expand_files([str(tmp_path)]) == [tmp_path / "more.jsonl", *files]
    assert expand_files([str(saved / "*")]) == files
    # A DatasetDict folder: one split of it.
    from datasets import Dataset

    DatasetDict({"train": Dataset.from_dict({"text": texts[:5]}), "test": Dataset.from_dict({"text": texts[5:7]})}
                ).save_to_disk(str(tmp_path / "dd"))  # fmt: skip
    assert read_all(FileSource("t", expand_files([str(tmp_path / "dd")], split="test")))[0] == texts[5:7]
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\], no 'validation'"):
        expand_files([str(tmp_path / "dd")], split="validation")


def hub_folder(folder: Path, files: int, per_file: int) -> Path:
    folder.mkdir()
    for k in range(files):
        write_jsonl(folder / f"part{k:02d}.jsonl", [f"d{k * per_file + i} w{k}" for i in range(per_file)])
    return folder


def test_hub_stream_with_enough_files_is_sharded_by_file(tmp_path, tok):
    folder = hub_folder(tmp_path / "hub", files=8, per_file=5)
    source = HubSource(str(folder), split="train")
    assert len(source.parts) == 8 and source.by_part(4) and not source.by_part(3)
    owned = {shard: read_all(source, shard, 4)[0] for shard in range(4)}
    assert sorted(int(t.split()[0][1:]) for texts in owned.values() for t in texts) == list(range(40))
    # Shard s reads files s and s + 4 only: the others can be garbage without shard s ever seeing them.
    for shard, texts in owned.items():
        assert {int(t.split()[1][1:]) for t in texts} == {shard, shard + 4}
    # 2 ranks x 2 DataLoader workers: every document once (datasets does not split the stream again per worker).
    seen = []
    for rank in range(2):
        finite = TokenWindows([source], tok, seq_len=2, rank=rank, world_size=2, endless=False)  # a window a document
        seen += [doc_id(w[0]) for b in StatefulDataLoader(finite, batch_size=2, num_workers=2) for w in b["input_ids"]]
    assert sorted(seen) == list(range(40))
    for k in (1, 2, 3, 5, 6, 7):
        (folder / f"part{k:02d}.jsonl").write_text("{not json\n")
    assert read_all(HubSource(str(folder), split="train"), 0, 4)[0] == owned[0]


def test_hub_stream_with_too_few_files_falls_back_to_round_robin(tmp_path):
    folder = hub_folder(tmp_path / "hub", files=3, per_file=7)
    source = HubSource(str(folder), split="train")
    assert not source.by_part(2)
    shards = [read_all(source, shard, 2)[0] for shard in range(2)]
    assert sorted(int(t.split()[0][1:]) for s in shards for t in s) == list(range(21))
    assert abs(len(shards[0]) - len(shards[1])) <= 1  # every shard streams every file and keeps every other record


@pytest.mark.heavy  # 10 s or more
@pytest.mark.timeout(180)
def test_resume_exact_for_arrow_save_to_disk_and_file_sharded_hub(tmp_path, tok):
    rng = random.Random(9)
    arrow = write_arrow(tmp_path / "a.arrow", make_docs(0, 30, rng, (3, 20)), field="body", rows_per_batch=4)
    saved = save_to_disk(tmp_path / "saved", make_docs(30, 30, rng, (3, 20)), field="content", num_shards=4)
    from step35.data.files import expand_files

    sources = [
        FileSource("arrow", [arrow], text_field="body", seed=3),
        FileSource("saved", expand_files([str(saved)]), text_field="content", seed=3),
    ]
    resume_matches(lambda: TokenWindows(sources, tok, seq_len=9, weights=[1, 2], seed=2), 40, save_at=[4, 13, 29])

    folder = tmp_path / "hub"
    folder.mkdir()
    for k in range(4):
        write_jsonl(folder / f"p{k}.jsonl", make_docs(60 + 10 * k, 10, rng, (3, 20)))
    hub = HubSource(str(folder), split="train", shuffle=True, seed=5)
    assert hub.by_part(2)  # 2 workers, 4 files: each worker streams 2 files
    states = resume_matches(lambda: TokenWindows([hub], tok, seq_len=9), 45, save_at=[3, 17, 36])
    assert max(worker_epochs(states[-1])) >= 1  # the last save is past an epoch boundary
