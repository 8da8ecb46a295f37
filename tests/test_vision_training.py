"""Training Step-3.7's vision side (step35/training/vision.py, the VLM's `loss`, FSDP units, LoRA targets): the
language-model objective on a batch of the data's image contract computes the cross-entropy of the model's own
image forward (whose logits equal transformers', tests/test_vision_model.py); a batch without images is the
language model's loss; on 2 gloo ranks with EP 2, a rank whose micro-batch has no image beside one whose has
gives one process's loss and gradients (no hang), and so does cp 2 with images in the sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from step35.config import ConfigError, load_vision_config, preset
from step35.model import build_model
from step35.model.lora import LoraConfig, LoraError, apply_lora
from step35.model.vision import images_of_batch
from step35.training.objective import LanguageModelObjective
from step35.training.vision import VisionOptions, check_image_data, freeze_vision, image_inputs, vision_config_of
from tests.dist.cases import case_args
from tests.runner import run_dist_script

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "tests" / "dist" / "vision_equivalence.py"
REL = 1e-5
VISION = ("vision_model.", "vit_large_projector.")


def tiny_vl(seed: int = 0):
    model = build_model(preset("tiny-vl"), device="cpu", vision=load_vision_config("tiny-vl"))
    model.init_weights(seed)
    return model


def contract_batch(g: torch.Generator) -> dict:
    """Two samples in the data's layout (image_records.IMAGE_KEYS): sample 0 holds an image with 2 crops then
    one without; sample 1 none. 112-pixel views (4 features), 56-pixel crops (1 each)."""
    ids = torch.randint(2, 1000, (2, 33), generator=g)
    ids[0, 2:8] = 1000  # 2 crops + the view: 6 features
    ids[0, 12:16] = 1000
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == 1000, -100)
    pixel_values = torch.zeros(2, 3, 3, 112, 112)
    pixel_values[0, :2] = torch.randn(2, 3, 112, 112, generator=g)
    local = torch.zeros(2, 4, 3, 56, 56)
    local[0, :2] = torch.randn(2, 3, 56, 56, generator=g)
    crops = torch.tensor([[2, 0, 0], [0, 0, 0]])
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(32).repeat(2, 1),
            "pixel_values": pixel_values, "pixel_values_local": local, "num_local_patches": crops,
            "num_images": torch.tensor([2, 0])}  # fmt: skip


def test_the_objective_on_an_image_batch_is_the_cross_entropy_of_the_image_forward():
    model = tiny_vl()
    batch = contract_batch(torch.Generator().manual_seed(1))
    objective = LanguageModelObjective()
    with torch.no_grad():
        got = objective.micro_batch(model, batch, training=False)
        logits = model(
            batch["input_ids"][:, :-1],
            batch["position_ids"],
            pixel_values=batch["pixel_values"][0, :2],
            pixel_values_local=batch["pixel_values_local"][0, :2],
            num_local_patches=[2, 0],
        )
        expected = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
        text_ids = batch["input_ids"].masked_fill(batch["input_ids"] == 1000, 5)  # the placeholders as a token
        without = objective.micro_batch(model, {**batch, "input_ids": text_ids, "num_images": torch.zeros(2).long()})
    lm_sum = got.sums[4].item()
    assert abs(lm_sum - expected.item()) <= 1e-4 * abs(expected.item()), (lm_sum, expected.item())
    assert abs(without.sums[4].item() - lm_sum) > 1e-3  # the images change the loss


def test_a_batch_without_images_is_the_language_models_loss():
    """The VLM on text (no image keys, or keys with no image) = the language model alone with the same weights."""
    vlm = tiny_vl()
    lm = build_model(preset("tiny-vl"), device="cpu")
    lm.load_state_dict({k: v for k, v in vlm.state_dict().items() if not k.startswith(VISION)})
    batch = contract_batch(torch.Generator().manual_seed(2))
    batch["input_ids"][batch["input_ids"] == 1000] = 5
    batch["num_images"][:] = 0
    objective = LanguageModelObjective()
    with torch.no_grad():
        text = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        ours = [objective.micro_batch(vlm, b, training=False).sums[4].item() for b in (batch, text)]
        theirs = objective.micro_batch(lm, text, training=False).sums[4].item()
    assert ours == [theirs, theirs]
    assert image_inputs(text) == {}
    assert images_of_batch(*(batch[k] for k in ("pixel_values", "pixel_values_local", "num_local_patches",
                                                 "num_images")))["pixel_values"].shape == (0, 3, 112, 112)  # fmt: skip


def test_frozen_by_default_trained_on_request_and_from_scratch_init():
    model = tiny_vl()
    freeze_vision(model, train=False)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith(VISION))
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith(VISION))
    state = model.state_dict()
    block = "vision_model.transformer.resblocks.0"
    assert torch.equal(state[f"{block}.ls_1.gamma"], torch.ones(32)) and torch.equal(state[f"{block}.ln_1.weight"],
                                                                                         torch.ones(32))  # fmt: skip
    assert not state[f"{block}.attn.in_proj_bias"].any() and state[f"{block}.mlp.c_fc.weight"].std() > 0.01
    assert VisionOptions.of({}) == VisionOptions(False) and VisionOptions.of({"train": True}).train
    with pytest.raises(ValueError, match=r"model.vision: unknown field\(s\) \['trian'\]"):
        VisionOptions.of({"trian": True})
    with pytest.raises(ConfigError, match="model.vision is set but model.config=tiny has no vision side"):
        vision_config_of(VisionOptions(), "tiny")
    assert vision_config_of(None, "tiny-vl") is None and vision_config_of(VisionOptions(), "tiny-vl").hidden_size == 32


def test_lora_targets_the_projector_and_the_encoder_linears():
    model = build_model(preset("tiny-vl"), device="cpu", vision=load_vision_config("tiny-vl"))
    apply_lora(model, LoraConfig(rank=2, targets=["attention", "vision", "vision_projector"], base_dtype="float32"))
    model.init_weights(0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and n.startswith(VISION)}
    expected = {f"vit_large_projector.lora_{x}" for x in "AB"} | {
        f"vision_model.transformer.resblocks.{i}.{m}.lora_{x}"
        for i in range(2)
        for m in ("attn.out_proj", "mlp.c_fc", "mlp.c_proj")
        for x in "AB"
    }
    assert trained == expected
    batch = contract_batch(torch.Generator().manual_seed(3))
    LanguageModelObjective().micro_batch(model, batch).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in trained
               and n.endswith("lora_B"))  # fmt: skip
    with pytest.raises(LoraError, match="names \\['vision'\\] but the model has no vision side"):
        apply_lora(build_model(preset("tiny"), device="cpu"), LoraConfig(rank=2, targets=["vision"]))


class _Data:
    def __init__(self, images, token):
        self.images, self.image_token_id = images, token


def test_images_need_the_vision_side_and_its_token():
    vision = load_vision_config("tiny-vl")
    check_image_data(_Data(None, None), None)  # no images: nothing to check
    with pytest.raises(ValueError, match="data.images is set but the model has no vision side: set model.vision"):
        check_image_data(_Data(object(), 1000), None)
    with pytest.raises(ValueError, match="<im_patch> is id 1024, the model's image_token_id is 1000"):
        check_image_data(_Data(object(), 1024), vision)
    check_image_data(_Data(object(), 1000), vision)


# ------------------------------------------------------------------------------------------------ gloo ranks
CASES = {
    "ep2_trained": ["--ep", "2", "--cp", "1", "--train-vision"],
    "ep2_frozen": ["--ep", "2", "--cp", "1"],
    "cp2_trained": ["--ep", "2", "--cp", "2", "--train-vision"],
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return run_dist_script(SCRIPT, tmp_path_factory.mktemp("vision") / "r.pt", 2, *case_args(CASES), timeout=240)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # a rank that skipped a vision module would hang its peer's collectives: fail, not wait
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_one_process_with_a_text_only_rank(two_ranks, case):
    r = two_ranks[case]
    assert r["missing"] == [] and r["images_on_rank"] == 3
    assert abs(r["loss"] - r["ref_loss"]) <= REL * abs(r["ref_loss"]), (r["loss"], r["ref_loss"])
    worst = max(r["grad_errors"], key=r["grad_errors"].get)
    assert r["grad_errors"][worst] <= REL, (worst, r["grad_errors"][worst])
    assert len(r["vision_grads"]) == (0 if case == "ep2_frozen" else 37)  # every vision parameter when trained


def test_cached_generation_with_images_equals_rerunning_the_whole_context():
    """step35 generate --image: the prompt's first forward reads the images (embed_with_images into the KV-cached
    step); every later token then equals a forward over the whole context with the images, token by token."""
    from step35.eval.generator import Generator

    model = tiny_vl(3).eval()
    g = torch.Generator().manual_seed(4)
    images = {"pixel_values": torch.randn(1, 3, 112, 112, generator=g),
              "pixel_values_local": torch.randn(2, 3, 56, 56, generator=g), "num_local_patches": [2]}  # fmt: skip
    prompt = [5, 6] + [1000] * 6 + [7, 8]  # 2 crops + the view: 6 features
    generator = Generator(model, tokenizer=None, start_id=0, stop_ids=set())
    cached = generator.generate_ids(prompt, 6, images=images)
    generator.use_cache = False
    assert generator.generate_ids(prompt, 6, images=images) == cached
    with torch.no_grad():
        assert cached[0] == int(model(torch.tensor([prompt]), **images)[0, -1].argmax())
        other = {**images, "pixel_values": torch.randn(1, 3, 112, 112, generator=g)}
        assert not torch.equal(model(torch.tensor([prompt]), **images), model(torch.tensor([prompt]), **other))
