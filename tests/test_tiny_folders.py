"""scripts/make_tiny_folder.py: a tiny Step-3.7 folder and tiny FP8 folders made by one documented command that
needs only step35's own install (run here as the README prints it, in a process without the tests' transformers).

Checked against outside references: the Step-3.7 folder's vision tensors have the names and shapes that
transformers 5.24's Step3p7ForConditionalGeneration saves (tests/helpers/step37.py makes one), and transformers
loads the folder with no missing or unexpected key; the language model is step35's own initialisation of the
preset, computed here; the FP8 folders hold every matrix in FP8 with its scales in a block transformers reads
(fp8.loadable_block), and step35 reads them back within e4m3's rounding."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from step35.checkpoint.hf import fp8
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.config import preset
from step35.model import build_model
from tests.runner import ROOT, environment

SCRIPT = ROOT / "scripts" / "make_tiny_folder.py"
KINDS = ("step37", "fp8", "step37-fp8")

pytestmark = pytest.mark.heavy  # three processes that import step35 and write a folder (~5 s each on two cores)


@pytest.fixture(scope="module")
def made(tmp_path_factory, builtin_cache) -> Path:
    """The three folders, each made by `python scripts/make_tiny_folder.py --kind K --out DIR` in a process whose
    path has step35 and not the tests' .oracle (transformers)."""
    root = tmp_path_factory.mktemp("tiny-folders")
    env = environment(builtin_cache)
    no_oracle = subprocess.run([sys.executable, "-c", "import transformers"], cwd=ROOT, env=env, capture_output=True)
    assert no_oracle.returncode != 0  # the script runs without transformers
    for kind in KINDS:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--kind", kind, "--out", str(root / kind)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == str(root / kind), proc.stderr[-3000:]
    return root


def stored(folder: Path) -> dict[str, torch.Tensor]:
    return {n: t for file in sorted(folder.glob("*.safetensors")) for n, t in load_file(file).items()}


def initialised() -> dict[str, torch.Tensor]:
    """The tiny preset as step35 initialises it with seed 1 (the script's default), as the folders store it."""
    from step35.checkpoint.hf.materialize import checkpoint_state

    model = build_model(preset("tiny"), device="cpu")
    model.init_weights(1)
    return {
        n: t.detach() if n.endswith("router_bias") else t.detach().to(torch.bfloat16)
        for n, t in checkpoint_state(model).items()
    }


def test_the_step37_folder_is_what_transformers_saves_and_loads(made, tmp_path):
    """Vision tensors named and shaped as transformers saves a Step-3.7 model with the same vision config, the
    config's vision fields as transformers writes them, and Step3p7ForConditionalGeneration loads the whole folder
    (vision and language) with no missing, unexpected or mismatched key, each weight as stored."""
    pytest.importorskip("transformers")
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    from tests.helpers import BOOKKEEPING, STEP37_VISION, vision_tensors_and_config

    folder = made / "step37"
    config = json.loads((folder / "config.json").read_text())
    text = {k: v for k, v in config["text_config"].items() if k not in BOOKKEEPING}
    reference, reference_config = vision_tensors_and_config(tmp_path, text)
    tensors = stored(folder)
    vision = {n: tuple(t.shape) for n, t in tensors.items() if n.startswith(STEP37_VISION)}
    assert vision == {n: tuple(t.shape) for n, t in reference.items()}
    assert config["vision_config"] == reference_config["vision_config"]
    assert config["model_type"] == reference_config["model_type"] == "step3p7"

    model, info = Step3p7ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded = model.state_dict()
    for theirs, ours in (  # transformers' own names for the release's
        ("model.vision_model.embeddings.patch_embedding.weight", "vision_model.conv1.weight"),
        ("model.multi_modal_projector.weight", "vit_large_projector.weight"),
    ):
        assert torch.equal(loaded[theirs], tensors[ours].float()), ours
    assert torch.equal(
        loaded["model.language_model.layers.1.self_attn.q_proj.weight"],
        tensors["model.layers.1.self_attn.q_proj.weight"].float(),
    )


def test_the_language_model_is_step35s_initialisation(made):
    """step35 reads the bf16 Step-3.7 folder's language model as the preset initialised with seed 1, exactly,
    and the vision side is not part of it (carried)."""
    want = initialised()
    got = load_pretrained(made / "step37", dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value.float()), name
    config = json.loads((made / "step37" / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == [0] and config["text_config"]["bos_token_id"] is None


@pytest.mark.parametrize("kind", ["fp8", "step37-fp8"])
def test_the_fp8_folders_hold_every_matrix_in_blocks_transformers_reads(made, kind):
    """Every matrix of the language model but the modules not converted is float8_e4m3fn with float32 scales on
    the [32, 32] grid (352 = 11 x 32: no ragged block), the rest bf16 (router bias fp32); the Step-3.7 one keeps
    its vision side in bf16 and names it among the modules not converted; step35 reads the weights back within
    e4m3's rounding of the initialisation (3 mantissa bits: 2^-4 relative, 2^-9 of the block's scale)."""
    folder = made / kind
    config = json.loads((folder / "config.json").read_text())
    entry = config["quantization_config"]
    assert entry["quant_method"] == "fp8" and entry["weight_block_size"] == [32, 32]
    vision = ["vision_model", "vit_large_projector"] if kind == "step37-fp8" else []
    assert entry["modules_to_not_convert"] == [*fp8.NOT_CONVERTED, *vision]
    tensors, want = stored(folder), initialised()
    quantised = [n for n, t in want.items() if t.dim() >= 2 and not fp8.skipped(n, fp8.NOT_CONVERTED)]
    assert "model.layers.0.mlp.down_proj.weight" in quantised and "model.embed_tokens.weight" not in quantised
    for name in quantised:
        assert tensors[name].dtype == torch.float8_e4m3fn, name
        assert tensors[name + "_scale_inv"].shape == fp8.scale_shape(tuple(want[name].shape), (32, 32)), name
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n.startswith(("vision_", "vit_")))
    got = load_pretrained(folder, dtype=torch.float32).state_dict()
    for name, value in want.items():
        value = value.float()
        if name in quantised:
            rows, cols = value.shape[-2:]
            scale = tensors[name + "_scale_inv"].repeat_interleave(32, -2).repeat_interleave(32, -1)[..., :rows, :cols]
            assert ((got[name] - value).abs() <= value.abs() / 16 + scale / 512).all(), name
        else:
            assert torch.equal(got[name], value), name


def test_an_existing_out_is_refused_in_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_tiny_folder", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "taken").mkdir()
    with pytest.raises(SystemExit) as exit_:
        script.main(["--kind", "fp8", "--out", str(tmp_path / "taken")])
    assert exit_.value.code == f"make_tiny_folder: --out {tmp_path / 'taken'} exists: give a new folder"
