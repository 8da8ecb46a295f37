"""Step-3.7-Flash's vision side in step35 (step35/model/vision.py) computes what transformers' Step3p7 computes.

A random tiny Step-3.7 folder (the `tiny-vl` preset: `tiny` as the language model, a 2-layer vision encoder of
width 32) is written in the release's names and loaded by both: transformers' `Step3p7ForConditionalGeneration`
(which renames and permutes the vision tensors as it loads them: its conversion mapping) and step35's
`load_pretrained(vision=True)`. Pixel inputs have the shapes and crop counts of transformers' Step3p7ImageProcessor
(112-pixel global views, 98-pixel crops, its planner's crops per image) for images that give 0, 1 and several
crops. Tolerances, fp32: the tower's features 1e-5,
the logits 1e-4 (max abs; |logits| ~ 1-10)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from step35.checkpoint.hf.pretrained import load_pretrained
from step35.config import PRESETS, ConfigError, VisionConfig, load_vision_config, preset
from step35.model import build_model
from step35.model.vision import (
    VisionTower,
    feature_grid,
    splice_image_features,
)
from tests.helpers import step37_folder
from tests.hf_oracle import random_state_dict

pytestmark = pytest.mark.heavy  # transformers builds and loads a model; its image processor runs

FEATURES_TOLERANCE = 1e-5
LOGITS_TOLERANCE = 1e-4
VISION = ("vision_model.", "vit_large_projector.")
GLOBAL_SIDE, CROP_SIDE = 112, 98  # the image processor's global view and crop sizes, in pixels


def random_vision_tensors(names_and_shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Weights ~ N(0, 1 / fan_in); LayerNorm weights and LayerScale gammas ~ 1 + N(0, 0.3); biases and the position
    table ~ N(0, 0.3): activations O(1), every parameter felt."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names_and_shapes.items():
        noise = torch.randn(shape, generator=g)
        if len(shape) >= 2 and not name.endswith("positional_embedding"):
            out[name] = noise / math.sqrt(math.prod(shape[1:]))
        elif name.endswith(("ln_pre.weight", "ln_1.weight", "ln_2.weight", "gamma")):
            out[name] = 1 + 0.3 * noise
        else:
            out[name] = 0.3 * noise
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random `tiny-vl` folder in the release's names (fp32)."""
    path = tmp_path_factory.mktemp("tiny_vl")
    raw = PRESETS["tiny-vl"]()
    raw["text_config"]["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    tower = VisionTower(load_vision_config("tiny-vl"), preset("tiny-vl").hidden_size)
    vision = random_vision_tensors({n: tuple(t.shape) for n, t in tower.state_dict().items()}, seed=2)
    save_file({**random_state_dict(raw["text_config"], seed=1), **vision}, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def theirs(folder):
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    model, info = Step3p7ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def ours(folder):
    return load_pretrained(folder, vision=True).eval()


def pixel_inputs(sizes: list[tuple[int, int]]) -> dict:
    """The model inputs transformers' Step3p7ImageProcessor gives for images of (width, height) `sizes`: a global
    view each [N, 3, 112, 112], the crops of all [C, 3, 98, 98] (image by image), the crops per image (its
    planner's count). The pixels themselves are random: both models read the same tensors, and the processor's
    resize needs torchvision, which is not on .oracle's path (tests/test_image_processor.py)."""
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor

    processor = Step3p7ImageProcessor(size={"height": GLOBAL_SIDE, "width": GLOBAL_SIDE}, patch_size=CROP_SIDE)
    crops = [processor.get_number_of_image_patches(h, w) for w, h in sizes]
    g = torch.Generator().manual_seed(sum(w * h for w, h in sizes))
    return {
        "pixel_values": torch.randn(len(sizes), 3, GLOBAL_SIDE, GLOBAL_SIDE, generator=g),
        "pixel_values_local": torch.randn(sum(crops), 3, CROP_SIDE, CROP_SIDE, generator=g) if sum(crops) else None,
        "num_local_patches": crops,
    }


def tokens_per_view(side: int) -> int:
    return feature_grid(side // 14) ** 2


def input_ids_for(num_crops: list[int], rows: list[list[int]], image_token_id: int, seed: int) -> torch.Tensor:
    """[len(rows), S]: row r holds the images `rows[r]` (indices, in order), each a block of as many placeholders
    as it has features, between random text tokens; rows padded with text to one length."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(2, image_token_id, (n,), generator=g).tolist()

    built = []
    for images in rows:
        row = text(3)
        for i in images:
            row += [image_token_id] * (num_crops[i] * tokens_per_view(CROP_SIDE) + tokens_per_view(GLOBAL_SIDE))
            row += text(4)
        built.append(row)
    length = max(map(len, built))
    return torch.tensor([row + text(length - len(row)) for row in built])


# ------------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("nested", [False, True], ids=["release_names", "language_model_prefix"])
def test_loading_a_step37_folder_fills_every_vision_tensor(tmp_path, nested):
    path, language = step37_folder(tmp_path, nested=nested)
    stored = load_file(path / "model.safetensors")
    vision = {n: t for n, t in stored.items() if n.startswith(VISION)}
    model = load_pretrained(path, vision=True, num_mtp_layers=0 if nested else None)
    state = model.state_dict()
    assert set(state) == set(language) | set(vision)  # none missing, none unexpected
    for name, tensor in {**language, **vision}.items():
        assert torch.equal(state[name], tensor), name


# ------------------------------------------------------------------------------------------------ the tower
def test_the_tower_equals_transformers_vision_model_and_projector(ours, theirs):
    tower = VisionTower(ours.vision_config, ours.config.hidden_size)
    tower.load_state_dict({n: t for n, t in ours.state_dict().items() if n.startswith(VISION)})
    g = torch.Generator().manual_seed(4)
    # a global size, a crop size, and a grid of 5 patches (3 after the first downsampler: the padded edge)
    groups = [torch.randn(n, 3, side, side, generator=g) for n, side in ((2, 112), (3, 98), (1, 70))]
    with torch.no_grad():
        got = tower(groups)
        alone = tower(groups[1])
        vision, projector = theirs.model.vision_model, theirs.model.multi_modal_projector
        expected = [projector(vision(pixels).last_hidden_state) for pixels in groups]
    assert [tuple(t.shape) for t in got] == [(2, 4, 128), (3, 4, 128), (1, 4, 128)]
    err = max((a - b).abs().max().item() for a, b in zip(got, expected))
    print(f"max |features - transformers| = {err:.2e}")
    assert err <= FEATURES_TOLERANCE, err
    assert (alone - expected[1]).abs().max().item() <= FEATURES_TOLERANCE


# ------------------------------------------------------------------------------------------------ logits
CASES = {  # (image sizes (width, height), which images each row holds, the crops each image must have)
    "no_crops": ([(80, 60)], [[0], []], [0]),
    "one_crop": ([(115, 100)], [[0], []], [1]),
    "several_crops": ([(200, 200), (80, 60), (300, 100)], [[0, 1], [2]], [4, 0, 3]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers_on_images_and_text(ours, theirs, case):
    sizes, rows, crops = CASES[case]
    pixels = pixel_inputs(sizes)
    assert pixels["num_local_patches"] == crops
    token = ours.vision_config.image_token_id
    ids = input_ids_for(crops, rows, token, seed=len(case))
    with torch.no_grad():
        expected = theirs(input_ids=ids, **pixels, use_cache=False).logits
        got = ours(ids, **pixels)
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    print(f"{case}: max |logits - transformers| = {err:.2e}")
    assert err <= LOGITS_TOLERANCE, err
    with torch.no_grad():  # the images matter: without them the placeholders are a token's embedding
        plain = ours.model.embed_tokens(ids)
        assert not torch.allclose(plain, splice_image_features(plain, ids, token, ours.image_features(**pixels)))


# ------------------------------------------------------------------------------------------------ one pass
def test_every_vision_module_runs_once_with_or_without_crops_or_images(ours):
    """FSDP calls each sharded module's all-gather once per call on every rank: the number of calls must not
    depend on the images."""
    modules = {n: m for n, m in ours.vision_model.named_modules(prefix="vision_model") if type(m) is not nn.ModuleList}
    modules["vit_large_projector"] = ours.vit_large_projector
    calls = dict.fromkeys(modules, 0)
    hooks = [
        m.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1)) for name, m in modules.items()
    ]
    try:
        for sizes in ([(80, 60)], [(200, 200), (300, 100)], None):
            pixels = pixel_inputs(sizes) if sizes else {"pixel_values": None}
            calls.update(dict.fromkeys(calls, 0))
            with torch.no_grad():
                features = ours.image_features(**pixels)
            assert set(calls.values()) == {1}, {n: c for n, c in calls.items() if c != 1}
            assert features.shape[1] == ours.config.hidden_size
    finally:
        for hook in hooks:
            hook.remove()
    assert features.shape[0] == 0  # no images: no features, yet every module ran


def test_a_text_only_batch_still_gives_every_vision_parameter_a_gradient():
    """FSDP reduce-scatters every sharded parameter's gradient on every rank: a rank without images in its batch
    must have one too (zeros)."""
    model = build_model(preset("tiny-vl"), device="cpu", vision=load_vision_config("tiny-vl"))
    model.init_weights(0)
    ids = torch.randint(2, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    model(ids).sum().backward()
    vision = {n: p.grad for n, p in model.named_parameters() if n.startswith(VISION)}
    assert vision and all(g is not None and not g.any() for g in vision.values())


def test_the_release_spelling_of_the_vision_config_is_read():
    release = VisionConfig.from_release({"vision_config": {"width": 64, "layers": 3, "heads": 4, "ls_init_value": 0.1}})
    assert (release.hidden_size, release.num_hidden_layers, release.num_attention_heads) == (64, 3, 4)
    assert release.intermediate_size == int(64 * 8960 / 1536) and VisionConfig().intermediate_size == 8960
    with pytest.raises(ConfigError, match="vision_config.hidden_size"):
        VisionConfig.from_release({"vision_config": {"width": 30, "heads": 2}})


# ------------------------------------------------------------------------------------------------ the splice
def test_the_splice_replaces_placeholders_in_order_and_refuses_a_count_mismatch():
    ids = torch.tensor([[5, 9, 9, 6], [9, 7, 9, 9]])
    embeds = torch.zeros(2, 4, 3)
    features = torch.arange(15.0).reshape(5, 3)
    out = splice_image_features(embeds, ids, 9, features)
    placed = [(b, s) for b in range(2) for s in range(4) if ids[b, s] == 9]
    for row, (b, s) in enumerate(placed):
        assert torch.equal(out[b, s], features[row])
    assert torch.equal(out[0, 0], embeds[0, 0]) and torch.equal(out[1, 1], embeds[1, 1])
    with pytest.raises(ValueError, match="hold 5 image placeholder tokens .* give 4 feature rows"):
        splice_image_features(embeds, ids, 9, features[:4])
