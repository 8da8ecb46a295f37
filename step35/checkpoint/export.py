"""`step35 export`: a training checkpoint -> an HF folder that loads as it is.

    step35 export --checkpoint runs/tiny --out hf_out/ [--dtype bfloat16] [--max_shard_size 5GB]

`--checkpoint` is a `.ckpt` file, a sharded (DCP) checkpoint folder, or a run folder (its newest
complete checkpoint). Weights are read tensor by tensor (a sharded checkpoint of the 196B model never
has to fit in memory), verified against the manifest, unpickled only through `safe_load`, checked
for NaN/Inf, and written by `hf.write_hf_folder` (shards, index, manifest, one atomic publish).

What lands next to the weights:
- When the run started from an HF folder (`model.checkpoint`), every file of that folder that is not
  a weight file (remote-code .py files, tokenizer, generation config, chat template, licence, readme)
  is copied byte for byte, and config.json keeps that folder's fields (auto_map included).
- Without one, `auto_map` is dropped from config.json: there is no remote code to point at (vLLM and
  SGLang load `Step3p5ForCausalLM` natively; see the README for transformers).
- Always the tokenizer the run trained with: the files recorded in the checkpoint (`run_tokenizer`),
  or `--tokenizer`. config.json's bos/eos/pad ids are then made to agree with it: EOS must be among
  `eos_token_id` (else the list becomes the tokenizer's EOS, plus the run's document separator if it
  differs), `bos_token_id` and `pad_token_id` become the tokenizer's (dropped when it has none). Each
  change is reported; nothing is silently kept that disagrees with the tokenizer.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import torch

from step35.checkpoint import catalog, run_tokenizer
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import INDEX_FILE, SINGLE_FILE, write_hf_folder
from step35.checkpoint.integrity import FILE_MANIFEST_SUFFIX, MANIFEST, verify_for_load
from step35.checkpoint.safe_load import check_finite, safe_reader
from step35.checkpoint.trainer_io import META_FILE, check_loadable, dcp_load, load_file, load_meta
from step35.config import Step35Config, load_config

_PREFIX = "model."  # the LightningModule's attribute holding Step35ForCausalLM
# Files of an HF folder that are weights (rewritten by the export), or the folder's own bookkeeping.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_NOT_COPIED = {"config.json", INDEX_FILE, "pytorch_model.bin.index.json", MANIFEST}


# ------------------------------------------------------------------------------- reading checkpoints
def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file())


def resolve_checkpoint(path: str | Path) -> Path:
    """A `.ckpt` file or sharded folder as it is; a run folder (or its checkpoints/ folder): its newest
    complete checkpoint. Anything else is refused, naming what was looked for."""
    path = Path(path)
    if path.is_symlink():  # last.ckpt: read (and verify) what it points at, whose manifest is beside it
        path = path.resolve()
    if not path.exists() or path.is_file() or (path / META_FILE).is_file() or (path / ".metadata").is_file():
        return check_loadable(path)
    newest = catalog.newest_complete([path / "checkpoints", path])
    if newest is None:
        raise CheckpointError(f"{path}: neither a checkpoint (.ckpt file, sharded folder) nor a run folder with a "
                              f"complete checkpoint in {path / 'checkpoints'}")
    return newest.path


def lightning_meta(checkpoint: Path) -> dict:
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
        raise CheckpointError("the checkpoint records no model config; pass --model_config")
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


@dataclass
class TrainedCheckpoint:
    """A training checkpoint opened for reading: its Lightning dict (no weights for a sharded one),
    the model config, and the model's tensors by HF name, read one by one on iteration."""

    path: Path
    meta: dict
    config: Step35Config
    hyper_parameters: dict = field(default_factory=dict)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        found = False
        for name, tensor in (_dcp_tensors(self.path) if self.path.is_dir() else _file_tensors(self.meta)):
            found = True
            yield name, tensor
        if not found:
            raise CheckpointError(f"{self.path}: holds no model weights (keys starting with '{_PREFIX}')")

    def tokenizer_files(self) -> tuple[dict[str, bytes], int | None, str]:
        """(files, the run's EOS id or None, where they came from) of the tokenizer the run trained with."""
        saved = self.meta.get(run_tokenizer.RECORD_KEY)
        if saved is not None:
            saved = run_tokenizer.read_record(saved, self.path)
            return saved["files"], saved["eos_token_id"], f"the run's tokenizer ({saved['source']}, saved in {self.path})"
        # Checkpoints written before the tokenizer was recorded: rebuild where the data module looked.
        data = self.meta.get("datamodule_hyper_parameters") or {}
        folder = data.get("tokenizer") or self.hyper_parameters.get("checkpoint")
        if folder:
            return run_tokenizer.folder_files(folder), data.get("eos_token_id"), str(folder)
        if "builtin_vocab_size" in data:
            from step35.data.builtin import builtin_tokenizer_dir

            folder = builtin_tokenizer_dir(data["builtin_vocab_size"], data.get("cache_dir"))
            return run_tokenizer.folder_files(folder), data.get("eos_token_id"), f"the built-in tokenizer ({folder})"
        raise CheckpointError(f"{self.path}: records no tokenizer (trained without step35's data module?); "
                              "pass --tokenizer <folder with tokenizer.json>")


