"""Readers of what runs leave: the records of an offline wandb run, the events of TensorBoard files, the rows of
a CSVLogger's metrics.csv (and the losses of every attempt of a run folder), the steps of the complete
checkpoints in a folder, the tensors of an HF folder; and `assert_bitwise`, which compares two checkpoints' contents to the bit."""

from __future__ import annotations

import csv
from pathlib import Path

import torch


def wandb_records(run_root, kind: str) -> list:
    """Records of one type ("history", "config", ...) of an offline wandb run, read from its .wandb
    file with wandb's own protobuf classes (offline runs write no wandb-summary.json, and wandb 0.31
    ships no reader). The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks
    [crc32 u32][length u16][type u8][data], types full=1, first=2, middle=3, last=4."""
    from pathlib import Path

    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(Path(run_root).glob("**/run-*.wandb")).read_bytes()
    block, pos, chunks, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, chunk_type = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk wandb's writer process is still appending (a loaded machine)
            break
        chunk = data[pos + 7 : pos + 7 + length]
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
        try:
            record.ParseFromString(raw)
        except DecodeError:  # its last chunk not yet written
            continue
        if record.WhichOneof("record_type") == kind:
            records.append(record)
    return records


def tensorboard_events(folder: Path) -> list:
    """Every Event of the tfevents files under `folder` (TFRecord framing: length, crc, data, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(Path(folder).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12 : at + 12 + length])
            events.append(event)
            at += 12 + length + 4
    return events


def metric_rows(folder: Path) -> list[dict]:
    """The rows of `folder`/metrics.csv (a CSVLogger version folder), as dicts of strings."""
    with open(Path(folder) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def steps_of(rows: list[dict], column: str) -> dict[int, float]:
    """{step: value} of the rows that hold `column`."""
    return {int(r["step"]): float(r[column]) for r in rows if r.get(column)}


def run_losses(run: Path, column: str = "train/lm_loss") -> dict[int, float]:
    """{step: `column`} of every metrics.csv under `run` (every attempt of a run folder, in version order)."""
    out: dict[int, float] = {}
    for file in sorted(Path(run).rglob("metrics.csv")):
        out.update(steps_of(metric_rows(file.parent), column))
    return out


def safetensors_in(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in `folder` (an HF folder, one or several shards), by name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def saved_steps(folder: Path) -> list[int]:
    """Global steps of the complete checkpoints in `folder`, oldest first."""
    from step35.checkpoint.training import catalog

    return [c.global_step for c in catalog.complete_checkpoints(folder)]


def assert_bitwise(a, b, where: str = "") -> None:
    """`a` and `b` (tensors, or dicts / lists / tuples of them and of plain values) are equal to the bit, dtypes
    too; the message names the first place (`where`/key[index]) that differs."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where}: differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(set(a) ^ set(b)))
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
