"""`step35 plan` with Step-3.7's vision side on the devices (`model.vision`, plan/vision.py).

- weights: the vision parameter bytes the plan reads, and their gradients and AdamW states, equal what a real
  `tiny-vl` model built by step35 holds, counted here from its parameters (and from the vision config by hand):
  frozen, trained, LoRA on the vision targets (adapters only trained), and sharded over 4 simulated ranks (FSDP
  gives rank 0 ceil(rows / 4) rows of every tensor);
- activations: the bytes the plan predicts the vision forward keeps equal the saved tensors of a real forward of
  the tiny encoder and projector on a micro-batch of views and crops (saved_tensors_hooks, unique storages,
  parameters excluded): fp32 within 1 % (measured: equal), bf16 within 15 % (the CPU keeps LayerNorm statistics
  in bf16, the plan counts CUDA's fp32); under full and selective activation checkpointing (the encoder blocks
  wrapped by parallelize.checkpoint_blocks, as training wraps them) the storages the forward leaves alive;
- full activation checkpointing of a trained tiny-vl model changes neither its loss nor its gradients;
- the phases carry them; without model.vision a Step-3.7 model keeps today's report (nothing on the devices);
- the release's Step-3.7 config (a config.json only, no tensors) planned with the GPU recipe: its vision
  parameter count equals the analytic count of its config, sharded over 64 ranks; its numbers printed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from step35.config import PRESETS, VisionConfig, load_vision_config, preset
from step35.model import build_model
from step35.parallel.parallelize import checkpoint_blocks
from step35.plan.devices import DEVICES
from step35.plan.planner import make_plan, run_vision_activations
from step35.plan.settings import PlanInputError, read_settings
from step35.training.setup import TrainedModel, training_model
from tests.runner import run_plan

ROOT = Path(__file__).parent.parent
VISION = ("vision_model.", "vit_large_projector.")
RANK = 4  # the LoRA runs' rank
WINDOWS, IMAGES, CROPS = 2, 2, 3  # micro_batch_size, data.images.max_images, max_crops
VIEW, CROP = 112, 56  # tiny-vl's global view and crop sides (pixels)

RUN = """\
trainer:
  accelerator: cpu
  devices: {devices}
  precision: {precision}
{strategy}model:
  config: tiny-vl
{model}data:
  seq_len: 128
  micro_batch_size: {windows}
  images: {{view_size: {view}, crop_size: {crop}, max_images: {images}, max_crops: {crops}}}
"""
SHARDED = """\
  strategy:
    class_path: step35.strategy.Step35Strategy
    init_args:
      expert_parallel_size: 2
