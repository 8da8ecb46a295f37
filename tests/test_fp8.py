"""FP8 start folders (Step-3.5-Flash-FP8, Step-3.7-Flash-FP8; checkpoint/hf/fp8.py): weights stored as
float8_e4m3fn with per-block inverse scales `<name>_scale_inv`, the block in config.json's quantization_config.

The folders are made here, by block-quantising the tiny preset's weights the way the releases are laid out
(vLLM's and transformers' FP8 loaders, read for the layout): every matrix and stacked expert tensor in FP8 with
float32 scales [..., ceil(out / rows), ceil(in / cols)], what `modules_to_not_convert` names (embedding, LM
head, router) and the norms in bf16, the router bias in fp32. The block, [24, 40], is not square and cuts
every tiny shape with a ragged edge (128 = 5 x 24 + 8 rows, 128 = 3 x 40 + 8 columns, g_proj's 4 rows in one
block), and the 2-rank row shards cut blocks in two (64 = 2 x 24 + 16). The Step-3.5 folder keeps its scales
in a second shard (the reader must open it); the Step-3.7 folder (config.json wrapping text_config, the
quantization_config at its top level as transformers and vLLM read it) keeps them beside their weights and
carries an FP8 vision tensor. The expected values are computed here independently: `fp8.float() *
scale_inv` expanded per block with repeat_interleave."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import INDEX_FILE, model_tensor_infos
from step35.checkpoint.hf.materialize import checkpoint_state
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.config import Step35Config, preset
from step35.model import Step35ForCausalLM
from tests.helpers import one_step_from, safetensors_in
from tests.runner import ROOT, run_script

BLOCK = (24, 40)  # rows, cols of one scale block (the releases: 128 x 128)
FP8_MAX = 448.0  # the largest float8_e4m3fn
NOT_CONVERTED = ("model.embed_tokens", "lm_head", "moe.gate", "shared_head.output")  # as modules_to_not_convert
WEIGHTS, SCALES = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def quantised(name: str, tensor: torch.Tensor) -> bool:
    """Whether the release stores `name` in FP8: matrices and stacked experts, but the modules not converted."""
    module = name.removesuffix(".weight")
    return tensor.dim() >= 2 and not any(module == m or module.endswith("." + m) for m in NOT_CONVERTED)


def expand(scales: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """One scale per element of a tensor of `shape`: each block's scale repeated over its rows and columns."""
    rows, cols = shape[-2:]
    per_row = scales.repeat_interleave(BLOCK[0], dim=-2)[..., :rows, :]
    return per_row.repeat_interleave(BLOCK[1], dim=-1)[..., :cols]


