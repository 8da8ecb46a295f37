"""Issue 24: a LoRA run knows its base by content, and the PEFT folder reader trusts nothing.

- The base's fingerprint (step35/checkpoint/hf/lora_base.py) samples each shard's content, so two HF folders of one
  shape and no step35 manifest (every HF release) are told apart at resume, a moved copy is accepted, and the
  cost is bounded (the header and 3 x 1 MiB a shard).
- `apply_peft_folder` (step35/checkpoint/hf/peft.py) validates adapter_config.json (types, ranges, pattern keys
  matched literally, never run as regexes), every tensor's name and shape, and the merged weights' finiteness,
  with one-line errors naming the file.
- `check_resume` (step35/run/resume.py) refuses a LoRA resume with another rank, expert rank or alpha.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import lora_base
from step35.checkpoint.integrity import MANIFEST

SHARD = "model-00001-of-00001.safetensors"


def hf_release(folder, seed):
    """A tiny random HF folder as a release ships it: no step35 manifest."""
    from tests.helpers import hf_base

    hf_base(folder, seed)
    (folder / MANIFEST).unlink()
    return folder


# ------------------------------------------------------------------------------------------ 1. the base by content


def test_resume_refuses_a_same_shaped_base_without_manifest_and_accepts_the_moved_one(tmp_path, builtin_cache):
    """Before the fix both bases had the same index sha256 and file sizes and no manifest crc32: the resume on
    `other` was accepted (issue 24: rc 0, another loss). The refusal comes from on_load_checkpoint's
    lora_base.check_base, the function every resume (and export / generate) goes through."""
    from tests.helpers import lora_fit

    base, other = hf_release(tmp_path / "base", seed=1), hf_release(tmp_path / "other", seed=2)
    assert lora_base.base_identity(base, 0)["sizes"] == lora_base.base_identity(other, 0)["sizes"]
    assert not lora_base.base_identity(base, 0)["crc32"]  # no manifest: the old fingerprint cannot tell them apart
    lora_fit(tmp_path / "run", builtin_cache, 2, base=base)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    with pytest.raises(
        CheckpointError,
        match=rf"a LoRA checkpoint of another base: .*other \(model.checkpoint\) is not "
        rf"the base .*base the run trained on: {SHARD} has other content "
        rf"\(sampled crc32 \w{{8}}, was \w{{8}}\)",
    ):
        lora_fit(tmp_path / "run", builtin_cache, 2, base=other, ckpt_path=ckpt)
    moved = tmp_path / "elsewhere" / "base"
    shutil.copytree(base, moved)
    lora_fit(tmp_path / "run", builtin_cache, 2, base=moved, ckpt_path=ckpt)  # the same content: accepted


def test_a_record_without_a_comparable_fingerprint_is_refused(tmp_path):
    """A folder record without `sampled_crc32` (or of another sample_scheme) cannot tell a same-shaped base
    with other weights apart: refused, naming the scheme, even where its layout matches."""
    base = hf_release(tmp_path / "base", seed=1)
    current = lora_base.base_identity(base, 0)
    bare = {k: v for k, v in current.items() if k not in ("sampled_crc32", "sample_scheme")}
    with pytest.raises(
        CheckpointError,
        match=r"ckpt: its record of the base .*base holds no content fingerprint of "
        r"sample_scheme .* \(it has None\)",
    ):
        lora_base.check_base(bare, current, "ckpt")
    with pytest.raises(CheckpointError, match=r"it has 'another'"):
        lora_base.check_base({**current, "sample_scheme": "another"}, current, "ckpt")
    lora_base.check_base(current, lora_base.base_identity(base, 0), "ckpt")  # its own record: accepted


def big_shards(folder, count: int, mib: int):
    """`count` safetensors shards of 4 tensors of `mib` MiB of random fp32 each."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        save_file(
            {f"w{i}.{j}": torch.randn(mib * 2**18 // 4, 4, generator=g) for j in range(4)},
            folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors",
        )
    return folder


def test_the_fingerprint_reads_the_header_and_three_mib_per_shard(tmp_path, monkeypatch):
    folder = big_shards(tmp_path / "big", count=2, mib=4)
    read = []
    real = lora_base._read_span
    monkeypatch.setattr(
        lora_base, "_read_span", lambda f, offset, length: read.append(n := real(f, offset, length)) or n
    )
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


# ------------------------------------------------------------------------------------------ 2. the PEFT reader

P = "base_model.model."
Q, UP = "model.layers.0.self_attn.q_proj", "model.layers.1.moe.up_proj"


@pytest.fixture(scope="module")
def tiny_base():
    from step35.checkpoint.hf.materialize import materialize
    from step35.config import preset
    from step35.model import build_model

    model = build_model(preset("tiny"))
    materialize(model, "cpu", seed=0)
    return model


def base_model(tiny_base):
    import copy

    return copy.deepcopy(tiny_base)


def write_peft(folder, model, config_changes=None, tensor_changes=None, scale=0.1):
    """A PEFT folder over `model` as PEFT 0.21.2 writes one: a dense adapter (q_proj of layer 0, r 4), a routed
    experts' one (up_proj of layer 1, rank 2 and alpha 3 by rank_pattern / alpha_pattern) and lm_head as a module
    to save. `config_changes` / `tensor_changes` replace entries (a value None drops the entry)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    E, out_features, in_features = model.get_parameter(f"{UP}.weight").shape
    q_out, q_in = model.get_parameter(f"{Q}.weight").shape
    tensors = {
        f"{P}{Q}.lora_A.weight": torch.randn(4, q_in, generator=g) * scale,
        f"{P}{Q}.lora_B.weight": torch.randn(q_out, 4, generator=g) * scale,
        f"{P}{UP}.lora_A.weight": torch.randn(E * 2, in_features, generator=g) * scale,
        f"{P}{UP}.lora_B.weight": torch.randn(out_features, 2 * E, generator=g) * scale,
        f"{P}lm_head.weight": torch.randn(*model.lm_head.weight.shape, generator=g),
    }
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8.0,
        "target_modules": [Q],
        "target_parameters": [f"{UP}.weight"],
        "rank_pattern": {"moe.up_proj.weight": 2},
        "alpha_pattern": {"moe.up_proj.weight": 3.0},
        "modules_to_save": ["lm_head"],
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "layers_to_transform": None,
    }
    for changes, target in ((config_changes, config), (tensor_changes, tensors)):
        for key, value in (changes or {}).items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder, tensors


def test_a_valid_folder_merges_as_peft_computes(tmp_path, tiny_base):
    """The checks refuse nothing PEFT's own layout holds: W + 8/4 B A for q_proj, PEFT's per-expert delta at
    the pattern's rank 2 and alpha 3 for up_proj, lm_head copied; literal suffix keys apply as PEFT's regex."""
    from step35.checkpoint.hf.peft import apply_peft_folder

    folder, tensors = write_peft(tmp_path / "adapter", tiny_base)
    model = base_model(tiny_base)
    apply_peft_folder(model, folder)
    q = tiny_base.get_parameter(f"{Q}.weight")
    want = q + 8.0 / 4 * tensors[f"{P}{Q}.lora_B.weight"] @ tensors[f"{P}{Q}.lora_A.weight"]
    torch.testing.assert_close(model.get_parameter(f"{Q}.weight"), want)
    E, out_features, in_features = q_up = tiny_base.get_parameter(f"{UP}.weight").shape
    A, B = tensors[f"{P}{UP}.lora_A.weight"], tensors[f"{P}{UP}.lora_B.weight"]
    delta = torch.einsum("o r e, e r i -> e o i", B.reshape(out_features, 2, E), A.reshape(E, 2, in_features)) * 3 / 2
    torch.testing.assert_close(model.get_parameter(f"{UP}.weight"), tiny_base.get_parameter(f"{UP}.weight") + delta)
    assert torch.equal(model.lm_head.weight, tensors[f"{P}lm_head.weight"]) and q_up[0] > 1


CONFIG_CASES = {
    "catastrophic regex": (
        {"alpha_pattern": {"(.|.)*!": 2.0}},
        r"alpha_pattern key '\(\.\|\.\)\*!' is a regex, "
        r"which this reader does not run",
    ),
    "the issue's regex": ({"alpha_pattern": {"(a+)+$": 2.0}}, r"alpha_pattern key '\(a\+\)\+\$' is a regex"),
    "a pattern key for nothing": (
        {"alpha_pattern": {"k_proj": 2.0}},
        r"alpha_pattern key 'k_proj' applies to no "
        r"adapted module",
    ),
    "r a string": ({"r": "4"}, r"r='4': must be an integer >= 1"),
    "r 0": ({"r": 0}, r"r=0: must be an integer >= 1"),
    "r missing": ({"r": None}, r"r=None: must be an integer >= 1"),
    "alpha negative": ({"lora_alpha": -1}, r"lora_alpha=-1: must be a finite number > 0"),
    "alpha a list": ({"lora_alpha": [1]}, r"lora_alpha=\[1\]: must be a finite number > 0"),
    "rank_pattern 0": (
        {"rank_pattern": {"moe.up_proj.weight": 0}},
        r"rank_pattern\['moe.up_proj.weight'\]=0: must be "
        r"an integer >= 1",
    ),
    "regex target_modules": ({"target_modules": ".*q_proj"}, r"target_modules='\.\*q_proj': a regex"),
    "a target the model lacks": (
        {"target_modules": ["model.layers.0.self_attn.z_proj"]},
        r"target_modules names 'model.layers.0.self_attn.z_proj', which matches nothing",
    ),
    "dora": ({"use_dora": True}, r"use_dora=True: not supported by step35's merge"),
    "another method": ({"peft_type": "IA3"}, r"peft_type='IA3': only LoRA adapters can be merged"),
    "2-D target_parameters": (
        {"target_parameters": [f"{Q}.weight"], "rank_pattern": {}, "alpha_pattern": {}},
        r"target_parameters matches model.layers.0.self_attn.q_proj.weight \[128, 128\], not a "
        r"routed experts'",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_adapter_config_is_one_line_naming_the_file(tmp_path, tiny_base, case):
    """Before: the patterns ran as regexes on every module name (`(.|.)*!` backtracks ~2^38 steps on a layer's
    name: generate hung), a string r raised a raw TypeError, other cases merged something else or KeyError'd."""
    from step35.checkpoint.hf.peft import apply_peft_folder

    changes, message = CONFIG_CASES[case]
    folder, _ = write_peft(tmp_path / "adapter", tiny_base, config_changes=changes)
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"^\S*adapter/adapter_config.json: {message}") as refused:
        apply_peft_folder(base_model(tiny_base), folder)
    assert "\n" not in str(refused.value) and time.perf_counter() - started < 5


