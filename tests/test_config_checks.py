"""A config.json that is not Step-3.5's, or that cannot fit the checkpoint folder it comes with, is
refused early and by name (issue 24):

- another model's config.json (model_type / architectures, `step35.config.MODEL_FAMILIES`) is refused
  naming the file, the value found and the accepted values; one without model_type is read with a
  warning; keys no field uses are named in one warning line (an unknown override stays an error);
- a config (file or config_overrides) whose layer count, widths or experts differ from the HF
  folder's tensors is refused before the model is built, in seconds, naming the field, the config
  value and what the folder holds;
- a model.safetensors.index.json naming a file outside its folder (`..`, absolute, a symlink out)
  is refused naming the entry and the index, before any file is opened.

Each test of a new check fails on the code before the issue (checked): the old reader refused a
llama config.json on `layer_types` (no model_type in the message), warned about nothing, built any
layer count the config asked for (the module's __init__ accepted it; the tensor check came after
the build) and opened whatever path the index named. Three tests guard what must not change and
pass on both: the presets and step35's own files warn about nothing, an unknown override is still
an error, a config that fits its folder still loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import safetensors

from step35 import config as config_module
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import INDEX_FILE, read_tensor_infos
from step35.checkpoint.hf.pretrained import load_pretrained, save_pretrained
from step35.config import ConfigError, ConfigWarning, Step35Config, load_config, preset
from step35.module import Step35LightningModule
from tests.helpers import flash_config_dict, tiny_config_dict, tiny_model

LLAMA_CONFIG = {  # a llama config.json, as transformers writes it (shortened)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0",
}


def _write(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder / "config.json"


def _config_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# ----------------------------------------------------------------------------------- 1. model family
def test_another_models_config_json_is_refused_by_model_type(tmp_path):
    path = _write(tmp_path / "llama", LLAMA_CONFIG)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "llama")
    message = str(err.value)
    assert str(path) in message and "'llama'" in message  # the file and the value found
    assert "'step3p5'" in message and "Step3p5ForCausalLM" in message  # the accepted values
    assert "layer_types" not in message  # not some unrelated field of Step-3.5's


@pytest.mark.parametrize(
    "changes,found",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "'LlamaForCausalLM'"),  # step3p5 model_type, foreign class
        ({"model_type": None, "architectures": ["MixtralForCausalLM"]}, "'MixtralForCausalLM'"),
        ({"architectures": "Step3p5ForCausalLM"}, "list of class names"),
    ],
)
def test_foreign_architectures_are_refused(tmp_path, changes, found):
    raw = {k: v for k, v in {**tiny_config_dict(), **changes}.items() if v is not None}
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        Step35Config.from_json(path)
    assert str(path) in str(err.value) and found in str(err.value) and "architectures" in str(err.value)


def test_model_families_is_the_one_place_to_add_a_family(tmp_path, monkeypatch):
    """What the next family (Step-3.7-Flash: transformers' model_type `step3p7`) changes to be accepted."""
    raw = tiny_config_dict(model_type="step3p7", architectures=["Step3p7ForConditionalGeneration"])
    with pytest.raises(ConfigError, match="'step3p7'"):
        Step35Config.from_dict(raw)
    monkeypatch.setitem(config_module.MODEL_FAMILIES, "step3p7", ("Step3p7ForConditionalGeneration",))
    assert Step35Config.from_dict(raw).extra["model_type"] == "step3p7"


def test_config_json_without_model_type_is_read_with_a_warning(tmp_path):
    raw = tiny_config_dict()
    raw.pop("model_type"), raw.pop("architectures")
    path = _write(tmp_path, raw)
    found = _config_warnings(lambda: Step35Config.from_json(path))
    assert len(found) == 1 and str(path) in found[0] and "no model_type" in found[0]
    with pytest.warns(ConfigWarning):
        assert Step35Config.from_json(path).to_dict() == raw  # read, and written back as it was


def test_presets_and_their_files_warn_about_nothing(tmp_path):
    raw = flash_config_dict()
    raw.update(transformers_version="4.57.1", use_cache=True, _name_or_path="stepfun-ai/Step-3.5-Flash")
    path = _write(tmp_path, raw)
    assert _config_warnings(lambda: (preset("tiny"), preset("flash-196b"), load_config(path))) == []
    model = tiny_model()
    save_pretrained(model, tmp_path / "hf")  # what step35 writes reads back silently
    assert _config_warnings(lambda: Step35Config.from_json(tmp_path / "hf")) == []


def test_unknown_keys_are_named_in_one_warning_line(tmp_path):
    raw = tiny_config_dict(moe_num_expert=16, frobnicate={"a": 1}, transformers_version="4.57.1", use_cache=True)
    raw["dtype"] = raw.pop("torch_dtype")  # an alias is a field, not an unknown key
    path = _write(tmp_path, raw)
    found = _config_warnings(lambda: Step35Config.from_json(path))
    assert len(found) == 1 and "\n" not in found[0]
    message = found[0]
    assert str(path) in message and "moe_num_expert (did you mean moe_num_experts?)" in message
    assert "frobnicate" in message
    for quiet in ("transformers_version", "use_cache", "dtype", "auto_map", "architectures", "model_type"):
        assert quiet not in message.replace("did you mean", ""), quiet
    with pytest.warns(ConfigWarning):
        assert Step35Config.from_json(path).extra["moe_num_expert"] == 16  # kept, as before


def test_an_unknown_override_is_still_an_error():
    with pytest.raises(ConfigError, match=r"unknown config field 'moe_num_expert' \(did you mean 'moe_num_experts'"):
        preset("tiny").with_overrides({"moe_num_expert": 16})
    with pytest.raises(ConfigError, match="model.config_overrides: unknown config field 'model_type'"):
        Step35LightningModule(config="tiny", config_overrides={"model_type": "llama"})


# ----------------------------------------------------------------------------------- 2. shape vs folder
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny"
    save_pretrained(tiny_model(seed=1), path, max_shard_size=1_000_000)
    return path


def _layers(n: int, mtp: int = 1) -> dict:
    """Overrides for a config of `n` main layers that is valid in itself (every per-layer list as long)."""
    total = n + mtp
    return {
        "num_hidden_layers": n,
        "layer_types": ["sliding_attention"] * total,
        "rope_theta": 10000.0,
        "partial_rotary_factors": [],
        "swiglu_limits": [],
        "swiglu_limits_shared": [],
    }


def test_layer_count_typo_is_refused_before_building(hf_folder):
    """num_hidden_layers 100000 over the 5-layer tiny folder: refused in the module's __init__, before
    configure_model builds anything (the old code accepted it there and built 100000 layers)."""
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        Step35LightningModule(checkpoint=str(hf_folder), config_overrides=_layers(100000))
    seconds = time.perf_counter() - start
    message = str(err.value)
    assert "num_hidden_layers=100000" in message and str(hf_folder) in message
    assert "5 main and 1 MTP layers (model.layers.0-5)" in message and "model.layers.6 is not there" in message
    assert seconds < 5, seconds
    # Without the per-layer lists the config itself is refused already, naming the list.
    with pytest.raises(ConfigError, match="layer_types: has 6 entries; expected .* = 100001"):
        Step35LightningModule(checkpoint=str(hf_folder), config_overrides={"num_hidden_layers": 100000})


def test_config_json_layer_typo_is_refused_by_load_pretrained(hf_folder, tmp_path):
    path = tmp_path / "typo"
    shutil.copytree(hf_folder, path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(_layers(100000))
    (path / "config.json").write_text(json.dumps(raw))
    start = time.perf_counter()
    with pytest.raises(
        CheckpointError,
        match=r"num_hidden_layers=100000 needs model.layers.0-99999, but .* holds "
        r"5 main and 1 MTP layers",
    ):
        load_pretrained(path)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            {"hidden_size": 256},
            "config hidden_size=256, but {path} holds model.embed_tokens.weight of shape [1024, 128]",
        ),
        (
            {"vocab_size": 2048},
            "config vocab_size=2048, but {path} holds model.embed_tokens.weight of shape [1024, 128]",
        ),
        (
            {"moe_num_experts": 16},
            "config moe_num_experts=16, but {path} holds model.layers.1.moe.gate.weight of shape [8, 128] (8 experts)",
        ),
    ],
)
def test_shape_fields_are_named_with_what_the_folder_holds(hf_folder, overrides, expected):
    with pytest.raises(CheckpointError) as err:
        Step35LightningModule(checkpoint=str(hf_folder), config_overrides=overrides)
    assert expected.format(path=hf_folder) in str(err.value)


