"""The frozen base of a LoRA run, as its checkpoints record it instead of a second copy of it.

A LoRA run's training checkpoint holds the adapters, the full-trained targets, the buffers and the
optimizer state, not the frozen base weights (docs/lora.md). It records the base's identity,
`base_identity` (under `training.keys.LORA_BASE`; a PEFT export keeps it in its safetensors metadata,
hf/peft.py): the HF folder it was read from (`model.checkpoint`) with a fingerprint of that folder,
or, for a base drawn from the deterministic init, the init seed. Resume and `step35 export` /
`generate` read the base again and refuse a different one, naming the file that differs; a folder
that moved but is the same is accepted (the fingerprint decides, not the path).

The fingerprint of a folder:
- `index_sha256`, `sizes`: the sha256 of its safetensors index and each top-level .safetensors file's
  size. Two checkpoints of one architecture (every HF release of a model and its fine-tunes) have
  the same of both: these alone tell a layout apart, not weights.
- `crc32`: each file's crc32 as the folder's step35 manifest records it (a folder step35 wrote);
  the whole file's content, for free. HF releases carry no manifest.
- `sampled_crc32`: per file, the zlib CRC-32 of its safetensors header (tensor names, offsets,
  metadata) and of three SAMPLE_BYTES spans of its data (just after the header, the middle, the
  end; the whole data when it is shorter than the three). Bounded cost (the header and 3 MiB a
  shard, whatever the shard's size) and it tells apart any two trained checkpoints, whose weights
  differ everywhere; it can miss an edit confined to bytes it does not read, which is
  what the manifest's crc32 is for. `sample_scheme` names the sampling, so a later change of it
  is not mistaken for another base.

A folder record without a content fingerprint of this step35's `sample_scheme` cannot tell two
same-shaped bases apart (an HF release and its fine-tune): it is refused, not accepted on its layout.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import INDEX_FILE
from step35.checkpoint.integrity import manifest_info

SAMPLE_BYTES = 1 << 20  # each of the three spans read from a shard's data
SAMPLE_SCHEME = f"crc32(header + 3 x {SAMPLE_BYTES} bytes: start, middle, end of the data)"


def base_identity(folder: str | Path | None, init_seed: int) -> dict:
    """The identity of the base a LoRA run reads: its HF folder's fingerprint, or the init seed."""
    if folder is None:
        return {"folder": None, "init_seed": int(init_seed)}
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: the LoRA run's base (model.checkpoint) is not a folder")
    index = path / INDEX_FILE
    try:  # an HF folder written by step35 carries checksums of its files: the fingerprint takes them
        crc32 = {
            name: entry["crc32"]
            for name, entry in manifest_info(path)["files"].items()
            if name.endswith(".safetensors")
        }
    except CheckpointError:
        crc32 = {}
    files = sorted(path.glob("*.safetensors"))
    return {
        "folder": str(path),
        "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else None,
        "sizes": {p.name: p.stat().st_size for p in files},
        "crc32": crc32,
        "sample_scheme": SAMPLE_SCHEME,
        "sampled_crc32": {p.name: sampled_crc32(p) for p in files},
    }


def sampled_crc32(file: Path) -> str:
    """The CRC-32 (8 hex digits) of a safetensors file's header and of the spans `sample_spans` picks
    from its data: what tells two same-shaped files apart without reading them whole."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = _read_span(f, 0, 8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + header_len > size:
            raise CheckpointError(f"{file}: not a safetensors file (no header of its {size} bytes)")
        crc = zlib.crc32(head)
        crc = zlib.crc32(_read_span(f, 8, header_len), crc)
        for offset, length in sample_spans(8 + header_len, size):
            crc = zlib.crc32(_read_span(f, offset, length), crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def sample_spans(start: int, end: int, span: int = SAMPLE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of the data bytes [start, end) that the fingerprint reads: all of them when
    they fit in three spans, else one span at the start, one in the middle and one at the end."""
    if end - start <= 3 * span:
        return [(start, end - start)]
    return [(start, span), (start + (end - start - span) // 2, span), (end - span, span)]


def _read_span(f, offset: int, length: int) -> bytes:
    """`length` bytes of the open file `f` at `offset` (the one place the fingerprint reads data)."""
    f.seek(offset)
    return f.read(length)


def base_difference(saved: dict, current: dict) -> str | None:
    """One line naming how the base `current` differs from the recorded `saved`, or None if it is the same."""
    if (saved.get("folder") is None) != (current.get("folder") is None):
        return f"the run's base was {_described(saved)}, this one is {_described(current)} (model.checkpoint)"
    if saved.get("folder") is None:
        if saved.get("init_seed") != current.get("init_seed"):
            return (
                f"the run's base was drawn with model.init_seed={saved.get('init_seed')}, this run's is "
                f"{current.get('init_seed')}"
            )
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
    if _comparable_samples(saved, current):
        sampled, sampled_now = saved["sampled_crc32"], current["sampled_crc32"]
        for name in sorted(set(sampled) | set(sampled_now)):
            if sampled.get(name) != sampled_now.get(name):
                return (
                    f"{where}: {name} has other content (sampled crc32 {sampled_now.get(name, 'missing')}, "
                    f"was {sampled.get(name, 'absent')}); same layout, other weights"
                )
    return None


def _comparable_samples(saved: dict, current: dict) -> bool:
    return bool(saved.get("sampled_crc32")) and saved.get("sample_scheme") == current.get("sample_scheme")


def _described(identity: dict) -> str:
    folder = identity.get("folder")
    return f"the HF folder {folder}" if folder else f"the init (seed {identity.get('init_seed')})"


def check_base(saved: dict | None, current: dict, where: str | Path) -> None:
    """Refuse a base that is not the one checkpoint `where` recorded (CheckpointError naming what differs);
    or a folder record without a content fingerprint this step35 can compare."""
    if saved is None:
        return  # a checkpoint that holds the whole model: nothing to compare
    difference = base_difference(saved, current)
    if difference:
        raise CheckpointError(f"{where}: a LoRA checkpoint of another base: {difference}")
    if saved.get("folder") is not None and not _comparable_samples(saved, current):
        raise CheckpointError(
            f"{where}: its record of the base {saved['folder']} holds no content fingerprint of "
            f"sample_scheme {current.get('sample_scheme')!r} (it has "
            f"{saved.get('sample_scheme')!r}), so a base of the same shape with other weights "
            f"cannot be told apart; resume with the step35 that wrote it, or start a new run"
        )
