"""`step35 export` of a run with a Step-3.7 vision side (`model.vision`, issue 46): four runs of two steps on
conversations with an image (the data's image contract, 112-pixel views and 56-pixel crops), each exported once:

- frozen: from a tiny Step-3.7 folder (the `tiny-vl` preset, fp32, random vision tensors), model.vision {train:
  false}: the vision tensors are copied from the folder as stored, byte for byte (whatever the export's dtype);
- trained: the same folder, {train: true}: the run's vision tensors, which differ from the folder's;
- scratch: model.config tiny-vl, no folder, {train: true}: the export writes the whole Step-3.7 folder itself
  (config.json in the release's wrapped form, from the preset, with the trained text_config);
- lora: the folder, {train: false}, LoRA adapters on the attention, the encoder's linears and the projector,
  exported with --merge: the frozen base (vision side included) read again from the folder, the adapters merged;
  the merged vision weights differ from the folder's where adapters were and equal them elsewhere.

Each export loads in transformers' own Step3p7ForConditionalGeneration with no missing, unexpected or mismatched
key, and its logits on a prompt with an image (a global view and two crops) equal those of the run's model in
this process (fp32, max abs within 1e-4; measured 5e-7 to 1e-6, with max |logits| 2.4 to 3.1); the LoRA run's
"model" is the merged one `step35 generate` loads from its checkpoint, which also computes the run's own logits
(adapters beside the weights) within 1e-4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file, save_file

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.training.export import export_checkpoint
from tests.helpers import checkpoint_io, make_trainer, safetensors_in, write_jsonl

pytestmark = pytest.mark.heavy  # three short fits in this process; transformers loads three folders

TOLERANCE = 1e-4
VISION = ("vision_model.", "vit_large_projector.")
VIEW, CROP = 112, 56  # the preset's image_size and a crop of 4 x 4 patches: 4 + 1 features
CASES = {  # name: (start from the Step-3.7 folder, model.vision.train)
    "frozen": (True, False),
    "trained": (True, True),
    "scratch": (False, True),
    "lora": (True, False),
}
LORA = {"rank": 4, "targets": ["attention", "vision", "vision_projector"]}  # the lora case's model.lora


def vision_of(state: dict) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in state.items() if n.startswith(VISION)}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.view(torch.uint8))
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """{"folder": a tiny-vl Step-3.7 folder (fp32: the language model initialised with seed 1, random vision
    tensors as tests/test_vision_model.py draws them), "data": 8 conversations about one 100 x 60 image}."""
    from PIL import Image, ImageDraw

    from step35.checkpoint.hf.materialize import checkpoint_state
    from step35.config import PRESETS, load_vision_config, preset
    from step35.model import Step35ForCausalLM
    from step35.model.vision import VisionTower
    from tests.test_vision_model import random_vision_tensors

    root = tmp_path_factory.mktemp("vision-export")
    folder = root / "start"
    folder.mkdir()
    raw = PRESETS["tiny-vl"]()
    raw["text_config"]["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    language = Step35ForCausalLM(preset("tiny-vl"))
    language.init_weights(1)
    tower = VisionTower(load_vision_config("tiny-vl"), preset("tiny-vl").hidden_size)
    vision = random_vision_tensors({n: tuple(t.shape) for n, t in tower.state_dict().items()}, seed=2)
    text = {n: t.detach().clone() for n, t in checkpoint_state(language).items()}
    save_file({**text, **vision}, folder / "model.safetensors")
    image = Image.new("RGB", (100, 60), (255, 255, 255))
    ImageDraw.Draw(image).ellipse([20, 10, 70, 50], fill=(0, 90, 200))
    image.save(root / "a.png")
    records = [
        {"messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": f"q{i}"}]},
            {"role": "assistant", "content": f"a{i}"},
        ]}
        for i in range(8)
    ]  # fmt: skip
    return {"folder": folder, "data": write_jsonl(root / "data.jsonl", records), "root": root}


class InitialVision(pl.Callback):
    """A callback keeping the vision tensors as the run starts (after the model is built and loaded)."""

    def __init__(self):
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, module):
        self.state = vision_of(module.model.state_dict())


@pytest.fixture(scope="module")
def runs(inputs, builtin_cache):
    """run(case) -> the case's run of two steps, saved as run.ckpt and exported (fp32; the LoRA run with merge) to
    hf/, made once: {"case", "model" (the run's, in eval mode; the LoRA run's merged, as generate loads it), "live"
    (the run's own), "initial" (its vision tensors at the start), "checkpoint", "out", "report"}."""
    made: dict[str, dict] = {}

    def run(case: str) -> dict:
        if case not in made:
            made[case] = train_and_export(case, inputs, builtin_cache)
        return made[case]

    return run


def train_and_export(case: str, inputs: dict, cache: Path) -> dict:
    from step35.data import Step35DataModule
    from step35.eval.generator import load_generator
    from step35.module import Step35LightningModule

    from_folder, train = CASES[case]
    root = inputs["root"] / case
    start = {"checkpoint": str(inputs["folder"])} if from_folder else {"config": "tiny-vl"}
    lora = LORA if case == "lora" else None
    module = Step35LightningModule(
        lr=1e-2, warmup_steps=1, weight_decay=0.0, vision={"train": train}, lora=lora, **start
    )
    data = Step35DataModule(
        files=str(inputs["data"]), format="chat", seq_len=48, micro_batch_size=2, val_batches=0,
        cache_dir=str(cache), builtin_vocab_size=1000, images={"view_size": VIEW, "crop_size": CROP},
    )  # fmt: skip
    initial = InitialVision()
    trainer = make_trainer(
        max_steps=2, default_root_dir=root, enable_checkpointing=False, callbacks=[initial], **checkpoint_io(False)
    )
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(root / "run.ckpt")
    report = export_checkpoint(root / "run.ckpt", root / "hf", merge=lora is not None)
    live = module.model.eval()
    return {
        "case": case,
        "model": load_generator(root / "run.ckpt").model if lora else live,
        "live": live,
        "initial": initial.state,
        "checkpoint": root / "run.ckpt",
        "out": root / "hf",
        "report": report,
    }


def image_prompt(image_token_id: int) -> tuple[torch.Tensor, dict]:
    """Input ids with one image's placeholders (its 2 crops then its global view: 2 x 1 + 4 features) between
    text tokens, and the image's pixel inputs (random: both models read the same tensors)."""
    g = torch.Generator().manual_seed(7)
    pixels = {
        "pixel_values": torch.randn(1, 3, VIEW, VIEW, generator=g),
        "pixel_values_local": torch.randn(2, 3, CROP, CROP, generator=g),
        "num_local_patches": [2],
    }
    text = torch.randint(2, image_token_id, (12,), generator=g)
    ids = torch.cat([text[:5], torch.full((6,), image_token_id), text[5:]])
    return ids[None], pixels


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_the_export_and_computes_the_runs_logits_on_an_image(runs, case):
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    run = runs(case)
    config = json.loads((run["out"] / "config.json").read_text())
    assert config["model_type"] == "step3p7" and config["architectures"] == ["Step3p7ForConditionalGeneration"]
    assert config["text_config"]["hidden_size"] == 128 and config["vision_config"]["hidden_size"] == 32
    assert not (run["out"] / "modeling_step35.py").exists()  # transformers has the class
    theirs, info = Step3p7ForConditionalGeneration.from_pretrained(
        run["out"], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = run["model"]
    ids, pixels = image_prompt(ours.vision_config.image_token_id)
    with torch.no_grad():
        expected = theirs.eval()(input_ids=ids, **pixels, use_cache=False).logits
        got = ours(ids, **pixels)
        without = ours(ids, **{**pixels, "pixel_values": torch.zeros_like(pixels["pixel_values"])})
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    print(f"{case}: max |logits - transformers| = {err:.2e} (max |logits| {got.abs().max().item():.2f})")
    assert err <= TOLERANCE, err
    assert (without - got).abs().max().item() > 100 * TOLERANCE  # the image is read: its pixels move the logits
    if run["live"] is not ours:  # LoRA: the merged model computes the run's own (adapters beside the weights)
        with torch.no_grad():
            live = (run["live"](ids, **pixels) - got).abs().max().item()
        print(f"{case}: max |merged - the run's own logits| = {live:.2e}")
        assert live <= TOLERANCE, live


@pytest.mark.parametrize("case", sorted(CASES))
def test_vision_tensors_are_the_folders_when_frozen_and_the_runs_when_trained(runs, case, inputs):
    run = runs(case)
    stored = safetensors_in(run["out"])
    run_vision = vision_of(run["model"].state_dict())
    exported = {n: t for n, t in stored.items() if n.startswith(VISION)}
    assert set(exported) == set(run_vision) and len(exported) == 37
    start = {n: t for n, t in load_file(inputs["folder"] / "model.safetensors").items() if n.startswith(VISION)}
    note = next(n for n in run["report"].notes if n.startswith("a Step-3.7 folder"))
    if run["case"] == "lora":
        check_merged_vision(run, exported, start, note)
        return
    if run["case"] == "frozen":
        assert "as stored (frozen" in note, note
        assert all(same_bytes(exported[n], start[n]) for n in start)
        assert all(torch.equal(run_vision[n], run["initial"][n]) for n in run_vision)  # the run kept them frozen
        return
    assert "the run's, trained (model.vision.train true), in float32" in note, note
    for name, tensor in run_vision.items():
        assert same_bytes(exported[name], tensor), name
    changed = [n for n in run_vision if not torch.equal(run_vision[n], run["initial"][n])]
    assert len(changed) == len(run_vision), sorted(set(run_vision) - set(changed))  # every one trained
    if run["case"] == "trained":
        assert all(torch.equal(run["initial"][n], start[n]) for n in start)  # the run started from the folder's
        assert not any(torch.equal(exported[n], start[n]) for n in start)


def check_merged_vision(run: dict, exported: dict, start: dict, note: str) -> None:
    """The LoRA run's merged vision side: the folder's weights plus the adapters where there were adapters (which
    the run moved off their zero B), the folder's bytes everywhere else."""
    assert "the run's, with LoRA adapters on vision, vision_projector merged, in float32" in note, note
    live = run["live"].state_dict()
    adapted = {n.removesuffix(".lora_B") + ".weight" for n in live if n.startswith(VISION) and n.endswith(".lora_B")}
    assert len(adapted) == 7  # 2 blocks x (attn.out_proj, mlp.c_fc, mlp.c_proj), and the projector
    assert all(live[n.removesuffix(".weight") + ".lora_B"].abs().max() > 0 for n in adapted)  # the adapters trained
    assert all(torch.equal(run["initial"][n], start[n]) for n in start)  # the run's frozen base: the folder's
    changed = {n for n in start if not torch.equal(exported[n], start[n])}
    assert changed == adapted, sorted(changed ^ adapted)
    assert all(same_bytes(exported[n], start[n]) for n in set(start) - adapted)
    merged = vision_of(run["model"].state_dict())  # as generate merges them
    assert all(same_bytes(exported[n], t) for n, t in merged.items())
    deltas = {n: (exported[n] - start[n]).abs().max().item() for n in sorted(adapted)}
    print("lora: max |merged - folder| per adapted vision weight:", {n: f"{d:.1e}" for n, d in deltas.items()})


def test_the_scratch_export_is_a_step37_folder_of_the_preset(runs):
    """No start folder: config.json is the tiny-vl preset's wrapper (vision_config, image_token_id,
    projector_bias) around the trained text_config, and the run's tokenizer is written beside it."""
    from step35.config import PRESETS

    run = runs("scratch")
    preset = PRESETS["tiny-vl"]()
    config = json.loads((run["out"] / "config.json").read_text())
    for key in ("vision_config", "image_token_id", "projector_bias", "architectures", "model_type"):
        assert config[key] == preset[key], key
    assert config["torch_dtype"] == "float32" and config["text_config"]["torch_dtype"] == "float32"
    assert (run["out"] / "tokenizer.json").is_file()
    assert "model.config tiny-vl's" in next(n for n in run["report"].notes if n.startswith("a Step-3.7 folder"))


@pytest.mark.parametrize("case", ["frozen", "trained"])
def test_other_dtypes_convert_the_runs_vision_side_and_copy_a_frozen_one_as_stored(runs, case):
    """bf16 (through `step35 export`): the run's vision tensors in bf16, a frozen side still the folder's fp32
    bytes; FP8: the run's vision side stays bf16, named in modules_to_not_convert (as the FP8 releases leave it)."""
    from step35.cli import main

    run = runs(case)
    out = run["out"].parent / "hf-bf16"
    main(["export", "--checkpoint", str(run["checkpoint"]), "--out", str(out), "--dtype", "bfloat16"])
    stored = safetensors_in(out)
    vision = vision_of(run["model"].state_dict())
    if run["case"] == "frozen":
        assert all(stored[n].dtype == torch.float32 for n in vision)  # as stored
        return
    assert all(same_bytes(stored[n], t.to(torch.bfloat16)) for n, t in vision.items())
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    out = run["out"].parent / "hf-fp8"
    export_checkpoint(run["checkpoint"], out, dtype=torch.float8_e4m3fn)
    stored = safetensors_in(out)
    entry = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {"vision_model", "vit_large_projector"} <= set(entry["modules_to_not_convert"])
    assert all(same_bytes(stored[n], t.to(torch.bfloat16)) for n, t in vision.items())
    assert not any(n.startswith(VISION) and n.endswith("_scale_inv") for n in stored)
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn  # the rest is FP8


def test_a_source_with_another_vision_side_is_refused_for_a_frozen_run(runs, inputs):
    """A frozen run's vision tensors are copied from --source: one whose vision side is not the run's (here: a
    tensor missing) is refused, naming it, and nothing is written."""
    run = runs("frozen")
    other = run["out"].parent / "other"
    shutil.copytree(inputs["folder"], other)
    tensors = load_file(other / "model.safetensors")
    del tensors["vision_model.ln_pre.bias"]
    save_file(tensors, other / "model.safetensors")
    out = run["out"].parent / "hf-other"
    with pytest.raises(CheckpointError, match=r"frozen vision tensor vision_model.ln_pre.bias \(\[32\]\) is not"):
        export_checkpoint(run["checkpoint"], out, source=other)
    assert not out.exists()