def test_mtp_layers_are_compared_with_those_built(tmp_path):
    path = tmp_path / "no_mtp"
    save_pretrained(tiny_model(seed=2, num_mtp_layers=0), path)  # config says 1 MTP layer, none stored
    assert load_pretrained(path, num_mtp_layers=0).num_mtp_layers == 0  # builds none: loads as before
    with pytest.raises(
        CheckpointError,
        match=r"num_nextn_predict_layers=1 \(1 MTP layers built\) needs "
        r"model.layers.5-5, but .* holds 5 main and 0 MTP layers",
    ):
        load_pretrained(path)


def test_a_fitting_config_still_loads(hf_folder):
    module = Step35LightningModule(checkpoint=str(hf_folder), config_overrides={"sliding_window": 65})
    assert module.model_config.num_hidden_layers == 5
    assert load_pretrained(hf_folder).config.num_hidden_layers == 5


# ----------------------------------------------------------------------------------- 3. index entries
@pytest.fixture
def opened(monkeypatch) -> list[Path]:
    """The files safetensors opens from now on (every reader of step35 goes through safe_open)."""
    files: list[Path] = []
    real = safetensors.safe_open

    def recording(file, *args, **kwargs):
        files.append(Path(file).resolve())
        return real(file, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording)
    return files


