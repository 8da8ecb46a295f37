"""Export a training checkpoint back to an HF folder (config.json + safetensors shards + index),
tensor by tensor: a sharded (DCP) checkpoint of the 196B model never has to fit in memory.

    step35 export --checkpoint runs/x/checkpoints/last.ckpt --out hf_out/ [--dtype bfloat16]

Accepts Lightning's sharded checkpoint folder (Step35Strategy, DCP) and its single-file `.ckpt`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path
from typing import Iterator

import torch

from step35.checkpoint.hf import INDEX_FILE, CheckpointError, _replace_folder, parse_size
from step35.config import Step35Config, load_config

_PREFIX = "model."  # the LightningModule's attribute holding Step35ForCausalLM
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def _lightning_meta(checkpoint: Path) -> dict:
    if checkpoint.is_dir():
        meta = checkpoint / "meta.pt"
        if not meta.exists():
            raise CheckpointError(f"{checkpoint}: no meta.pt; not a Lightning sharded checkpoint")
        return torch.load(meta, map_location="cpu", weights_only=False)  # checkpoints are trusted input
    return torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)


def model_config_of(meta: dict) -> Step35Config:
    """The model config saved with the checkpoint, else the one its hyper-parameters name."""
    if "step35_config" in meta:
        return Step35Config.from_dict(meta["step35_config"])
    hp = meta.get("hyper_parameters") or {}
    source = hp.get("checkpoint") or hp.get("config")
    if not source:
        raise CheckpointError("the checkpoint records no model config; pass --config")
    return load_config(source)


def _dcp_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(folder)
    entries = reader.read_metadata().state_dict_metadata
    for key, info in entries.items():
        if not key.startswith("state_dict." + _PREFIX) or not isinstance(info, TensorStorageMetadata):
            continue
        tensor = torch.empty(info.size, dtype=info.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: tensor}, storage_reader=FileSystemReader(folder), no_dist=True)
        yield key[len("state_dict." + _PREFIX):], tensor


def _file_tensors(meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for key, tensor in meta["state_dict"].items():
        if key.startswith(_PREFIX):
            yield key[len(_PREFIX):], tensor


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
              max_shard_size: int | str = "5GB", config: Step35Config | None = None,
              tokenizer_from: str | Path | None = None) -> Path:
    """Write `out` as an HF checkpoint folder; router_bias stays fp32, other weights take `dtype`
    (default: the config's torch_dtype)."""
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    meta = _lightning_meta(checkpoint)
    config = config or model_config_of(meta)
    dtype = dtype or getattr(torch, config.torch_dtype)
    tensors = _dcp_tensors(checkpoint) if checkpoint.is_dir() else _file_tensors(meta)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    limit = parse_size(max_shard_size)
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            files.append(list(shard))
            save_file(shard, tmp / f"shard-{len(files):05d}.safetensors", metadata={"format": "pt"})
            shard, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.to(torch.float32 if name.endswith("router_bias") else dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > limit:
            flush()
        shard[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    if not files:
        raise CheckpointError(f"{checkpoint}: holds no model weights (keys starting with '{_PREFIX}')")
    weight_map = {}
    for k, names in enumerate(files, start=1):  # final HF names, now that the shard count is known
        final = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        (tmp / f"shard-{k:05d}.safetensors").rename(tmp / final)
        weight_map.update({n: final for n in names})
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    exported = Step35Config.from_dict(config.to_dict())
    exported.torch_dtype = str(dtype).removeprefix("torch.")
    exported.save(tmp / "config.json")
    source = tokenizer_from or (meta.get("hyper_parameters") or {}).get("checkpoint")
    if source and Path(source).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).exists():
                shutil.copy(Path(source) / name, tmp / name)
    _replace_folder(tmp, out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="step35 export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Lightning checkpoint: DCP folder or .ckpt file")
    p.add_argument("--out", required=True, help="HF folder to write (replaced atomically)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"])
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--config", default=None, help="model config (preset or config.json) if the checkpoint lacks one")
    p.add_argument("--tokenizer-from", default=None, help="folder whose tokenizer files to copy")
    args = p.parse_args(argv)
    out = export_hf(args.checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None,
                    args.max_shard_size, load_config(args.config) if args.config else None, args.tokenizer_from)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
