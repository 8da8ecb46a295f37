"""A Step-3.7-Flash folder is a start folder: its language model (config under `text_config`, tensors under
Step-3.5's names or under `model.language_model.*`) loads into step35's model, which then computes what
transformers' own `Step3p7ForConditionalGeneration` computes on text (fp32 logits within 1e-5); the vision
encoder and projector are not materialised.

The folder is made by tests/helpers.step37_folder: a random tiny language model in the release's layout
(tests/hf_oracle.py) nested as `text_config`, beside a tiny vision tower that transformers built and saved in the
release's names. The commands on such a folder (fit, export, generate, plan) are tests/test_step37_cli.py's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import model_tensor_infos
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.config import ConfigError, Step35Config, load_config
from tests.helpers import one_step_from, step37_folder

pytestmark = pytest.mark.heavy  # transformers builds a vision tower and loads the folders

TOLERANCE = 1e-5  # fp32, max abs over the logits (|logits| ~ 1-10); measured 3.5e-6 on both layouts


@pytest.fixture(scope="module", params=[False, True], ids=["release_names", "language_model_prefix"])
def folder(request, tmp_path_factory):
    return step37_folder(tmp_path_factory.mktemp("step37"), nested=request.param)


def test_the_config_is_the_text_config(folder):
    path, _ = folder
    config = load_config(path)
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "step3p7" and config.hidden_size == raw["text_config"]["hidden_size"]
    assert config.num_hidden_layers == raw["text_config"]["num_hidden_layers"]


def test_the_layout_is_detected_and_vision_is_carried_not_loaded(folder):
    path, language = folder
    infos, carried, layout = model_tensor_infos(path)
    nested = path.name == "nested"
    assert layout.release == "Step-3.7" and layout.text_prefix == ("model.language_model." if nested else "model.")
    assert "Step-3.7 folder" in layout.describe()
    assert set(infos) == set(language)  # the model's names, whatever the prefix in the files
    assert carried and all(n.startswith(("vision_model.", "vit_large_projector.")) for n in carried)
    model = load_pretrained(path, num_mtp_layers=0 if nested else None)
    assert not any("vision" in n or "projector" in n for n in model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, language[name]), name


def test_logits_equal_transformers_step3p7_on_text(folder):
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    path, _ = folder
    ours = load_pretrained(path, num_mtp_layers=0 if path.name == "nested" else None).eval()
    theirs = Step3p7ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = theirs(input_ids=ids, use_cache=False).logits
        got = ours(ids)  # [B, S, V] logits
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    print(f"max |logits - transformers| = {err:.2e}")
    assert err <= TOLERANCE, err


def test_a_step37_config_without_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "step3p7", "vision_config": {}}))
    with pytest.raises(ConfigError, match="under 'text_config', which is missing"):
        Step35Config.from_json(tmp_path)


def test_both_prefixes_in_one_folder_are_refused(tmp_path):
    path, language = step37_folder(tmp_path, nested=True)
    extra = {"model.norm.weight": language["model.norm.weight"]}
    save_file(extra, path / "extra.safetensors")
    weights = load_file(path / "model.safetensors") | extra
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="both under model.language_model"):
        load_pretrained(path, num_mtp_layers=0)


def test_a_fine_tune_exports_a_step37_folder_transformers_loads(tmp_path, builtin_cache):
    """One training step from a Step-3.7 folder (the tiny preset's language model, the built-in tokenizer), then
    `export`: config.json is Step-3.7's with the trained text config; the vision tensors are the folder's, dtype
    and bytes; the text tensors are the trained ones, in the release's names; transformers loads it natively
    (no missing or unexpected key) and computes step35's logits."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    from step35.checkpoint.hf.materialize import checkpoint_state
    from step35.checkpoint.training.export import export_checkpoint
    from step35.config import preset
    from step35.data import builtin_tokenizer_dir
    from step35.model import Step35ForCausalLM

    start = Step35ForCausalLM(preset("tiny"))
    start.init_weights(1)
    initial = {n: t.detach().clone() for n, t in checkpoint_state(start).items()}
    source, _ = step37_folder(tmp_path, nested=False, text=preset("tiny").to_dict(), language=initial)
    tokenizer = builtin_tokenizer_dir(cache_dir=builtin_cache)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (source / name).write_bytes((tokenizer / name).read_bytes())
    module, _ = one_step_from(source, tmp_path, builtin_cache)
    report = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "hf")
    out = tmp_path / "hf"
    assert any("a Step-3.7 folder" in note for note in report.notes), report.notes
    assert not (out / "modeling_step35.py").exists()  # transformers has the class
    written, released = (json.loads((p / "config.json").read_text()) for p in (out, source))
    assert written["model_type"] == "step3p7" and written["architectures"] == released["architectures"]
    assert written["vision_config"] == released["vision_config"]
    assert written["text_config"]["hidden_size"] == released["text_config"]["hidden_size"]
    stored = {}
    for file in sorted(out.glob("*.safetensors")):
        stored |= load_file(file)
    vision = {n: t for n, t in load_file(source / "model.safetensors").items() if n.startswith(("vision_", "vit_"))}
    for name, tensor in vision.items():
        assert stored[name].dtype == tensor.dtype and torch.equal(stored[name], tensor), name
    trained = dict(module.model.state_dict())
    assert set(stored) == set(vision) | set(trained)
    for name, tensor in trained.items():
        assert torch.equal(stored[name], tensor), name
    assert any(not torch.equal(trained[n], initial[n]) for n in trained)  # the step changed the text tensors
    theirs, info = Step3p7ForConditionalGeneration.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(2, 1000, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = (load_pretrained(out)(ids) - theirs.eval()(input_ids=ids, use_cache=False).logits).abs().max().item()
    assert err <= TOLERANCE, err
