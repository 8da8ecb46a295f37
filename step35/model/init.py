"""Deterministic from-scratch initialisation that gives the same full model on any world size.

Every tensor is defined as a concatenation of row blocks (along dim 0), block b drawn from a
generator seeded by (seed, tensor name, b). A rank that owns rows r0..r1 of a tensor (an FSDP
shard, or the experts of one expert-parallel rank) draws only the blocks covering them, so
sharded and unsharded initialisation agree bit for bit and no rank draws a whole 3 GB tensor.
"""

from __future__ import annotations

import hashlib
import math

import torch

from step35.config import Step35Config

INITIALIZER_RANGE = 0.02
_BLOCK_ELEMENTS = 1 << 20  # about one million values per generator call


VISION_PREFIXES = ("vision_model.", "vit_large_projector.")  # Step-3.7's encoder and projector (model/vision.py)


def init_kind(name: str) -> str:
    """'zeros' | 'norm' | 'ones' | 'normal' | 'normal_out' (output projections, scaled by depth) | 'lora_A'
    (LoRA down-projections: uniform in +-1/sqrt(in), kaiming-uniform-like; LoRA's B starts at zero).
    The vision side: LayerNorm weights and LayerScale gammas 1 (plain pre-LN blocks at the start), biases 0."""
    if name.endswith("lora_A"):
        return "lora_A"
    if name.endswith(("router_bias", "lora_B")):
        return "zeros"
    if name.startswith(VISION_PREFIXES):
        if name.endswith("bias"):  # also attn.in_proj_bias
            return "zeros"
        return "ones" if name.endswith(("ln_pre.weight", "ln_1.weight", "ln_2.weight", "gamma")) else "normal"
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "normal_out"
    return "normal"


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_tensor(
    name: str,
    shape: tuple[int, ...],
    config: Step35Config,
    seed: int,
    index: tuple[slice, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The initial value of tensor `name` (full shape `shape`), restricted to `index` (slices per dim)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out_shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
    kind = init_kind(name)
    if kind == "zeros" or (kind == "norm" and config.zero_centered):
        return torch.zeros(out_shape, dtype=dtype)
    if kind in ("norm", "ones"):
        return torch.ones(out_shape, dtype=dtype)
    std = INITIALIZER_RANGE
    if kind == "normal_out":
        std = INITIALIZER_RANGE / math.sqrt(2 * config.num_hidden_layers)
    rows = range(*index[0].indices(shape[0]))
    if len(rows) == 0:
        return torch.zeros(out_shape, dtype=dtype)
    if rows.step != 1:
        raise ValueError(f"{name}: only contiguous row ranges can be initialised, got {index[0]}")
    row_numel = math.prod(shape[1:])
    block_rows = max(1, _BLOCK_ELEMENTS // max(row_numel, 1))
    pieces = []
    for block in range(rows.start // block_rows, (rows.stop - 1) // block_rows + 1):
        b0 = block * block_rows
        n = min(block_rows, shape[0] - b0)
        g = torch.Generator().manual_seed(_block_seed(seed, name, block))
        if kind == "lora_A":  # A [r, in] or stacked [E, in, r]: the input width is dim 1 either way
            values = (torch.rand((n, *shape[1:]), generator=g, dtype=torch.float32) * 2 - 1) / math.sqrt(shape[1])
        else:
            values = torch.randn((n, *shape[1:]), generator=g, dtype=torch.float32)
        lo, hi = max(rows.start, b0) - b0, min(rows.stop, b0 + n) - b0
        pieces.append(values[(slice(lo, hi),) + index[1:]])
    return (torch.cat(pieces) * (1.0 if kind == "lora_A" else std)).to(dtype)