def test_an_overflowing_alpha_is_refused_naming_the_config(tmp_path, tiny_base):
    """lora_alpha 1e38 with adapters of size ~10: W + 2.5e37 B A overflows float32. Before: merged into inf."""
    from step35.checkpoint.hf.peft import apply_peft_folder

    folder, _ = write_peft(tmp_path / "adapter", tiny_base, config_changes={"lora_alpha": 1e38}, scale=10.0)
    model = base_model(tiny_base)
    with pytest.raises(
        CheckpointError,
        match=rf"adapter/adapter_config.json: alpha 1e\+38 / r 4 merges {Q}.weight into "
        r"non-finite values \(lora_alpha or alpha_pattern too large\)",
    ):
        apply_peft_folder(model, folder)


def test_peft_model_refuses_a_merge_that_overflows_the_dtype(tmp_path, tiny_base):
    """Finite in float32, the merge runs before the cast: lora_alpha 1e6 fits float32 but not float16."""
    from step35.checkpoint.hf.peft import peft_model
    from step35.checkpoint.hf.pretrained import save_pretrained

    save_pretrained(tiny_base, tmp_path / "base")
    folder, _ = write_peft(
        tmp_path / "adapter",
        tiny_base,
        scale=10.0,
        config_changes={"lora_alpha": 1e6, "base_model_name_or_path": str(tmp_path / "base")},
    )
    with pytest.raises(CheckpointError, match=rf"adapter/adapter_config.json: the merged {Q}.weight overflows float16"):
        peft_model(folder, torch.float16, "cpu")


