"""Shared helpers of the step35 tests: the one tiny config dict every test starts from, the one hand
computation of RoPE inverse frequencies with llama3 scaling (docs/architecture.md §2.4-2.5), which the
model tests and the reference forward share, and readers of what runs leave (wandb records). Starting step35
(a subprocess, torchrun, a launcher, the CLI in this process) is tests/runner.py's. Other reference math stays
in the test that needs it, written from docs/architecture.md."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from step35.config import PRESETS, Step35Config
from step35.model import Step35ForCausalLM



def tiny_config_dict(**overrides) -> dict:
    """The `tiny` preset's config dict (released layout), with top-level keys replaced."""
    raw = PRESETS["tiny"]()
    raw.update(copy.deepcopy(overrides))
    return raw


def tiny_config(**overrides) -> Step35Config:
    return Step35Config.from_dict(tiny_config_dict(**overrides))


def flash_config_dict() -> dict:
    return PRESETS["flash-196b"]()


def hand_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """Inverse frequency of each rotary pair, theta^(-2j/r) (docs/architecture.md §2.4 step 3), then
    llama3 scaling (§2.5) when `scaling` is given; one pair at a time in Python floats (float64)."""
    inv = [theta ** (-2.0 * j / rotary_dim) for j in range(rotary_dim // 2)]
    if scaling is None:
        return inv
    factor, l_orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    out = []
    for f in inv:
        wavelength = 2 * math.pi / f
        if wavelength < l_orig / high:  # high frequencies: unchanged
            out.append(f)
        elif wavelength > l_orig / low:  # low frequencies: divided by the factor
            out.append(f / factor)
        else:  # in between: interpolated
            s = (l_orig / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return out


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Fill every state-dict tensor with random values so that each feature bites: norm weights
    away from 0 (so 1 + w matters), router bias non-zero (so it changes the chosen experts),
    projections large enough that activations are O(1)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight"):
            values = torch.rand(t.shape, generator=g) - 0.5  # w in [-0.5, 0.5): scale 1 + w
        elif name.endswith("router_bias"):
            values = torch.randn(t.shape, generator=g) * 0.2
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(t.shape, generator=g)
        else:
            values = torch.randn(t.shape, generator=g) * std
        t.copy_(values.to(t.dtype))
    return model


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, num_mtp_layers: int | None = None,
               **overrides) -> Step35ForCausalLM:
    """A randomised tiny Step-3.5 model (5 main layers + 1 MTP layer, every feature switched on)."""
    torch.manual_seed(seed)
    model = Step35ForCausalLM(tiny_config(**overrides), num_mtp_layers=num_mtp_layers)
    randomize_(model, seed)
    return model.to(dtype)


def state_numel(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict().values())


def wandb_records(run_root, kind: str) -> list:
    """Records of one type ("history", "config", ...) of an offline wandb run, read from its .wandb
    file with wandb's own protobuf classes (offline runs write no wandb-summary.json, and wandb 0.31
    ships no reader). The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks
    [crc32 u32][length u16][type u8][data], types full=1, first=2, middle=3, last=4."""
    from pathlib import Path

    from wandb.proto import wandb_internal_pb2 as pb

    data = next(Path(run_root).glob("**/run-*.wandb")).read_bytes()
    block, pos, chunks, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, chunk_type = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if chunk_type == 1:
            chunks.append(chunk)
        elif chunk_type == 2:
            pending = chunk
        elif chunk_type == 3:
            pending += chunk
        elif chunk_type == 4:
            chunks.append(pending + chunk)
    records = []
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == kind:
            records.append(record)
    return records


def train_byte_bpe(texts: list[str], special_tokens: list[str], folder, vocab_size: int = 400):
    """A byte-level BPE (tokenizers' Tokenizer) trained on `texts` here, saved as `folder`/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    return tokenizer
