"""A training checkpoint opened for reading: what `step35 export` and `step35 generate` start from.

A checkpoint is a `.ckpt` file or a sharded (DCP) checkpoint folder (a run folder's is picked by
`step35.run.checkpoint_of`). Weights are read tensor by tensor (a sharded checkpoint of the 196B model never
has to fit in memory), verified against the manifest, unpickled only through `safe_load`, and
checked for NaN/Inf.

Paths written inside a checkpoint (its hyper-parameters name the HF folder the run started from,
the model config, the tokenizer folder) are data from another machine: they are read only for
files of a known kind, never walked, and every use of one is reported: in `TrainedCheckpoint.notes`
(the model config) or in the origin `tokenizer_files` returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf import lora_base
from step35.checkpoint.hf.folder import INDEX_FILE, SINGLE_FILE, model_tensor_infos
from step35.checkpoint.hf.fp8 import read_whole
from step35.checkpoint.integrity import verify_for_load
from step35.checkpoint.safe_load import check_finite, safe_reader
from step35.checkpoint.training import keys, run_tokenizer
from step35.checkpoint.training.trainer_io import check_loadable, dcp_load, load_file, load_meta
from step35.config import PRESETS, ConfigError, Step35Config, VisionConfig, load_config, load_vision_config
from step35.model.lora import LoraConfig, LoraError, is_adapter, merged_weight


def is_hf_folder(path: Path) -> bool:
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and ((path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file())
    )


def resolve_checkpoint(path: str | Path) -> Path:
    """A `.ckpt` file or sharded folder as it is (`last.ckpt`: what it points at). A run folder is
    not read here: `step35.run.checkpoint_of` picks its checkpoint (the run layer owns the folder's
    layout and the choice of the newest intact checkpoint)."""
    path = Path(path)
    if path.is_symlink():  # last.ckpt: read (and verify) what it points at, whose manifest is beside it
        path = path.resolve()
    if path.is_dir() and not ((path / keys.META_FILE).is_file() or (path / ".metadata").is_file()):
        raise CheckpointError(
            f"{path}: not a checkpoint (a .ckpt file or a sharded checkpoint folder); for a run "
            "folder, step35 export / generate pick its newest intact checkpoint"
        )
    return check_loadable(path)


def lightning_meta(checkpoint: Path) -> dict:
    """Verified against the manifest; the file's dict (a .ckpt, NaN-checked) or the folder's meta.pt."""
    check_loadable(checkpoint)
    if checkpoint.is_dir():
        verify_for_load(checkpoint)
        return load_meta(checkpoint)
    return load_file(checkpoint)


def named_config(value: object, where: Path) -> Step35Config:
    """The model config a checkpoint's hyper-parameters name: a preset, or a config.json (a file of
    that name, or the one inside a named folder). Any other file is refused: its content would land
    in the exported config.json."""
    if not isinstance(value, str) or not value:
        raise CheckpointError(f"{where}: the checkpoint records no model config; pass --model_config")
    path = Path(value).expanduser()
    if value not in PRESETS and not (path.is_dir() or path.name == "config.json"):
        raise CheckpointError(
            f"{where}: the checkpoint names {value!r} as its model config, which is neither a "
            "preset, a config.json nor a folder holding one; pass --model_config"
        )
    try:
        return load_config(value)
    except ConfigError as e:
        raise CheckpointError(f"{where}: its model config: {e}; pass --model_config") from None


def _dcp_tensors(folder: Path, only: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = safe_reader(folder).read_metadata().state_dict_metadata
    for key, info in entries.items():
        if not key.startswith(keys.DCP_MODEL_PREFIX) or not isinstance(info, TensorStorageMetadata):
            continue
        if not only(key[len(keys.DCP_MODEL_PREFIX) :]):
            continue  # not read at all
        tensor = torch.empty(info.size, dtype=info.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_load({key: tensor}, folder)
        check_finite([(key, tensor)], folder)
        yield key[len(keys.DCP_MODEL_PREFIX) :], tensor


def _file_tensors(meta: dict, only: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, tensor in meta[keys.STATE_DICT].items():
        if key.startswith(keys.MODEL_PREFIX) and only(key[len(keys.MODEL_PREFIX) :]):
            yield key[len(keys.MODEL_PREFIX) :], tensor


@dataclass
class TrainedCheckpoint:
    """A training checkpoint opened for reading: its Lightning dict (no weights for a sharded one),
    the model config, and the model's tensors by HF name, read one by one on iteration. `notes` says
    which paths named inside the checkpoint were read (one line each)."""

    path: Path
    meta: dict
    config: Step35Config
    hyper_parameters: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def tensors(self, only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the model's tensors (a LoRA run's adapters included), those whose name passes
        `only`; a sharded checkpoint reads no other. A LoRA run's frozen base, which its checkpoints
        leave out, comes after the saved tensors: from the base's HF folder (checked against the
        fingerprint recorded) or the deterministic init, in the base dtype the run computed in."""
        wanted = only or (lambda name: True)
        saved = set()
        for name, tensor in _dcp_tensors(self.path, wanted) if self.path.is_dir() else _file_tensors(self.meta, wanted):
            saved.add(name)
            yield name, tensor
        if not saved and only is None:
            raise CheckpointError(f"{self.path}: holds no model weights (keys starting with '{keys.MODEL_PREFIX}')")
        if self.meta.get(keys.LORA_BASE) is not None:
            yield from self._base_tensors(lambda n: wanted(n) and n not in saved)

    def _base_tensors(self, only: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """The frozen base of a LoRA run's checkpoint, read again as the run read it."""
        from safetensors import safe_open

        from step35.checkpoint.hf.materialize import checkpoint_state
        from step35.model import build_model
        from step35.model.init import init_tensor

        record = self.meta[keys.LORA_BASE]
        num_mtp = self.hyper_parameters.get("num_mtp_layers")
        model = build_model(self.config, num_mtp, device="meta", vision=self.vision_config)
        names = {n: tuple(t.shape) for n, t in checkpoint_state(model).items() if only(n)}
        dtype = self.lora.resolved_base_dtype(self.config) if self.lora else None
        if record.get("folder") is None:
            self.notes.append(f"the frozen base drawn from the init (model.init_seed={record.get('init_seed')})")
            for name, shape in names.items():
                yield name, init_tensor(name, shape, self.config, record["init_seed"]).to(dtype or torch.float32)
            return
        folder = record["folder"]
        lora_base.check_base(record, lora_base.base_identity(folder, 0), self.path)
        self.notes.append(f"the frozen base read from {folder} (named in {self.path}, fingerprint checked)")
        infos, carried, _ = model_tensor_infos(folder)
        if self.vision_config is not None:  # the vision side, apart in a Step-3.7 folder, as materialize reads it
            infos = {**infos, **carried}
        for name, shape in names.items():
            if name not in infos or infos[name].shape != shape:
                raise CheckpointError(f"{folder}: the LoRA run's base lacks {name} of shape {list(shape)}")
            if infos[name].scales is not None:  # an FP8 base, dequantised as the run read it (hf/fp8.py)
                tensor = read_whole(infos[name], dtype or getattr(torch, self.config.torch_dtype))
            else:
                with safe_open(infos[name].file, framework="pt") as f:
                    tensor = f.get_tensor(infos[name].key)
            check_finite([(name, tensor)], infos[name].file)
            yield name, tensor.to(dtype) if dtype is not None and not name.endswith("router_bias") else tensor

    @cached_property
    def vision_config(self) -> VisionConfig | None:
        """The vision side of a run with `model.vision` (training/vision.py): its model.checkpoint's `vision_config`,
        else its model.config's (a preset or a Step-3.7 config.json); None for a run of the language model alone."""
        if not isinstance(self.hyper_parameters.get("vision"), dict):
            return None
        value = self.hyper_parameters.get("checkpoint") or self.hyper_parameters.get("config")
        path = Path(value).expanduser() if isinstance(value, str) and value else None
        if path is None or (value not in PRESETS and not (path.is_dir() or path.name == "config.json")):
            raise CheckpointError(
                f"{self.path}: the run has model.vision, but its model.checkpoint / model.config ({value!r}) is "
                "neither a preset, a config.json nor a folder holding one to read its vision side from"
            )
        try:
            vision = load_vision_config(value)
        except ConfigError as e:
            raise CheckpointError(f"{self.path}: the run has model.vision; its vision side: {e}") from None
        if value not in PRESETS:
            self.notes.append(f"the vision config read from {value} (named in {self.path})")
        return vision

    @property
    def lora(self) -> LoraConfig | None:
        """The run's LoRA options (`model.lora`), None for a run without adapters."""
        try:
            return LoraConfig.of(self.hyper_parameters.get("lora"))
        except LoraError as e:
            raise CheckpointError(f"{self.path}: its model.lora: {e}") from None

    def merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors by HF name with every LoRA adapter merged into its weight as
        W + (alpha / r) * BA in float32 (model/lora.py: merged_weight); the same as `tensors()` for a
        run without adapters. The adapters (small) are read first, then the weights one by one."""
        lora = self.lora
        if lora is None:
            yield from self.tensors()
            return
        adapters = dict(self.tensors(only=is_adapter))
        prefixes = sorted({n.rsplit(".", 1)[0] for n in adapters})  # `...q_proj` of `...q_proj.lora_A`
        for prefix in prefixes:
            if f"{prefix}.lora_A" not in adapters or f"{prefix}.lora_B" not in adapters:
                raise CheckpointError(f"{self.path}: the adapter of {prefix}.weight lacks its lora_A or lora_B")
        pending = {f"{prefix}.weight" for prefix in prefixes}
        for name, tensor in self.tensors(only=lambda n: not is_adapter(n)):
            if name in pending:
                prefix = name[: -len(".weight")]
                tensor = merged_weight(
                    name, tensor, adapters[f"{prefix}.lora_A"], adapters[f"{prefix}.lora_B"], lora.scale_alpha
                )
                if not bool(torch.isfinite(tensor).all()):  # an adapter scaled past float32's range
                    raise CheckpointError(
                        f"{self.path}: merging its LoRA adapter into {name} gives NaN/Inf (W + alpha/r x BA with "
                        f"model.lora.alpha={lora.scale_alpha:g}): refusing to write non-finite weights; export "
                        f"without --merge (a PEFT adapter folder) or from a run with a smaller alpha"
                    )
                pending.discard(name)
            yield name, tensor
        if pending:
            raise CheckpointError(f"{self.path}: holds adapters of weights it lacks, e.g. {sorted(pending)[:3]}")

    def start_folder(self) -> str | None:
        """The HF folder the run started from (`model.checkpoint`), as the checkpoint names it."""
        value = self.hyper_parameters.get("checkpoint")
        return value if isinstance(value, str) and value else None

    def tokenizer_files(self) -> tuple[dict[str, bytes], int | None, str]:
        """(files, the run's EOS id or None, where they came from) of the tokenizer the run trained with."""
        saved = self.meta.get(keys.TOKENIZER)
        if saved is not None:
            saved = run_tokenizer.read_record(saved, self.path)
            return (
                saved["files"],
                saved["eos_token_id"],
                f"the run's tokenizer ({saved['source']}, saved in {self.path})",
            )
        # Checkpoints written before the tokenizer was recorded: the folder the data module read, as the
        # checkpoint names it (only the tokenizer files, by name), else the built-in tokenizer rebuilt in
        # this machine's cache (the run's cache_dir is a path of the training machine: not written to).
        data = self.meta.get(keys.DATAMODULE_HYPER_PARAMETERS) or {}
        eos = data.get("eos_token_id") if isinstance(data.get("eos_token_id"), int) else None
        folder = data.get("tokenizer") or self.start_folder()
        if isinstance(folder, str) and folder:
            return (
                run_tokenizer.folder_files(folder),
                eos,
                f"{folder} (named in {self.path}, which records no tokenizer files)",
            )
        if isinstance(data.get("builtin_vocab_size"), int):
            from step35.data.builtin import builtin_tokenizer_dir

            folder = builtin_tokenizer_dir(data["builtin_vocab_size"])
            return (
                run_tokenizer.folder_files(folder),
                eos,
                f"the built-in tokenizer rebuilt in {folder} ({self.path} records no tokenizer files)",
            )
        raise CheckpointError(
            f"{self.path}: records no tokenizer (trained without step35's data module?); "
            "pass --tokenizer <folder with tokenizer.json>"
        )


def open_checkpoint(path: str | Path, config: Step35Config | None = None) -> TrainedCheckpoint:
    """Verify and open a training checkpoint (a .ckpt file or a sharded folder). The
    model config is `config`, else the one saved with the checkpoint, else the one its
    hyper-parameters name (older checkpoints; said in `notes`)."""
    path = resolve_checkpoint(path)
    meta = lightning_meta(path)
    hp = dict(meta.get(keys.HYPER_PARAMETERS) or {})
    notes = []
    if config is None and keys.MODEL_CONFIG in meta:
        config = Step35Config.from_dict(meta[keys.MODEL_CONFIG])
    elif config is None:
        named = hp.get("checkpoint") or hp.get("config")
        config = named_config(named, path)
        notes.append(f"model config read from {named} (named in {path}, which records no model config)")
    return TrainedCheckpoint(path, meta, config, hp, notes)
