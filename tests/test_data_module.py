"""Step35DataModule: the built-in corpus and tokenizer, setup errors, per-rank resume, and a real Lightning resume."""

import json
import multiprocessing
import random
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from step35.data import Step35DataModule, builtin_corpus_path, builtin_tokenizer_dir
from step35.data.bad_records import BadRecords, BadRecordWarning
from step35.data.sources import Cursor, Holdout
from step35.data.tokenizer import TextTokenizer
from tests.helpers import make_trainer

WORDS = [f"d{i}" for i in range(500)] + [f"w{i}" for i in range(50)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("step35_cache")


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    folder = tmp_path_factory.mktemp("word_tokenizer")
    vocab = {"<unk>": 0, "<eos>": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))  # the EOS from a model config
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for part in range(2):
        ids = range(40 * part, 40 * part + 40)
        lines = [f"d{i} " + " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(3, 25))) for i in ids]
        (folder / f"part{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return folder


def test_builtin_corpus_and_tokenizer_are_made_offline_and_cached(cache):
    corpus = builtin_corpus_path(cache)
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert len(texts) > 100 and any("assert" in t for t in texts)

    folder = builtin_tokenizer_dir(512, cache)
    made = (folder / "tokenizer.json").stat().st_mtime_ns
    assert builtin_tokenizer_dir(512, cache) == folder  # cached: same folder, not retrained
    assert (folder / "tokenizer.json").stat().st_mtime_ns == made
    assert builtin_corpus_path(cache) == corpus
    assert builtin_tokenizer_dir(600, cache) != folder  # keyed by vocab size

    tokenizer = TextTokenizer.from_folder(folder)
    assert tokenizer.eos_token_id == 0 and tokenizer.vocab_size == 512
    for text in ["def f(x):\n    return x ** 2  # squares", "naïve café, 東京 🚀", texts[3]]:
        ids = tokenizer.encode(text)
        assert max(ids) < 512 and 0 not in ids
        assert tokenizer.decode(ids) == text
    assert not list(cache.glob(".tmp-*"))  # no staging leftovers
    with pytest.raises(ValueError, match="at least 257"):
        builtin_tokenizer_dir(100, cache)


def _build_builtin(cache: str, queue) -> None:
    queue.put(str(builtin_tokenizer_dir(300, cache)))


@pytest.mark.heavy  # processes racing
@pytest.mark.timeout(120)
def test_builtin_cache_survives_processes_racing_on_first_use(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_build_builtin, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in processes:
        p.start()
    folders = {queue.get(timeout=100) for _ in processes}
    for p in processes:
        p.join(100)
        assert p.exitcode == 0
    assert len(folders) == 1
    assert TextTokenizer.from_folder(folders.pop()).vocab_size == 300
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []


def test_default_datamodule_trains_on_the_builtin_corpus(cache):
    dm = Step35DataModule(cache_dir=str(cache), seq_len=32, micro_batch_size=2, val_batches=3, builtin_vocab_size=512)
    dm.setup("fit")
    assert (dm.vocab_size, dm.eos_token_id, dm.seq_len, dm.micro_batch_size) == (512, 0, 32, 2)
    batches = iter(dm.train_dataloader())
    for _ in range(3):
        batch = next(batches)
        assert set(batch) == {"input_ids"}
        assert batch["input_ids"].shape == (2, 33) and batch["input_ids"].dtype == torch.long
    val = list(dm.val_dataloader())
    assert len(val) == 3 and all(b["input_ids"].shape == (2, 33) for b in val)
    assert dm.skipped_records == {"builtin": 0}
    dm.check_model_vocab(512)
    with pytest.raises(ValueError, match=r"512 tokens.*vocab_size of 500"):
        dm.check_model_vocab(500)
    dm.teardown("fit")


@pytest.mark.heavy  # 2 DataLoader worker processes
@pytest.mark.timeout(120)
def test_two_workers_and_tokenizer_from_model_config(corpus, word_tokenizer):
    dm = Step35DataModule(files=str(corpus / "*.jsonl"), tokenizer=str(word_tokenizer), seq_len=8, num_workers=2,
                          val_fraction=0.1, val_batches=1)  # fmt: skip
    dm.setup("fit")
    assert dm.eos_token_id == 1  # config.json eos_token_id, first entry of the list
    batches = [b["input_ids"] for _, b in zip(range(6), dm.train_dataloader())]
    assert all(b.shape == (4, 9) for b in batches)
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    # validation windows come from held-out documents only
    train_docs = {t for b in batches for t in b.flatten().tolist() if t < 502}
    val_docs = {t for t in val.flatten().tolist() if t < 502}
    assert not (train_docs - {0, 1}) & (val_docs - {0, 1})
    dm.teardown("fit")


def test_val_files_and_asking_again_for_the_train_loader(tmp_path, corpus, word_tokenizer):
    (tmp_path / "held_out.txt").write_text("d499 w1 w2 w3\n" * 10)
    dm = Step35DataModule(files=str(corpus), val_files=str(tmp_path / "held_out.txt"), txt_mode="line",
                          tokenizer=str(word_tokenizer), seq_len=4, micro_batch_size=2, val_batches=2)  # fmt: skip
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    assert val.shape == (4, 5) and (val == torch.tensor([2 + 499, 2 + 501, 2 + 502, 2 + 503, 1])).all()

    uninterrupted = [b["input_ids"] for _, b in zip(range(6), dm.train_dataloader())]
    dm = Step35DataModule(files=str(corpus), tokenizer=str(word_tokenizer), seq_len=4, micro_batch_size=2)
    first = [b["input_ids"] for _, b in zip(range(3), dm.train_dataloader())]
    again = [b["input_ids"] for _, b in zip(range(3), dm.train_dataloader())]  # reload_dataloaders_every_n_epochs
    assert all(torch.equal(a, b) for a, b in zip(first + again, uninterrupted))


def test_rank_comes_from_the_strategy(corpus, word_tokenizer):
    dm = Step35DataModule(files=str(corpus), tokenizer=str(word_tokenizer))
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 3}))
    assert dm.data_parallel_rank_and_size() == (3, 4)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(), global_rank=1, world_size=2)
    assert dm.data_parallel_rank_and_size() == (1, 2)


