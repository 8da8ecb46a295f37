"""RunCheckpoint(async_save=True): the training loop waits only while the state is staged in host memory, a
background thread writes it, and every rule of the run folder holds as for synchronous saves.

The background writes are slowed down where a test needs them in flight (tests/dist/hooks.SlowBackgroundWrites, or
a slowed `save_file` in this process): the loop trains on while a write waits, so a checkpoint that took anything
from the live parameters instead of its staged copy differs from the synchronous run's.

In this process (world size 1): a single-file and a sharded run write bitwise what the synchronous run writes; a
full disk during a background write fails the run naming that checkpoint, the previous one intact. Two gloo ranks
with EP 2 under torchrun: the same bitwise equality; SIGKILL during a background write (shards on disk, no
manifest) leaves the previous checkpoint, which `--ckpt_path auto` resumes, bitwise to the uninterrupted end;
SIGTERM to the ranks during a background write ends each with exit 75 and complete checkpoints only."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from step35.callbacks import RunCheckpoint
from step35.checkpoint.integrity import is_complete, verify
from step35.checkpoint.publish import leftovers
from step35.checkpoint.training import catalog, trainer_io
from step35.checkpoint.training.background import BackgroundSaveFailed
from step35.data import Step35DataModule
from step35.module import Step35LightningModule
from tests.helpers import CHAOS_CONFIG, assert_bitwise, checkpoint_io, make_trainer, metric_rows, small_filesystem
from tests.runner import Job, command, kill_job, run_plan, wait_for

pytestmark = pytest.mark.heavy  # training runs in this process and jobs of two ranks

STEPS = 8  # every run: 8 steps, a checkpoint every 2 (kept)


# ------------------------------------------------------------------------------------------------ comparisons
def consolidated(checkpoint: Path, tmp: Path) -> dict:
    """A checkpoint's tensors (model, optimizer) and its other state (schedule, loops, data position), whichever
    its layout; the callbacks' state is left out (it names the run's own folder)."""
    if checkpoint.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = tmp / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
        dcp_to_torch_save(checkpoint, out)
        state = torch.load(out, weights_only=False)
        state.update(trainer_io.load_meta(checkpoint))
    else:
        state = torch.load(checkpoint, weights_only=False)
    state.pop("callbacks")
    return state


def assert_same_checkpoints(run_a: Path, run_b: Path, steps, tmp: Path) -> None:
    for step in steps:
        name = f"step={step:06d}.ckpt"
        a, b = run_a / "checkpoints" / name, run_b / "checkpoints" / name
        assert is_complete(a) and is_complete(b), (a, b)
        state = consolidated(a, tmp)
        assert any(k.startswith("optimizer") for k in state) and state["global_step"] == step
        assert_bitwise(state, consolidated(b, tmp), name)


def tensor_bytes_per_rank(folder: Path) -> list[int]:
    """The tensor bytes in each rank's shard file of a DCP checkpoint, from its metadata (the files add each
    item's serialization, ~1.5 KB a tensor)."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata, written = FileSystemReader(folder).read_metadata(), {}
    for index, stored in metadata.storage_data.items():
        item = metadata.state_dict_metadata[index.fqn]
        if isinstance(item, TensorStorageMetadata):
            chunk = next(c for c in item.chunks if list(c.offsets) == list(index.offset))
            size = math.prod(chunk.sizes) * item.properties.dtype.itemsize
            written[stored.relative_path] = written.get(stored.relative_path, 0) + size
    return [written[name] for name in sorted(written)]


# ------------------------------------------------------------------------------------------------ in this process
class StepClock(pl.Callback):
    """The loop's optimizer step, readable from a background write."""

    step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step = trainer.global_step


