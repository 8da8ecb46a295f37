"""Make a tiny start folder in a release's layout, to try `--model.checkpoint` with a Step-3.7 or an FP8 folder
without downloading one (hundreds of GB). Needs only step35's own install:

    python scripts/make_tiny_folder.py --kind step37 --out tiny-step37          # Step-3.7-Flash (bf16)
    python scripts/make_tiny_folder.py --kind fp8 --out tiny-fp8                # Step-3.5-Flash-FP8
    python scripts/make_tiny_folder.py --kind step37-fp8 --out tiny-step37-fp8  # Step-3.7-Flash-FP8
    step35 fit --config configs/tiny-sft.yaml --model.checkpoint tiny-step37 --run_dir runs/from-step37

The language model is the `tiny` preset (`--preset`) with step35's initialisation (`--seed`), its weights in
bf16 (the router bias fp32), with the built-in tokenizer and its chat template, config.json's special ids set to
the tokenizer's (as `step35 export` sets them):

- `step37`: the Step-3.7-Flash BF16 release's layout: config.json wraps the language model's fields in
  `text_config` (model_type step3p7, Step3p7ForConditionalGeneration) beside a `vision_config`, and the one
  safetensors file holds a vision encoder (`vision_model.*`, 1 block of width 32 on 56-pixel images in 14-pixel
  patches) and its projector (`vit_large_projector.weight`) beside the language model in Step-3.5's names. The
  vision tensors are named and shaped as transformers 5.24's Step3p7ForConditionalGeneration saves them
  (tests/test_tiny_folders.py compares them), random: step35 trains the language model and carries them.
- `fp8`: the Step-3.5-Flash-FP8 layout (step35/checkpoint/hf/fp8.py): every matrix and stacked expert tensor in
  float8_e4m3fn beside its float32 `<name>_scale_inv`, the embedding, LM heads, router and norms in bf16, and
  config.json's `quantization_config`. The block is the largest up to the releases' 128 x 128 that cuts every
  quantised matrix whole ([32, 32] for the tiny preset), so transformers' FP8 loader reads it too.
- `step37-fp8`: both: the Step-3.7 layout with the language model in FP8 and the vision side in bf16 (named in
  `modules_to_not_convert`).

The folder is written as step35 writes its exports (hf/folder.py: shards, index, manifest, one atomic publish);
an existing `--out` is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

KINDS = ("step37", "fp8", "step37-fp8")
# The vision encoder of the tiny Step-3.7 folder (transformers' Step3p7VisionConfig fields).
VISION = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
VISION_MLP_RATIO = 2  # the encoder's MLP width over its hidden size
IMAGE_TOKEN_ID = 151679  # transformers' default Step3p7Config.image_token_id


def language_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """The preset's model, initialised as `step35 fit` initialises a model from scratch, in the HF names: bf16,
    the router bias fp32."""
    from step35.checkpoint.hf.materialize import checkpoint_state
    from step35.model import build_model

    model = build_model(config, device="cpu")
    model.init_weights(seed)
    return {
        name: tensor.detach().clone() if name.endswith("router_bias") else tensor.detach().to(torch.bfloat16)
        for name, tensor in checkpoint_state(model).items()
    }


def vision_tensors(text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """The vision encoder and projector in the Step-3.7 release's names and shapes (bf16): a patch convolution,
    positions, one pre-norm block with layer scales, two 3x3 downsamplers (width x2 each) and the projector into
    the language model's width. Random (normal, std 0.02), norms 1 and 0, layer scales 0.1."""
    width, layers = VISION["hidden_size"], VISION["num_hidden_layers"]
    patch, positions = VISION["patch_size"], (VISION["image_size"] // VISION["patch_size"]) ** 2
    mlp = width * VISION_MLP_RATIO
    shapes = {
        "vision_model.conv1.weight": (width, 3, patch, patch),
        "vision_model.positional_embedding": (positions, width),
        "vision_model.ln_pre.weight": (width,),
        "vision_model.ln_pre.bias": (width,),
        "vision_model.vit_downsampler1.weight": (2 * width, width, 3, 3),
        "vision_model.vit_downsampler1.bias": (2 * width,),
        "vision_model.vit_downsampler2.weight": (4 * width, 2 * width, 3, 3),
        "vision_model.vit_downsampler2.bias": (4 * width,),
        "vit_large_projector.weight": (text_hidden, 4 * width),
    }
    for i in range(layers):
        block = f"vision_model.transformer.resblocks.{i}."
        shapes |= {
            block + "attn.in_proj_weight": (3 * width, width),
            block + "attn.in_proj_bias": (3 * width,),
            block + "attn.out_proj.weight": (width, width),
            block + "attn.out_proj.bias": (width,),
            block + "mlp.c_fc.weight": (mlp, width),
            block + "mlp.c_fc.bias": (mlp,),
            block + "mlp.c_proj.weight": (width, mlp),
            block + "mlp.c_proj.bias": (width,),
        }
        shapes |= {block + f"ln_{j}.{p}": (width,) for j in (1, 2) for p in ("weight", "bias")}
        shapes |= {block + f"ls_{j}.gamma": (width,) for j in (1, 2)}
    generator = torch.Generator().manual_seed(seed)
    return {name: _vision_init(name, shape, generator) for name, shape in sorted(shapes.items())}


def _vision_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if ".ln_" in name:
        return (torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)).to(torch.bfloat16)
    if name.endswith("gamma"):
        return torch.full(shape, 0.1, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def vision_config() -> dict:
    """config.json's `vision_config` of the tiny encoder, as transformers writes it."""
    return {
        **VISION,
        "intermediate_size": VISION["hidden_size"] * VISION_MLP_RATIO,
        "mlp_ratio": float(VISION_MLP_RATIO),
        "model_type": "step3p5_vision",
        "num_channels": 3,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-05,
        "layer_scale_init_value": 0.1,
        "attention_dropout": 0.0,
        "max_position_embeddings": 2704,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    }


def tokenizer_files(config) -> dict[str, Path]:
    """The built-in tokenizer's files (trained at first use, cached), and config's special ids set to agree."""
    from step35.checkpoint.training.export import align_special_ids
    from step35.checkpoint.training.run_tokenizer import special_ids
    from step35.data import builtin_tokenizer_dir

    folder = builtin_tokenizer_dir()
    files = {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}
    align_special_ids(config, special_ids({name: path.read_bytes() for name, path in files.items()}, folder), None)
    return files


def make_folder(kind: str, out: str | Path, preset_name: str = "tiny", seed: int = 1) -> Path:
    """Write the tiny folder `kind` (KINDS) at `out`; returns its path."""
    from step35.checkpoint.hf import fp8
    from step35.checkpoint.hf.folder import write_hf_folder
    from step35.config import preset

    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r}: one of {', '.join(KINDS)}")
    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out} exists: give a new folder")
    config = preset(preset_name)
    config.torch_dtype = "bfloat16"
    files = tokenizer_files(config)
    tensors: dict[str, torch.Tensor] = language_tensors(config, seed)
    wrapped = kind.startswith("step37")
    if wrapped:
        tensors |= vision_tensors(config.hidden_size, seed)
    entry = None
    stream = tensors.items()
    if kind.endswith("fp8"):
        vision = ["vision_model", "vit_large_projector"] if wrapped else []
        not_converted = [*fp8.NOT_CONVERTED, *vision]
        shapes = fp8.quantised_shapes(fp8.matrix_shapes(config), not_converted)
        block = fp8.loadable_block(fp8.DEFAULT_BLOCK, shapes.values())
        entry = fp8.export_entry(None, {}) | {"weight_block_size": list(block), "modules_to_not_convert": not_converted}
        stream = fp8.quantized_tensors(tensors.items(), block, not_converted, torch.bfloat16)
    written = config
    if wrapped:
        written = {
            "architectures": ["Step3p7ForConditionalGeneration"],
            "model_type": "step3p7",
            "torch_dtype": "bfloat16",
            "image_token_id": IMAGE_TOKEN_ID,
            "projector_bias": False,
            "vision_config": vision_config(),
            "text_config": config.to_dict(),
        }
    return write_hf_folder(out, stream, written, copy_files=files, quantization=entry)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", required=True, choices=KINDS, help="the release layout")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist)")
    parser.add_argument("--preset", default="tiny", help="the language model's preset (step35.presets)")
    parser.add_argument("--seed", type=int, default=1, help="the initialisation's seed")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        folder = make_folder(args.kind, args.out, args.preset, args.seed)
    except ValueError as error:
        raise SystemExit(f"make_tiny_folder: {error}") from None
    print(folder)


if __name__ == "__main__":
    main()
