"""Which release of the family an HF folder holds, and where its language model's tensors are in it.

- Step-3.5-Flash (and -Base, and prunes with fewer experts): config.json is the language model's
  (`model_type: step3p5`); tensors `model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head`.
- Step-3.7-Flash (`model_type: step3p7`): the same language model, its fields under `text_config`
  (step35.config.language_model_fields), beside a vision encoder `vision_model.*` and its projector
  `vit_large_projector.*`. The BF16 and FP8 releases keep the language model's tensors under
  Step-3.5's names; the NVFP4 export puts them under `model.language_model.*` (and has no MTP layers).

Without `model.vision` the vision tensors are not part of the model step35 trains: never materialised on a
training device, named here so that the tensor check does not call them unexpected and an export can carry them.
A run with `model.vision` builds them (model/vision.py, under these same names); its export writes them back
(checkpoint/training/export.py), around a config.json that `release_config` reads when no start folder gives one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.config import WRAPPING_FAMILIES
from step35.presets import PRESETS

MODEL_PREFIX = "model."  # the language model's own prefix (embed_tokens, layers, norm)
NESTED_PREFIX = "model.language_model."  # Step-3.7's NVFP4 export
CARRIED_PREFIXES = ("vision_model.", "vit_large_projector.")  # Step-3.7's vision encoder and projector
VISION_MODULES = tuple(prefix.rstrip(".") for prefix in CARRIED_PREFIXES)  # their top modules


def is_vision_tensor(name: str) -> bool:
    """A tensor of Step-3.7's vision encoder or projector (the release's names, which are step35's too)."""
    return name.startswith(CARRIED_PREFIXES)


@dataclass(frozen=True)
class Layout:
    """A folder's release (`"Step-3.5"` or `"Step-3.7"`) and the prefix of its language model's `model.*`
    tensors in the files (`"model."` or `"model.language_model."`)."""

    release: str
    text_prefix: str = MODEL_PREFIX

    def carried(self, stored: str) -> bool:
        """A tensor of the folder that is not the language model's (Step-3.7's vision side)."""
        return self.release == "Step-3.7" and stored.startswith(CARRIED_PREFIXES)

    def model_name(self, stored: str) -> str:
        """The model's name of a language-model tensor stored as `stored`."""
        if stored.startswith(self.text_prefix):
            return MODEL_PREFIX + stored[len(self.text_prefix) :]
        return stored

    def stored_name(self, name: str) -> str:
        """Where the model's tensor `name` is stored in this release's files."""
        if name.startswith(MODEL_PREFIX):
            return self.text_prefix + name[len(MODEL_PREFIX) :]
        return name

    def describe(self) -> str:
        if self.release == "Step-3.5":
            return "a Step-3.5 folder"
        return (
            f"a Step-3.7 folder (language model under {self.text_prefix}*, its vision encoder and projector "
            "carried through, not trained)"
        )


def wrapping_config(folder: Path) -> dict | None:
    """`folder`/config.json when it wraps the language model's config (a model_type of
    step35.config.WRAPPING_FAMILIES: Step-3.7's), else None (Step-3.5's own, or no readable config.json)."""
    return _wrapping(Path(folder) / "config.json")


def release_config(name_or_path: object) -> dict | None:
    """The wrapping config.json (Step-3.7's) that a run's `model.config` or `model.checkpoint` names: a preset
    (`tiny-vl`), a file named config.json or a folder holding one; None for anything else (a Step-3.5 config, a
    file of another name: never read)."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path):
        return None
    if str(name_or_path) in PRESETS:
        raw = PRESETS[str(name_or_path)]()
        return raw if raw.get("model_type") in WRAPPING_FAMILIES else None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return wrapping_config(path)
    return _wrapping(path) if path.name == "config.json" else None


def _wrapping(config_json: Path) -> dict | None:
    try:
        raw = json.loads(config_json.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable: from_json says so
        return None
    return raw if isinstance(raw, dict) and raw.get("model_type") in WRAPPING_FAMILIES else None


def layout_of(folder: Path, stored_names) -> Layout:
    """The layout of `folder` from its config.json and the names of the tensors its files hold."""
    if wrapping_config(folder) is None:
        return Layout("Step-3.5")
    names = list(stored_names)
    nested = any(n.startswith(NESTED_PREFIX) for n in names)
    flat = any(n.startswith(MODEL_PREFIX) and not n.startswith(NESTED_PREFIX) for n in names)
    if nested and flat:
        example = next(n for n in names if n.startswith(MODEL_PREFIX) and not n.startswith(NESTED_PREFIX))
        raise CheckpointError(
            f"{folder}: a Step-3.7 folder with language-model tensors both under {NESTED_PREFIX}* and under "
            f"{MODEL_PREFIX}* (e.g. {example}); one release's files only"
        )
    return Layout("Step-3.7", NESTED_PREFIX if nested else MODEL_PREFIX)
