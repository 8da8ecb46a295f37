"""`step35 export` never destroys data (issue 24): an existing --out is replaced only when step35 wrote it
(or with --overwrite), never what the export reads (the checkpoint, its run folder and its entries, the LoRA
base) nor a folder holding one; a checkpoint pruned by a live run while it is read gives way to the newest
intact one; the partial copies of killed exports are removed (only those of dead writers); a full disk ends
in one line with the partial removed; and everything written is 0644 / 0755 under umask 022.

Before these fixes every refused case below was deleted with rc 0, a killed export's partial stayed forever,
ENOSPC ended in a traceback, and the PEFT adapter file was 0600 (safetensors' mode)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import step35.checkpoint.training.export as export_lib
from step35.checkpoint import publish
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.checkpoint.training.trainer_io import remove, save_file
from step35.cli import main


def snapshot(root: Path) -> dict[str, object]:
    """Everything under `root` (or the file `root`): {relative path: bytes | 'dir' | 'link -> target'}."""

    def entry(path: Path) -> object:
        if path.is_symlink():
            return f"link -> {os.readlink(path)}"
        return "dir" if path.is_dir() else path.read_bytes()

    if not root.is_dir() or root.is_symlink():
        return {".": entry(root)}
    return {p.relative_to(root).as_posix(): entry(p) for p in sorted(root.rglob("*"))}


def refused(argv: list[str], match: str) -> str:
    """Run `step35 export` expecting a refusal; returns its message (checked to be one line)."""
    with pytest.raises(SystemExit) as failure:
        main(["export", *argv])
    message = str(failure.value)
    assert "\n" not in message and message.startswith(("step35 export: ", "step35: ")), message
    assert re.search(match, message), message
    return message


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run folder (checkpoints/step=000003.ckpt, its manifest, last.ckpt) in
    tmp_path/parent/run, plus a config.yaml and a log, as a CLI run folder holds."""
    run = tmp_path / "parent" / "run"
    shutil.copytree(tiny_run[0], run, symlinks=True)
    (run / "config.yaml").write_text("model:\n  config: tiny\n")
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text("step,loss\n1,6.9\n")
    return run


# ---------------------------------------------------------------------------------- 1. what --out may replace
def test_an_unrelated_folder_or_file_is_refused_unless_overwrite(run_copy, tmp_path):
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work\n")
    (folder / "sub" / "data.bin").write_bytes(b"\x00\x01" * 100)
    file = tmp_path / "notes.txt"
    file.write_text("do not lose\n")
    before = snapshot(tmp_path)
    refused(
        ["--checkpoint", str(run_copy), "--out", str(folder)],
        r"--out .*mine exists \(a folder of 2 entries\) and is not a folder step35 exported: refused; pass "
        r"--overwrite",
    )
    refused(["--checkpoint", str(run_copy), "--out", str(file)], r"notes.txt exists \(a file\) .* --overwrite")
    assert snapshot(tmp_path) == before
    main(["export", "--checkpoint", str(run_copy), "--out", str(folder), "--overwrite", "true"])
    assert load_pretrained(folder) is not None and not (folder / "thesis.tex").exists()
    assert snapshot(file) == {".": b"do not lose\n"}


@pytest.mark.parametrize(
    "out, match",
    [
        (
            "parent/run",
            r"--out .*parent/run is the run folder of the checkpoint, which this export reads: refused, even "
            r"with --overwrite",
        ),
        (
            "parent/run/checkpoints",
            r"--out .*checkpoints holds the checkpoint \(.*step=000003.ckpt\), which this export "
            r"reads: refused, even with --overwrite",
        ),
        ("parent", r"--out .*parent holds the checkpoint .* refused, even with --overwrite"),
        ("parent/run/checkpoints/step=000003.ckpt", r"is the checkpoint, which this export reads: refused, even"),
        ("parent/run/checkpoints/step=000003.ckpt/hf", r"lies inside the checkpoint .* refused, even with --overwrite"),
        (
            "parent/run/csv",
            r"--out .*csv: csv is part of the run folder .*/run, not an export: refused, even with "
            r"--overwrite; export to a new name there \(e.g. .*run/hf\)",
        ),
        ("parent/run/config.yaml", r"config.yaml is part of the run folder"),
        ("parent/run/checkpoints/hf", r"checkpoints is part of the run folder"),
    ],
)
@pytest.mark.parametrize("named", ["run folder", "last.ckpt", "checkpoint file"])
def test_what_the_export_reads_is_never_replaced_even_with_overwrite(run_copy, tmp_path, out, match, named):
    checkpoint = {
        "run folder": run_copy,
        "last.ckpt": run_copy / "checkpoints" / "last.ckpt",
        "checkpoint file": run_copy / "checkpoints" / "step=000003.ckpt",
    }[named]
    before = snapshot(tmp_path)
    for overwrite in ([], ["--overwrite", "true"]):
        refused(["--checkpoint", str(checkpoint), "--out", str(tmp_path / out), *overwrite], match)
        assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def lora_on_a_base(tmp_path_factory, builtin_cache):
    """A LoRA run of 2 steps over an HF base folder: (run folder, base folder)."""
    from tests.helpers import hf_base, lora_fit

    root = tmp_path_factory.mktemp("lora-on-base")
    base = hf_base(root / "base", seed=1)
    lora_fit(root / "run", builtin_cache, 2, base=base)
    return root / "run", base


