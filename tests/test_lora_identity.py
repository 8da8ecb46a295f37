"""Issue 24: a LoRA run knows its base by content, and the PEFT folder reader trusts nothing.

- The base's fingerprint (step35/checkpoint/lora_base.py) samples each shard's content, so two HF folders of one
  shape and no step35 manifest (every HF release) are told apart at resume, a moved copy is accepted, and the
  cost is bounded (the header and 3 x 1 MiB a shard).
- `apply_peft_folder` (step35/checkpoint/peft.py) validates adapter_config.json (types, ranges, pattern keys
  matched literally, never run as regexes), every tensor's name and shape, and the merged weights' finiteness,
  with one-line errors naming the file.
- `check_resume` (step35/run/resume.py) refuses a LoRA resume with another rank, expert rank or alpha.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings

import pytest
import torch

from step35.checkpoint import lora_base
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import MANIFEST

SHARD = "model-00001-of-00001.safetensors"


def hf_release(folder, seed):
    """A tiny random HF folder as a release ships it: no step35 manifest."""
    from tests.test_lora_checkpoint import hf_base

    hf_base(folder, seed)
    (folder / MANIFEST).unlink()
    return folder


# ------------------------------------------------------------------------------------------ 1. the base by content

def test_resume_refuses_a_same_shaped_base_without_manifest_and_accepts_the_moved_one(tmp_path, builtin_cache):
    """Before the fix both bases had the same index sha256 and file sizes and no manifest crc32: the resume on
    `other` was accepted (issue 24: rc 0, another loss). The refusal comes from on_load_checkpoint's
    lora_base.check_base, the function every resume (and export / generate) goes through."""
    from tests.test_lora_checkpoint import fit

    base, other = hf_release(tmp_path / "base", seed=1), hf_release(tmp_path / "other", seed=2)
    assert lora_base.base_identity(base, 0)["sizes"] == lora_base.base_identity(other, 0)["sizes"]
    assert not lora_base.base_identity(base, 0)["crc32"]  # no manifest: the old fingerprint cannot tell them apart
    fit(tmp_path / "run", builtin_cache, 2, base=base)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    with pytest.raises(CheckpointError, match=rf"a LoRA checkpoint of another base: .*other \(model.checkpoint\) is not "
                                              rf"the base .*base the run trained on: {SHARD} has other content "
                                              rf"\(sampled crc32 \w{{8}}, was \w{{8}}\)"):
        fit(tmp_path / "run", builtin_cache, 2, base=other, ckpt_path=ckpt)
    moved = tmp_path / "elsewhere" / "base"
    shutil.copytree(base, moved)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*predates content fingerprints")
        fit(tmp_path / "run", builtin_cache, 2, base=moved, ckpt_path=ckpt)  # the same content: accepted


def test_an_old_record_compares_what_it_can_and_says_what_it_cannot(tmp_path):
    """A record written before `sampled_crc32`: with a manifest crc32 it still refuses other weights; without
    one it accepts a same-shaped base, with a warning naming the file compared by size only."""
    base, other = hf_release(tmp_path / "base", seed=1), hf_release(tmp_path / "other", seed=2)
    old = {k: v for k, v in lora_base.base_identity(base, 0).items() if k not in ("sampled_crc32", "sample_scheme")}
    with pytest.warns(UserWarning, match=rf"ckpt: the record of the base .*base predates content fingerprints: "
                                         rf"{SHARD} compared by size only"):
        lora_base.check_base(old, lora_base.base_identity(other, 0), "ckpt")
    from tests.test_lora_checkpoint import hf_base

    with_manifest, other_with_manifest = hf_base(tmp_path / "m1", seed=1), hf_base(tmp_path / "m2", seed=2)
    old = {k: v for k, v in lora_base.base_identity(with_manifest, 0).items()
           if k not in ("sampled_crc32", "sample_scheme")}
    with pytest.raises(CheckpointError, match=rf"{SHARD} has crc32 \w+ in its manifest, was \w+"):
        lora_base.check_base(old, lora_base.base_identity(other_with_manifest, 0), "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every file covered by the manifest: nothing to warn about
        lora_base.check_base(old, lora_base.base_identity(with_manifest, 0), "ckpt")


def big_shards(folder, count: int, mib: int):
    """`count` safetensors shards of 4 tensors of `mib` MiB of random fp32 each."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        save_file({f"w{i}.{j}": torch.randn(mib * 2**18 // 4, 4, generator=g) for j in range(4)},
                  folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors")
    return folder


def test_the_fingerprint_reads_the_header_and_three_mib_per_shard(tmp_path, monkeypatch):
    folder = big_shards(tmp_path / "big", count=2, mib=4)
    read = []
    real = lora_base._read_span
    monkeypatch.setattr(lora_base, "_read_span", lambda f, offset, length: read.append(n := real(f, offset, length))
                        or n)
    started = time.perf_counter()
    identity = lora_base.base_identity(folder, 0)
    seconds = time.perf_counter() - started
    total = sum(identity["sizes"].values())
    headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in folder.glob("*.safetensors"))
    bytes_read = sum(len(b) for b in read)
    print(f"fingerprint of {total / 2**20:.0f} MiB in 2 shards: read {bytes_read} bytes in {seconds * 1000:.1f} ms")
    assert bytes_read == headers + 2 * 3 * lora_base.SAMPLE_BYTES < total / 5
    # a byte changed in a sampled span (here: the last byte of the last shard) is a different base
    last = sorted(folder.glob("*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    assert "has other content" in lora_base.base_difference(identity, lora_base.base_identity(folder, 0))


def test_a_file_that_is_no_safetensors_is_named(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / SHARD).write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=rf"{SHARD}: not a safetensors file \(no header of its 16 bytes\)"):
        lora_base.base_identity(folder, 0)