def test_setup_errors_name_the_problem(tmp_path, corpus, word_tokenizer):
    tok = str(word_tokenizer)
    with pytest.raises(FileNotFoundError, match=r"no files match '.*nothing/\*\.jsonl'"):
        Step35DataModule(files=str(tmp_path / "nothing/*.jsonl"), tokenizer=tok).setup()
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "vocab.txt").write_text("a\n")
    with pytest.raises(FileNotFoundError, match=r"notok.*no tokenizer\.json.*vocab\.txt"):
        Step35DataModule(files=str(corpus), tokenizer=str(tmp_path / "notok")).setup()
    (tmp_path / "e1.jsonl").write_text("")
    (tmp_path / "e2.txt").write_text("")
    with pytest.raises(ValueError, match="every matched file is empty"):
        Step35DataModule(files=[str(tmp_path / "e1.jsonl"), str(tmp_path / "e2.txt")], tokenizer=tok).setup()
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data\.csv: cannot read \.csv"):
        Step35DataModule(files=str(tmp_path / "data.csv"), tokenizer=tok).setup()
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        Step35DataModule(seq_len=0)
    with pytest.raises(ValueError, match="1 weights for 2 files entries"):
        Step35DataModule(files=["a", "b"], weights=[1.0])
    with pytest.raises(ValueError, match="weights must be non-negative"):
        Step35DataModule(files=["a", "b"], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="either val_files or val_fraction"):
        Step35DataModule(files=["a"], val_files=["b"], val_fraction=0.1)


def test_an_empty_file_among_others_is_fine_and_bad_records_are_counted(tmp_path, word_tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "data.jsonl").write_text('{"text": "d1 w1 w2"}\n{"text": \n{"other": 1}\n' + '{"text": "d2 w3"}\n' * 20)
    dm = Step35DataModule(files=str(tmp_path), tokenizer=str(word_tokenizer), seq_len=4, micro_batch_size=1)
    with pytest.warns(BadRecordWarning, match=r"data\.jsonl:2: invalid JSON"):
        next(iter(dm.train_dataloader()))
    assert dm.skipped_records == {str(tmp_path): 2}
    strict = Step35DataModule(files=str(tmp_path), tokenizer=str(word_tokenizer), seq_len=4, strict=True)
    with pytest.raises(ValueError, match=r"data\.jsonl:2: invalid JSON"):
        next(iter(strict.train_dataloader()))


