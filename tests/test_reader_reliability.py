"""Issue 42: what the HF-folder, PEFT and pickle readers say about bad input: one step35 line naming the file and
what to do, never a traceback or a line about something else.

- a single-file model.safetensors whose header is garbage or cut short (before: safetensors' raw error);
- a config.json nested 100,000 deep (before: RecursionError), read by `generate` and by `fit`;
- a shard that cannot be mapped into memory (before: "unreadable safetensors file", as if damaged);
- a PEFT adapter folder given to `fit --model.checkpoint` or `export --checkpoint` (before: a traceback about a
  missing config.json, or "neither a checkpoint nor a run folder");
- a checksum mismatch in an HF folder (before: "--ckpt_path last|auto now skip this checkpoint", and a damage
  record left beside a folder that --ckpt_path never chooses);
- a pickle the weights_only allowlist refuses (before: "it asks for GLOBAL")."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import pytest
import torch

from step35.checkpoint.errors import CheckpointError
from step35.config import preset
from tests.helpers import flip_byte, hf_base

SHARD = "model-00001-of-00001.safetensors"


def only_error_line(err: str, start: str) -> str:
    """The one line of `err` that starts with `start`; there is no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(start)]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture(autouse=True)
def quiet_stale_log_handlers(monkeypatch):
    """Lightning's log handler writes to the stderr of its first import, an earlier test's capture that pytest has
    closed: logging would print "--- Logging error ---" and a traceback of its own into this test's stderr."""
    import logging

    monkeypatch.setattr(logging, "raiseExceptions", False)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return hf_base(tmp_path_factory.mktemp("base") / "base", seed=1)


def single_file_folder(folder: Path, content: bytes) -> Path:
    """An HF folder of the tiny preset whose one weight file, model.safetensors, holds `content`."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset("tiny").to_dict()))
    (folder / "model.safetensors").write_bytes(content)
    return folder


@pytest.mark.parametrize(
    "content",
    [b"\xff" * 8 + b"{}", struct.pack("<Q", 100) + b'{"model.embed_tokens.weight": {"dtype'],
    ids=["garbage_length", "truncated_header"],
)
def test_a_single_file_with_a_bad_header_is_one_line(step35_here, tmp_path, content):
    folder = single_file_folder(tmp_path / "hf", content)
    code, _, err = step35_here("generate", "--checkpoint", str(folder), "--prompt", "The")
    line = only_error_line(err, "step35 generate:")
    assert code == 1 and f"{folder}/model.safetensors: unreadable safetensors file (SafetensorError: " in line
    assert line.endswith("its header is damaged or the file is cut short: download or copy it again"), line


def deep_copy(base: Path, folder: Path) -> Path:
    """A copy of `base` whose config.json is a list nested 100,000 deep."""
    import shutil

    shutil.copytree(base, folder)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return folder


def test_a_deeply_nested_config_json_is_one_line(step35_here, base, tmp_path):
    folder = deep_copy(base, tmp_path / "deep")
    message = f"{folder}/config.json: nested deeper than the JSON reader follows"
    code, _, err = step35_here("generate", "--checkpoint", str(folder), "--prompt", "The")
    assert code == 1 and message in only_error_line(err, "step35 generate:")
    code, _, err = step35_here(
        "fit", "--config", "configs/tiny.yaml", f"--model.checkpoint={folder}", f"--run_dir={tmp_path / 'run'}"
    )
    assert code == 1 and message in only_error_line(err, "step35: model.checkpoint=")


@pytest.mark.parametrize(
    "error",
    [
        MemoryError("Cannot allocate memory (os error 12)"),  # safetensors 0.8 under ulimit -v (tried)
        RuntimeError("unable to mmap 8589934592 bytes from file <shard>: Cannot allocate memory (12)"),  # torch's
    ],
    ids=["safetensors", "torch"],
)
def test_a_shard_that_cannot_be_mapped_says_so(step35_here, base, monkeypatch, error):
    """A shard larger than the process may map: safetensors maps the whole file when it opens it. The error the
    library raises is raised here by its safe_open, so no large file or memory limit is needed."""
    import safetensors

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    code, _, err = step35_here("generate", "--checkpoint", str(base), "--prompt", "The")
    line = only_error_line(err, "step35 generate:")
    assert code == 1 and f"{base}/{SHARD}: cannot be mapped into memory ({type(error).__name__}: " in line
    assert "exceeds this process's limit (ulimit -v, a container's memory limit" in line, line


def adapter_folder(folder: Path, base: Path) -> Path:
    """A PEFT adapter folder over `base`: adapter_config.json and adapter_model.safetensors, no config.json."""
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj"],
                "base_model_name_or_path": str(base),
            }
        )  # fmt: skip
    )
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(4, 8)}, folder / "adapter_model.safetensors")
    return folder


def test_a_peft_folder_where_a_model_is_needed_is_named_as_one(step35_here, base, tmp_path):
    adapter = adapter_folder(tmp_path / "adapter", base)
    said = f"{adapter}: a PEFT adapter folder (LoRA adapters, adapter_config.json), not a model. `step35 generate "
    code, _, err = step35_here(
        "fit", "--config", "configs/tiny.yaml", f"--model.checkpoint={adapter}", f"--run_dir={tmp_path / 'run'}"
    )
    line = only_error_line(err, "step35: model.checkpoint ")
    assert code == 1 and said in line and f"runs it merged on its base {base};" in line, line
    code, _, err = step35_here("export", "--checkpoint", str(adapter), "--out", str(tmp_path / "out"))
    line = only_error_line(err, "step35 export: --checkpoint ")
    assert code == 1 and said in line and "`step35 export --checkpoint <run> --merge true`" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_a_checksum_mismatch_in_an_hf_folder_says_to_restore_it(base, tmp_path):
    """An HF folder is never chosen by --ckpt_path, so the line does not mention it, and no damage record (which
    only --ckpt_path last|auto reads) is left beside the folder."""
    import shutil

    from step35.checkpoint.hf.pretrained import load_pretrained

    folder = tmp_path / "hf"
    shutil.copytree(base, folder)
    flip_byte(folder / SHARD)
    with pytest.raises(CheckpointError) as refused:
        load_pretrained(folder)
    line = str(refused.value)
    assert line.startswith(f"{folder / SHARD}: checksum mismatch") and "ckpt_path" not in line, line
    assert line.endswith("the file is damaged; restore the folder (copy, download or export it again)"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_refused_pickle_names_the_class_and_what_to_do(step35_here, tmp_path):
    """torch says "Unsupported global: GLOBAL argparse.Namespace was not an allowed global"; step35 said "it asks
    for GLOBAL". Now the class is named, through `step35 export` as through the loader."""
    from step35.checkpoint.safe_load import load_torch

    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": argparse.Namespace(lr=1.0)}, bad)
    with pytest.raises(CheckpointError) as refused:
        load_torch(bad)
    said = (
        f"{bad}: refused to unpickle: it asks for the Python object argparse.Namespace, which is not on step35's "
        "allowlist of the types a checkpoint holds (torch.load with weights_only=True), so nothing from the file "
        "was run. step35's own checkpoints never hold it; if you trust this file, add it to checkpoint_types() in "
        "step35/checkpoint/safe_load.py"
    )
    assert str(refused.value) == said
    code, _, err = step35_here("export", "--checkpoint", str(bad), "--out", str(tmp_path / "out"))
    assert code == 1 and said in only_error_line(err, "step35 export:")