@pytest.mark.timeout(120)
def test_generate_on_a_hostile_folder_stops_in_one_line(tmp_path, tiny_base, builtin_cache):
    """`step35 generate` on a PEFT folder over a real base folder: the catastrophic alpha_pattern (before: a hang)
    and a [1, H] lm_head (before: broadcast into lm_head, generate ran on) each end the command in one line."""
    from step35.checkpoint.hf.pretrained import save_pretrained
    from step35.cli import main
    from step35.data.builtin import builtin_tokenizer_dir

    save_pretrained(tiny_base, tmp_path / "base")
    tokenizer = str(builtin_tokenizer_dir(cache_dir=builtin_cache))
    cases = [
        ({"alpha_pattern": {"(.|.)*!": 2.0}}, {}, r"adapter_config.json: alpha_pattern key .* is a regex"),
        (
            {},
            {f"{P}lm_head.weight": torch.zeros(1, 128)},
            r"adapter_model.safetensors: base_model.model.lm_head."
            r"weight is float32 \[1, 128\]",
        ),
    ]
    for i, (config_changes, tensor_changes, message) in enumerate(cases):
        folder, _ = write_peft(
            tmp_path / f"adapter{i}",
            tiny_base,
            tensor_changes=tensor_changes,
            config_changes={**config_changes, "base_model_name_or_path": str(tmp_path / "base")},
        )
        started = time.perf_counter()
        with pytest.raises(SystemExit, match=rf"^step35 generate: \S*adapter{i}/{message}") as stopped:
            main(["generate", "--checkpoint", str(folder), "--prompt", "The", "--tokenizer", tokenizer])
        assert "\n" not in str(stopped.value) and time.perf_counter() - started < 30


