"""FP8 start folders (Step-3.5-Flash-FP8, Step-3.7-Flash-FP8): weights stored block-quantised, read
dequantised.

Such a folder's config.json carries `quantization_config` (`quant_method: fp8`, `weight_block_size: [bo, bi]`,
`modules_to_not_convert`): at the top level of the file, also for Step-3.7, whose language model's fields sit
under `text_config` (transformers and vLLM read it there; one found under `text_config` is read too). A
quantised tensor `<name>` [..., out, in] is stored as float8_e4m3fn beside `<name>_scale_inv`, float32, of
shape [..., ceil(out / bo), ceil(in / bi)]: one inverse scale per block, the blocks at the bottom and right
edges cut short when a width is not a multiple of the block. The stored value of an element is
`fp8.float() * scale_inv` of its block. Stacked experts [E, out, in] have scales [E, ceil(out / bo),
ceil(in / bi)], one grid per expert. What `modules_to_not_convert` names (embedding, LM head, router, norms)
is stored in the config's dtype without scales; the dtype of each stored tensor decides, not that list.

Pairing (`pair_scales`, called when a folder's tensors are listed) attaches each FP8 tensor's scales to its
entry and takes the scale tensors out of the listing, refusing, with the file and tensor named, an FP8
tensor without its scales, scales of another shape or dtype, and scales of a tensor that is not FP8.
Reading (`read_dequantized`) takes the slice of the FP8 tensor a rank owns and the rows and columns of the
scale grid covering it, and multiplies one matrix at a time in float32 before casting to the model's dtype:
a rank never reads more than its slice and the blocks it cuts into, and no full-precision copy of a file
(or of a whole stacked tensor) is made; the per-element scales are gathered for the slice only, so a block far
wider than the tensor costs nothing more (a side above MAX_BLOCK is refused as a damaged config.json). Scales
that are zero, negative or not finite are refused, naming the scale tensor and its file.

Writing (`quantized_tensors`, for `step35 export --dtype float8_e4m3fn`): the releases' layout again. Each
matrix and stacked expert tensor is block-quantised (`quantize`) but those whose module the
`modules_to_not_convert` patterns name (`NOT_CONVERTED` unless the start folder's own list is kept), matched
as transformers' FP8 loader matches them (`skipped`); the rest (norms, the router bias, the modules not
converted) keep their high-precision dtype. The block is the start folder's (its carried FP8 tensors are in it),
else the releases' 128 x 128 or the largest block below it that cuts every quantised matrix whole
(`loadable_block`): transformers' FP8 loader reads whole blocks only (see TRANSFORMERS_RAGGED below). An export in
another dtype writes a config.json without `quantization_config` (`without_quantization`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.safe_load import open_safetensors
from step35.config import WRAPPING_FAMILIES

QUANTIZATION_KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"  # `<name>_scale_inv`: `...weight_scale_inv` for a `...weight`
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # the releases store e4m3fn; e5m2 dequantises the same way
SCALE_DTYPES = (torch.float32, torch.bfloat16)  # the releases store float32
DEFAULT_BLOCK = (128, 128)  # the releases' scale block, for an FP8 export of a run that did not start from one
# The modules an FP8 export leaves in bf16, as config.json's modules_to_not_convert: the embedding, the LM heads
# (the model's and each MTP layer's) and the router, whose small errors move every token or every routing choice.
# Norms and the router bias are vectors, never quantised.
NOT_CONVERTED = ("embed_tokens", "lm_head", "moe.gate", "shared_head.output")
# The largest weight_block_size side read: the releases use 128, and a block wider than a tensor's dimension is one
# block along it (ceil division). Far larger values are a damaged or hostile config.json, refused by name.
MAX_BLOCK = 2**16


@dataclass(frozen=True)
class BlockScales:
    """Where the inverse scales of one FP8-stored tensor are (`key` in `file`), the block each covers
    (rows, columns of the tensor's last two dimensions), and their stored dtype."""

    file: Path
    key: str
    block: tuple[int, int]
    dtype: torch.dtype = torch.float32

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """The bytes of the scales of a tensor of `shape`, as stored."""
        return math.prod(scale_shape(shape, self.block)) * self.dtype.itemsize


def _quantization_entry(raw: dict) -> object:
    """config.json's quantization_config: at the top level (where transformers and vLLM read it, Step-3.7's
    too), else under a wrapping release's language-model key (Step-3.7's text_config)."""
    if QUANTIZATION_KEY in raw:
        return raw[QUANTIZATION_KEY]
    family = WRAPPING_FAMILIES.get(raw.get("model_type"))
    inner = raw.get(family[1]) if family else None
    return inner.get(QUANTIZATION_KEY) if isinstance(inner, dict) else None


def block_size(folder: str | Path) -> tuple[int, int] | None:
    """The FP8 block (rows, columns) `folder`'s config.json declares; None when it declares no quantization
    (or has no readable config.json: whoever reads the config says so). A quantization step35 does not read
    (another quant_method, FP8 without blocks) is refused naming the file and the field."""
    config = Path(folder) / "config.json"
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable: from_json says so
        return None
    entry = _quantization_entry(raw) if isinstance(raw, dict) else None
    if entry is None:
        return None
    method = entry.get("quant_method") if isinstance(entry, dict) else None
    if method != "fp8":
        raise CheckpointError(
            f"{config}: {QUANTIZATION_KEY} with quant_method {method!r}; step35 reads FP8 block-quantised folders "
            "(quant_method fp8, weight_block_size [rows, cols]) and unquantised ones only"
        )
    block = entry.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= MAX_BLOCK for b in block)):
        raise CheckpointError(
            f"{config}: {QUANTIZATION_KEY}.weight_block_size is {_shown(block)}, expected [rows, cols] of one scale "
            f"block, integers from 1 to {MAX_BLOCK} (the releases: [128, 128]); FP8 with one scale per tensor is not read"
        )
    return block[0], block[1]


