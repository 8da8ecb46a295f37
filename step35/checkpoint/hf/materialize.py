"""Fill a model built on the meta device: only the tensor pieces this rank holds, from an HF
checkpoint (reading only those slices from the safetensors files) or from the deterministic init.

Works the same for plain tensors (one process) and DTensors (FSDP2 shards, expert-parallel
shards): each local piece is located in the full tensor by its global offset. Before a weight is
read the headers are checked against the model (names, shapes, dtypes), then the files against
the folder's manifest when it has one (checksums split over the ranks); every piece read is
refused if it holds NaN/Inf. Errors are raised on all ranks alike, naming the file or tensor.
An FP8 folder's tensors are dequantised slice by slice as they are read (fp8.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from step35.checkpoint.errors import raise_together
from step35.checkpoint.hf.folder import TensorInfo, check_tensors, model_tensor_infos
from step35.checkpoint.hf.fp8 import read_dequantized
from step35.checkpoint.hf.release import CARRIED_PREFIXES
from step35.checkpoint.integrity import verify_on_all_ranks
from step35.checkpoint.safe_load import check_finite, open_safetensors
from step35.config import Step35Config
from step35.model.init import init_tensor
from step35.model.lora import is_adapter

Index = tuple[slice, ...]


def local_pieces(model: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...], Index]]:
    """name -> (the local tensor to fill, the full (global) shape, where the local tensor sits in it)."""
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
        if hasattr(data, "device_mesh"):  # a DTensor
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape = tuple(data.shape)
            local_shape, offset = compute_local_shape_and_global_offset(shape, data.device_mesh, data.placements)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
            out[name] = (data.to_local(), shape, index)
        else:
            out[name] = (data, tuple(data.shape), tuple(slice(0, n) for n in data.shape))
    return out


def materialize(
    model: nn.Module, device: torch.device | str, checkpoint: str | Path | None = None, seed: int = 0
) -> int:
    """Allocate the model's local storage on `device` and fill it. Returns the bytes read from disk."""
    if checkpoint is not None:

        def check_headers() -> dict[str, TensorInfo]:
            infos, carried, _ = model_tensor_infos(checkpoint)  # a Step-3.7 folder's vision tensors, apart
            expected = expected_tensors(model)
            if any(name.startswith(CARRIED_PREFIXES) for name in expected):  # a vision-language model loads them
                infos = {**infos, **carried}
            check_tensors(infos, expected, ignored_mtp_tensors(model.config, model.num_mtp_layers, infos))
            return infos

        infos = raise_together(check_headers)
        verify_on_all_ranks(checkpoint, missing_ok=True)  # HF folders from elsewhere carry no manifest
    model.to_empty(device=device)
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name not in persistent:  # running statistics (router token counts) start at zero
            buffer.zero_()
    if checkpoint is None:
        fill_from_init(model, seed)
        return 0
    fill_from_init(model, seed, only=is_adapter)  # LoRA adapters are not in an HF checkpoint: they start fresh
    return raise_together(lambda: fill_from_checkpoint(model, infos))


@torch.no_grad()
def fill_from_init(model: nn.Module, seed: int, only=None) -> None:
    """Fill every local piece (or those whose name passes `only`) from the deterministic init."""
    for name, (local, shape, index) in local_pieces(model).items():
        if only is None or only(name):
            local.copy_(init_tensor(name, shape, model.config, seed, index, dtype=torch.float32))


@torch.no_grad()
def fill_from_checkpoint(model: nn.Module, infos: dict[str, TensorInfo]) -> int:
    """Copy each local piece from its slice of the checkpoint; never reads a whole tensor it does not own (an FP8
    tensor: its slice and the rows and columns of its scale grid that cover it, fp8.py)."""
    pieces = local_pieces(model)
    by_file: dict[Path, list[str]] = {}
    for name in checkpoint_state(model):
        by_file.setdefault(infos[name].file, []).append(name)
    nbytes = 0
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                local, _, index = pieces[name]
                if local.numel() == 0:
                    continue
                if infos[name].scales is not None:  # FP8: this slice and the scale blocks it touches, dequantised
                    value, read = read_dequantized(f, infos[name], index, local.dtype)
                else:
                    value = f.get_slice(infos[name].key)[index]
                    read = value.numel() * value.element_size()
                check_finite([(name, value)], file)
                nbytes += read
                local.copy_(value)
    return nbytes


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of `model` holds (a tied lm_head is stored once, as the embedding)."""
    state = {n: t for n, t in model.state_dict(keep_vars=True).items() if not is_adapter(n)}  # LoRA: base only
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    dtypes = model.checkpoint_dtypes()
    return {name: (tuple(t.shape), dtypes[name]) for name, t in checkpoint_state(model).items()}


def ignored_mtp_tensors(config: Step35Config, num_mtp_layers: int, names) -> set[str]:
    """Checkpoint tensors of MTP layers the model was built without."""
    first_unbuilt = config.num_hidden_layers + num_mtp_layers
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    return {
        n
        for n in names
        if (m := pattern.match(n)) and int(m.group(1)) >= first_unbuilt and int(m.group(1)) < config.num_total_layers
    }