def _point_entry(folder: Path, target: str) -> tuple[str, Path]:
    """Move the shard holding lm_head.weight outside `folder` (a readable file is there: only the path
    check can stop it) and name it `target` in the index. Returns the entry and the moved file."""
    index = json.loads((folder / INDEX_FILE).read_text())
    shard = index["weight_map"]["lm_head.weight"]
    outside = folder.parent / "secret.safetensors"
    shutil.move(folder / shard, outside)
    for name, file in index["weight_map"].items():
        if file == shard:
            index["weight_map"][name] = target
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return next(n for n, f in index["weight_map"].items() if f == target), outside  # the first one named


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_the_folder_is_refused(where, hf_folder, tmp_path, opened):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_folder, folder)
    outside = tmp_path / "secret.safetensors"
    target = {"dotdot": "../secret.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[where]
    entry, outside = _point_entry(folder, target)
    if where == "symlink":
        os.symlink(outside, folder / "link.safetensors")
    for read in (read_tensor_infos, load_pretrained):
        with pytest.raises(CheckpointError) as err:
            read(folder)
        message = str(err.value)
        assert f"{folder / INDEX_FILE}: entry {entry} names the file {target!r}" in message
        assert "outside the checkpoint folder; refused" in message
    assert outside.resolve() not in opened and opened == []  # nothing was opened at all


def test_hub_cache_snapshot_symlinks_into_its_blobs_are_accepted(hf_folder, tmp_path):
    """The layout `hf download` leaves in ~/.cache/huggingface/hub: each file of the snapshot is a
    symlink to ../../blobs/<hash>, outside the snapshot folder but inside its repository's cache."""
    repo = tmp_path / "models--stepfun-ai--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for k, file in enumerate(sorted(hf_folder.iterdir())):
        shutil.copy(file, blobs / f"blob{k}")
        os.symlink(f"../../blobs/blob{k}", snapshot / file.name)
    assert load_pretrained(snapshot).config.num_hidden_layers == 5
    # ... but not out of the repository's cache: one shard moved elsewhere, its link pointed there
    index = json.loads((snapshot / INDEX_FILE).read_text())
    shard = index["weight_map"]["lm_head.weight"]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move((snapshot / shard).resolve(), elsewhere)
    (snapshot / shard).unlink()
    os.symlink(elsewhere, snapshot / shard)
    with pytest.raises(CheckpointError, match=f"names the file '{shard}', which resolves outside the checkpoint"):
        read_tensor_infos(snapshot)