def _shown(value) -> str:
    """repr of a value read from config.json, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the inverse scales of a tensor of `shape`: one per block of its last two dimensions,
    the blocks at the edges cut short (ceil division)."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def pair_scales(folder: str | Path, infos: dict) -> dict:
    """`infos` (stored name -> folder.TensorInfo) with every FP8 tensor's `scales` set and the scale tensors
    taken out; unchanged for a folder without FP8 tensors or scales. Refuses, naming the file and tensor: an
    FP8 tensor when config.json declares no FP8 blocks, one without its `<name>_scale_inv`, scales of another
    shape than the block grid or of a dtype other than float32/bfloat16, and scales of a tensor that is not
    stored in FP8 (or not there)."""
    fp8 = [name for name, info in infos.items() if info.dtype in FP8_DTYPES]
    scales = {name for name in infos if name.endswith(SCALE_SUFFIX)}
    if not fp8 and not scales:
        return infos
    block = block_size(folder)
    config = Path(folder) / "config.json"
    out = {name: info for name, info in infos.items() if name not in scales}
    for name in fp8:
        info = infos[name]
        if block is None:
            raise CheckpointError(
                f"{info.file}: tensor {name} is stored as {info.dtype}, but {config} declares no "
                f"{QUANTIZATION_KEY} (quant_method fp8, weight_block_size) to say how to scale it"
            )
        if len(info.shape) < 2:
            raise CheckpointError(
                f"{info.file}: tensor {name} of shape {list(info.shape)} is stored as {info.dtype}; only matrices "
                "(and stacked matrices) carry block scales"
            )
        scale_name = name + SCALE_SUFFIX
        scale = infos.get(scale_name)
        if scale is None:
            raise CheckpointError(
                f"{info.file}: tensor {name} is stored as {info.dtype} without its inverse scales {scale_name} "
                "(not in the folder); it cannot be dequantised"
            )
        expected = scale_shape(info.shape, block)
        if scale.shape != expected:
            raise CheckpointError(
                f"{scale.file}: tensor {scale_name} has shape {list(scale.shape)}, but {name} of shape "
                f"{list(info.shape)} in blocks of {list(block)} ({config}) needs {list(expected)}"
            )
        if scale.dtype not in SCALE_DTYPES:
            raise CheckpointError(
                f"{scale.file}: tensor {scale_name} is {scale.dtype}; inverse scales are read as float32 or bfloat16"
            )
        out[name] = dataclasses.replace(info, scales=BlockScales(scale.file, scale.key, block, scale.dtype))
    for scale_name in sorted(scales):
        base = scale_name[: -len(SCALE_SUFFIX)]
        if base not in fp8:
            what = f"stored as {infos[base].dtype}, not FP8" if base in infos else "not in the folder"
            raise CheckpointError(
                f"{infos[scale_name].file}: holds inverse scales {scale_name}, but {base} is {what}; "
                "scales belong to FP8 tensors only"
            )
    return out


def read_dequantized(handle, info, index: tuple[slice, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The slice `index` of the FP8 tensor `info` (open in `handle`, a safetensors file), dequantised into
    `dtype`, and the bytes read: the FP8 slice and the rows and columns of the scale grid covering it."""

    block = info.scales.block
    *leading, rows, cols = index
    grid = (*leading, _blocks(rows, block[0]), _blocks(cols, block[1]))
    weights = handle.get_slice(info.key)[index]
    if info.scales.file == info.file:
        scales = handle.get_slice(info.scales.key)[grid]
    else:  # a release may put the scales in another shard than the weight
        with open_safetensors(info.scales.file) as other:
            scales = other.get_slice(info.scales.key)[grid]
    check_scales(scales, info)
    nbytes = weights.numel() * weights.element_size() + scales.numel() * scales.element_size()
    return dequantize(weights, scales, (rows.start % block[0], cols.start % block[1]), block, dtype), nbytes