@pytest.mark.parametrize("merge", [["--merge", "true"], []], ids=["merge", "peft"])
def test_a_lora_runs_base_is_never_replaced(lora_on_a_base, merge):
    run, base = lora_on_a_base
    before = snapshot(base.parent)
    for out, match in [
        (
            base,
            r"--out .*base is the LoRA run's base \(model.checkpoint\), which this export reads: "
            r"refused, even with --overwrite",
        ),
        (base / "hf", r"lies inside the LoRA run's base"),
        (base.parent, r"holds the checkpoint"),
    ]:
        refused(["--checkpoint", str(run), "--out", str(out), "--overwrite", "true", *merge], match)
        assert snapshot(base.parent) == before


def test_a_step35_export_is_replaced_and_a_new_name_in_the_run_folder_is_fine(run_copy, capsys):
    """README's workflow: `--out runs/tiny/hf`, run again after more training: the previous export is replaced
    (said), the run's own files are untouched."""
    out = run_copy / "hf"
    main(["export", "--checkpoint", str(run_copy), "--out", str(out)])
    run_files = {k: v for k, v in snapshot(run_copy).items() if not k.startswith("hf")}
    stale = out / "stale.txt"
    stale.write_text("from the previous export\n")
    capsys.readouterr()
    main(["export", "--checkpoint", str(run_copy), "--out", str(out)])
    assert f"replaced the previous step35 export at {out}" in capsys.readouterr().err
    assert not stale.exists() and load_pretrained(out) is not None
    assert {k: v for k, v in snapshot(run_copy).items() if not k.startswith("hf")} == run_files


# ------------------------------------------------------------------------------------ a live run's rotation
def two_checkpoint_run(run_copy: Path) -> tuple[Path, Path]:
    """The run copy with a second, older intact checkpoint (step 2): (older, newest)."""
    checkpoints = run_copy / "checkpoints"
    newest, older = checkpoints / "step=000003.ckpt", checkpoints / "step=000002.ckpt"
    shutil.copyfile(newest, older)
    manifest = json.loads((checkpoints / "step=000003.ckpt.manifest.json").read_text())
    manifest["extra"]["global_step"] = 2
    (checkpoints / "step=000002.ckpt.manifest.json").write_text(json.dumps(manifest))
    return older, newest


def prune_on_first_read(monkeypatch, victim: Path) -> None:
    """Make the first read of a checkpoint find `victim` pruned by the live run just after it was chosen."""
    real = export_lib.open_checkpoint
    calls = []

    def open_checkpoint(path, config=None):
        if not calls:
            remove(victim)  # what keep_last retention does (manifest first, then the file)
        calls.append(path)
        return real(path, config)

    monkeypatch.setattr(export_lib, "open_checkpoint", open_checkpoint)


def test_a_checkpoint_pruned_while_read_gives_way_to_the_newest_intact_one(run_copy, tmp_path, monkeypatch, capsys):
    older, newest = two_checkpoint_run(run_copy)
    prune_on_first_read(monkeypatch, newest)
    main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "hf")])
    said = capsys.readouterr()
    assert (
        f"{newest} was removed or replaced while it was being read (a live run pruning its checkpoints?): "
        f"reading {older}, the newest intact checkpoint now, instead"
    ) in said.err
    assert f"wrote {tmp_path / 'hf'} from {older}" in said.out
    assert load_pretrained(tmp_path / "hf") is not None


def test_a_named_checkpoint_pruned_while_read_is_said_not_replaced(run_copy, tmp_path, monkeypatch):
    _, newest = two_checkpoint_run(run_copy)
    prune_on_first_read(monkeypatch, newest)
    refused(
        ["--checkpoint", str(newest), "--out", str(tmp_path / "hf")],
        r"step=000003.ckpt: removed or replaced while it was being read \(a live run pruning its checkpoints, "
        r"keep_last\?\); name the run folder",
    )
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------ 2. partials of killed exports
def fake_partial(parent: Path, pid: int, host: str | None = None) -> Path:
    """A full-size-looking partial copy as an export with writer `pid` on `host` leaves it (host None:
    the spelling of step35 before host tags)."""
    tag = f"{pid}-{host}-0123abcd" if host else f"{pid}-0123abcd"
    partial = parent / f".hf.partial-{tag}"
    partial.mkdir(parents=True)
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 4096)
    return partial


def dead_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it


