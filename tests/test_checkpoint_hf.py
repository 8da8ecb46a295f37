"""HF checkpoint folders (docs/architecture.md §3): save_pretrained / from_pretrained round trips bit for bit,
shards + index, config.json written back, MTP tensors ignored exactly when MTP is not built, an
interrupted save keeps the previous checkpoint, and every kind of bad checkpoint fails naming the
tensor or file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from step35.checkpoint.hf.folder import INDEX_FILE, CheckpointError
from step35.checkpoint.hf.pretrained import load_pretrained, save_pretrained
from step35.model import Step35ForCausalLM
from tests.helpers import flash_config_dict, tiny_config_dict, tiny_model

SHARD = 1_000_000  # bytes: the ~7.8 MB fp32 tiny model becomes ~9 shards
MTP_PREFIX = "model.layers.5."  # tiny: 5 main layers, MTP layer 5


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in the folder, read with safetensors itself."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} stored twice"
                out[name] = f.get_tensor(name)
    return out


def _file_dtypes(folder: Path) -> dict[str, str]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    return out


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_FILE).read_text())


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture
def saved(tmp_path) -> tuple[Step35ForCausalLM, Path]:
    model = tiny_model(seed=0)
    path = tmp_path / "ckpt"
    save_pretrained(model, path, max_shard_size=SHARD)
    return model, path


# ----------------------------------------------------------------------------------- round trips
def test_round_trip_fp32_sharded(saved):
    model, path = saved
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 3
    n = len(shards)
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = _index(path)
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)  # the index covers every tensor
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    files = _file_tensors(path)
    assert set(files) == set(state)
    for name, file in index["weight_map"].items():
        with safe_open(path / file, framework="pt") as f:
            assert name in f.keys()
    for shard in shards:  # shards respect the size limit (unless one tensor is bigger)
        size = sum(t.numel() * t.element_size() for n_, t in files.items() if index["weight_map"][n_] == shard)
        names = [n_ for n_ in files if index["weight_map"][n_] == shard]
        assert size <= SHARD or len(names) == 1

    loaded = load_pretrained(path)
    _assert_same_state(model, loaded)
    ids = torch.randint(0, 1024, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_round_trip_bf16_router_bias_fp32(tmp_path):
    model = tiny_model(seed=1).to(torch.bfloat16)
    path = tmp_path / "bf16"
    save_pretrained(model, path, max_shard_size=SHARD // 2)
    dtypes = _file_dtypes(path)
    assert len(dtypes) == len(model.state_dict())
    for name, dtype in dtypes.items():
        assert dtype == ("F32" if name.endswith("router_bias") else "BF16"), name
    assert sum(1 for n in dtypes if n.endswith("router_bias")) == 4
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_pretrained(path)
    _assert_same_state(model, loaded)
    assert loaded.model.layers[1].moe.router_bias.dtype == torch.float32
    # Loading a bf16 checkpoint as fp32: exact (bf16 -> fp32 is lossless).
    as32 = load_pretrained(path, dtype=torch.float32)
    for name, t in as32.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, model.state_dict()[name].float()), name


def test_config_json_written_back(saved, tmp_path):
    model, path = saved
    written = json.loads((path / "config.json").read_text())
    want = model.config.to_dict()
    assert written == want and list(written) == list(want)
    assert written["torch_dtype"] == "float32"
    # Saved from a bf16 model: torch_dtype updated, nothing else changes; the source config untouched.
    path16 = tmp_path / "bf16"
    save_pretrained(model.to(torch.bfloat16), path16)
    written16 = json.loads((path16 / "config.json").read_text())
    assert written16 == {**want, "torch_dtype": "bfloat16"} and list(written16) == list(want)
    assert model.config.torch_dtype == "float32"
    # The release's own spelling variants survive: "dtype" instead of "torch_dtype".
    raw = tiny_config_dict()
    raw = {("dtype" if k == "torch_dtype" else k): ("bfloat16" if k == "torch_dtype" else v) for k, v in raw.items()}
    (path16 / "config.json").write_text(json.dumps(raw))
    loaded = load_pretrained(path16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16  # "dtype": "bfloat16" read...
    path_alias = tmp_path / "alias"
    save_pretrained(loaded.float(), path_alias)
    again = json.loads((path_alias / "config.json").read_text())
    assert again["dtype"] == "float32" and "torch_dtype" not in again and list(again) == list(raw)
    again32 = load_pretrained(path_alias)  # ...and its fp32 re-save loads as fp32
    assert again32.model.embed_tokens.weight.dtype == torch.float32


def test_release_config_survives_save(tmp_path):
    # config.json of the release (docs/architecture.md §1) round-trips through a checkpoint save unchanged
    # apart from torch_dtype; built on meta, nothing allocated: only the config path is exercised.
    from step35.config import Step35Config

    raw = flash_config_dict()
    cfg = Step35Config.from_dict(raw)
    cfg.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == raw


def test_single_file_checkpoint(tmp_path):
    model = tiny_model(seed=2)
    path = tmp_path / "single"
    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    model.config.save(path)
    _assert_same_state(model, load_pretrained(path))


def test_without_mtp_ignores_exactly_the_mtp_tensors(saved):
    model, path = saved
    loaded = load_pretrained(path, num_mtp_layers=0)
    assert loaded.num_mtp_layers == 0 and len(loaded.model.layers) == 5
    file_names = set(_file_tensors(path))
    mtp_names = {n for n in file_names if n.startswith(MTP_PREFIX)}
    assert len(mtp_names) == 17
    assert set(loaded.state_dict()) == file_names - mtp_names
    full = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, full[name]), name
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    # A non-MTP extra tensor is still an error without MTP.
    _add_tensor(path, "model.layers.2.mlp.extra.weight", torch.zeros(3))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.2.mlp.extra.weight")):
        load_pretrained(path, num_mtp_layers=0)


def test_nothing_left_uninitialised(saved, monkeypatch):
    # to_empty hands out uninitialised memory; make it visibly garbage. After loading, every tensor
    # must equal the file's, nothing may be on meta, and the router token counts must start at 0.
    model, path = saved
    real = torch.empty_like

    def garbage_empty_like(t, *args, **kwargs):
        out = real(t, *args, **kwargs)
        if out.device.type != "meta":
            out.fill_(7 if not out.is_floating_point() else float("nan"))
        return out

    monkeypatch.setattr(torch, "empty_like", garbage_empty_like)
    loaded = load_pretrained(path)
    monkeypatch.setattr(torch, "empty_like", real)
    files = _file_tensors(path)
    state = loaded.state_dict()
    assert set(state) == set(files)
    for name, t in state.items():
        assert t.device.type == "cpu", name
        assert torch.equal(t, files[name]), name
    for name, t in list(loaded.named_parameters()) + list(loaded.named_buffers()):
        assert t.device.type == "cpu", name
        assert not (t.is_floating_point() and torch.isnan(t).any()), name
    for inv in loaded.model._inv_freq.values():
        assert inv.device.type == "cpu"
    for layer in loaded.model.main_layers:
        if layer.spec.is_moe:
            assert int(layer.moe.tokens_per_expert.abs().sum()) == 0
    ids = torch.randint(0, 1024, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


# ----------------------------------------------------------------------------------- atomic save
def test_interrupted_save_keeps_previous_checkpoint(saved, monkeypatch):
    model, path = saved
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    other = tiny_model(seed=5)
    real = safetensors.torch.save_file
    calls = []

    def failing_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("killed while writing the second shard")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
    with pytest.raises(RuntimeError, match="killed"):
        save_pretrained(other, path, max_shard_size=SHARD)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    _assert_same_state(model, load_pretrained(path))
    # A later complete save replaces it.
    save_pretrained(other, path, max_shard_size=SHARD)
    _assert_same_state(other, load_pretrained(path))
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".ckpt.old")]


# ----------------------------------------------------------------------------------- bad checkpoints
def _shard_of(path: Path, name: str) -> Path:
    return path / _index(path)["weight_map"][name]


def _edit_shard(file: Path, fn) -> None:
    tensors = load_file(file)
    tensors = fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_index(path: Path, fn) -> None:
    index = _index(path)
    fn(index)
    (path / INDEX_FILE).write_text(json.dumps(index))


def _add_tensor(path: Path, name: str, value: torch.Tensor, file: str | None = None) -> None:
    file = file or _index(path)["weight_map"]["model.norm.weight"]

    def add(t):
        t[name] = value
        return t

    _edit_shard(path / file, add)
    _edit_index(path, lambda ix: ix["weight_map"].__setitem__(name, file))


def _replace(path: Path, name: str, value: torch.Tensor) -> None:
    _edit_shard(_shard_of(path, name), lambda t: {**t, name: value})


def _missing_tensor(path):
    name = "model.layers.2.moe.up_proj.weight"
    _edit_shard(_shard_of(path, name), lambda t: {k: v for k, v in t.items() if k != name})
    _edit_index(path, lambda ix: ix["weight_map"].pop(name))
    return [name]


def _missing_from_index_only(path):
    name = "model.layers.0.self_attn.g_proj.weight"
    _edit_index(path, lambda ix: ix["weight_map"].pop(name))
    return [name]


def _unexpected_tensor(path):
    name = "model.layers.0.self_attn.extra_proj.weight"
    _add_tensor(path, name, torch.zeros(4, 4))
    return [name]


def _unexpected_layer(path):
    name = "model.layers.9.input_layernorm.weight"  # beyond main + MTP layers
    _add_tensor(path, name, torch.zeros(128))
    return [name]


def _unlisted_tensor_in_shard(path):
    name = "model.layers.1.moe.stray.weight"
    file = _shard_of(path, "model.norm.weight")
    _edit_shard(file, lambda t: {**t, name: torch.zeros(2)})
    return [name, file.name]


def _wrong_shape(path):
    name = "model.layers.3.self_attn.q_proj.weight"
    _replace(path, name, torch.zeros(6 * 32, 127))
    return [name]


def _wrong_expert_count(path):
    name = "model.layers.4.moe.down_proj.weight"
    _replace(path, name, torch.zeros(7, 128, 64))
    return [name]


def _wrong_dtype_fp16(path):
    name = "model.layers.1.self_attn.k_norm.weight"
    _replace(path, name, torch.zeros(32, dtype=torch.float16))
    return [name, "float16"]


def _router_bias_bf16(path):
    name = "model.layers.2.moe.router_bias"
    _replace(path, name, torch.zeros(8, dtype=torch.bfloat16))
    return [name, "bfloat16"]


def _missing_shard_file(path):
    file = _shard_of(path, "lm_head.weight")
    file.unlink()
    return [file.name]


def _index_invalid_json(path):
    (path / INDEX_FILE).write_text('{"weight_map": {"a": ')
    return [INDEX_FILE]


def _index_weight_map_list(path):
    _edit_index(path, lambda ix: ix.__setitem__("weight_map", list(ix["weight_map"])))
    return [INDEX_FILE]


def _index_without_weight_map(path):
    _edit_index(path, lambda ix: ix.pop("weight_map"))
    return [INDEX_FILE]


def _index_value_not_a_file_name(path):
    _edit_index(path, lambda ix: ix["weight_map"].__setitem__("model.norm.weight", 3))
    return [INDEX_FILE]


def _index_points_at_wrong_file(path):
    name = "model.layers.1.moe.gate.weight"
    right = _shard_of(path, name).name
    wrong = next(f for f in sorted(set(_index(path)["weight_map"].values())) if f != right)
    _edit_index(path, lambda ix: ix["weight_map"].__setitem__(name, wrong))
    return [name, wrong]


def _truncated_shard(path):
    file = _shard_of(path, "model.layers.3.moe.gate_proj.weight")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    return [file.name]


def _truncated_header(path):
    file = _shard_of(path, "model.norm.weight")
    file.write_bytes(file.read_bytes()[:20])
    return [file.name]


def _not_safetensors(path):
    file = _shard_of(path, "model.norm.weight")
    file.write_text("this is not a safetensors file, but long enough to have a header length" * 3)
    return [file.name]


def _no_weights(path):
    (path / INDEX_FILE).unlink()
    return ["model.safetensors"]


def _bad_config_field(path):
    raw = json.loads((path / "config.json").read_text())
    raw["moe_top_k"] = 99
    (path / "config.json").write_text(json.dumps(raw))
    return ["moe_top_k"]


def _bad_config_list(path):
    raw = json.loads((path / "config.json").read_text())
    raw["swiglu_limits"] = raw["swiglu_limits"][:-1]
    (path / "config.json").write_text(json.dumps(raw))
    return ["swiglu_limits"]


def _bad_config_dtype(path):
    raw = json.loads((path / "config.json").read_text())
    raw["torch_dtype"] = "bfloat17"
    (path / "config.json").write_text(json.dumps(raw))
    return ["torch_dtype"]


def _config_not_json(path):
    (path / "config.json").write_text("{")
    return ["config.json"]


def _config_missing(path):
    (path / "config.json").unlink()
    return ["config.json"]


def _config_shape_mismatch(path):
    raw = json.loads((path / "config.json").read_text())
    raw["moe_intermediate_size"] = 32  # valid config, but the experts stored are [8, 64, 128]
    (path / "config.json").write_text(json.dumps(raw))
    return ["model.layers.1.moe."]


BAD = [
    _missing_tensor,
    _missing_from_index_only,
    _unexpected_tensor,
    _unexpected_layer,
    _unlisted_tensor_in_shard,
    _wrong_shape,
    _wrong_expert_count,
    _wrong_dtype_fp16,
    _router_bias_bf16,
    _missing_shard_file,
    _index_invalid_json,
    _index_weight_map_list,
    _index_without_weight_map,
    _index_value_not_a_file_name,
    _index_points_at_wrong_file,
    _truncated_shard,
    _truncated_header,
    _not_safetensors,
    _no_weights,
    _bad_config_field,
    _bad_config_list,
    _bad_config_dtype,
    _config_not_json,
    _config_missing,
    _config_shape_mismatch,
]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bf16") / "ckpt"
    save_pretrained(tiny_model(seed=6).to(torch.bfloat16), path, max_shard_size=SHARD // 2)
    return path


@pytest.mark.parametrize("corrupt", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_bad_checkpoint_raises_naming_the_problem(corrupt, bf16_checkpoint, tmp_path):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(bf16_checkpoint, path)
    load_pretrained(path)  # the copy itself is fine
    expected = corrupt(path)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(path)
    for text in expected:
        assert text in str(err.value), (text, str(err.value))


def test_save_killed_between_the_two_renames_points_at_the_intact_copy(tmp_path):
    from step35.checkpoint.errors import CheckpointError
    from step35.config import preset
    from step35.model import Step35ForCausalLM

    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(0)
    save_pretrained(model, tmp_path / "ckpt")
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-1234")  # the state a kill at that instant leaves
    with pytest.raises(CheckpointError, match=r"intact at .*\.ckpt\.old-1234"):
        load_pretrained(tmp_path / "ckpt")
