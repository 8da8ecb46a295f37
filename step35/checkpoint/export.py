"""Export a training checkpoint back to an HF folder (config.json + safetensors shards + index),
tensor by tensor: a sharded (DCP) checkpoint of the 196B model never has to fit in memory.

    step35 export --checkpoint runs/x/checkpoints/last.ckpt --out hf_out/ [--dtype bfloat16]

Accepts Lightning's sharded checkpoint folder (Step35Strategy, DCP) and its single-file `.ckpt`.
The input is verified against its manifest, read without unpickling code (`safe_load`), and every
tensor is checked for NaN/Inf before it is written; the output is published atomically with its
own manifest (`hf.write_hf_folder`).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Iterator

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import write_hf_folder
from step35.checkpoint.integrity import verify_for_load
from step35.checkpoint.safe_load import check_finite, safe_reader
from step35.checkpoint.trainer_io import check_loadable, dcp_load, load_file, load_meta
from step35.config import Step35Config, load_config

_PREFIX = "model."  # the LightningModule's attribute holding Step35ForCausalLM
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def _lightning_meta(checkpoint: Path) -> dict:
    """Verified against the manifest; the file's dict (a .ckpt, NaN-checked) or the folder's meta.pt."""
    check_loadable(checkpoint)
    if checkpoint.is_dir():
        verify_for_load(checkpoint)
        return load_meta(checkpoint)
    return load_file(checkpoint)


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = safe_reader(folder).read_metadata().state_dict_metadata
    for key, info in entries.items():
        if not key.startswith("state_dict." + _PREFIX) or not isinstance(info, TensorStorageMetadata):
            continue
        tensor = torch.empty(info.size, dtype=info.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_load({key: tensor}, folder)
        check_finite([(key, tensor)], folder)
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
    checkpoint, out = Path(checkpoint), Path(out)
    meta = _lightning_meta(checkpoint)
    config = config or model_config_of(meta)
    dtype = dtype or getattr(torch, config.torch_dtype)
    tensors = _dcp_tensors(checkpoint) if checkpoint.is_dir() else _file_tensors(meta)
    exported = Step35Config.from_dict(config.to_dict())
    exported.torch_dtype = str(dtype).removeprefix("torch.")
    source = tokenizer_from or (meta.get("hyper_parameters") or {}).get("checkpoint")
    copies = [Path(source) / n for n in TOKENIZER_FILES if (Path(source) / n).exists()] \
        if source and Path(source).is_dir() else []

    def cast() -> Iterator[tuple[str, torch.Tensor]]:
        count = 0
        for name, tensor in tensors:
            count += 1
            yield name, tensor.to(torch.float32 if name.endswith("router_bias") else dtype)
        if count == 0:
            raise CheckpointError(f"{checkpoint}: holds no model weights (keys starting with '{_PREFIX}')")

    write_hf_folder(out, cast(), exported, max_shard_size, copy_files=copies)
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
    try:
        out = export_hf(args.checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None,
                        args.max_shard_size, load_config(args.config) if args.config else None, args.tokenizer_from)
    except CheckpointError as e:
        raise SystemExit(f"step35 export: {e}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
