"""Run folders, locks and launchers under misuse (issue 42): a checkpoint folder inside another live run's folder
(or a run folder around another run's checkpoint folder) is refused before anything there is touched; launcher
variables left in a shell are named at once; a full disk, a file-size limit, a refusal while the module is built
and a torchrun job given one device end in one step35 line, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from step35.run import RunFolder, RunFolderBusy, lock
from tests.helpers import write_run_config
from tests.runner import cli_fit
from tests.test_run import hold, kill9


def listing(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` with its bytes (what must be untouched)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def live_run(tmp_path):
    """A run folder A whose lock a live process holds, with a complete save and a save in progress in checkpoints/."""
    run = RunFolder(tmp_path / "A")
    run.checkpoints.mkdir(parents=True)
    (run.checkpoints / "step=000005.ckpt").write_bytes(b"A's save")
    (run.checkpoints / ".step=000010.ckpt.partial-4242-0123abcd").write_bytes(b"A's save in progress")
    holder, _ = hold(run.root)
    try:
        yield run, holder
    finally:
        kill9(holder)


# ------------------------------------------------------------------------------ 1. nested run and checkpoint folders
@pytest.mark.heavy  # a process holds the lock
@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/deeper"])
def test_a_checkpoint_folder_inside_a_live_runs_folder_is_refused_untouched(
    inside, live_run, tmp_path, builtin_cache, capfd
):
    run, holder = live_run
    before = listing(run.root)
    dirpath = run.root / inside
    second = cli_fit(
        capfd,
        write_run_config(tmp_path),
        tmp_path / "B",
        builtin_cache,
        f"--trainer.callbacks.dirpath={dirpath}",
        check=False,
    )
    assert second.returncode == 1
    said = [line for line in second.stderr.splitlines() if "step35:" in line]
    assert len(said) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert (
        f"the checkpoint folder (RunCheckpoint.dirpath) {dirpath} is inside {run.root}, a folder a live run owns "
        in (said[0])
    ), said
    assert f"pid {holder.pid}" in said[0] and "own RunCheckpoint.dirpath" in said[0], said
    assert listing(run.root) == before and not (run.root / inside / ".step35.lock").exists()


@pytest.mark.heavy  # a process holds the lock
def test_a_run_folder_around_a_live_runs_checkpoint_folder_is_refused(tmp_path):
    """The reverse: B saves into X/checkpoints (its RunCheckpoint.dirpath lock), then a run is started in X."""
    outer = RunFolder(tmp_path / "X")
    theirs = outer.checkpoints
    holder, _ = hold(theirs)
    try:
        with pytest.raises(RunFolderBusy) as refused:
            lock.RunLock(outer).acquire()
        message = str(refused.value)
        assert f"{outer.root} holds {theirs}, a folder a live run owns (pid {holder.pid}" in message, message
        assert "--run_dir" in message
    finally:
        kill9(holder)
    mine = lock.RunLock(outer)  # the holder is gone: free
    assert mine.acquire() is None
    mine.release()


@pytest.mark.parametrize("outer_first", [True, False], ids=["outer-first", "inner-first"])
def test_a_folder_this_process_holds_is_no_obstacle(outer_first, tmp_path):
    """A run folder inside the checkpoint folder this same job locked (or the reverse) is one job's own."""
    outer = RunFolder(tmp_path / "ckpts")
    inner = RunFolder(tmp_path / "ckpts" / "run")
    try:
        for folder in (outer, inner) if outer_first else (inner, outer):
            assert lock.acquire(folder) is None
        assert lock.held(outer) and lock.held(inner)
    finally:
        lock.release(inner)
        lock.release(outer)
