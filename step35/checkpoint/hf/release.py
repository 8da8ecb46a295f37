"""Which release of the family an HF folder holds, and where its language model's tensors are in it.

- Step-3.5-Flash (and -Base, and prunes with fewer experts): config.json is the language model's
  (`model_type: step3p5`); tensors `model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head`.
- Step-3.7-Flash (`model_type: step3p7`): the same language model, its fields under `text_config`
  (step35.config.language_model_fields), beside a vision encoder `vision_model.*` and its projector
  `vit_large_projector.*`. The BF16 and FP8 releases keep the language model's tensors under
  Step-3.5's names; the NVFP4 export puts them under `model.language_model.*` (and has no MTP layers).

The vision tensors are not part of the model step35 trains: never materialised on a training device,
named here so that the tensor check does not call them unexpected and an export can carry them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.config import WRAPPING_FAMILIES

MODEL_PREFIX = "model."  # the language model's own prefix (embed_tokens, layers, norm)
NESTED_PREFIX = "model.language_model."  # Step-3.7's NVFP4 export
CARRIED_PREFIXES = ("vision_model.", "vit_large_projector.")  # Step-3.7's vision encoder and projector


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
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
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