TENSOR_CASES = {
    "a [1, H] module to save": (
        {f"{P}lm_head.weight": torch.zeros(1, 128)},
        r"base_model.model.lm_head.weight is float32 \[1, 128\], the model needs a "
        r"floating-point \[1024, 128\]",
    ),
    "a missing adapter": (
        {f"{P}{Q}.lora_B.weight": None},
        rf"lacks base_model.model.{Q}.lora_B.weight \[128, 4\], "
        r"which adapter_config.json asks for",
    ),
    "an extra tensor": (
        {f"{P}model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 128)},
        r"holds base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight, which "
        r"adapter_config.json does not target in this model",
    ),
    "a tensor outside the prefix": (
        {"lm_head.weight": torch.zeros(1024, 128)},
        r"holds lm_head.weight, not under PEFT's prefix",
    ),
    "a wrong expert rank": (
        {f"{P}{UP}.lora_A.weight": torch.zeros(8 * 3, 128)},
        rf"base_model.model.{UP}.lora_A.weight is float32 \[24, 128\], the model needs a "
        r"floating-point \[16, 128\]",
    ),
    "integer adapters": (
        {f"{P}{Q}.lora_A.weight": torch.zeros(4, 128, dtype=torch.int32)},
        rf"base_model.model.{Q}.lora_A.weight is int32 \[4, 128\]",
    ),
    "NaN": (
        {f"{P}{Q}.lora_A.weight": torch.full((4, 128), float("nan"))},
        rf"tensor base_model.model.{Q}.lora_A.weight holds NaN",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_a_bad_adapter_tensor_is_one_line_naming_the_file(tmp_path, tiny_base, case):
    """Before: a [1, H] lm_head was broadcast into lm_head by copy_, an extra tensor ignored, a missing one a raw
    KeyError, a wrong shape a LoraError naming no file, NaN merged in."""
    from step35.checkpoint.hf.peft import apply_peft_folder

    changes, message = TENSOR_CASES[case]
    folder, _ = write_peft(tmp_path / "adapter", tiny_base, tensor_changes=changes)
    model = base_model(tiny_base)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=rf"^\S*adapter/adapter_model.safetensors: {message}") as refused:
        apply_peft_folder(model, folder)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # refused before anything merged


@pytest.mark.parametrize("damage", ["config", "weights", "record"])
def test_unreadable_files_are_named(tmp_path, tiny_base, damage):
    from safetensors.torch import save_file

    from step35.checkpoint.hf.peft import apply_peft_folder

    folder, tensors = write_peft(tmp_path / "adapter", tiny_base)
    if damage == "config":
        (folder / "adapter_config.json").write_text("{not json")
        message = r"adapter_config.json: not a readable JSON file \(JSONDecodeError"
    elif damage == "weights":
        (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
        message = r"adapter_model.safetensors: not a readable safetensors file"
    else:
        save_file(tensors, folder / "adapter_model.safetensors", metadata={"step35_lora_base": "[1, 2]"})
        message = r"adapter_model.safetensors: its metadata step35_lora_base is not a base identity"
    with pytest.raises(CheckpointError, match=message) as refused:
        apply_peft_folder(base_model(tiny_base), folder)
    assert "\n" not in str(refused.value)


# ------------------------------------------------------------------------------------------ 3. LoRA options at resume

RUN = {"lr": 1e-2, "warmup_steps": 1, "decay_steps": 4, "moe_bias_update_rate": 1e-3}  # as tests/helpers.lora_fit


def lora_module(**lora):
    from step35.module import Step35LightningModule

    return Step35LightningModule(config="tiny", lora={"rank": 4, **lora}, **RUN)


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, builtin_cache):
    """A 2-step LoRA run (rank 4, alpha null: 4) on the init base; its checkpoint as the resume reads it."""
    from step35.run import read_saved_run
    from tests.helpers import lora_fit

    run = tmp_path_factory.mktemp("lora-resume")
    lora_fit(run, builtin_cache, 2)
    return read_saved_run(next(run.rglob("step=000002.ckpt")))


def resume_check(saved, module):
    from step35.run import check_resume

    return check_resume(saved, module.model_config, dict(module.hparams))


def test_a_resume_with_another_rank_or_alpha_is_refused_by_name(lora_checkpoint):
    """Before: check_resume said nothing of model.lora; another rank reached torch's raw size-mismatch error at
    load, another alpha trained on silently with the adapters rescaled."""
    from step35.run import ResumeMismatchError
    from tests.helpers import LORA

    saved = lora_checkpoint
    same = dict(LORA)
    assert resume_check(saved, lora_module(**same)) == []
    with pytest.raises(
        ResumeMismatchError,
        match=r"model.lora.rank: 4 -> 2 changes the shape of every dense adapter "
        r".*; resume with model.lora.rank=4",
    ):
        resume_check(saved, lora_module(**{**same, "rank": 2, "alpha": 4.0}))
    with pytest.raises(
        ResumeMismatchError,
        match=r"model.lora.alpha: 4 -> 16 \(resolved: null is the rank\) rescales "
        r"the trained adapters.*; resume with model.lora.alpha=4",
    ):
        resume_check(saved, lora_module(**{**same, "alpha": 16.0}))
    assert resume_check(saved, lora_module(**{**same, "alpha": 4.0})) == []  # null was the rank: the same alpha
    with pytest.raises(ResumeMismatchError, match=r"model.lora.expert_rank: 2 -> 3 \(resolved; set None -> 3\)"):
        resume_check(saved, lora_module(**{**same, "expert_rank": 3}))
    with pytest.raises(ResumeMismatchError, match=r"model.lora.targets: .* changes which parameters train"):
        resume_check(saved, lora_module(**{**same, "targets": ["attention"]}))
    with pytest.raises(ResumeMismatchError, match=r"model.lora: .* -> None changes which parameters train"):
        from step35.module import Step35LightningModule

        resume_check(saved, Step35LightningModule(config="tiny", **RUN))
    assert resume_check(saved, lora_module(**{**same, "dropout": 0.1})) == ["model.lora.dropout: 0.0 -> 0.1"]
