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

import step35.checkpoint.export as export_lib
from step35.checkpoint import publish
from step35.checkpoint.pretrained import load_pretrained
from step35.checkpoint.trainer_io import remove, save_file
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


@pytest.fixture(scope="module")
def lora_on_a_base(tmp_path_factory, builtin_cache):
    """A LoRA run of 2 steps over an HF base folder: (run folder, base folder)."""
    from tests.test_lora_checkpoint import fit, hf_base

    root = tmp_path_factory.mktemp("lora-on-base")
    base = hf_base(root / "base", seed=1)
    fit(root / "run", builtin_cache, 2, base=base)
    return root / "run", base


# ----------------------------------------------------------------------------------------------- 4. modes
@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def modes(root: Path) -> dict[str, str]:
    """{relative path: octal mode} of every file and folder of `root` (`root` itself included)."""
    return {p.relative_to(root.parent).as_posix(): oct(stat.S_IMODE(p.stat().st_mode))
            for p in [root, *root.rglob("*")] if not p.is_symlink()}


def test_everything_step35_writes_is_0644_and_0755_under_umask_022(run_copy, lora_on_a_base, tmp_path, umask_022):
    main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "hf"), "--max_shard_size", "1MB"])
    main(["export", "--checkpoint", str(lora_on_a_base[0]), "--out", str(tmp_path / "adapter")])  # PEFT
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    folder = tmp_path / "ckpts"
    checkpoint = {"state_dict": {"model.w": torch.zeros(3)}, "global_step": 1, "epoch": 0}
    save_file(checkpoint, folder / "step=000001.ckpt")
    found = {**modes(tmp_path / "hf"), **modes(tmp_path / "adapter"), **modes(folder)}
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "hf/config.json",
            "hf/step35.manifest.json", "ckpts/step=000001.ckpt", "ckpts/step=000001.ckpt.manifest.json"} <= set(found)
    assert len([name for name in found if name.startswith("hf/model-")]) > 1  # the shards
    wrong = {name: mode for name, mode in found.items()
             if mode != ("0o755" if (tmp_path / name).is_dir() else "0o644")}
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