def fit_here(run: Path, cache: Path, async_save: bool, sharded: bool, dirpath=None, clock=None, fail=None):
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(cache))
    module = Step35LightningModule(config="tiny", warmup_steps=2, mtp_loss_weight=0.3)
    checkpoints = RunCheckpoint(dirpath=dirpath, every_n_train_steps=2, keep_last=10, async_save=async_save)
    trainer = make_trainer(
        max_steps=STEPS,
        logger=pl.loggers.CSVLogger(run, name="csv"),
        log_every_n_steps=1,
        default_root_dir=run,
        callbacks=[checkpoints, *[c for c in (clock, fail) if c is not None]],
        **checkpoint_io(sharded),
    )
    pl.seed_everything(0)
    trainer.fit(module, datamodule=data)
    return trainer


WRITE_DELAY_S = 1.0


@pytest.fixture
def slowed_writes(monkeypatch) -> tuple[StepClock, list[int]]:
    """Background writes in this process start WRITE_DELAY_S late (single file: `save_file`; sharded: DCP's save);
    the clock to pass to the run, and the steps its loop had reached when each write started."""
    import torch.distributed.checkpoint as dcp

    clock, reached = StepClock(), []

    def slowed(write):
        def slow(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                time.sleep(WRITE_DELAY_S)
                reached.append(clock.step)
            return write(*args, **kwargs)

        return slow

    monkeypatch.setattr(trainer_io, "save_file", slowed(trainer_io.save_file))
    monkeypatch.setattr(dcp, "save", slowed(dcp.save))
    return clock, reached


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_background_saves_hold_the_state_of_their_step(sharded, tmp_path, builtin_cache, slowed_writes):
    clock, reached = slowed_writes
    fit_here(tmp_path / "sync", builtin_cache, async_save=False, sharded=sharded, clock=clock)
    assert reached == []  # the synchronous saves were not slowed: written on the loop's thread
    trainer = fit_here(tmp_path / "async", builtin_cache, async_save=True, sharded=sharded, clock=clock)
    assert trainer.global_step == STEPS
    # each write started after the loop had trained past the save's step (WRITE_DELAY_S of steps of ~0.1 s)
    saved_steps = [2, 4, 6, 8]
    assert len(reached) == 4 and all(r > step for r, step in zip(reached[:3], saved_steps)), reached
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async", saved_steps, tmp_path)
    assert (tmp_path / "async" / "checkpoints" / "last.ckpt").resolve().name == "step=000008.ckpt"
    # logged per save: the loop was let go before the delayed write completed (how much sooner: the benchmark)
    rows = [r for r in metric_rows(tmp_path / "async" / "csv" / "version_0") if r.get("checkpoint/save_s")]
    assert len(rows) == 4, rows
    for row in rows:
        blocking, total = float(row["checkpoint/blocking_s"]), float(row["checkpoint/save_s"])
        assert blocking < total and total >= WRITE_DELAY_S and float(row["checkpoint/bytes"]) > 1e6, row
    sync_rows = [r for r in metric_rows(tmp_path / "sync" / "csv" / "version_0") if r.get("checkpoint/save_s")]
    assert len(sync_rows) == 4 and all(r["checkpoint/blocking_s"] == r["checkpoint/save_s"] for r in sync_rows)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_staging_that_cannot_be_allocated_falls_back_to_a_synchronous_save(
    sharded, tmp_path, builtin_cache, monkeypatch, capfd
):
    from torch.distributed.checkpoint.staging import DefaultStager

    def no_memory(self, state, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 52428800000 bytes")

    monkeypatch.setattr(DefaultStager, "stage", no_memory)
    trainer = fit_here(tmp_path / "run", builtin_cache, async_save=True, sharded=sharded)
    assert trainer.global_step == STEPS
    folder = tmp_path / "run" / "checkpoints"
    assert [catalog.step_from_name(p) for p in sorted(folder.glob("step=*.ckpt"))] == [2, 4, 6, 8]
    assert all(is_complete(p) for p in folder.glob("step=*.ckpt"))
    rows = [r for r in metric_rows(tmp_path / "run" / "csv" / "version_0") if r.get("checkpoint/save_s")]
    assert len(rows) == 4 and all(r["checkpoint/blocking_s"] == r["checkpoint/save_s"] for r in rows)  # synchronous
    said = "step35: the checkpoint's state could not be staged in host memory (DefaultCPUAllocator: can't allocate"
    assert capfd.readouterr().err.count(said) == 4


def staged_storages(staged) -> dict[int, int]:
    """data_ptr -> bytes of every host buffer in a staged state (nested dicts and lists; DTensors' shards)."""
    found = {}
    if isinstance(staged, dict):
        staged = list(staged.values())
    if isinstance(staged, (list, tuple)):
        for value in staged:
            found.update(staged_storages(value))
    elif isinstance(staged, torch.Tensor):
        storage = (staged.to_local() if hasattr(staged, "to_local") else staged).untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_staging_buffers_exist_before_the_first_save(sharded, tmp_path, builtin_cache, monkeypatch):
    """The first background save held the loop longer (0.37 s against 0.18-0.25 s) while its staging buffers were
    allocated: they are allocated after the first optimizer step on a thread of their own, and the first save
    copies into them (all but a few small non-parameter tensors, < 1% of its bytes)."""
    from torch.distributed.checkpoint.staging import DefaultStager

    calls = []  # (thread name, buffers) per staging
    real_stage = DefaultStager.stage

    def spy(self, state, **kwargs):
        staged = real_stage(self, state, **kwargs)
        calls.append((threading.current_thread().name, staged_storages(staged)))
        return staged

    monkeypatch.setattr(DefaultStager, "stage", spy)
    fit_here(tmp_path / "run", builtin_cache, async_save=True, sharded=sharded)
    assert [name for name, _ in calls] == ["step35-staging-buffers"] + ["MainThread"] * 4, [n for n, _ in calls]
    ahead, first_save = calls[0][1], calls[1][1]
    new_bytes = sum(size for ptr, size in first_save.items() if ptr not in ahead)
    assert new_bytes < 0.01 * sum(first_save.values()), (new_bytes, sum(first_save.values()))
    assert all(calls[i][1].keys() == first_save.keys() for i in (2, 3, 4))  # every later save reuses them too


class RaiseAtStep(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 5:
            raise RuntimeError("injected failure at step 6")


@pytest.mark.timeout(600)
def test_an_error_waits_for_the_background_save_in_flight(tmp_path, builtin_cache, slowed_writes, capfd):
    clock, reached = slowed_writes
    with pytest.raises(RuntimeError, match="injected failure at step 6"):
        fit_here(tmp_path / "run", builtin_cache, async_save=True, sharded=True, clock=clock, fail=RaiseAtStep())
    assert len(reached) == 2 and reached[1] == 5, reached  # step 4's write began after the failure (at step 6)...
    folder = tmp_path / "run" / "checkpoints"
    assert is_complete(folder / "step=000004.ckpt") and leftovers(folder) == []  # ...and complete when fit raised
    assert "step35: the background save of step 4 completed before the run ended" in capfd.readouterr().err


@pytest.fixture
def small_disk(tmp_path):
    """A 30 MiB tmpfs: one tiny-model checkpoint (~21 MB) fits, a second does not."""
    (tmp_path / "small").mkdir()
    with small_filesystem(tmp_path / "small", "30m") as folder:
        yield folder


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_full_disk_in_a_background_write_fails_the_run_naming_it(sharded, small_disk, tmp_path, builtin_cache):
    with pytest.raises(BackgroundSaveFailed) as failed:
        fit_here(tmp_path / "run", builtin_cache, async_save=True, sharded=sharded, dirpath=small_disk)
    message = str(failed.value)
    assert f"{small_disk / 'step=000004.ckpt'}: the background write of the step-4 checkpoint failed" in message
    assert "no space left on device (ENOSPC)" in message and "the previous checkpoint is intact" in message
    previous = small_disk / "step=000002.ckpt"
    assert is_complete(previous) and verify(previous)["extra"]["global_step"] == 2  # every checksum holds
    assert catalog.newest_complete([small_disk]).path == previous
    assert (small_disk / "last.ckpt").resolve() == previous.resolve()
    assert leftovers(small_disk) == [] and not (small_disk / "step=000004.ckpt").exists()


# ------------------------------------------------------------------------------------------------ two ranks
ASYNC_CONFIG = CHAOS_CONFIG.replace(
    "        every_n_train_steps: 5\n        keep_last: 2\n",
    "        every_n_train_steps: 2\n        keep_last: 10\n        verbose: true\n        async_save: ASYNC\n",
)
TWO_RANKS = [
    "--trainer.strategy=step35.strategy.Step35Strategy",
    "--trainer.strategy.expert_parallel_size=2",
    "--trainer.devices=2",
]


def job(tmp: Path, name: str, cache: Path, async_save: bool, *extra: str) -> Job:
    config = tmp / f"{name}.yaml"
    config.write_text(ASYNC_CONFIG.replace("ASYNC", "true" if async_save else "false"))
    args = ["fit", "--config", str(config), f"--run_dir={tmp / name}", f"--trainer.max_steps={STEPS}", *TWO_RANKS]
    return Job(command([*args, *extra], nproc=2), tmp / f"{name}.log", cache)


def slow_writes(before_s: float, after_s: float, from_step: int = 0) -> list[str]:
    return [
        "--trainer.callbacks+=tests.dist.hooks.SlowBackgroundWrites",
        f"--trainer.callbacks.before_s={before_s}",
        f"--trainer.callbacks.after_s={after_s}",
        f"--trainer.callbacks.from_step={from_step}",
    ]


@pytest.fixture(scope="module")
def synchronous_run(tmp_path_factory, builtin_cache) -> Path:
    """The reference: 2 ranks, EP 2, synchronous saves at steps 2, 4, 6, 8."""
    tmp = tmp_path_factory.mktemp("sync")
    with job(tmp, "sync", builtin_cache, async_save=False) as sync:
        assert sync.wait(timeout=400) == 0, sync.output()[-6000:]
    return tmp / "sync"


def shards_written(run_job: Job, step: int) -> bool:
    return re.search(rf"background write of \S*step={step:06d}\.ckpt\S*: shards written", run_job.output()) is not None


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_two_ranks_background_saves_equal_the_synchronous_ones(tmp_path, builtin_cache, synchronous_run, capsys):
    with job(tmp_path, "async", builtin_cache, True, *slow_writes(1.0, 0.5)) as run:
        assert run.wait(timeout=400) == 0, run.output()[-6000:]
        out = run.output()
    assert_same_checkpoints(synchronous_run, tmp_path / "async", [2, 4, 6, 8], tmp_path)
    held = [float(x) for x in re.findall(r"in the background: [\d.]+ MiB, training held ([\d.]+) s", out)]
    complete = [float(x) for x in re.findall(r"in the background: .*, complete after ([\d.]+) s", out)]
    assert len(held) == len(complete) == 4 and all(h < c and c >= 1.5 for h, c in zip(held, complete)), out[-3000:]
    # the loop trained on while a write waited: some save's shards were written after a later optimizer step
    began = [(int(a), int(b)) for a, b in re.findall(r"step=(\d+)\.ckpt\S*: begins at step (\d+)", out)]
    assert len(began) == 8 and any(at > step for step, at in began), began  # (each rank prints its own)
    rows = [r for r in metric_rows(tmp_path / "async" / "csv" / "version_0") if r.get("checkpoint/save_s")]
    assert len(rows) == 4, rows
    # `step35 plan` counts the host memory the staging takes: each rank's checkpoint share (within 0.1% of the
    # tensor bytes each rank wrote, read from DCP's metadata), per node x 2 ranks
    args = ["--config", str(tmp_path / "async.yaml"), *TWO_RANKS, "--no-suggestions", "--json"]
    code, out, _ = run_plan(capsys, *args, "--host-memory-gib=0.03")
    staging = json.loads(out)["host_staging"]
    written = tensor_bytes_per_rank(tmp_path / "async" / "checkpoints" / "step=000008.ckpt")
    assert code == 0 and staging["per_node_bytes"] == 2 * staging["per_rank_bytes"], staging
    assert len(written) == 2 and all(abs(staging["per_rank_bytes"] / w - 1) < 1e-3 for w in written), (staging, written)
    assert staging["exceeds_host_memory"] is False  # 20 MB of 30
    code, out, _ = run_plan(capsys, *args[:-1], "--host-memory-gib=0.01")
    assert "WARNING: the staging (0.02 GiB per node) exceeds the node's 0.01 GiB of host memory" in out, out


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_sigkill_in_a_background_write_resumes_the_previous_checkpoint_bitwise(
    tmp_path, builtin_cache, synchronous_run
):
    folder = tmp_path / "run" / "checkpoints"
    with job(tmp_path, "run", builtin_cache, True, *slow_writes(0.0, 30.0, from_step=4)) as run:
        wait_for(lambda: shards_written(run, 4), 300, run, "the step-4 shards on disk")
        kill_job(run.proc)
    # the half-written checkpoint (shards, no manifest) is no checkpoint: step 2 is the newest
    assert catalog.newest_complete([folder]).global_step == 2
    assert not is_complete(folder / "step=000004.ckpt")
    with job(tmp_path, "run", builtin_cache, True, "--ckpt_path=auto") as resumed:
        assert resumed.wait(timeout=400) == 0, resumed.output()[-6000:]
        out = resumed.output()
    assert f"--ckpt_path auto: resuming from {folder}/step=000002.ckpt (global step 2," in out, out[-3000:]
    assert leftovers(folder) == []
    assert_same_checkpoints(synchronous_run, tmp_path / "run", [4, 6, 8], tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_sigterm_in_a_background_write_exits_75_with_complete_checkpoints(tmp_path, builtin_cache):
    folder = tmp_path / "run" / "checkpoints"
    with job(tmp_path, "run", builtin_cache, True, *slow_writes(0.0, 4.0, from_step=4)) as run:
        wait_for(lambda: shards_written(run, 4), 300, run, "the step-4 shards on disk")
        for rank in run.workers():  # as a scheduler signals every task (torchrun's own exit code on SIGTERM is 1)
            rank.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        out = run.output()
    assert len(re.findall(r"exitcode\s+:\s*75\b", out)) == 2, out[-3000:]  # torchrun's summary: each rank's code
    stops = re.findall(r"\[rank (\d)\] step35: stopped by SIGTERM after step (\d+); (?:checkpoint (\S+);|step)", out)
    assert sorted(rank for rank, _, _ in stops) == ["0", "1"], out[-4000:]
    assert is_complete(folder / "step=000004.ckpt")  # the write in flight completed before the exit
    verify(folder / "step=000004.ckpt")
    (stopped_at,) = {int(step) for _, step, _ in stops}
    # the stop waited for the save in flight (and reported it) before its own message and exit
    reported = re.findall(
        r"step35: saved \S*step=(\d+)\.ckpt in the background", out[: out.index("stopped by SIGTERM")]
    )
    assert str(4) in [str(int(r)) for r in reported], out[-4000:]
    newest = catalog.newest_complete([folder])
    assert newest.global_step == stopped_at >= 4, (newest, out[-3000:])
    verify(newest.path)
    assert leftovers(folder) == [] and not catalog.incomplete_checkpoints(folder)
    steps = [catalog.step_from_name(p) for p in folder.glob("step=*.ckpt") if not p.is_symlink()]
    assert len(steps) == len(set(steps)), steps  # the stop waited for the save in flight: no step saved twice
