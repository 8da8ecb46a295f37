"""Bad records skipped past the first reports are still counted where a user sees them: the metric
`data/skipped_records/<source>` (summed over DataLoader workers and ranks, validation reads included)
and one summary line at the end of fit.

The corpora put their bad records first, so every shard (rank x worker) reads all of its bad records
before its first window and no shard reaches a second epoch: the exact total is the number of bad
lines written, known without asking the code under test."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from step35.data import Step35DataModule
from step35.data.bad_records import METRIC_PREFIX, REPORTS_PER_SOURCE
from tests.helpers import make_trainer
from tests.runner import step35

pytestmark = pytest.mark.heavy  # DataLoader worker processes, or several ranks

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs".split()


def write_corpus(path: Path, bad: int, good: int) -> Path:
    lines = ['{"text": "broken' + str(i) for i in range(bad)]  # invalid JSON, one per line
    lines += [json.dumps({"text": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(12))}) for i in range(good)]
    path.write_text("\n".join(lines) + "\n")
    return path


class Mean(pl.LightningModule):
    """A one-parameter model: the data path is under test, not the model."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        loss = (self.w - batch["input_ids"].float().mean() / 1000).pow(2).sum()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def logging_trainer(tmp_path: Path, max_steps: int, log_every_n_steps: int) -> pl.Trainer:
    """A trainer that logs to a CSVLogger under `tmp_path`/logs (read back with metric_rows)."""
    logger = CSVLogger(tmp_path / "logs", name="csv")
    return make_trainer(
        max_steps=max_steps,
        log_every_n_steps=log_every_n_steps,
        limit_val_batches=None,
        enable_checkpointing=False,
        logger=logger,
        default_root_dir=tmp_path,
    )


def metric_rows(folder: Path) -> list[dict]:
    files = list(folder.rglob("metrics.csv"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(300)
def test_counts_of_both_workers_are_logged_per_source_and_summed_up(tmp_path, builtin_cache):
    a = write_corpus(tmp_path / "a.jsonl", bad=30, good=300)  # 15 per worker: more than the reports
    b = write_corpus(tmp_path / "b.jsonl", bad=3, good=300)
    assert 30 // 2 > REPORTS_PER_SOURCE
    dm = Step35DataModule(
        files=[str(a), str(b)],
        weights=[1.0, 1.0],
        seq_len=16,
        micro_batch_size=2,
        num_workers=2,
        cache_dir=str(builtin_cache),
    )
    trainer = logging_trainer(tmp_path, max_steps=8, log_every_n_steps=3)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        trainer.fit(Mean(), datamodule=dm)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)

    key_a, key_b = METRIC_PREFIX + str(a), METRIC_PREFIX + str(b)
    logged = {
        int(r["step"]): (float(r[key_a]), float(r[key_b])) for r in metric_rows(tmp_path / "logs") if r.get(key_a)
    }
    # Every 3 steps and at the last one (7). At step 0 only worker 0 has delivered a batch: a running count.
    assert sorted(logged) == [0, 3, 6, 7], logged
    assert logged[0][0] < 30
    assert logged[7] == (30.0, 3.0)
    assert all(logged[s] <= logged[t] for s, t in zip(sorted(logged), sorted(logged)[1:]))  # never goes down
    summary = [m for m in messages if m.startswith("bad records skipped")]
    assert summary == [f"bad records skipped, all ranks and workers: 33 in all ({str(a)!r}: 30, {str(b)!r}: 3)"]


@pytest.mark.timeout(300)
def test_clean_data_logs_no_metric_and_says_none(tmp_path, builtin_cache):
    clean = write_corpus(tmp_path / "clean.jsonl", bad=0, good=200)
    dm = Step35DataModule(files=str(clean), seq_len=16, micro_batch_size=2, cache_dir=str(builtin_cache))
    trainer = logging_trainer(tmp_path, max_steps=3, log_every_n_steps=1)
    trainer.fit(Mean(), datamodule=dm)
    assert not any(k.startswith(METRIC_PREFIX) for k in metric_rows(tmp_path / "logs")[0])
    assert dm._skipped_log.summary() == f"bad records skipped, all ranks and workers: none ({str(clean)!r}: 0)"


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_two_ranks_two_workers_and_validation_count_every_bad_record_once(tmp_path, builtin_cache):
    """The CLI under torchrun: 2 ranks x 2 workers read the training shards, and each rank reads the
    held-out stream from its start (validation.py): the logged total is every bad line, once."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", bad=40, good=600)
    run = tmp_path / "run"
    proc = step35(
        [
            "fit",
            "--config",
            "configs/tiny.yaml",
            "--trainer.strategy=step35.strategy.Step35Strategy",
            "--trainer.strategy.expert_parallel_size=2",
            "--trainer.devices=2",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=1000",
            "--trainer.log_every_n_steps=2",
            f"--data.files={corpus}",
            "--data.num_workers=2",
            "--data.val_fraction=0.1",
            "--data.val_batches=1",
            "--data.seq_len=32",
            "--data.micro_batch_size=2",
            f"--trainer.default_root_dir={run}",
            f"--trainer.logger.init_args.save_dir={run}",
        ],
        builtin_cache,
        nproc=2,
        timeout=840,
    )  # under torchrun, one thread per rank
    key = METRIC_PREFIX + str(corpus)
    logged = {int(r["step"]): float(r[key]) for r in metric_rows(run) if r.get(key)}
    assert logged[3] == 40.0, logged
    line = f"bad records skipped, all ranks and workers: 40 in all ({str(corpus)!r}: 40)"
    assert (proc.stdout + proc.stderr).count(line) == 1, proc.stderr[-5000:]