def block_quantise(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 inverse scales): each block's largest magnitude mapped to FP8_MAX."""
    rows, cols = tensor.shape[-2:]
    grid = (math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
    padded = F.pad(tensor.float(), (0, grid[1] * BLOCK[1] - cols, 0, grid[0] * BLOCK[0] - rows))
    blocks = padded.unflatten(-1, (grid[1], BLOCK[1])).unflatten(-3, (grid[0], BLOCK[0]))
    largest = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(largest > 0, largest / FP8_MAX, torch.ones_like(largest))
    values = (tensor.float() / expand(scale_inv, tensor.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale_inv


def dequantised(values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The reference: `fp8.float() * scale_inv` per block, in float32."""
    return values.float() * expand(scale_inv, values.shape)


def quantization_config() -> dict:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": list(NOT_CONVERTED),
    }


def fp8_folder(folder: Path, language: dict[str, torch.Tensor], text: dict, release: str) -> dict[str, torch.Tensor]:
    """Write `language` (step35's names, bf16 / fp32 router bias) block-quantised as an FP8 folder of `release`
    ("Step-3.5": its config.json, scales in a second shard; "Step-3.7": text_config in a wrapping config.json,
    one file, an FP8 vision tensor and a bf16 projector carried). Returns what step35 must read, in float32."""
    folder.mkdir()
    weights, scales, expected = {}, {}, {}
    for name, tensor in language.items():
        if quantised(name, tensor):
            weights[name], scales[name + "_scale_inv"] = block_quantise(tensor)
            expected[name] = dequantised(weights[name], scales[name + "_scale_inv"])
        else:
            weights[name], expected[name] = tensor, tensor.float()
    if release == "Step-3.5":
        save_file(weights, folder / WEIGHTS)
        save_file(scales, folder / SCALES)
        index = {n: WEIGHTS for n in weights} | {n: SCALES for n in scales}
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": index}))
        config = {**text, "quantization_config": quantization_config()}
    else:
        vision = torch.randn(48, 88, generator=torch.Generator().manual_seed(7))
        carried = {"vit_large_projector.weight": torch.randn(8, 48).to(torch.bfloat16)}
        carried["vision_model.patch_embed.weight"], carried["vision_model.patch_embed.weight_scale_inv"] = (
            block_quantise(vision)
        )
        save_file(weights | scales | carried, folder / "model.safetensors")
        config = {
            "model_type": "step3p7",
            "architectures": ["Step3p7ForConditionalGeneration"],
            "text_config": {**text, "model_type": "step3p5"},
            "quantization_config": quantization_config(),
        }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return expected


@pytest.fixture(scope="module")
def folders(tmp_path_factory, builtin_cache):
    """The tiny preset's initial weights (seed 1) as a Step-3.5 and a Step-3.7 FP8 folder, each with the built-in
    tokenizer: {release: (folder, the float32 values step35 must read)}."""
    from step35.data import builtin_tokenizer_dir

    text = {**preset("tiny").to_dict(), "torch_dtype": "bfloat16"}  # the releases: bf16 beside the FP8 tensors
    model = Step35ForCausalLM(Step35Config.from_dict(text))
    model.init_weights(1)
    language = {
        n: t.detach().clone() if n.endswith("router_bias") else t.detach().to(torch.bfloat16)
        for n, t in checkpoint_state(model).items()
    }
    root = tmp_path_factory.mktemp("fp8")
    tokenizer = builtin_tokenizer_dir(cache_dir=builtin_cache)
    out = {}
    for release in ("Step-3.5", "Step-3.7"):
        folder = root / release
        out[release] = folder, fp8_folder(folder, language, text, release)
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / name, folder / name)
    return out


def test_the_fixture_cuts_ragged_blocks_in_the_shapes_that_matter(folders):
    _, expected = folders["Step-3.5"]
    scales = load_file(folders["Step-3.5"][0] / SCALES)
    ragged = [n for n in scales if any(d % b for d, b in zip(expected[n[: -len("_scale_inv")]].shape[-2:], BLOCK))]
    assert "model.layers.1.moe.gate_proj.weight_scale_inv" in scales  # stacked experts, one grid per expert
    assert scales["model.layers.1.moe.gate_proj.weight_scale_inv"].shape == (8, 3, 4)  # [8, 64, 128] / [24, 40]
    assert len(ragged) == len(scales) and "model.embed_tokens.weight_scale_inv" not in scales


@pytest.mark.parametrize("release", ["Step-3.5", "Step-3.7"])
def test_loaded_weights_equal_the_blockwise_dequantisation(folders, release):
    folder, expected = folders[release]
    infos, carried, layout = model_tensor_infos(folder)
    assert layout.release == release and not any(n.endswith("_scale_inv") for n in infos | carried)
    assert {n for n, i in infos.items() if i.scales is not None} == {n for n, t in expected.items() if quantised(n, t)}
    for dtype in (torch.float32, torch.bfloat16):
        state = load_pretrained(folder, dtype=dtype).state_dict()
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            want = value if name.endswith("router_bias") else value.to(dtype)
            assert state[name].dtype == want.dtype and torch.equal(state[name], want), (name, dtype)


def broken_copy(folders, tmp_path, edit) -> Path:
    """A copy of the Step-3.5 FP8 folder with its scale shard (and index) changed by `edit(scales, weight_map)`."""
    folder = tmp_path / "broken"
    shutil.copytree(folders["Step-3.5"][0], folder)
    scales = load_file(folder / SCALES)
    index = json.loads((folder / INDEX_FILE).read_text())
    edit(scales, index["weight_map"])
    save_file(scales, folder / SCALES)
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder


EXPERT = "model.layers.2.moe.down_proj.weight"
ATTENTION = "model.layers.0.self_attn.g_proj.weight"


def test_a_missing_scale_is_refused_naming_the_tensor_and_file(folders, tmp_path):
    def drop(scales, weight_map):
        del scales[EXPERT + "_scale_inv"], weight_map[EXPERT + "_scale_inv"]

    with pytest.raises(CheckpointError, match=rf"{WEIGHTS}: tensor {EXPERT} is stored as torch.float8_e4m3fn without"):
        load_pretrained(broken_copy(folders, tmp_path, drop))


@pytest.mark.parametrize(
    "bad",
    [lambda s: s[:, :, :-1], lambda s: s[0], lambda s: torch.cat([s, s[:, :1]], dim=1)],
    ids=["a_column_short", "one_expert", "a_block_row_more"],
)
def test_a_scale_of_the_wrong_shape_is_refused_naming_it(folders, tmp_path, bad):
    def reshape(scales, weight_map):
        scales[EXPERT + "_scale_inv"] = bad(scales[EXPERT + "_scale_inv"]).contiguous()

    with pytest.raises(CheckpointError, match=rf"{SCALES}: tensor {EXPERT}_scale_inv has shape .* needs \[8, 6, 2\]"):
        load_pretrained(broken_copy(folders, tmp_path, reshape))


def test_other_broken_scales_are_refused(folders, tmp_path):
    def as_fp16(scales, weight_map):
        scales[ATTENTION + "_scale_inv"] = scales[ATTENTION + "_scale_inv"].half()

    with pytest.raises(CheckpointError, match=rf"{ATTENTION}_scale_inv is torch.float16"):
        load_pretrained(broken_copy(folders, tmp_path, as_fp16))
    stray = "model.embed_tokens.weight_scale_inv"  # the embedding is stored in bf16: a scale of it is no FP8 scale

    def add_stray(scales, weight_map):
        scales[stray], weight_map[stray] = torch.ones(1, 1), SCALES

    with pytest.raises(CheckpointError, match=rf"holds inverse scales {stray}, but .* stored as torch.bfloat16"):
        load_pretrained(broken_copy(folders, tmp_path / "stray", add_stray))


@pytest.mark.parametrize(
    "quantization, message",
    [
        (None, "declares no quantization_config"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'; step35 reads FP8"),
        ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size is None"),
    ],
    ids=["none", "another_method", "no_blocks"],
)
def test_a_config_that_does_not_say_how_to_scale_is_refused(folders, tmp_path, quantization, message):
    folder = tmp_path / "config"
    shutil.copytree(folders["Step-3.5"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(folder)


def test_plan_counts_an_fp8_vision_side_with_its_scales(folders, step35_here):
    """`step35 plan` on the Step-3.7 FP8 folder: the carried vision side's bytes are the stored ones, the FP8
    tensor's scales included (counted here from the file), its values counted once."""
    folder, _ = folders["Step-3.7"]
    stored = {n: t for n, t in load_file(folder / "model.safetensors").items() if n.startswith(("vision_", "vit_"))}
    code, out, err = step35_here("plan", "--config", "configs/tiny.yaml", f"--model.checkpoint={folder}",
                                 f"--data.tokenizer={folder}", "--json")  # fmt: skip
    assert code == 0, err[-3000:]
    carried = json.loads(out)["carried"]
    assert carried["bytes"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert carried["tensors"] == len(stored) == 3
    assert carried["params"] == sum(t.numel() for n, t in stored.items() if not n.endswith("_scale_inv"))
    assert carried["dtypes"] == ["bfloat16", "float8_e4m3fn"]


@pytest.fixture(scope="module")
def one_step(folders, tmp_path_factory, builtin_cache):
    """One training step (in this process, Lightning) from the Step-3.5 FP8 folder: (the trained float32
    weights by name, the checkpoint)."""
    source, _ = folders["Step-3.5"]
    module, checkpoint = one_step_from(source, tmp_path_factory.mktemp("fp8-step"), builtin_cache)
    return {n: t.detach().clone() for n, t in module.model.state_dict().items()}, checkpoint


@pytest.mark.heavy  # the module's one training step (Lightning), then two exports
def test_one_step_from_an_fp8_folder_exports_bf16_without_quantization_config(folders, one_step, tmp_path):
    """`export` of a run from the Step-3.5 FP8 folder: bf16 weights (router bias fp32), config.json without
    quantization_config, said in the export's notes; the folder loads back and holds the trained weights. The
    same checkpoint exported with the Step-3.7 FP8 folder as --source (the same language model) writes a Step-3.7
    folder whose carried FP8 vision tensor is dequantised into bf16 and whose scales are gone."""
    from step35.checkpoint.training.export import export_checkpoint

    trained, checkpoint = one_step
    report = export_checkpoint(checkpoint, tmp_path / "hf")
    notes = [n for n in report.notes if "FP8" in n]
    assert len(notes) == 1 and "written in bfloat16" in notes[0] and "[24, 40]" in notes[0], report.notes
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    stored = safetensors_in(tmp_path / "hf")
    assert stored.keys() == trained.keys()
    for name, value in trained.items():
        dtype = torch.float32 if name.endswith("router_bias") else torch.bfloat16
        assert stored[name].dtype == dtype and torch.equal(stored[name], value.to(dtype)), name
    loaded = load_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(loaded[n], stored[n]) for n in stored)
    with pytest.raises(CheckpointError, match="float8_e5m2: step35 writes FP8 folders the releases' way"):
        export_checkpoint(checkpoint, tmp_path / "e5m2", dtype=torch.float8_e5m2)
    assert not (tmp_path / "e5m2").exists()

    wrapped, _ = folders["Step-3.7"]
    report = export_checkpoint(checkpoint, tmp_path / "hf37", source=wrapped)
    config = json.loads((tmp_path / "hf37" / "config.json").read_text())
    assert config["model_type"] == "step3p7" and "quantization_config" not in config
    assert "quantization_config" not in config["text_config"]
    assert any("FP8" in n for n in report.notes), report.notes
    stored = safetensors_in(tmp_path / "hf37")
    assert not any(n.endswith("_scale_inv") for n in stored)
    released = load_file(wrapped / "model.safetensors")
    vision = "vision_model.patch_embed.weight"
    want = dequantised(released[vision], released[vision + "_scale_inv"]).to(torch.bfloat16)
    assert stored[vision].dtype == torch.bfloat16 and torch.equal(stored[vision], want)
    assert torch.equal(stored["vit_large_projector.weight"], released["vit_large_projector.weight"])
    assert load_pretrained(tmp_path / "hf37").state_dict().keys() == trained.keys()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_fp8_export(stored: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> None:
    """`stored` (an FP8 export's tensors, step35's names) against `trained`: what the release quantises (the
    test's own rule, `quantised`) equals this file's block quantisation of the trained float32 weight, bitwise,
    values and scales, and dequantises within e4m3's rounding of it; the rest is bf16 (router bias fp32)."""
    for name, value in trained.items():
        if quantised(name, value):
            values, scales = block_quantise(value)
            assert same_bytes(stored[name], values) and same_bytes(stored[name + "_scale_inv"], scales), name
            # e4m3 keeps 3 mantissa bits: a normal value within 2^-4 of itself, a subnormal within 2^-9 of its scale
            error = (dequantised(values, scales) - value).abs()
            assert (error <= value.abs() / 16 + expand(scales, value.shape) / 512).all(), name
        else:
            dtype = torch.float32 if name.endswith("router_bias") else torch.bfloat16
            assert same_bytes(stored[name], value.to(dtype)), name


@pytest.mark.heavy  # the module's one training step (Lightning), then three exports
def test_an_fp8_export_writes_the_releases_block_layout(folders, one_step, tmp_path):
    """`export --dtype float8_e4m3fn` of the run from the Step-3.5 FP8 folder: every matrix and stacked expert
    tensor quantised in the start folder's [24, 40] blocks, bitwise as the test quantises the trained weights,
    the modules not converted in bf16; config.json carries the start folder's quantization_config and
    torch_dtype bfloat16; step35 reads it back as the block-wise dequantisation. With a Step-3.7 FP8 --source,
    the vision tensor and its scales are carried byte for byte and the quantization_config sits at the top
    level; with a bf16 Step-3.7 --source (made here), the vision side stays bf16 and is named among the
    modules not converted, so no loader looks for its scales."""
    from step35.checkpoint.training.export import export_checkpoint

    trained, checkpoint = one_step
    source, _ = folders["Step-3.5"]
    report = export_checkpoint(checkpoint, tmp_path / "fp8", dtype=torch.float8_e4m3fn)
    assert any("float8_e4m3fn, block-quantised in blocks of [24, 40]" in n for n in report.notes), report.notes
    assert any(  # the start folder's block is kept (its FP8 tensors are in it) and said to be ragged for transformers
        n.startswith("the start folder's block [24, 40], kept") and "transformers 5.24's FP8 loader cannot read" in n
        for n in report.notes
    ), report.notes
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == quantization_config() and config["torch_dtype"] == "bfloat16"
    stored = safetensors_in(tmp_path / "fp8")
    scales = {n + "_scale_inv" for n, t in trained.items() if quantised(n, t)}
    assert scales and stored.keys() == trained.keys() | scales
    check_fp8_export(stored, trained)
    for name, value in load_pretrained(tmp_path / "fp8", dtype=torch.float32).state_dict().items():
        want = dequantised(stored[name], stored[name + "_scale_inv"]) if name + "_scale_inv" in stored else stored[name]
        assert torch.equal(value, want.float()), name

    wrapped, _ = folders["Step-3.7"]
    export_checkpoint(checkpoint, tmp_path / "fp8-37", dtype=torch.float8_e4m3fn, source=wrapped)
    config = json.loads((tmp_path / "fp8-37" / "config.json").read_text())
    entry = quantization_config()  # the release's projector is bf16 but not in its list: the export names it
    entry["modules_to_not_convert"].append("vit_large_projector")
    assert config["quantization_config"] == entry and "quantization_config" not in config["text_config"]
    stored, released = safetensors_in(tmp_path / "fp8-37"), load_file(wrapped / "model.safetensors")
    carried = [n for n in released if n.startswith(("vision_model.", "vit_large_projector."))]
    assert len(carried) == 3 and all(same_bytes(stored[n], released[n]) for n in carried)
    check_fp8_export(stored, trained)  # the release's names are step35's for this layout

    plain = tmp_path / "bf16-37"  # the Step-3.7 folder as a bf16 release: dequantised, no scales, no quantization
    shutil.copytree(wrapped, plain)
    unquantised = {
        n: dequantised(t, released[n + "_scale_inv"]).to(torch.bfloat16) if n + "_scale_inv" in released else t
        for n, t in released.items()
        if not n.endswith("_scale_inv")
    }
    save_file(unquantised, plain / "model.safetensors")
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    report = export_checkpoint(checkpoint, tmp_path / "fp8-from-bf16", dtype=torch.float8_e4m3fn, source=plain)
    config = json.loads((tmp_path / "fp8-from-bf16" / "config.json").read_text())
    # no FP8 start: the releases' [128, 128] would cut the 352-wide MLP raggedly, so the largest block below it
    # that cuts every quantised matrix whole (352 = 11 x 32), said in the notes
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    assert any(n.startswith("blocks of [32, 32], not the releases' [128, 128]") for n in report.notes), report.notes
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "embed_tokens", "lm_head", "moe.gate", "shared_head.output", "vision_model", "vit_large_projector",
    ]  # fmt: skip
    stored = safetensors_in(tmp_path / "fp8-from-bf16")
    assert all(same_bytes(stored[n], unquantised[n]) for n in unquantised if n.startswith(("vision_", "vit_")))
    assert not any(n.startswith(("vision_", "vit_")) and n.endswith("_scale_inv") for n in stored)
    assert stored["model.layers.1.moe.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.moe.gate_proj.weight_scale_inv"].shape == (8, 2, 4)  # [8, 64, 128] in 32 x 32


def slice_bytes(name: str, bounds: list[tuple[int, int]], expected: dict[str, torch.Tensor]) -> int:
    """What reading the slice `bounds` of `name` costs, counted here: an FP8 slice's bytes (1 each) and the float32
    scales of the blocks it touches; a bf16 slice 2 bytes an element, the router bias 4."""
    count = math.prod(stop - start for start, stop in bounds)
    if count == 0:
        return 0  # an empty shard reads nothing
    if not quantised(name, expected[name]):
        return count * (4 if name.endswith("router_bias") else 2)
    *leading, (r0, r1), (c0, c1) = bounds
    blocks = (math.ceil(r1 / BLOCK[0]) - r0 // BLOCK[0]) * (math.ceil(c1 / BLOCK[1]) - c0 // BLOCK[1])
    return count + 4 * blocks * math.prod(stop - start for start, stop in leading)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_ranks_with_ep_2_read_only_their_slices(folders, tmp_path):
    """2 gloo ranks, FSDP x EP 2 (tests/dist/fp8_load.py), from the Step-3.5 FP8 folder: each rank's shards are the
    dequantised slices of the full tensors, and it read exactly its FP8 slices and the scale blocks they touch:
    about half the folder, not all of it."""
    folder, expected = folders["Step-3.5"]
    run_script(
        ROOT / "tests" / "dist" / "fp8_load.py",
        2,
        "--checkpoint",
        str(folder),
        "--ep",
        "2",
        "--out",
        str(tmp_path),
        timeout=300,
    )
    whole = sum(t.numel() * t.element_size() for f in (WEIGHTS, SCALES) for t in load_file(folder / f).values())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        pieces = result["pieces"]
        assert pieces.keys() == expected.keys()
        for name, (local, bounds) in pieces.items():
            index = tuple(slice(start, stop) for start, stop in bounds)
            assert torch.equal(local, expected[name][index]), (rank, name, bounds)
        assert any(b[0] != (0, expected[n].shape[0]) for n, (_, b) in pieces.items())  # sharded, not replicated
        read = result["bytes_read"]
        assert read == sum(slice_bytes(n, b, expected) for n, (_, b) in pieces.items()), rank
        print(f"rank {rank} read {read} of the folder's {whole} bytes")
        assert read < 0.6 * whole, (read, whole)


def test_quantize_matches_an_independent_block_quantisation():
    """fp8.quantize (what the FP8 export writes with) equals a per-block loop computed here, bitwise, on a
    stacked [E, out, in] tensor with ragged edge blocks and an all-zero block; dequantising it round-trips
    within float8_e4m3fn's precision."""
    from step35.checkpoint.hf import fp8

    torch.manual_seed(0)
    weight = torch.randn(3, 50, 90, dtype=torch.bfloat16)
    weight[1, :24, :40] = 0
    values, scales = fp8.quantize(weight, BLOCK)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (3, math.ceil(50 / 24), math.ceil(90 / 40))
    for e in range(3):
        for r in range(scales.shape[1]):
            for c in range(scales.shape[2]):
                rows, cols = slice(r * 24, (r + 1) * 24), slice(c * 40, (c + 1) * 40)
                blk = weight[e, rows, cols].float()
                amax = blk.abs().max()
                scale = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
                assert scales[e, r, c] == scale
                expected = (blk / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                assert torch.equal(values[e, rows, cols].view(torch.uint8), expected.view(torch.uint8))
    back = fp8.dequantize(values, scales, (0, 0), BLOCK, torch.float32)
    assert torch.allclose(back, weight.float(), rtol=0.07, atol=1e-6)


# ------------------------------------------------------------------ issue 42: hostile block sizes and scales
def with_block(folders, tmp_path, block) -> Path:
    """A copy of the Step-3.5 FP8 folder whose config.json declares `block` and whose scales are the grids of
    that block (one scale per expert and matrix when the block is wider than every tensor): only the block is
    wrong, every shape agrees with it."""
    folder = broken_copy(folders, tmp_path, lambda scales, weight_map: None)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / WEIGHTS)
    scales = load_file(folder / SCALES)
    for name in scales:
        shape = weights[name.removesuffix("_scale_inv")].shape
        scales[name] = torch.ones(*shape[:-2], 1, 1)
    save_file(scales, folder / SCALES)
    return folder


@pytest.mark.parametrize(
    "block",
    [[2**24, 2**24], [2**40, 128], [128, 0], [-128, 128], [128.0, 128], [True, 128], [128]],
    ids=["2^24", "2^40", "zero", "negative", "a_float", "a_bool", "one_side"],
)
def test_an_absurd_block_size_is_refused_by_the_header_check(folders, tmp_path, block):
    """Before: a block of 2^24 or 2^40 (the scales one per matrix, so every shape agreed) passed the header check,
    and reading expanded each scale over rows x block elements (8 GiB a matrix at 2^24, 4 TiB at 2^40) until the
    allocator failed with a traceback. The header check, which reads no weight, now names config.json's field."""
    folder = with_block(folders, tmp_path, block)
    with pytest.raises(
        CheckpointError, match=r"config.json: quantization_config.weight_block_size is .*from 1 to 65536"
    ):
        model_tensor_infos(folder)


def largest_allocation(work) -> int:
    """The most CPU memory any one torch operation of `work()` allocated (torch's profiler, no timing)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    return max(event.cpu_memory_usage for event in prof.events())


def test_scales_are_expanded_over_the_slice_only_whatever_the_block():
    """A block of 2^16 (the largest accepted) on a [64, 128] slice 30 rows into its tensor: the result is the
    slice times its one scale, and no operation allocates more than a few times the slice's float32 bytes.
    Before: each scale was repeated block-many times (64 x 65536 floats, 16 MiB for a 32 KiB slice); the same
    for the FP8 export's quantize, which padded the matrix to the block (64 MiB at 4096 x 4096)."""
    from step35.checkpoint.hf import fp8

    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    values, scales = fp8.quantize(weight, (64, 128))
    block = (2**16, 2**16)
    slice_bytes_f32 = weight.numel() * 4
    out = {}
    used = largest_allocation(lambda: out.update(read=fp8.dequantize(values, scales, (30, 0), block, torch.float32)))
    assert torch.equal(out["read"], values.float() * scales[0, 0])
    assert used <= 4 * slice_bytes_f32, used
    used = largest_allocation(lambda: out.update(wide=fp8.quantize(weight, (4096, 4096))))
    assert used <= 4 * slice_bytes_f32, used
    assert torch.equal(out["wide"][1], scales)
    assert torch.equal(out["wide"][0].view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf"), float("nan")], ids=["zero", "negative", "inf", "nan"])
def test_a_scale_that_is_not_finite_and_positive_is_refused_naming_it(folders, tmp_path, bad):
    """Before: a zero scale read its block as zeros and a negative one flipped its signs, silently (inf and nan
    were caught later as non-finite weights, without naming the scale)."""

    def spoil(scales, weight_map):
        scales[EXPERT + "_scale_inv"][3, 1, 0] = bad

    with pytest.raises(
        CheckpointError,
        match=rf"{SCALES}: tensor {EXPERT}_scale_inv holds 1 inverse scale\(s\) that are not finite and > 0 "
        rf"\(e.g. {bad}\) for {EXPERT}; the folder is damaged",
    ):
        load_pretrained(broken_copy(folders, tmp_path, spoil))


# ------------------------------------------------------------------ issue 42: modules_to_not_convert is data, not code
@pytest.mark.timeout(60)
def test_modules_to_not_convert_entries_are_matched_literally():
    """Before: each entry ran as a regular expression, so "(a+)+$" against a long name backtracked for ages (2^60
    steps here) and "(" raised a raw re.error in the FP8 export. Now both match as the literal text they are, and
    the names the releases use keep transformers' rule (a dotted prefix, or a suffix)."""
    from step35.checkpoint.hf.fp8 import NOT_CONVERTED, quantized_tensors, skipped

    long_name = "a" * 60 + "!.weight"
    assert not skipped(long_name, ["(a+)+$"])
    assert skipped("(a+)+$.weight", ["(a+)+$"])  # the literal text itself
    weight = torch.randn(8, 8)
    written = dict(
        quantized_tensors([("model.layers.0.self_attn.q_proj.weight", weight)], (4, 4), ["("], torch.bfloat16)
    )
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert skipped("model.layers.0.moe.gate.weight", NOT_CONVERTED)
    assert not skipped("model.layers.0.moe.gate_proj.weight", NOT_CONVERTED)
    assert skipped("vision_model.blocks.0.fc1.weight", ["vision_model"])
    assert not skipped("model.layers.0.moe.gate.weight", ["moe.gat."])  # "." is a dot, not any character


@pytest.mark.parametrize("names", ["lm_head", [None], [""], {"lm_head": 1}], ids=["a_string", "null", "empty", "a_map"])
def test_a_modules_to_not_convert_that_is_no_list_of_names_is_refused(folders, tmp_path, names):
    """Before: a string was iterated character by character (every module ending in "d" left unquantised) and a
    null entry raised a raw TypeError in the FP8 export."""
    from step35.checkpoint.hf.fp8 import source_entry

    folder = tmp_path / "names"
    shutil.copytree(folders["Step-3.5"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = names
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.modules_to_not_convert is .* list"):
        source_entry(folder)


# ------------------------------------------------------------------ issue 47: FP8 exports that transformers reads
def read_right_by_transformers(side: int, block: int) -> bool:
    """transformers 5.24's FP8 loader, simulated: it takes a tensor's block as side // grid, where the grid is the
    scales' count along that side (ceil(side / block) as step35 writes them), and refuses a side the grid does not
    divide; it then reads element i with scale i // its block, which is the writer's i // block only when the two
    blocks agree or there is one block."""
    grid = math.ceil(side / block)
    return side % grid == 0 and (grid == 1 or side // grid == block)


def test_the_export_block_is_the_largest_that_transformers_reads_right():
    """fp8.loadable_block against a search over every block up to the releases' 128: the tiny preset's quantised
    matrices (352 = 11 x 32 wide MLP) get [32, 32], the largest block every matrix is read right in; the release
    config's keep [128, 128]; and ragged_matrix names the first matrix a block cuts, with transformers' words."""
    from step35.checkpoint.hf import fp8

    for config, want in ((preset("tiny"), (32, 32)), (preset("flash-196b"), (128, 128))):
        shapes = fp8.quantised_shapes(fp8.matrix_shapes(config), fp8.NOT_CONVERTED)
        assert "model.layers.1.moe.gate.weight" not in shapes and "model.embed_tokens.weight" not in shapes
        best = tuple(
            max(b for b in range(1, 129) if all(read_right_by_transformers(s[axis], b) for s in shapes.values()))
            for axis in (-2, -1)
        )
        assert fp8.loadable_block((128, 128), shapes.values()) == best == want, config.hidden_size
        assert fp8.ragged_matrix(want, shapes) is None
    tiny = fp8.quantised_shapes(fp8.matrix_shapes(preset("tiny")), fp8.NOT_CONVERTED)
    assert fp8.ragged_matrix((128, 128), tiny) == (
        "model.layers.0.mlp.gate_proj.weight [352, 128]: `Weight shape (352, 128) not divisible by scale grid (3, 1)`"
    )


@pytest.mark.heavy  # the module's one training step (Lightning), an export, transformers' load
def test_the_tiny_fp8_export_loads_in_transformers(folders, one_step, tmp_path):
    """Before: `export --dtype float8_e4m3fn` of a tiny run with no FP8 start wrote 128 x 128 blocks, and
    transformers 5.24 refused the folder (`Weight shape (128, 352) not divisible by scale grid (1, 3)`). Now its
    blocks are [32, 32] and AutoModelForCausalLM loads it on the CPU (dequantising) with every weight equal to
    what step35 reads from the folder, and the same logits."""
    transformers = pytest.importorskip("transformers")
    from step35.checkpoint.training.export import export_checkpoint

    _, checkpoint = one_step
    fp8_source, expected = folders["Step-3.5"]
    plain = tmp_path / "bf16"  # the same start as a bf16 Step-3.5 folder: no FP8 block to keep
    plain.mkdir()
    save_file(
        {n: t if n.endswith("router_bias") else t.to(torch.bfloat16) for n, t in expected.items()}, plain / WEIGHTS
    )
    config = json.loads((fp8_source / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copyfile(fp8_source / name, plain / name)
    out = tmp_path / "fp8"
    export_checkpoint(checkpoint, out, dtype=torch.float8_e4m3fn, source=plain)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_pretrained(out, dtype=torch.float32).eval()
    theirs = hf.eval().state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(theirs[name], value), name
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=1e-5)