def check_scales(scales: torch.Tensor, info) -> None:
    """Refuse inverse scales of `info` (those a slice read) that are not finite and > 0: a zero scale reads its
    block as zeros and a negative one flips its signs, silently, where a release's scales are all positive."""
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        value = scales[bad].flatten()[0].item()
        raise CheckpointError(
            f"{info.scales.file}: tensor {info.scales.key} holds {int(bad.sum())} inverse scale(s) that are not "
            f"finite and > 0 (e.g. {value}) for {info.key}; the folder is damaged: download or quantise it again"
        )


def _blocks(span: slice, size: int) -> slice:
    """The blocks of `size` that the elements `span` of one dimension touch."""
    return slice(span.start // size, -(-span.stop // size))


def dequantize(
    weights: torch.Tensor,
    scales: torch.Tensor,
    offset: tuple[int, int],
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """FP8 `weights` [..., R, C] times their inverse scales, in `dtype`. `scales` [..., r, c] are the blocks the
    slice touches, the first starting `offset` (rows, cols) elements before the slice. Computed in float32 one
    matrix at a time (a stacked expert tensor: one expert), so the temporaries stay one matrix big."""
    *leading, num_rows, num_cols = weights.shape
    out = torch.empty(weights.shape, dtype=dtype)
    flat_weights = weights.reshape(-1, num_rows, num_cols)
    flat_scales = scales.reshape(-1, *scales.shape[-2:])
    flat_out = out.view(-1, num_rows, num_cols)
    for i in range(flat_weights.shape[0]):
        per_element = _per_element(flat_scales[i].to(torch.float32), offset, (num_rows, num_cols), block)
        flat_out[i] = flat_weights[i].to(torch.float32) * per_element
    return out


def _per_element(scales: torch.Tensor, offset: tuple[int, int], shape: tuple[int, int], block: tuple[int, int]):
    """The scale of each element of a [rows, cols] slice starting `offset` elements into the first block of
    `scales` [r, c]: gathered by block index, so it is as big as the slice whatever the block (repeating each
    scale block-many times would be rows x block, gigabytes for a block far larger than the tensor)."""
    rows = torch.div(torch.arange(offset[0], offset[0] + shape[0]), block[0], rounding_mode="floor")
    cols = torch.div(torch.arange(offset[1], offset[1] + shape[1]), block[1], rounding_mode="floor")
    return scales[rows][:, cols]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise `weight` [..., R, C] the releases' way: per block, scale_inv = amax(|block|) / 448 in
    float32 (an all-zero block gets 1), values = clamp(w / scale_inv, -448, 448) as float8_e4m3fn. One matrix
    (one expert) at a time in float32."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    *leading, num_rows, num_cols = weight.shape
    grid = scale_shape(tuple(weight.shape), block)
    # a block wider than the matrix is one block along that side: the same grid and scales, without padding to it
    block = (min(block[0], num_rows), min(block[1], num_cols))
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid, dtype=torch.float32)
    flat_w = weight.reshape(-1, num_rows, num_cols)
    flat_v = values.view(-1, num_rows, num_cols)
    flat_s = scales.view(-1, *grid[-2:])
    pad_r, pad_c = grid[-2] * block[0] - num_rows, grid[-1] * block[1] - num_cols
    for i in range(flat_w.shape[0]):
        w = flat_w[i].to(torch.float32)
        padded = torch.nn.functional.pad(w.abs(), (0, pad_c, 0, pad_r))
        amax = padded.view(grid[-2], block[0], grid[-1], block[1]).amax(dim=(1, 3))
        scale = amax / fp8_max
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        flat_s[i] = scale
        per_element = _per_element(scale, (0, 0), (num_rows, num_cols), block)
        flat_v[i] = (w / per_element).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return values, scales


def read_whole(info, dtype: torch.dtype) -> torch.Tensor:
    """The whole FP8 tensor `info`, dequantised into `dtype` (an export's carried tensors, a LoRA run's base)."""

    with open_safetensors(info.file) as handle:
        value, _ = read_dequantized(handle, info, tuple(slice(0, n) for n in info.shape), dtype)
    return value


def without_quantization(config: dict) -> tuple[dict, bool]:
    """`config` (a config.json's content) without `quantization_config`, at the top level or under a wrapping
    release's language-model key, and whether there was one: an export in another dtype than FP8 writes no FP8
    weights, so the key would describe weights the folder does not hold."""
    out = dict(config)
    removed = out.pop(QUANTIZATION_KEY, None) is not None
    family = WRAPPING_FAMILIES.get(out.get("model_type"))
    if family and isinstance(out.get(family[1]), dict) and QUANTIZATION_KEY in out[family[1]]:
        out[family[1]] = {k: v for k, v in out[family[1]].items() if k != QUANTIZATION_KEY}
        removed = True
    return out, removed


def skipped(name: str, patterns: Iterable[str]) -> bool:
    """Whether the tensor `name` belongs to a module `patterns` (modules_to_not_convert) names, matched as
    transformers' FP8 loader matches them, so that what step35 quantises is what a loader expects quantised: a
    pattern from the start of the module's name up to a boundary of its dotted parts ("vision_model" takes
    "vision_model.blocks.0.fc1", "moe.gate" not "moe.gate_proj"), or a suffix of it. Matched literally, as the
    PEFT reader matches its keys (peft.py): transformers runs them as regular expressions, but the list comes
    from a start folder's config.json, and a pattern such as "(a+)+$" would take forever on a long name
    ("." matches only "."; no module name needs more)."""
    module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    return any(module == p or module.startswith(p + ".") or module.endswith(p) for p in patterns)


def export_entry(started: dict | None, carried: dict, shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """config.json's quantization_config for weights written by `quantized_tensors`: the start folder's own entry
    (`started`, its other fields, block and list kept) or the releases' fields with NOT_CONVERTED and the block
    DEFAULT_BLOCK, or, given the `shapes` of the matrices written (`matrix_shapes`), the largest block up to it
    that cuts none of the quantised ones raggedly (`loadable_block`). The `carried` tensors stay as stored: the
    top module of a matrix among them stored unquantised (no scales) and not yet named is added to the list, so
    that loaders expect no scales for it."""
    entry = dict(started) if started else {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    not_converted = list(entry.get("modules_to_not_convert") or NOT_CONVERTED)
    plain = {n.split(".", 1)[0] for n, info in carried.items() if not info.scales and len(info.shape) > 1}
    not_converted += sorted(p for p in plain if not skipped(p, not_converted))
    block = tuple(entry.get("weight_block_size") or DEFAULT_BLOCK)
    if not started and shapes is not None:
        block = loadable_block(DEFAULT_BLOCK, quantised_shapes(shapes, not_converted).values())
    entry.update(quant_method="fp8", weight_block_size=list(block), modules_to_not_convert=not_converted)
    return entry


# ------------------------------------------------------------------ blocks that transformers can read
# transformers 5.24's FP8 loader (integrations/finegrained_fp8.py, Fp8Dequantize) does not read the block from
# config.json: it derives it from each tensor's shape and scale grid (rows // grid rows, cols // grid cols), and
# refuses a shape the grid does not divide ("Weight shape (128, 352) not divisible by scale grid (1, 3)"), or, where
# it happens to divide (300 rows in blocks of 128: a grid of 3, read as blocks of 100), reads the scales against the
# wrong rows. A grid is read right when each side of the matrix is a multiple of the block's side, or fits in one
# block. The releases' matrices are multiples of 128; the tiny preset's 352-wide MLP is not.
TRANSFORMERS_RAGGED = "Weight shape ({}, {}) not divisible by scale grid ({}, {})"


def matrix_shapes(config, stored_name: Callable[[str], str] | None = None) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape of every matrix and stacked matrix a model of `config` (a Step35Config) writes, read
    off the model built on the meta device (no memory): what an FP8 export may quantise. `stored_name` maps
    step35's names to the release's layout (Step-3.7's)."""
    from step35.model import build_model

    name_of = stored_name or (lambda name: name)
    return {name_of(n): tuple(t.shape) for n, t in build_model(config).state_dict().items() if t.dim() >= 2}


def quantised_shapes(shapes: dict[str, tuple[int, ...]], not_converted: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The entries of `shapes` that `quantized_tensors` quantises (what `not_converted` does not name)."""
    patterns = tuple(not_converted)
    return {name: shape for name, shape in shapes.items() if len(shape) >= 2 and not skipped(name, patterns)}


def cuts_whole(side: int, block: int) -> bool:
    """Whether blocks of `block` cut a dimension of `side` elements so that transformers reads them right."""
    return side <= block or side % block == 0


def loadable_block(block: tuple[int, int], shapes: Iterable[tuple[int, ...]]) -> tuple[int, int]:
    """The largest block, each side at most `block`'s, that cuts every matrix of `shapes` whole (`cuts_whole`):
    `block` itself for the releases' shapes, [32, 32] for the tiny preset's (352 = 11 x 32). Side 1 always does."""
    shapes = list(shapes)
    return tuple(
        next(b for b in range(wanted, 0, -1) if all(cuts_whole(shape[axis - 2], b) for shape in shapes))
        for axis, wanted in enumerate(block)
    )


def ragged_matrix(block: tuple[int, int], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The first matrix of `shapes` that `block` cuts raggedly, with transformers' refusal of it; None if none."""
    for name, shape in shapes.items():
        rows, cols = shape[-2:]
        if not (cuts_whole(rows, block[0]) and cuts_whole(cols, block[1])):
            grid = scale_shape(shape, block)[-2:]
            return f"{name} {list(shape)}: `{TRANSFORMERS_RAGGED.format(rows, cols, *grid)}`"
    return None


def block_notes(started: dict | None, entry: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What an export in `entry`'s block means to transformers' FP8 loader: why a block other than the releases'
    was chosen (no FP8 start folder), or that a start folder's block, kept, cuts a matrix raggedly."""
    block = tuple(entry["weight_block_size"])
    quantised = quantised_shapes(shapes, entry["modules_to_not_convert"])
    if started:
        ragged = ragged_matrix(block, quantised)
        if ragged is None:
            return []
        return [
            f"the start folder's block {list(block)}, kept (its FP8 tensors are in it), cuts {ragged}: transformers "
            "5.24's FP8 loader cannot read this folder (step35 reads it)"
        ]
    if block == DEFAULT_BLOCK:
        return []
    ragged = ragged_matrix(DEFAULT_BLOCK, quantised)
    return [
        f"blocks of {list(block)}, not the releases' {list(DEFAULT_BLOCK)}: those would cut {ragged} in transformers "
        f"5.24's FP8 loader, which reads whole blocks only; {list(block)} is the largest block that cuts every "
        "quantised matrix whole"
    ]


def source_entry(folder: str | Path | None) -> dict | None:
    """The quantization_config of `folder`'s config.json (block_size checks it, and modules_to_not_convert is
    refused unless a list of names), None for an unquantised one."""
    if folder is None or block_size(folder) is None:
        return None
    config = Path(folder) / "config.json"
    entry = dict(_quantization_entry(json.loads(config.read_text())))
    names = entry.get("modules_to_not_convert")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) and n for n in names)):
        raise CheckpointError(
            f"{config}: {QUANTIZATION_KEY}.modules_to_not_convert is {_shown(names)}, expected a list of module "
            'names (e.g. ["lm_head", "model.embed_tokens"]) or null'
        )
    return entry


def quantized_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int], not_converted: Iterable[str], high: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` written the FP8 releases' way: each matrix or stacked matrix not `skipped` by `not_converted` as
    float8_e4m3fn `name` and float32 `name_scale_inv` (`quantize`, from the tensor's own precision); the router
    bias in float32; everything else in `high`. One tensor at a time."""
    patterns = tuple(not_converted)
    for name, tensor in tensors:
        if name.endswith("router_bias"):
            yield name, tensor.to(torch.float32)
        elif tensor.dim() >= 2 and tensor.is_floating_point() and not skipped(name, patterns):
            values, scales = quantize(tensor, block)
            yield name, values
            yield name + SCALE_SUFFIX, scales
        else:
            yield name, tensor.to(high)