def test_hub_dataset_path_streams_a_local_dataset(tmp_path, word_tokenizer):
    folder = tmp_path / "hub_like"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": f"d{i} w1 w2"}) + "\n" for i in range(50)))
    dm = Step35DataModule(hub_dataset=str(folder), tokenizer=str(word_tokenizer), seq_len=7, micro_batch_size=2,
                          val_fraction=0.2, val_batches=1)  # fmt: skip
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))["input_ids"]
    assert batch.shape == (2, 8)
    w1, w2, eos = 2 + WORDS.index("w1"), 2 + WORDS.index("w2"), 1
    assert all(window[k + 1 : k + 4].tolist() == [w1, w2, eos] for window in batch for k in (0, 4))  # whole records
    assert len(list(dm.val_dataloader())) == 1
    with pytest.raises(ValueError, match="has no field 'content'"):
        Step35DataModule(hub_dataset=str(folder), text_field="content", tokenizer=str(word_tokenizer)).setup()


# -- the same corpus in the formats people already have ------------------------------------------------------


def corpus_texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for f in sorted(corpus.glob("*.jsonl")) for line in f.read_text().splitlines()]


def write_arrow(path: Path, field: str, texts: list[str]) -> Path:
    import pyarrow as pa

    table = pa.table({field: texts})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=16):
            writer.write_batch(batch)
    return path


def data_options(kind: str, corpus: Path, folder: Path) -> dict:
    """DataModule options reading `corpus` (80 documents) as jsonl files, a save_to_disk folder, an arrow file,
    a hub-style stream of 8 files, or two sources with different text fields and weights (a save_to_disk folder with `content`, an arrow file
    with `body`)."""
    from datasets import Dataset

    texts = corpus_texts(corpus)
    if kind == "jsonl":
        return {"files": str(corpus)}
    if kind == "save_to_disk":
        Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "saved"), num_shards=3)
        return {"files": str(folder / "saved")}
    if kind == "arrow":
        return {"files": str(write_arrow(folder / "corpus.arrow", "text", texts))}
    if kind == "hub_8_files":  # a datasets stream with 8 data files: 2 ranks x 2 workers each stream 2 of them
        (folder / "hub").mkdir()
        for k in range(8):
            lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[10 * k : 10 * k + 10])
            (folder / "hub" / f"part{k}.jsonl").write_text(lines)
        return {"hub_dataset": str(folder / "hub")}
    assert kind == "two_text_fields"
    Dataset.from_dict({"content": texts[:40], "id": list(range(40))}).save_to_disk(str(folder / "saved"), num_shards=2)
    arrow = write_arrow(folder / "rest.arrow", "body", texts[40:])
    return {"sources": [{"path": str(folder / "saved"), "text_field": "content", "weight": 2.0},
                        {"path": str(arrow), "text_field": "body", "weight": 1.0}]}  # fmt: skip


# -- per-rank state through a rank-0-only checkpoint ---------------------------------------------------------
#
# Two processes form a real gloo group. Each takes 5 batches, then Step35DataModule.state_dict() all-gathers
# the states and only rank 0 writes the result, as Lightning does with the non-tensor part of a checkpoint;
# both ranks then record their next 6 batches. New processes, with a new group, all read rank 0's file, and
# each must continue with exactly its own 6 batches.


def _rank_process(phase: str, rank: int, folder: str, data: dict, tokenizer: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{phase}", rank=rank, world_size=2)
    dm = Step35DataModule(**data, tokenizer=tokenizer, seq_len=6, micro_batch_size=2, num_workers=2)
    dm.setup("fit")
    if phase == "resume":
        dm.load_state_dict(torch.load(f"{folder}/datamodule_state.pt", weights_only=True))
    batches = iter(dm.train_dataloader())
    if phase == "first":
        for _ in range(5):
            next(batches)
        state = dm.state_dict()
        if rank == 0:
            torch.save(state, f"{folder}/datamodule_state.pt")
    torch.save([next(batches)["input_ids"] for _ in range(6)], f"{folder}/{phase}-rank{rank}.pt")
    dm.teardown("fit")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["jsonl", "two_text_fields", "hub_8_files"])
