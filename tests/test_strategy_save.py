"""Step35Strategy's sharded checkpoints are swapped in atomically: a save that dies half-way leaves
the previous checkpoint at that path intact and loadable (in-process, world size 1, gloo)."""

import lightning.pytorch as pl
import pytest
import torch

from step35.data import Step35DataModule
from step35.module import Step35LightningModule
from step35.strategy import Step35Strategy


def fit(tmp_path, builtin_cache, max_steps: int, ckpt_path=None) -> pl.Trainer:
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Step35Strategy(), max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.timeout(300)
def test_save_killed_midway_keeps_the_previous_checkpoint(tmp_path, builtin_cache, monkeypatch):
    fit(tmp_path, builtin_cache, max_steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir() and (last / "meta.pt").exists()
    before = {p.name: p.read_bytes() for p in last.iterdir()}

    import lightning.pytorch.strategies.model_parallel as mp

    def dies_half_way(state, path):
        (path / "__0_0.distcp").write_bytes(b"half a shard")
        raise RuntimeError("killed during the save")  # (Lightning turns KeyboardInterrupt into SystemExit)

    monkeypatch.setattr(mp, "_distributed_checkpoint_save", dies_half_way)
    with pytest.raises(RuntimeError, match="killed during the save"):
        fit(tmp_path, builtin_cache, max_steps=4, ckpt_path=last)  # resumes, trains, then dies saving `last`
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in last.iterdir()} == before  # untouched, byte for byte
    trainer = fit(tmp_path, builtin_cache, max_steps=3, ckpt_path=last)  # and it still resumes
    assert trainer.global_step == 3
