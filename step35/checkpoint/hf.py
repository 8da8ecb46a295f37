"""HF checkpoint folders: config.json + safetensors (one file, or shards + model.safetensors.index.json).

Loading checks every tensor's name, shape and dtype against the model before any weight is read,
and fails naming the tensor or file: nothing is skipped or left randomly initialised. Reading
goes through `safe_open(...).get_slice`, so a caller that owns part of a tensor (an FSDP shard,
the experts of one EP rank) reads only those bytes. Saving writes into a sibling temporary folder
and swaps it in at the end, so a killed save never destroys the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.config import ConfigError, Step35Config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_locations(path: str | Path) -> dict[str, Path]:
    """Which file holds each tensor, from the index (or the single file). Checks the files exist."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({type(e).__name__}: {e})") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                missing = sorted(n for n, f in files.items() if f == file)
                raise CheckpointError(f"{file}: shard file named in {INDEX_FILE} is missing "
                                      f"({len(missing)} tensors, e.g. {missing[0]})")
        return files
    single = path / SINGLE_FILE
    if single.exists():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    _check_interrupted_save(path)
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _check_interrupted_save(path: Path) -> None:
    if path.exists():
        return
    leftovers = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.exists() else []
    if leftovers:  # a save was killed between moving the old folder aside and moving the new one in
        raise CheckpointError(f"{path}: not there, but the checkpoint that a save interrupted was moving aside "
                              f"is intact at {leftovers[-1]}; rename it back to {path}")


def read_tensor_infos(path: str | Path) -> dict[str, TensorInfo]:
    """Name -> (file, shape, dtype) for every tensor, read from the safetensors headers only."""
    from safetensors import safe_open

    locations = tensor_locations(path)
    infos: dict[str, TensorInfo] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in locations.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{file}: the index places tensor {name} in this file, but it is not there")
                    piece = f.get_slice(name)
                    infos[name] = TensorInfo(file, tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
                stray = sorted(present - set(names))  # in the file but not in the index: never silently dropped
                if stray:
                    raise CheckpointError(f"{file}: holds {len(stray)} tensor(s) that {INDEX_FILE} does not list, "
                                          f"e.g. {stray[:3]}")
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    return infos


def check_tensors(infos: dict[str, TensorInfo], expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  ignored: set[str] = frozenset()) -> None:
    """Every expected tensor present with its shape and dtype, nothing unexpected (but `ignored`)."""
    missing = sorted(set(expected) - set(infos))
    unexpected = sorted(set(infos) - set(expected) - set(ignored))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} tensor(s) the model does not, e.g. "
                              f"{unexpected[:3]} in {infos[unexpected[0]].file.name}")
    for name, (shape, dtype) in expected.items():
        info = infos[name]
        if info.shape != tuple(shape):
            raise CheckpointError(f"{name} in {info.file.name}: shape {list(info.shape)}, the config needs {list(shape)}")
        if info.dtype != dtype:
            raise CheckpointError(f"{name} in {info.file.name}: dtype {info.dtype}, expected {dtype} "
                                  f"(config.json torch_dtype; router_bias is always float32)")


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    dtypes = model.checkpoint_dtypes()
    return {name: (tuple(t.shape), dtypes[name]) for name, t in _checkpoint_state(model).items()}


def ignored_mtp_tensors(config: Step35Config, num_mtp_layers: int, names) -> set[str]:
    """Checkpoint tensors of MTP layers the model was built without."""
    first_unbuilt = config.num_hidden_layers + num_mtp_layers
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    return {n for n in names if (m := pattern.match(n)) and int(m.group(1)) >= first_unbuilt
            and int(m.group(1)) < config.num_total_layers}


def load_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    num_mtp_layers: int | None = None):
    """Build `cls(config)` on meta, check the checkpoint against it, then materialise and fill it."""
    from step35.checkpoint.materialize import materialize

    path = Path(path)
    _check_interrupted_save(path)
    try:
        config = Step35Config.from_json(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    with torch.device("meta"):
        model = cls(config, num_mtp_layers)
    model.to(dtype or getattr(torch, config.torch_dtype))  # router_bias stays fp32 (MoE._apply)
    materialize(model, device, checkpoint=path)
    return model


def _checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict(keep_vars=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as model.embed_tokens.weight
    return state


def parse_size(size: int | str) -> int:
    """'5GB' -> 5 * 10**9, '2GiB' -> 2 * 2**30, 1000 -> 1000 (the HF convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", size, re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size: cannot read {size!r} (examples: 5GB, 500MiB, 1000000)")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * base ** power)


def save_pretrained(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "5GB") -> None:
    """Write config.json, model-0000k-of-0000n.safetensors shards and the index, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    limit = parse_size(max_shard_size)
    state = {name: t.detach().to("cpu").contiguous() for name, t in _checkpoint_state(model).items()}
    weight_dtypes = {t.dtype for n, t in state.items() if not n.endswith("router_bias")}
    if len(weight_dtypes) != 1:
        raise CheckpointError(f"model holds weights of several dtypes {sorted(map(str, weight_dtypes))}; "
                              "cast it to one dtype before saving")
    config = Step35Config.from_dict(model.config.to_dict())
    config.torch_dtype = str(weight_dtypes.pop()).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, tmp / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save(tmp / "config.json")
    _replace_folder(tmp, path)


def _replace_folder(new: Path, target: Path) -> None:
    # Swap: the old folder survives until the new one is complete, then goes.
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