"""
CASES = {  # model section, precision
    "frozen": ("  vision: {}\n", "32-true"),
    "trained": ("  vision: {train: true}\n", "32-true"),
    "trained-bf16": ("  vision: {train: true}\n", "bf16-true"),
    "lora": (f"  vision: {{}}\n  lora: {{rank: {RANK}, targets: [attention, vision, vision_projector]}}\n", "32-true"),
    "lora-projector": (f"  vision: {{}}\n  lora: {{rank: {RANK}, targets: [vision_projector]}}\n", "32-true"),
}


def settings_of(tmp_path: Path, case: str, devices: int = 1, **changes):
    model, precision = CASES[case]
    fields = dict(
        devices=devices,
        precision=precision,
        strategy=SHARDED if devices > 1 else "",
        model=model,
        windows=WINDOWS,
        view=VIEW,
        crop=CROP,
        images=IMAGES,
        crops=CROPS,
    )
    fields.update(changes)
    path = tmp_path / f"{case}-{devices}.yaml"
    path.write_text(RUN.format(**fields))
    return read_settings(["--config", str(path)])


def plan_of(settings):
    return make_plan(settings, DEVICES["cpu"], allocator_margin=0.05, device_memory_gib=64)


# ------------------------------------------------------------------------------ weights
def vision_param_count(v: VisionConfig, text_hidden: int) -> int:
    """The encoder's and projector's parameters from the config, module by module (model/vision.py)."""
    D, I, p = v.hidden_size, v.intermediate_size, v.patch_size
    block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + 2 * D + (D * I + I) + (I * D + D)  # LNs, attn, ls, mlp
    stem = v.num_channels * p * p * D + (v.image_size // p) ** 2 * D + 2 * D  # conv1, positions, ln_pre
    downsamplers = (2 * D * D * 9 + 2 * D) + (4 * D * 2 * D * 9 + 4 * D)
    projector = 4 * D * text_hidden + (text_hidden if v.projector_bias else 0)
    return stem + v.num_hidden_layers * block + downsamplers + projector


def vision_tensors_of_built_model() -> dict[str, tuple[int, ...]]:
    """The vision parameters of the tiny-vl model as step35 builds it (meta), name -> shape."""
    model = build_model(preset("tiny-vl"), None, vision=load_vision_config("tiny-vl"), device="meta")
    return {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(VISION)}


def adapter_values(v: VisionConfig, text_hidden: int, blocks: bool, projector: bool) -> int:
    """LoRA values on the vision targets: A [r, in] + B [out, r] per adapted linear."""
    D, I = v.hidden_size, v.intermediate_size
    per_block = RANK * ((D + D) + (D + I) + (I + D))  # attn.out_proj, mlp.c_fc, mlp.c_proj
    return (v.num_hidden_layers * per_block if blocks else 0) + (RANK * (4 * D + text_hidden) if projector else 0)


def test_the_tiny_vision_config_counts_what_the_model_holds():
    shapes = vision_tensors_of_built_model()
    assert sum(math.prod(s) for s in shapes.values()) == vision_param_count(load_vision_config("tiny-vl"), 128)


@pytest.mark.parametrize("case", ["frozen", "trained", "lora"])
def test_vision_weights_on_one_device_equal_the_built_model(tmp_path, case):
    """Unsharded, fp32: the vision bytes the plan holds, trains and keeps AdamW states for (x2)."""
    state = plan_of(settings_of(tmp_path, case)).state
    v = load_vision_config("tiny-vl")
    base = sum(math.prod(s) for s in vision_tensors_of_built_model().values())
    adapters = adapter_values(v, 128, blocks=case == "lora", projector=case == "lora")
    trained = {"frozen": 0, "trained": base, "lora": adapters}[case]
    print(f"{case}: vision {base:,} values + {adapters:,} adapter values, {state.vision_params:,} bytes held")
    assert state.vision_total == base
    assert state.vision_params == 4 * (base + adapters)
    assert state.vision_grads == 4 * trained
    assert state.vision_optimizer == 2 * 4 * trained  # AdamW: exp_avg, exp_avg_sq


@pytest.mark.parametrize("case", ["frozen", "trained"])
def test_vision_weights_sharded_over_four_ranks(tmp_path, case):
    """FSDP2 splits dim 0 of every vision tensor into chunks of ceil(rows / 4); rank 0 holds the first."""
    state = plan_of(settings_of(tmp_path, case, devices=4)).state
    rank0 = sum(-(-s[0] // 4) * math.prod(s[1:]) for s in vision_tensors_of_built_model().values())
    assert state.vision_params == 4 * rank0
    assert state.vision_grads == (4 * rank0 if case == "trained" else 0)
    assert state.vision_optimizer == (8 * rank0 if case == "trained" else 0)


def test_the_vision_side_adds_its_bytes_to_the_device_totals(tmp_path):
    """The same run with and without model.vision (and its images): parameters, gradients, optimizer states
    and activations differ by exactly the vision side's."""
    with_vision = plan_of(settings_of(tmp_path, "trained"))
    text = (tmp_path / "trained-1.yaml").read_text()
    text = text.replace("  vision: {train: true}\n", "").replace("  images: {view_size", "  # images: {view_size")
    (tmp_path / "text.yaml").write_text(text)
    without = plan_of(read_settings(["--config", str(tmp_path / "text.yaml")]))
    a, b = with_vision.state, without.state
    assert without.settings.vision is None and without.vision is None
    assert a.params - b.params == a.vision_params and a.grads - b.grads == a.vision_grads
    assert a.optimizer - b.optimizer == a.vision_optimizer and a.params_total == b.params_total
    assert with_vision.activations.total - without.activations.total == with_vision.vision.total > 0
    phases = {p.name: p.rows for p in with_vision.phases}
    assert phases["forward"]["activations"] == with_vision.activations.total
    assert phases["vision backward"]["vision activations"] == with_vision.vision.total