def test_partials_of_dead_exports_are_removed_and_said_live_ones_kept(run_copy, tmp_path, capsys):
    parent = tmp_path / "exports"
    here = publish.host_tag()
    dead = fake_partial(parent, dead_pid(), here)
    live = fake_partial(parent, os.getpid(), here)  # this process: alive
    elsewhere = fake_partial(parent, dead_pid(), "0badf00d")  # another host's pid means nothing here
    old = fake_partial(parent, dead_pid())
    assert publish.partial_writer(dead) == (dead_pid(), here) and publish.partial_writer(old) == (dead_pid(), None)
    main(["export", "--checkpoint", str(run_copy), "--out", str(parent / "hf")])
    err = capsys.readouterr().err
    assert (
        f"removed {dead}, left by an export that was killed (its process, pid {dead_pid()} on this host, is gone)"
        in err
    )
    assert f"left {old}: a partial copy written by an older step35" in err
    assert not dead.exists() and live.is_dir() and elsewhere.is_dir() and old.is_dir()
    assert str(live) not in err and str(elsewhere) not in err


@pytest.mark.multiprocess
def test_the_partial_of_a_live_export_in_another_process_is_kept(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = fake_partial(tmp_path, sleeper.pid, publish.host_tag())
        assert publish.dead_partials(tmp_path) == ([], [])
        assert publish.remove_dead_partials(tmp_path) == [] and live.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert publish.remove_dead_partials(tmp_path) == [live] and not live.exists()  # its writer is gone now


def test_partial_names_carry_pid_and_host():
    partial = publish.partial_path("/x/hf")
    assert publish.partial_writer(partial) == (os.getpid(), publish.host_tag())
    assert publish.leftover_of(partial) == ("hf", "partial")
    assert publish.partial_writer("/x/.hf.old-12-abcdef12-0011aabb") is None  # a retired copy: not a partial


# -------------------------------------------------------------------------------------------- 3. a full disk
@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        RuntimeError('Error while serializing: Os { code: 28, kind: StorageFull, message: "No space left on device" }'),
    ],
    ids=["ENOSPC", "EDQUOT", "safetensors"],
)
def test_a_full_disk_ends_in_one_line_with_the_partial_removed(run_copy, tmp_path, monkeypatch, error):
    import safetensors.torch

    out = tmp_path / "exports" / "hf"
    main(["export", "--checkpoint", str(run_copy), "--out", str(out), "--max_shard_size", "1MB"])
    before = snapshot(out)
    real, calls = safetensors.torch.save_file, []

    def save_file_on_a_full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the first shard fits, the second does not
            raise error
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_on_a_full_disk)
    message = refused(
        ["--checkpoint", str(run_copy), "--out", str(out), "--max_shard_size", "1MB"],
        r"^step35: export failed: no space left on device writing ",
    )
    assert f"the partial export was removed; {out} is as it was before" in message
    assert len(calls) == 2 and snapshot(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no partial left


def test_another_write_error_is_one_line_too(run_copy, tmp_path, monkeypatch):
    import safetensors.torch

    def read_only(tensors, filename, metadata=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", read_only)
    refused(
        ["--checkpoint", str(run_copy), "--out", str(tmp_path / "hf")],
        r"^step35: export failed: Permission denied \(.*\.hf\.partial-.*shard-00001.safetensors\); the "
        r"partial export was removed",
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "parent"]


# ----------------------------------------------------------------------------------------------- 4. modes
@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def modes(root: Path) -> dict[str, str]:
    """{relative path: octal mode} of every file and folder of `root` (`root` itself included)."""
    return {
        p.relative_to(root.parent).as_posix(): oct(stat.S_IMODE(p.stat().st_mode))
        for p in [root, *root.rglob("*")]
        if not p.is_symlink()
    }


def test_everything_step35_writes_is_0644_and_0755_under_umask_022(run_copy, lora_on_a_base, tmp_path, umask_022):
    main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "hf"), "--max_shard_size", "1MB"])
    main(["export", "--checkpoint", str(lora_on_a_base[0]), "--out", str(tmp_path / "adapter")])  # PEFT
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    folder = tmp_path / "ckpts"
    checkpoint = {"state_dict": {"model.w": torch.zeros(3)}, "global_step": 1, "epoch": 0}
    save_file(checkpoint, folder / "step=000001.ckpt")
    found = {**modes(tmp_path / "hf"), **modes(tmp_path / "adapter"), **modes(folder)}
    assert {
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "hf/config.json",
        "hf/step35.manifest.json",
        "ckpts/step=000001.ckpt",
        "ckpts/step=000001.ckpt.manifest.json",
    } <= set(found)
    assert len([name for name in found if name.startswith("hf/model-")]) > 1  # the shards
    wrong = {name: mode for name, mode in found.items() if mode != ("0o755" if (tmp_path / name).is_dir() else "0o644")}
    assert not wrong


def test_publish_gives_a_private_temporary_file_and_folder_the_umask_modes(tmp_path, umask_022):
    import tempfile

    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700
    fd, name = tempfile.mkstemp(dir=folder)  # 0600
    os.close(fd)
    tmp = publish.partial_path(tmp_path / "out")
    folder.rename(tmp)
    publish.publish(tmp, tmp_path / "out")
    assert modes(tmp_path / "out") == {"out": "0o755", f"out/{Path(name).name}": "0o644"}
