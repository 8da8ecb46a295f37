"""Run folders, locks and launchers under misuse (issue 42): a checkpoint folder inside another live run's folder
(or a run folder around another run's checkpoint folder) is refused before anything there is touched; launcher
variables left in a shell are named at once; a full disk, a file-size limit, a refusal while the module is built
and a torchrun job given one device end in one step35 line, not a traceback."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

from step35 import job
from step35.run import RunFolder, RunFolderBusy, lock
from tests.helpers import flip_byte, hf_base, small_filesystem, write_run_config
from tests.runner import LAUNCH_PREFIXES, LAUNCH_VARIABLES, cli_fit, python
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


# ------------------------------------------------------------------------------ 2. launcher variables left in a shell
@pytest.fixture
def shell_with(monkeypatch):
    """shell_with(variables): this process as a command started from a shell where only `variables` of every
    launcher's are set; step35.job reads it afresh (its earlier reading comes back after the test)."""
    for name in [*LAUNCH_VARIABLES, *(k for k in os.environ if k.startswith(LAUNCH_PREFIXES))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(job, "_THIS_PROCESS", None)
    monkeypatch.setattr(job, "_STARTED_ID", None)

    def shell(variables: dict[str, str], devices_per_node: int | None = None) -> job.JobPlace:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return job.this_process(devices_per_node, fresh=True)

    return shell


TORCHRUN_RANK1 = {
    "TORCHELASTIC_RUN_ID": "none",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    "variables, named",
    [
        ({"LOCAL_RANK": "1"}, "rank 1 of a lightning job (LOCAL_RANK=1 in the environment)"),
        ({"NODE_RANK": "1"}, "rank 1 of a lightning job (NODE_RANK=1 in the environment)"),
        (TORCHRUN_RANK1, "rank 1 of a torchrun job (TORCHELASTIC_RUN_ID=none, RANK=1, GROUP_RANK=0, LOCAL_RANK=1"),
    ],
    ids=["LOCAL_RANK", "NODE_RANK", "torchrun"],
)
def test_a_non_zero_rank_says_at_once_which_variables_made_it_one(variables, named, shell_with, tmp_path, monkeypatch):
    place = shell_with(variables, devices_per_node=1)
    assert not place.is_rank_zero
    monkeypatch.setattr(lock, "RANK0_WAIT_S", 0.5)
    monkeypatch.setattr(lock, "RANK0_WAIT_SAID_AFTER_S", 0.0)
    said = []
    monkeypatch.setattr(sys, "stderr", type("Stream", (), {"write": said.append, "flush": lambda self: None})())
    with pytest.raises(SystemExit) as ended:
        lock.wait_for_rank0(RunFolder(tmp_path / "run"), until="resume")
    assert len(said) == 1 and said[0].startswith("[rank 1] step35: waiting up to 0 s for the job's rank 0"), said
    assert named in said[0] and "the launcher is expected to start rank 0" in said[0], said
    assert named in str(ended.value) and "unset them" in str(ended.value), ended.value


@pytest.mark.heavy  # a fit in this process
def test_a_stray_local_rank_ends_naming_it(shell_with, tmp_path, builtin_cache, capfd, monkeypatch):
    """`step35 fit` from a shell with LOCAL_RANK=1 left over: rank 1 of a job without rank 0 says so and ends."""
    shell_with({"LOCAL_RANK": "1"})
    monkeypatch.setattr(lock, "RANK0_WAIT_S", 1.0)
    monkeypatch.setattr(lock, "RANK0_WAIT_SAID_AFTER_S", 0.0)
    ended = cli_fit(capfd, write_run_config(tmp_path), tmp_path / "run", builtin_cache, check=False)
    lines = [line for line in ended.stderr.splitlines() if "step35:" in line]
    assert ended.returncode == 1 and "Traceback" not in ended.stderr, ended.stderr[-3000:]
    assert len(lines) == 2 and all(line.startswith("[rank 1] step35: ") for line in lines), lines
    assert all("LOCAL_RANK=1" in line for line in lines), lines
    assert "waited 1 s" in lines[1] and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("variable", ["RANK", "SLURM_PROCID"])
def test_a_rank_variable_lightning_reads_but_the_job_does_not_is_warned_about(variable, shell_with):
    place = shell_with({variable: "1"})
    assert place.is_rank_zero  # step35 (and the Trainer) run it as the one process it is
    note = job.lightning_rank_mismatch(place)
    assert note is not None and note.startswith(f"{variable}=1 is set, but this process is rank 0 of a job started "), (
        note
    )
    assert f"Unset {variable}" in note, note
    assert job.lightning_rank_mismatch(shell_with({variable: "0"})) is None
    assert job.lightning_rank_mismatch(shell_with(TORCHRUN_RANK1)) is None  # a real rank 1


@pytest.mark.heavy  # a fit in this process
def test_a_one_process_fit_with_rank_1_left_over_says_so(shell_with, tmp_path, builtin_cache, capfd):
    shell_with({"RANK": "1"})
    done = cli_fit(
        capfd, write_run_config(tmp_path), tmp_path / "run", builtin_cache, "--trainer.max_steps=1", check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step35: RANK=1 is set, but this process is rank 0 of a job started from a shell" in done.stderr


# ------------------------------------------------------------------------------ 3. one line, not a traceback
def test_torchrun_with_more_processes_than_trainer_devices_is_refused(shell_with, tmp_path, capfd):
    shell_with({**TORCHRUN_RANK1, "RANK": "0", "LOCAL_RANK": "0"})
    refused = cli_fit(capfd, write_run_config(tmp_path), tmp_path / "run", None, "--trainer.devices=1", check=False)
    lines = [line for line in refused.stderr.splitlines() if "step35:" in line]
    assert refused.returncode == 1 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert lines[0].startswith("step35: a torchrun job (") and "WORLD_SIZE=2, LOCAL_WORLD_SIZE=2" in lines[0], lines
    assert "has 2 processes, but trainer.devices=1 x trainer.num_nodes=1 make 1" in lines[0], lines
    assert lines[0].endswith("Set --trainer.devices 2 (the processes the launcher starts per node)"), lines
    assert not (tmp_path / "run").exists()


@pytest.mark.heavy  # a fit in this process
def test_a_fit_on_a_full_disk_ends_in_one_line_naming_the_run_folder(tmp_path, builtin_cache, capfd):
    (tmp_path / "small").mkdir()
    with small_filesystem(tmp_path / "small", "64k") as disk:
        with pytest.raises(OSError) as full:
            (disk / "filler").write_bytes(b"x" * (1 << 20))
        assert full.value.errno == errno.ENOSPC
        refused = cli_fit(capfd, write_run_config(tmp_path), disk / "run", builtin_cache, check=False)
        lines = [line for line in refused.stderr.splitlines() if "step35:" in line]
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert lines == [
            f"step35: {disk / 'run'}: cannot write its lock file {disk / 'run' / '.step35.lock'}: no space left on "
            "device (ENOSPC), the disk is full; free space there, or give this run its own folder with --run_dir on "
            "another filesystem"
        ], lines
        assert not lock.held(RunFolder(disk / "run"))  # nothing left open: the tmpfs unmounts


def limited_python(code: str, *args: str):
    """`code` run by `python -c` with `args` as sys.argv[1:] in a process whose files may not grow past 1 MiB."""
    return python(FILE_SIZE_LIMITED + f"sys.argv[1:] = {list(args)!r}\n" + code)


# A process whose files may not grow past 1 MiB (`ulimit -f 1024`), SIGXFSZ ignored so that a write gets EFBIG.
FILE_SIZE_LIMITED = (
    "import resource, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
)


@pytest.mark.heavy  # a process of its own
def test_a_save_over_the_file_size_limit_names_the_checkpoint_and_the_limit(tmp_path):
    path = tmp_path / "step=000001.ckpt"
    saved = limited_python(
        "import torch\n"
        "from step35.checkpoint.training.trainer_io import save_file\n"
        "try:\n"
        "    save_file({'state_dict': {'w': torch.zeros(1 << 20)}, 'global_step': 1}, sys.argv[1])\n"
        "except OSError as e:\n"
        "    print(e.errno, e.strerror)\n",
        str(path),
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    code, line = saved.stdout.strip().split(" ", 1)
    assert int(code) == errno.EFBIG and "\n" not in line, saved.stdout
    assert line.startswith(f"{path}: a file of this checkpoint would be larger than this process's file-size limit, ")
    assert "1.0 MiB (ulimit -f 1024) (EFBIG)" in line and "the partial save was removed" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy  # a process of its own
def test_an_export_over_the_file_size_limit_is_one_line(tiny_run, tmp_path):
    out = tmp_path / "hf"
    exported = limited_python(
        "from step35.cli import main\nmain(sys.argv[1:])\n",
        *["export", "--checkpoint", str(tiny_run[0]), "--out", str(out), "--max_shard_size", "1GB"],
    )
    lines = [line for line in exported.stderr.splitlines() if "step35" in line]
    assert exported.returncode == 1 and "Traceback" not in exported.stderr, exported.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("step35: export failed: "), lines
    assert "would be larger than this process's file-size limit, 1.0 MiB (ulimit -f 1024) (EFBIG)" in lines[0], lines
    # (safetensors' error names no file: the export folder is named, as for a full disk)
    assert lines[0].startswith(f"step35: export failed: {out} would be larger than "), lines
    assert lines[0].endswith(f"the partial export was removed; {out} is as it was before"), lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy  # a fit in this process
def test_a_damaged_model_checkpoint_found_while_the_module_is_built_is_one_line(tmp_path, builtin_cache, capfd):
    """configure_model reads model.checkpoint's weights: their CheckpointError used to follow a traceback."""
    from step35.data.builtin import builtin_tokenizer_dir

    base = hf_base(tmp_path / "base", seed=1)
    shard = next(base.glob("*.safetensors"))
    flip_byte(shard)
    refused = cli_fit(
        capfd,
        write_run_config(tmp_path),
        tmp_path / "run",
        builtin_cache,
        f"--model.checkpoint={base}",
        f"--data.tokenizer={builtin_tokenizer_dir(1024, builtin_cache)}",
        check=False,
    )
    lines = [line for line in refused.stderr.splitlines() if "step35:" in line]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert lines == [f"step35: {shard}: checksum mismatch" + lines[0].split("checksum mismatch", 1)[1]], lines
    assert "restore the folder" in lines[0], lines