# ------------------------------------------------------------------------------ activations
def tiny_vl_model(settings, checkpointing: str = "none", seed: int = 0):
    """The run's tiny model on the CPU, its blocks checkpointed as parallelize checkpoints them (training_model's
    shard step, where the strategy's parallelize runs)."""
    lora = settings.lora.options if settings.lora is not None else None
    spec = TrainedModel(settings.model_config, 0, 0.0, lora, settings.vision, settings.train_vision)
    shard = None if checkpointing == "none" else (lambda model: checkpoint_blocks(model, checkpointing))
    return training_model(spec, shard=shard, dtype=settings.stored_dtype, device="cpu", seed=seed).train()


def tiny_images(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The plan's micro-batch of images: 4 global views, 6 crops, and the crops of each image."""
    g = torch.Generator().manual_seed(0)
    views = torch.randn(WINDOWS * IMAGES, 3, VIEW, VIEW, generator=g, dtype=dtype)
    crops = torch.randn(WINDOWS * CROPS, 3, CROP, CROP, generator=g, dtype=dtype)
    per_image = [2, 1, 0, 3]  # the crops of each of the 4 images, 6 in all
    assert len(per_image) == views.shape[0] and sum(per_image) == crops.shape[0]
    return views, crops, per_image


def measured_vision_bytes(settings, checkpointing: str = "none") -> int:
    """Bytes a real forward of the run's tiny encoder and projector keeps for backward on the plan's views:
    unique storages packed by autograd, parameters excluded. Checkpointed blocks pack inside their own hooks and
    hold their inputs and (selective) matmul outputs outside them: then the storages the forward created that are
    still alive after it, the pixels and the features (its output) excluded (benchmarks/activation_memory.py)."""
    model = tiny_vl_model(settings, checkpointing)
    views, crops, per_image = tiny_images(settings.vision_dtype)
    if checkpointing != "none":
        return retained_vision_bytes(model, views, crops, per_image)
    parameters = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    kept: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in parameters:
            kept[ref] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        features = model.image_features(views, crops, per_image)
    if features.requires_grad:
        features.float().square().sum().backward()  # the counted graph is a complete one
    return sum(kept.values())


def retained_vision_bytes(model, views: torch.Tensor, crops: torch.Tensor, per_image: list[int]) -> int:
    from benchmarks.activation_memory import _PartTracker, count_saved

    _, retained, features = count_saved(lambda: model.image_features(views, crops, per_image), _PartTracker(), model)
    outside = {StorageWeakRef(t.untyped_storage()) for t in (views, crops, features)}
    kept = sum(nbytes for ref, (*_, nbytes) in retained.items() if ref not in outside)
    if features.requires_grad:
        features.float().square().sum().backward()  # the counted graph is a complete one
    return kept


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize(
    "case,tolerance",
    [("trained", 0.01), ("trained-bf16", 0.15), ("lora", 0.01), ("lora-projector", 0.01), ("frozen", 0)],
)
def test_predicted_vision_activations_match_saved_tensors(tmp_path, case, tolerance, checkpointing):
    settings = settings_of(tmp_path, case).with_layout(activation_checkpointing=checkpointing)
    predicted = run_vision_activations(settings)
    measured = measured_vision_bytes(settings, checkpointing)
    print(
        f"{case}, {checkpointing}: predicted {predicted.total:,} B, measured {measured:,} B; "
        f"per view {predicted.per_view}"
    )
    assert predicted.total == pytest.approx(measured, rel=tolerance)
    assert (measured == 0) == (case == "frozen")
    # the views' shares add up to the whole but for the rotary tables (per view size)
    shares = WINDOWS * (IMAGES * predicted.per_view[VIEW] + CROPS * predicted.per_view[CROP])
    assert 0 <= predicted.total - shares < 0.05 * max(predicted.total, 1)


@pytest.mark.parametrize("case", ["trained", "frozen"])
def test_full_checkpointing_of_the_vision_side_keeps_loss_and_gradients(tmp_path, case):
    """tiny-vl, fp32: the decoder layers and the encoder blocks checkpointed in full (as parallelize wraps them)
    give the loss and every gradient of the unwrapped model, parameter names unchanged; a frozen encoder (no
    input of its checkpointed blocks asks for a gradient) runs and keeps nothing."""
    settings = settings_of(tmp_path, case)
    views, crops, per_image = tiny_images(torch.float32)
    token = settings.vision.image_token_id
    g = torch.Generator().manual_seed(1)
    text = torch.randint(2, token, (2, 40), generator=g)
    placeholders = torch.full((2, 11), token)  # 22 features: 4 views of 2 x 2, 6 crops of 1
    ids = torch.cat([text[:, :20], placeholders, text[:, 20:]], dim=1)
    images = {"pixel_values": views, "pixel_values_local": crops, "num_local_patches": per_image}
    results = {}
    for checkpointing in ("none", "full"):
        model = tiny_vl_model(settings, checkpointing, seed=3)
        wrapped = hasattr(model.vision_model.transformer.resblocks[0].forward, "__wrapped__")
        assert wrapped == (checkpointing == "full")
        loss = model.loss(ids[:, :-1], ids[:, 1:], images=images).loss
        loss.backward()
        results[checkpointing] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    (loss, grads), (loss_ac, grads_ac) = results["none"], results["full"]
    assert grads_ac.keys() == grads.keys()
    assert any(n.startswith("vision_model.transformer.") for n in grads) == (case == "trained")
    torch.testing.assert_close(loss_ac, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name  # every trained parameter gets a gradient
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def test_without_model_vision_nothing_is_on_the_devices_and_images_are_refused(tmp_path):
    text = RUN.format(devices=1, precision="32-true", strategy="", model="", windows=2, view=112, crop=56,
                      images=1, crops=0)  # fmt: skip
    (tmp_path / "no-vision.yaml").write_text(text)
    with pytest.raises(PlanInputError, match="data.images is set but the model has no vision side"):
        read_settings(["--config", str(tmp_path / "no-vision.yaml")])
    (tmp_path / "text.yaml").write_text(text.replace("  images: {", "  # images: {"))
    plan = plan_of(read_settings(["--config", str(tmp_path / "text.yaml")]))
    assert plan.vision is None and plan.state.vision_params == 0 and plan.settings.carried is None
    assert "vision forward" not in [p.name for p in plan.phases]


# ------------------------------------------------------------------------------ the release's config
RECIPE = str(ROOT / "configs" / "flash-196b-4k-gpu.yaml")  # 64 H100, FSDP over 64, micro-batch 1 of 4K tokens
RELEASE_VISION = {  # Step-3.7-Flash's vision_config as the release spells it (transformers' Step3p7VisionConfig)
    "width": 1536,
    "layers": 47,
    "heads": 16,
    "mlp_ratio": 8960 / 1536,
    "image_size": 728,
    "patch_size": 14,
    "ls_init_value": 0.1,
    "model_type": "step3p5_vision",
}


@pytest.fixture(scope="module")
def release_args(tmp_path_factory) -> dict[str, list[str]]:
    """`step35 plan` arguments: the GPU recipe on a Step-3.7 folder holding only its config.json (the release's
    text and vision configs), with the release's image processor sizes (data.images: {}), frozen and trained."""
    folder = tmp_path_factory.mktemp("step37_release")
    raw = {
        "architectures": ["Step3p7ForConditionalGeneration"],
        "model_type": "step3p7",
        "image_token_id": 151679,
        "projector_bias": False,
        "text_config": {**PRESETS["flash-196b"](), "model_type": "step3p5"},
        "vision_config": RELEASE_VISION,
    }
    (folder / "config.json").write_text(json.dumps(raw))
    common = ["--config", RECIPE, f"--model.checkpoint={folder}", "--data.images={}", "--no-suggestions", "--json"]
    trained = [*common, "--model.vision={train: true}"]  # the recipe checkpoints in full
    return {
        "frozen": [*common, "--model.vision={}"],
        "trained": trained,
        "trained selective": [*trained, "--trainer.strategy.activation_checkpointing=selective"],
        "trained none": [*trained, "--trainer.strategy.activation_checkpointing=none"],
    }


@pytest.mark.heavy  # the 196B model with the vision side sharded for 64 simulated ranks, twice (then cached)
@pytest.mark.timeout(300)
def test_release_vision_side_planned_from_its_config_alone(capsys, release_args):
    vision = VisionConfig.from_release({"vision_config": RELEASE_VISION})
    analytic = vision_param_count(vision, 4096)
    plans, lines = {}, []
    for name, args in release_args.items():
        code, out, err = run_plan(capsys, *args)
        assert code in (0, 1), err[-3000:]
        plans[name] = json.loads(out)
        v = plans[name]["vision"]
        act = v["activations"]
        lines.append(
            f"{name}: {v['params_total']:,} vision parameters; rank 0 holds {v['param_bytes'] / 2**30:.3f} GiB, "
            f"gradients {v['grad_bytes'] / 2**30:.3f} GiB, optimizer {v['optimizer_bytes'] / 2**30:.3f} GiB; "
            f"{act['tokens']:,} encoder tokens, {act['features']:,} features per micro-batch; kept "
            f"{act['total'] / 2**30:.2f} GiB ({', '.join(f'{k} px {b / 2**20:,.0f} MiB' for k, b in act['per_view'].items())}"
            f" per view); one block's work {act['block_work'] / 2**30:.2f} GiB; required "
            f"{plans[name]['verdict']['required'] / 2**30:.1f} GiB"
        )
        assert v["params_total"] == analytic  # 1.98 B: 47 blocks of width 1536, the downsamplers, the projector
        # fp32 master weights, FSDP over the 64 ranks (rank 0: every tensor's rounded-up chunk)
        assert analytic * 4 / 64 <= v["param_bytes"] <= analytic * 4 / 64 * 1.01
        assert act["tokens"] == 4 * 52**2 + 36 * 36**2 and act["features"] == 4 * 13**2 + 36 * 9**2
        assert plans[name]["carried"] is None  # on the devices now, not carried on the host
        assert plans[name]["model"]["params_total"] > 196e9  # the language model's count, vision apart
    print("\n".join(lines))
    frozen, trained = plans["frozen"]["vision"], plans["trained"]["vision"]
    assert frozen["grad_bytes"] == frozen["optimizer_bytes"] == frozen["activations"]["total"] == 0
    assert trained["grad_bytes"] == trained["param_bytes"] and trained["optimizer_bytes"] == 2 * trained["param_bytes"]
    # trained, in bf16, per token of a view: 47 blocks x (13 D + 3 I) values at least without checkpointing; their
    # input D under full; under selective also the 4 linears' outputs 5 D + I and the flash kernel's output D
    D, I = 1536, 8960
    per_view = {name: plans[name]["vision"]["activations"]["per_view"]["728"] for name in plans}
    assert per_view["trained none"] == pytest.approx(52**2 * 47 * (13 * D + 3 * I) * 2, rel=0.05)
    assert per_view["trained"] == pytest.approx(52**2 * 47 * D * 2, rel=0.10)  # + the stem, downsamplers, projector
    assert per_view["trained selective"] == pytest.approx(52**2 * 47 * (7 * D + I) * 2, rel=0.02)
    assert plans["trained"]["verdict"]["fits"]  # 8.5 GiB kept by the 47 checkpointed blocks and the rest: ~70 GiB
    assert not plans["trained none"]["verdict"]["fits"]  # 36 crops + 4 views kept by 47 unchecked blocks: ~237 GiB
    assert not plans["trained selective"]["verdict"]["fits"]  # the matmul outputs alone: ~2 GiB a block