def open_checkpoint(path: str | Path, config: Step35Config | None = None) -> TrainedCheckpoint:
    """Resolve (a run folder -> its newest checkpoint), verify and open a training checkpoint."""
    path = resolve_checkpoint(path)
    meta = lightning_meta(path)
    return TrainedCheckpoint(path, meta, config or model_config_of(meta), dict(meta.get("hyper_parameters") or {}))


# ------------------------------------------------------------------------------- what goes along
def source_files(folder: Path) -> dict[str, Path]:
    """Every file of an HF folder but its weights, config.json, index and manifest (hidden ones skipped)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: the run started from this HF folder (model.checkpoint), which is gone; "
                              "pass --source <where it is now> (its remote code, tokenizer and readme are copied)")
    out = {}
    for file in sorted(folder.rglob("*")):
        rel = file.relative_to(folder)
        if not file.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        name = rel.as_posix()
        if name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(FILE_MANIFEST_SUFFIX):
            continue
        out[name] = file
    return out


def align_special_ids(config: Step35Config, ids: run_tokenizer.SpecialIds, run_eos: int | None) -> list[str]:
    """Make config's bos/eos/pad ids agree with the tokenizer's (see the module docstring); returns
    one line per change."""
    notes = []
    wanted = [i for i in dict.fromkeys([ids.eos, run_eos]) if i is not None]
    if not wanted:
        raise CheckpointError("the tokenizer names no EOS token and the run recorded none: cannot tell where "
                              "documents end; give the tokenizer an eos_token")
    if not set(wanted) <= set(config.eos_token_ids):
        value = wanted if isinstance(config.eos_token_id, list) or len(wanted) > 1 else wanted[0]
        notes.append(f"eos_token_id {config.eos_token_id} -> {value} (the tokenizer's EOS is {ids.eos}"
                     + (f", the run separated documents with {run_eos}" if run_eos not in (None, ids.eos) else "")
                     + ")")
        config.eos_token_id = value
    if config.bos_token_id != ids.bos:
        notes.append(f"bos_token_id {config.bos_token_id} -> {ids.bos} (the tokenizer's BOS"
                     + (")" if ids.bos is not None else ": it has none)"))
        config.bos_token_id = ids.bos
    if config.extra.get("pad_token_id") != ids.pad:
        if ids.pad is None:
            notes.append(f"pad_token_id {config.extra.pop('pad_token_id')} dropped (the tokenizer has no pad token)")
        else:
            notes.append(f"pad_token_id {config.extra.get('pad_token_id')} -> {ids.pad} (the tokenizer's pad token)")
            config.extra["pad_token_id"] = ids.pad
    return notes


@dataclass
class ExportReport:
    out: Path
    checkpoint: Path
    tokenizer: str
    copied: list[str]
    notes: list[str]


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
              max_shard_size: int | str = "5GB", config: Step35Config | None = None,
              tokenizer: str | Path | None = None, source: str | Path | None = None) -> Path:
    """Write `out` as an HF checkpoint folder (see `export_checkpoint`); returns `out`."""
    return export_checkpoint(checkpoint, out, dtype, max_shard_size, config, tokenizer, source).out


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                      max_shard_size: int | str = "5GB", config: Step35Config | None = None,
                      tokenizer: str | Path | None = None, source: str | Path | None = None) -> ExportReport:
    """Write `out` as an HF checkpoint folder; router_bias stays fp32, other weights take `dtype`
    (default: the config's torch_dtype). `config`: for checkpoints that record none; `tokenizer`: a
    tokenizer folder instead of the run's; `source`: the HF folder the run started from, when it has
    moved. Returns what was written and every change made to config.json."""
    trained = open_checkpoint(checkpoint, config)
    exported = Step35Config.from_dict(trained.config.to_dict())
    dtype = dtype or getattr(torch, exported.torch_dtype)
    exported.torch_dtype = str(dtype).removeprefix("torch.")

    source = source or trained.hyper_parameters.get("checkpoint")
    files: dict[str, Path | bytes] = dict(source_files(Path(source))) if source else {}
    notes = []
    if not source and "auto_map" in exported.extra:
        exported.extra.pop("auto_map")
        notes.append("auto_map dropped: the run did not start from an HF folder, so there is no remote code to "
                     "point at (vLLM/SGLang load Step3p5ForCausalLM natively)")
    if tokenizer:
        tok_files, run_eos, tok_from = run_tokenizer.folder_files(tokenizer), None, str(tokenizer)
    else:
        tok_files, run_eos, tok_from = trained.tokenizer_files()
    replaced = sorted(n for n, content in tok_files.items()
                      if n in files and (files[n] if isinstance(files[n], bytes) else files[n].read_bytes()) != content)
    if replaced:
        notes.append(f"{', '.join(replaced)} of {source} replaced by {tok_from}: the run trained with another tokenizer")
    files.update(tok_files)
    notes += align_special_ids(exported, run_tokenizer.special_ids(tok_files, tok_from), run_eos)

    def cast() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in trained.tensors():
            yield name, tensor.to(torch.float32 if name.endswith("router_bias") else dtype)

    write_hf_folder(out, cast(), exported, max_shard_size, copy_files=files)
    return ExportReport(Path(out), trained.path, tok_from, sorted(files), notes)


# ------------------------------------------------------------------------------- the subcommand
def export(checkpoint: str, out: str, dtype: Literal["bfloat16", "float32", "float16"] | None = None,
           max_shard_size: str = "5GB", tokenizer: str | None = None, source: str | None = None,
           model_config: str | None = None) -> None:
    """Write a training checkpoint as an HF folder (config.json, safetensors shards, index, tokenizer),
    published atomically with a manifest.

    Args:
        checkpoint: a .ckpt file, a sharded checkpoint folder, or a run folder (its newest complete checkpoint).
        out: the HF folder to write (replaced atomically if it exists).
        dtype: dtype of the exported weights (router_bias stays float32); default: the config's torch_dtype.
        max_shard_size: largest safetensors shard, e.g. 5GB, 500MiB.
        tokenizer: a tokenizer folder to export instead of the one the run trained with.
        source: the HF folder the run started from, if it moved since (default: the run's model.checkpoint).
        model_config: the model config (preset, config.json or folder) for checkpoints that record none.
    """
    done = export_checkpoint(checkpoint, out, getattr(torch, dtype) if dtype else None, max_shard_size,
                             load_config(model_config) if model_config else None, tokenizer, source)
    for note in done.notes:
        print(f"step35 export: {note}", file=sys.stderr)
    print(f"step35 export: wrote {done.out} from {done.checkpoint} (tokenizer: {done.tokenizer}; files besides "
          f"the weights: {', '.join(done.copied)})")


def main(argv: list[str] | None = None) -> None:
    from step35.function_cli import run_function

    run_function(export, "step35 export", argv)


if __name__ == "__main__":
    main()
