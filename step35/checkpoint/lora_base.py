"""The frozen base of a LoRA run, as its checkpoints record it instead of a second copy of it.

A LoRA run's training checkpoint holds the adapters, the full-trained targets, the buffers and the
optimizer state, not the frozen base weights (docs/lora.md). It records the base's identity under
RECORD_KEY: the HF folder it was read from (`model.checkpoint`) with a fingerprint of that folder
(the sha256 of its safetensors index, each top-level .safetensors file's size, and the crc32 its
step35 manifest records when it has one), or, for a base drawn from the deterministic init, the
init seed. Resume and `step35 export` / `generate` read the base again and refuse a different one,
naming what differs; a folder that moved but is the same is accepted (the fingerprint decides).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import INDEX_FILE
from step35.checkpoint.integrity import manifest_info

RECORD_KEY = "step35_lora_base"


def base_identity(folder: str | Path | None, init_seed: int) -> dict:
    """The identity of the base a LoRA run reads: its HF folder's fingerprint, or the init seed."""
    if folder is None:
        return {"folder": None, "init_seed": int(init_seed)}
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: the LoRA run's base (model.checkpoint) is not a folder")
    index = path / INDEX_FILE
    try:  # an HF folder written by step35 carries checksums of its files: the fingerprint takes them
        crc32 = {name: entry["crc32"] for name, entry in manifest_info(path)["files"].items()
                 if name.endswith(".safetensors")}
    except CheckpointError:
        crc32 = {}
    return {"folder": str(path),
            "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else None,
            "sizes": {p.name: p.stat().st_size for p in sorted(path.glob("*.safetensors"))},
            "crc32": crc32}


def base_difference(saved: dict, current: dict) -> str | None:
    """One line naming how the base `current` differs from the recorded `saved`, or None if it is the same."""
    if (saved.get("folder") is None) != (current.get("folder") is None):
        return f"the run's base was {_described(saved)}, this one is {_described(current)} (model.checkpoint)"
    if saved.get("folder") is None:
        if saved.get("init_seed") != current.get("init_seed"):
            return f"the run's base was drawn with model.init_seed={saved.get('init_seed')}, this run's is " \
                   f"{current.get('init_seed')}"
        return None
    where = f"{current['folder']} (model.checkpoint) is not the base {saved['folder']} the run trained on"
    if saved.get("index_sha256") != current.get("index_sha256"):
        return f"{where}: its {INDEX_FILE} differs"
    sizes, now = saved.get("sizes") or {}, current.get("sizes") or {}
    for name in sorted(set(sizes) | set(now)):
        if sizes.get(name) != now.get(name):
            return f"{where}: {name} is {now.get(name, 'missing')} bytes, was {sizes.get(name, 'absent')}"
    crc, crc_now = saved.get("crc32") or {}, current.get("crc32") or {}
    for name in sorted(set(crc) & set(crc_now)):
        if crc[name] != crc_now[name]:
            return f"{where}: {name} has crc32 {crc_now[name]} in its manifest, was {crc[name]}"
    return None


def _described(identity: dict) -> str:
    folder = identity.get("folder")
    return f"the HF folder {folder}" if folder else f"the init (seed {identity.get('init_seed')})"


def check_base(saved: dict | None, current: dict, where: str | Path) -> None:
    """Refuse a base that is not the one checkpoint `where` recorded (CheckpointError naming what differs)."""
    if saved is None:
        return  # a checkpoint that holds the whole model: nothing to compare
    difference = base_difference(saved, current)
    if difference:
        raise CheckpointError(f"{where}: a LoRA checkpoint of another base: {difference}")
