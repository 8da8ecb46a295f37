"""Step-3.7-Flash folders: a tiny Step-3.7 checkpoint folder (a vision encoder and projector saved by
transformers, around a language model in the flat BF16/FP8 layout or the nested NVFP4 one), and the
config.json keys that say how a config was saved rather than what the model is."""

from __future__ import annotations

from pathlib import Path

import torch

# ------------------------------------------------------------------------------ Step-3.7-Flash folders
# config.json keys of an HF config that say how it was saved, not what the model is
BOOKKEEPING = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path")
STEP37_VISION = ("vision_model.", "vit_large_projector.")  # the vision encoder's and projector's tensors


def vision_tensors_and_config(tmp: Path, text: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A tiny Step-3.7 vision encoder + projector saved by transformers: its tensors in the release's names
    (`vision_model.*`, `vit_large_projector.*`) and its config.json (without text_config)."""
    import json

    from safetensors.torch import load_file
    from transformers.models.step3p7.configuration_step3p7 import Step3p7Config, Step3p7VisionConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    from tests.hf_oracle import hf_config_from_dict

    vision = Step3p7VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14, mlp_ratio=2.0
    )
    torch.manual_seed(0)
    model = Step3p7ForConditionalGeneration(
        Step3p7Config(text_config=hf_config_from_dict(text).to_dict(), vision_config=vision.to_dict())
    )
    model.save_pretrained(tmp / "transformers_saved")
    tensors = {}
    for file in sorted((tmp / "transformers_saved").glob("*.safetensors")):
        tensors |= {n: t for n, t in load_file(file).items() if n.startswith(STEP37_VISION)}
    assert any(n.startswith("vit_large_projector.") for n in tensors) and len(tensors) > 10, sorted(tensors)
    config = json.loads((tmp / "transformers_saved" / "config.json").read_text())
    config.pop("text_config")
    return tensors, config


def step37_folder(
    tmp: Path, nested: bool, text: dict | None = None, language: dict | None = None
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Step-3.7 folder `tmp`/flat or `tmp`/nested: (its path, the language model's tensors in step35's
    names). `nested`: the NVFP4 export's layout (model.language_model.*, no MTP layers), else the BF16/FP8
    releases' (Step-3.5's names). `text` / `language`: the language model's config and tensors (default:
    tests/hf_oracle.py's tiny, random)."""
    import json

    from safetensors.torch import save_file

    from tests.hf_oracle import random_state_dict
    from tests.hf_oracle import tiny_config_dict as oracle_tiny

    text = {k: v for k, v in (text or oracle_tiny()).items() if k not in BOOKKEEPING}
    text["torch_dtype"] = "float32"
    language = language if language is not None else random_state_dict(text, seed=1)
    if nested:
        first_mtp = text["num_hidden_layers"]
        language = {
            n: t
            for n, t in language.items()
            if not n.startswith(tuple(f"model.layers.{first_mtp + j}." for j in range(3)))
        }
    vision, config = vision_tensors_and_config(tmp, text)
    config["text_config"] = {**text, "model_type": "step3p5"}
    folder = tmp / ("nested" if nested else "flat")
    folder.mkdir()
    stored = {(n.replace("model.", "model.language_model.", 1) if nested else n): t for n, t in language.items()}
    save_file({**stored, **vision}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, language