def test_per_rank_state_survives_a_rank0_only_checkpoint(tmp_path, corpus, word_tokenizer, kind):
    context = multiprocessing.get_context("spawn")
    data = data_options(kind, corpus, tmp_path)
    if kind == "hub_8_files":
        from step35.data.hub import HubSource

        assert HubSource(data["hub_dataset"]).by_part(2 * 2)  # 2 ranks x 2 workers: sharded by file
    for phase in ("first", "resume"):
        args = [(phase, rank, str(tmp_path), data, str(word_tokenizer)) for rank in range(2)]
        processes = [context.Process(target=_rank_process, args=a) for a in args]
        for p in processes:
            p.start()
        for p in processes:
            p.join(100)
            assert p.exitcode == 0, f"{phase}: rank process failed"
    state = torch.load(tmp_path / "datamodule_state.pt", weights_only=True)
    assert sorted(state["train_stream_by_rank"]) == [0, 1]
    for rank in range(2):
        first = torch.load(tmp_path / f"first-rank{rank}.pt")
        resumed = torch.load(tmp_path / f"resume-rank{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(first, resumed)), f"rank {rank} did not continue where it stopped"
    rank0 = torch.cat(torch.load(tmp_path / "first-rank0.pt"))
    rank1 = torch.cat(torch.load(tmp_path / "first-rank1.pt"))
    assert not torch.equal(rank0, rank1)  # the ranks really read different data


# -- a real Lightning run, checkpointed at step 3 and resumed -----------------------------------------------


class Recorder(pl.LightningModule):
    """Trains one parameter and keeps every batch it is given."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []
        self.val_seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return (self.w - batch["input_ids"].float().mean()).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(batch["input_ids"].clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.heavy  # two training runs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["jsonl", "save_to_disk", "arrow", "two_text_fields", "hub_8_files"])
def test_lightning_resume_continues_with_the_same_batches(tmp_path, corpus, word_tokenizer, kind):
    data = data_options(kind, corpus, tmp_path)

    def run(ckpt_path=None):
        module = Recorder()
        dm = Step35DataModule(**data, tokenizer=str(word_tokenizer), seq_len=8, micro_batch_size=2,
                              num_workers=2, val_fraction=0.1, val_batches=2)  # fmt: skip
        trainer = make_trainer(
            max_steps=8, val_check_interval=4, limit_val_batches=None, num_sanity_val_steps=0,
            default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module

    full = run()
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    assert "Step35DataModule" in saved
    assert "combined_loader" not in saved["loops"]["fit_loop"]  # Lightning keeps no second, rank-0-only copy
    resumed = run(ckpt_path=checkpoint)
    assert len(full.seen) == 8 and len(resumed.seen) == 5
    for i, (a, b) in enumerate(zip(resumed.seen, full.seen[3:])):
        assert torch.equal(a, b), f"batch {3 + i} differs after resume"
    assert len(full.val_seen) == 4 and all(torch.equal(a, b) for a, b in zip(full.val_seen[:2], full.val_seen[2:]))
    if kind == "two_text_fields":  # both sources are read, each through its own text field
        docs = {t - 2 for b in full.seen for t in b.flatten().tolist() if 2 <= t < 2 + 500}
        assert min(docs) < 40 <= max(docs)


# -- data.sources in YAML, validation defaults, a save_to_disk folder as hub_dataset -------------------------


def test_sources_yaml_shape_through_the_cli_parser(tmp_path, corpus, word_tokenizer):
    from lightning.pytorch.cli import LightningArgumentParser

    data = data_options("two_text_fields", corpus, tmp_path)
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(Step35DataModule, "data")
    yaml = f"""
data:
  tokenizer: {word_tokenizer}
  seq_len: 8
  sources:
    - path: {data["sources"][0]["path"]}
      text_field: content
      weight: 2
    - path: [{data["sources"][1]["path"]}]
      text_field: body
    - hub: {corpus}
      split: train
      weight: 0.5
      name: streamed
"""
    dm = parser.instantiate(parser.parse_string(yaml)).data
    assert [(s.text_field, s.weight) for s in dm.sources] == [("content", 2.0), ("body", 1.0), (None, 0.5)]
    dm.setup("fit")
    assert [s.text_field for s in dm._train_sources] == ["content", "body", "text"]
    assert dm._train_sources[2].name == "streamed" and len(dm._train_sources[2].parts) == 2  # corpus: 2 files
    batch = next(iter(dm.train_dataloader()))["input_ids"]
    assert batch.shape == (4, 9)
    assert dm.hparams["sources"][0] == {"path": data["sources"][0]["path"], "hub": None, "subset": None,
                                        "split": "train", "text_field": "content", "txt_mode": None, "weight": 2.0,
                                        "name": None, "format": None}  # fmt: skip
    with pytest.raises(Exception, match="text_fields"):
        parser.parse_string(yaml.replace("text_field: body", "text_fields: body"))
    with pytest.raises(ValueError, match=r"unknown keys \['text_fields'\]"):
        Step35DataModule(sources=[{"path": "x", "text_fields": "body"}])
    with pytest.raises(ValueError, match="exactly one of `path`"):
        Step35DataModule(sources=[{"weight": 1.0}])
    with pytest.raises(ValueError, match="either sources or the short form"):
        Step35DataModule(files="x", sources=[{"path": "y"}])


def test_the_same_file_twice_with_two_text_fields(tmp_path, word_tokenizer):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"q": f"d{i} w1", "a": f"d{i} w2"}) + "\n" for i in range(30)))
    dm = Step35DataModule(sources=[{"path": str(path), "text_field": "q"}, {"path": str(path), "text_field": "a"}],
                          tokenizer=str(word_tokenizer), seq_len=2, micro_batch_size=30, val_fraction=0)  # fmt: skip
    dm.setup("fit")
    assert [s.name for s in dm._train_sources] == [str(path), f"{path}#2"]  # distinct names for the counts
    words = {w for w in next(iter(dm.train_dataloader()))["input_ids"][:, 1].tolist()}
    assert words == {2 + WORDS.index("w1"), 2 + WORDS.index("w2")}


def test_validation_is_on_by_default_and_said_so(tmp_path, corpus, word_tokenizer, caplog):
    import logging

    caplog.set_level(logging.INFO)
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"d{i % 500} w{i % 50} w1"}) + "\n" for i in range(2000)))
    dm = Step35DataModule(files=str(big), tokenizer=str(word_tokenizer), seq_len=4, micro_batch_size=2, val_batches=2)
    dm.setup("fit")
    assert dm._train_sources[0].holdout == Holdout(0.01, "train")
    assert "validation: 1.00% of the documents of every source held out (default" in caplog.text
    held_out = [t for _, _, t in dm._val_sources[0].documents(Cursor(), 0, 1, BadRecords("v", False), False)]
    assert 10 <= len(held_out) <= 30  # 1% of 2000, give or take the hash
    assert len(dm.val_dataloader()) == 2

    # 3 documents at 1%: nothing is held out, and a run that did not ask for validation must not fail on it.
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": f"d{i} w1 w2"}) + "\n" for i in range(3)))
    dm = Step35DataModule(files=str(few), tokenizer=str(word_tokenizer), seq_len=4, micro_batch_size=1)
    dm.setup("fit")
    assert not list(dm._val_sources[0].documents(Cursor(), 0, 1, BadRecords("v", False), False))
    with pytest.warns(UserWarning, match="validation is off: validation data .* holds no window"):
        assert dm.val_dataloader() == []

    caplog.clear()
    off = Step35DataModule(files=str(corpus), tokenizer=str(word_tokenizer), val_fraction=0)
    off.setup("fit")
    assert off.val_dataloader() == [] and "validation: off (data.val_fraction=0 and no data.val_files)" in caplog.text
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "d1 w1"}) + "\n")
    strict = Step35DataModule(files=str(tiny), tokenizer=str(word_tokenizer), seq_len=8, val_fraction=0.5)
    strict.setup("fit")
    with pytest.raises(ValueError, match="no window"):  # asked for explicitly: an error, as before
        strict.val_dataloader()


def test_a_save_to_disk_folder_as_hub_dataset_or_files(tmp_path, corpus, word_tokenizer):
    options = data_options("save_to_disk", corpus, tmp_path)
    for data in ({"hub_dataset": options["files"]}, options):
        dm = Step35DataModule(**data, tokenizer=str(word_tokenizer), seq_len=8, val_fraction=0)
        dm.setup("fit")
        assert [Path(p.path).name for p in dm._train_sources[0].parts] == [
            f"data-0000{k}-of-00003.arrow" for k in range(3)
        ]
        assert next(iter(dm.train_dataloader()))["input_ids"].shape == (4, 9)
