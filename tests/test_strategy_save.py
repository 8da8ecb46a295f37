"""Step35Strategy's sharded checkpoints are swapped in atomically: a save that dies half-way leaves
the previous checkpoint at that path intact and loadable (in-process, world size 1, gloo). A save
onto a full disk (a small tmpfs where mounting is allowed, else a writer raising ENOSPC) fails with
OSError ENOSPC naming the checkpoint, and leaves no partial files behind, sharded or single-file."""

import errno
import os

import lightning.pytorch as pl
import pytest
import torch

from step35.data import Step35DataModule
from step35.module import Step35LightningModule
from tests.helpers import checkpoint_io, make_trainer, small_filesystem, tiny_run_args

pytestmark = pytest.mark.heavy  # step35 as a subprocess, saves killed midway


def fit(tmp_path, builtin_cache, max_steps: int, ckpt_path=None, dirpath=None, sharded: bool = True) -> pl.Trainer:
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    trainer = make_trainer(
        max_steps=max_steps,
        default_root_dir=tmp_path,
        **checkpoint_io(sharded),
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=dirpath or tmp_path / "ckpt", save_last=True)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.timeout(300)
def test_save_killed_midway_keeps_the_previous_checkpoint(tmp_path, builtin_cache, monkeypatch):
    fit(tmp_path, builtin_cache, max_steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir() and (last / "meta.pt").exists()
    before = {p.name: p.read_bytes() for p in last.iterdir()}

    import torch.distributed.checkpoint as dcp

    def dies_half_way(state, checkpoint_id, process_group=None):  # the DCP write step35's writer calls
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half a shard")
        raise RuntimeError("killed during the save")  # (Lightning turns KeyboardInterrupt into SystemExit)

    monkeypatch.setattr(dcp, "save", dies_half_way)
    with pytest.raises(RuntimeError, match="killed during the save"):
        fit(tmp_path, builtin_cache, max_steps=4, ckpt_path=last)  # resumes, trains, then dies saving `last`
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in last.iterdir()} == before  # untouched, byte for byte
    assert not [p for p in last.parent.iterdir() if ".partial" in p.name]  # the failed save is gone already
    trainer = fit(tmp_path, builtin_cache, max_steps=3, ckpt_path=last)  # and it still resumes
    assert trainer.global_step == 3


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs (a tiny-model checkpoint takes ~24 MB)."""
    (tmp_path / "small").mkdir()
    with small_filesystem(tmp_path / "small", "6m") as folder:
        yield folder


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "file"])
def test_full_disk_names_enospc_and_leaves_nothing(sharded, small_disk, tmp_path, builtin_cache):
    with pytest.raises(OSError) as err:
        fit(tmp_path, builtin_cache, max_steps=1, dirpath=small_disk, sharded=sharded)
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC and "ENOSPC" in message, message
    assert f"{small_disk / 'epoch=0-step=1.ckpt'}: no space left on device (ENOSPC)" in message, message
    assert "\n" not in message and len(message) < 400, message
    assert os.listdir(small_disk) == []  # the partial save is removed at once, not at the next start
    stat = os.statvfs(small_disk)
    assert stat.f_bfree == stat.f_blocks  # all its space back


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "file"])
def test_writer_raising_enospc_is_named_and_cleaned_up(sharded, tmp_path, builtin_cache, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def half_then_full(state, checkpoint_id, process_group=None):  # DCP's writer, as it fails on a full disk
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    if sharded:
        monkeypatch.setattr(dcp, "save", half_then_full)
    else:
        save = torch.save

        def full(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and "state_dict" in obj:  # the checkpoint, not anything else
                f.write(b"half")
                raise OSError(errno.ENOSPC, "No space left on device")
            return save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="no space left on device \\(ENOSPC\\)") as err:
        fit(tmp_path, builtin_cache, max_steps=1, sharded=sharded)
    assert err.value.errno == errno.ENOSPC and str(tmp_path / "ckpt") in str(err.value)
    assert os.listdir(tmp_path / "ckpt") == []


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_ranks_full_disk_fail_together_and_leave_nothing(tmp_path, builtin_cache):
    """2 ranks (torchrun, the real CLI) saving onto a full tmpfs: both ranks stop with the ENOSPC
    line naming the checkpoint, no rank is left waiting, and the partial folder is already gone."""
    from step35.checkpoint.publish import leftovers
    from tests.runner import step35

    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    with small_filesystem(checkpoints, "6m"):
        args = tiny_run_args(
            "fit",
            run,
            "--trainer.strategy=step35.strategy.Step35Strategy",
            "--trainer.strategy.expert_parallel_size=2",
            "--trainer.devices=2",
            "--trainer.max_steps=1",
        )
        result = step35(args, builtin_cache, timeout=400, nproc=2, check=False)
        assert result.returncode != 0
        for rank in (0, 1):  # each rank's failure report: one `step35:` line naming the checkpoint
            assert any(
                ln.startswith(f"[rank {rank}] step35: run failed during 'checkpoint save")
                and "no space left on device (ENOSPC)" in ln
                and str(checkpoints) in ln
                for ln in result.stderr.splitlines()
            ), result.stderr[-3000:]
        assert leftovers(checkpoints) == [] and not [p for p in checkpoints.iterdir() if p.is_dir()]
