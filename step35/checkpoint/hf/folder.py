"""HF checkpoint folders, the format: config.json + safetensors (one file, or shards +
model.safetensors.index.json). Knows files, names, shapes and dtypes; filling a model is
`materialize.py`, model <-> folder is `pretrained.py`.

Reading checks every tensor's name, shape and dtype from the safetensors headers before any weight
is read, and fails naming the tensor or file. The index may name only files inside the folder (a
hub cache snapshot: also its `blobs/`). `check_config_fits` compares a config's layer count, widths
and expert count with the folder's tensors before a model is built from it. `write_hf_folder` is
the one writer of such folders (save_pretrained and export): shards streamed to a temporary
sibling, index, config.json, a manifest of the weight files, then an atomic publish.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.fp8 import QUANTIZATION_KEY, BlockScales, pair_scales, without_quantization
from step35.checkpoint.hf.release import Layout, layout_of
from step35.checkpoint.integrity import MANIFEST, write_manifest
from step35.checkpoint.publish import check_not_interrupted, partial_path, publish
from step35.checkpoint.safe_load import leaves_folder, open_safetensors, unopenable
from step35.config import Step35Config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str  # its name in `file` (a Step-3.7 folder may store a model tensor under another prefix: release.py)
    scales: BlockScales | None = None  # an FP8-stored tensor's per-block inverse scales (fp8.py), read dequantised


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
        check_index_entries(weight_map, path, index)
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                missing = sorted(n for n, f in files.items() if f == file)
                raise CheckpointError(
                    f"{file}: shard file named in {INDEX_FILE} is missing ({len(missing)} tensors, e.g. {missing[0]})"
                )
        return files
    single = path / SINGLE_FILE
    if single.exists():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    check_not_interrupted(path)
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _hub_blobs(folder: Path) -> tuple[Path, ...]:
    """The blob store of a Hugging Face hub cache snapshot (`models--org--name/snapshots/<revision>/`),
    into which every file of the snapshot is a symlink (`../../blobs/<hash>`); () for other folders."""
    root = folder.resolve()
    blobs = root.parent.parent / "blobs"
    return (blobs.resolve(),) if root.parent.name == "snapshots" and blobs.is_dir() else ()


def own_files(folder: Path, names: Iterable[str]) -> tuple[dict[str, Path], dict[str, str]]:
    """The files named `names` at the top of `folder`, split by `leaves_folder`'s rule (a hub cache snapshot's
    `blobs/` counts as inside): ({name: file} of those that are the folder's own, {name: where it leads} of
    those that resolve outside it). A link out is never followed: what a start folder holds is copied into
    checkpoints and exports meant for upload, and a `LICENSE -> /proc/self/environ` would publish secrets."""
    blobs = _hub_blobs(folder)
    inside: dict[str, Path] = {}
    outside: dict[str, str] = {}
    for name in names:
        file = folder / name
        if not file.is_file():
            continue
        if leaves_folder(folder, name, blobs):
            outside[name] = os.path.realpath(file)
        else:
            inside[name] = file
    return inside, outside


def check_index_entries(weight_map: dict[str, str], folder: Path, index: Path) -> None:
    """Every file the index names lies inside `folder` (safe_load's rule for DCP `.metadata`: no
    absolute path, no `..`, no symlink out; a hub cache snapshot may point into its `blobs/`), checked
    before any file is opened: the index is data, and would otherwise open whatever path it names."""
    blobs = _hub_blobs(folder)
    for file in sorted(set(weight_map.values())):
        reason = leaves_folder(folder, file, blobs)
        if reason:
            name = next(n for n, f in weight_map.items() if f == file)
            raise CheckpointError(
                f"{index}: entry {name} names the file {file!r}, {reason}; refused (put the "
                f"shard in the folder and name it relative to it)"
            )


def read_tensor_infos(path: str | Path) -> dict[str, TensorInfo]:
    """Name -> (file, shape, dtype) for every tensor, read from the safetensors headers only."""
    locations = tensor_locations(path)
    infos: dict[str, TensorInfo] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in locations.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        try:
            with open_safetensors(file) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(
                            f"{file}: the index places tensor {name} in this file, but it is not there"
                        )
                    piece = f.get_slice(name)
                    infos[name] = TensorInfo(
                        file, tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()], name
                    )
                stray = sorted(present - set(names))  # in the file but not in the index: never silently dropped
                if stray:
                    raise CheckpointError(
                        f"{file}: holds {len(stray)} tensor(s) that {INDEX_FILE} does not list, e.g. {stray[:3]}"
                    )
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(unopenable(file, e)) from None
    return infos


def model_tensor_infos(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo], Layout]:
    """`read_tensor_infos` of the folder's language model, keyed by the model's names (each info's `key` is
    where it is stored); apart, the tensors the folder carries (Step-3.7's vision side, by stored name); and the
    folder's layout (release.py). An FP8 folder's scale tensors are not listed: each FP8 tensor's info carries
    them (fp8.pair_scales)."""
    infos = pair_scales(path, read_tensor_infos(path))
    layout = layout_of(Path(path), infos)
    model, carried = {}, {}
    for stored, info in infos.items():
        if layout.carried(stored):
            carried[stored] = info
        else:
            model[layout.model_name(stored)] = info
    return model, carried, layout


def check_tensors(
    infos: dict[str, TensorInfo],
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ignored: set[str] = frozenset(),
) -> None:
    """Every expected tensor present with its shape and dtype, nothing unexpected (but `ignored`). An FP8-stored
    tensor (its info carries scales) is dequantised into the model's dtype as it is read: its stored dtype is
    not compared."""
    missing = sorted(set(expected) - set(infos))
    unexpected = sorted(set(infos) - set(expected) - set(ignored))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) the model does not, e.g. "
            f"{unexpected[:3]} in {infos[unexpected[0]].file.name}"
        )
    for name, (shape, dtype) in expected.items():
        info = infos[name]
        if info.shape != tuple(shape):
            raise CheckpointError(
                f"{name} in {info.file.name}: shape {list(info.shape)}, the config needs {list(shape)}"
            )
        if info.scales is None and info.dtype != dtype:
            raise CheckpointError(
                f"{name} in {info.file.name}: dtype {info.dtype}, expected {dtype} "
                f"(config.json torch_dtype; router_bias is always float32)"
            )


_LAYER_ID = re.compile(r"model\.layers\.(\d+)\.")
_MTP_MARK = "eh_proj.weight"  # only MTP layers have it (docs/architecture.md §3)


def _layer_summary(layer_ids: set[int], mtp_ids: set[int]) -> str:
    """'5 main and 1 MTP layers (model.layers.0-5)': what a folder holds, for an error message."""
    if not layer_ids:
        return "no model.layers.* tensors"
    ids = sorted(layer_ids)
    spans, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return f"{len(layer_ids) - len(mtp_ids)} main and {len(mtp_ids)} MTP layers (model.layers.{','.join(spans)})"


def _header_shape(file: Path, name: str) -> tuple[int, ...]:  # `name` as stored in `file`
    try:
        with open_safetensors(file) as f:
            return tuple(f.get_slice(name).get_shape())
    except CheckpointError:
        raise
    except Exception as e:  # a bad file: the full header check names it the same way
        raise CheckpointError(unopenable(file, e)) from None


def check_config_fits(config: Step35Config, path: str | Path, num_mtp_layers: int | None = None) -> None:
    """Refuse a config (config.json + config_overrides) that cannot fit the HF folder `path`, before a
    model is built from it: a typo such as num_hidden_layers 100000 would otherwise build for minutes
    and gigabytes before the tensor check names a missing tensor. Reads the index (or the single
    file's header) and the headers of the files holding the embedding and one router; compares the
    layer ids the model needs (main layers and the `num_mtp_layers` MTP layers built, None: all),
    hidden_size and vocab_size (the embedding), moe_num_experts (the first MoE layer's router), each
    named with the config value and what the folder holds. Refuses only what the full tensor check
    would refuse; everything else is left to it (a folder without weights included)."""
    path = Path(path)
    if not ((path / INDEX_FILE).exists() or (path / SINGLE_FILE).exists()):
        return  # nothing to compare with: whoever reads the weights says so
    stored = tensor_locations(path)
    layout = layout_of(path, stored)
    locations = {layout.model_name(n): f for n, f in stored.items() if not layout.carried(n)}
    layer_ids = {int(m.group(1)) for name in locations if (m := _LAYER_ID.match(name))}
    mtp_ids = {int(m.group(1)) for name in locations if name.endswith(_MTP_MARK) and (m := _LAYER_ID.match(name))}
    holds = _layer_summary(layer_ids, mtp_ids)
    main = config.num_hidden_layers
    missing_main = sorted(set(range(main)) - layer_ids)
    if missing_main:
        raise CheckpointError(
            f"config num_hidden_layers={main} needs model.layers.0-{main - 1}, but {path} holds "
            f"{holds}: model.layers.{missing_main[0]} is not there; set num_hidden_layers to "
            "the folder's (config.json or config_overrides)"
        )
    built = config.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
    missing_mtp = sorted(set(range(main, main + built)) - layer_ids)
    if missing_mtp:
        raise CheckpointError(
            f"config num_nextn_predict_layers={config.num_nextn_predict_layers} ({built} MTP "
            f"layers built) needs model.layers.{main}-{main + built - 1}, but {path} holds {holds}; "
            "set num_nextn_predict_layers to the folder's, or build fewer (model.num_mtp_layers)"
        )
    embed = "model.embed_tokens.weight"
    if embed in locations:
        shape = _header_shape(locations[embed], layout.stored_name(embed))
        for axis, field in ((0, "vocab_size"), (1, "hidden_size")):
            value = getattr(config, field)
            if len(shape) == 2 and shape[axis] != value:
                raise CheckpointError(
                    f"config {field}={value}, but {path} holds {embed} of shape {list(shape)} "
                    f"({field} {shape[axis]}); set {field} to the folder's"
                )
    router = next(
        (
            f"model.layers.{i}.moe.gate.weight"
            for i in sorted(config.moe_layer_ids)
            if f"model.layers.{i}.moe.gate.weight" in locations
        ),
        None,
    )
    if router is not None:
        shape = _header_shape(locations[router], layout.stored_name(router))
        if shape and shape[0] != config.moe_num_experts:
            raise CheckpointError(
                f"config moe_num_experts={config.moe_num_experts}, but {path} holds {router} of "
                f"shape {list(shape)} ({shape[0]} experts); set moe_num_experts to the folder's"
            )


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
    return int(float(m.group(1)) * base**power)


def default_file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the process's umask (0644 under the usual 022)."""
    mask = os.umask(0)  # the umask can only be read by setting it; put back at once
    os.umask(mask)
    return 0o666 & ~mask


def write_hf_folder(
    path: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: Step35Config | Mapping,
    max_shard_size: int | str = "5GB",
    copy_files: Mapping[str, Path | bytes] | None = None,
    quantization: Mapping | None = None,
) -> Path:
    """Write an HF folder at `path` from (name, tensor) pairs and `config` (a Step35Config, or a release's
    config.json as a dict; its quantization_config replaced by `quantization`, the entry describing FP8
    `tensors` (fp8.quantized_tensors), at the top level where loaders read it, or left out), streamed: a shard
    is written as soon as it is full, so the whole state never has to be in memory. Shards
    model-0000k-of-0000n, the index, config.json, `copy_files` (relative name -> a file copied byte for
    byte, or the bytes: tokenizer, remote code, ...), the manifest of weights and index, then one atomic
    publish; a failure removes the temporary folder and leaves any previous `path` untouched."""
    from safetensors.torch import save_file

    path = Path(path)
    limit = parse_size(max_shard_size)
    tmp = partial_path(path)
    tmp.mkdir(parents=True)
    try:
        shard: dict[str, torch.Tensor] = {}
        files: list[list[str]] = []
        size = total = 0

        def flush() -> None:
            nonlocal shard, size
            if shard:
                files.append(list(shard))
                shard_path = tmp / f"shard-{len(files):05d}.safetensors"
                save_file(shard, shard_path, metadata={"format": "pt"})
                shard_path.chmod(default_file_mode())  # safetensors creates its files 0600
                shard, size = {}, 0

        for name, tensor in tensors:
            tensor = tensor.detach().to("cpu").contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > limit:
                flush()
            shard[name] = tensor
            size += nbytes
            total += nbytes
        flush()
        if not files:
            raise CheckpointError(f"{path}: no tensors to write")
        weight_map, names = {}, [INDEX_FILE]
        for k, tensor_names in enumerate(files, start=1):  # final HF names, now that the count is known
            final = f"model-{k:05d}-of-{len(files):05d}.safetensors"
            (tmp / f"shard-{k:05d}.safetensors").rename(tmp / final)
            weight_map.update({n: final for n in tensor_names})
            names.append(final)
        (tmp / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        # a Step35Config, or a release's own config.json (Step-3.7's wraps the language model's config); its
        # quantization_config only when it describes `tensors`: an FP8 start folder's would describe weights not there
        raw, _ = without_quantization(config.to_dict() if isinstance(config, Step35Config) else dict(config))
        if quantization is not None:
            raw[QUANTIZATION_KEY] = dict(quantization)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for name, source in (copy_files or {}).items():
            target = tmp / name
            if target.exists() or name == MANIFEST or Path(name).is_absolute() or ".." in Path(name).parts:
                raise CheckpointError(
                    f"{path}: cannot write extra file {name!r} (it would replace a file of the "
                    "checkpoint, or leave the folder)"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(source, bytes):
                target.write_bytes(source)
            else:
                shutil.copyfile(source, target)
        # config.json and tokenizer files stay editable (they are validated when read); weights are not
        write_manifest(tmp, {"kind": "hf", "total_size": total}, names=names)
        publish(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
