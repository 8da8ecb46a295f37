"""A training checkpoint -> an HF folder that loads as it is (the library behind `step35 export`).

The weights come from `trained.open_checkpoint` and are written by `hf.folder.write_hf_folder` (shards,
index, manifest, one atomic publish); a LoRA run's are exported with `merge`, its adapters merged
into the weights (`TrainedCheckpoint.merged_tensors`), or without it as a PEFT adapter folder
(`hf.peft.write_peft_folder`, nothing else written). What lands next to a full export's weights:
- From the HF folder the run started from (`--source`, else the `model.checkpoint` the checkpoint
  names), only files of the kinds an HF model folder publishes, looked up by name at its top level,
  never by walking it: the tokenizer files, chat template and generation config
  (`run_tokenizer.TOKENIZER_FILES`), the model card and licence (`CARD_FILES`), and the remote code
  `auto_map` names (with the modules that code imports relatively). The folder is named by a file
  from elsewhere; a checkpoint naming a home folder must not publish its `id_rsa`. config.json keeps
  the start folder's fields (auto_map included), as training read them.
- Our own transformers modeling file (`hf/modeling/modeling_step35.py`, config and causal LM in one
  file) with config.json's `auto_map` pointing at it, unless the start folder brings the remote code
  its `auto_map` names (the release's, copied as above): so that `AutoModelForCausalLM.from_pretrained(
  out, trust_remote_code=True)` loads every export. `architectures` stays `Step3p5ForCausalLM`, which
  vLLM and SGLang load natively.
- Always the tokenizer the run trained with: the files recorded in the checkpoint (`run_tokenizer`),
  or `tokenizer`. config.json's bos/eos/pad ids are then made to agree with it: EOS must be among
  `eos_token_id` (else the list becomes the tokenizer's EOS, plus the run's document separator if it
  differs), `bos_token_id` and `pad_token_id` become the tokenizer's (dropped when it has none).
Every file written besides the weights is listed with where it came from, and every change and
every path read from the checkpoint is reported: nothing is silently kept or taken.

A Step-3.7 start folder's export is a Step-3.7 folder again (config.json wraps the trained text_config;
transformers loads it natively, so no modeling file). Its vision encoder and projector (`vision_model.*`,
`vit_large_projector.*`, the release's names) are copied from the start folder as stored, byte for byte, unless
the run built them (`model.vision`) and changed them (`train: true`, or LoRA adapters on them, merged): then the
run's are written, in the export's dtype (bf16 in an FP8 export, named in modules_to_not_convert). A run with
`model.vision` and no start folder (`model.config tiny-vl`) writes its own, in a config.json that is the wrapper
its model.config names (`_vision_side`).

Where an export may write (`check_out`, before anything is written): `out` replaces only an HF or
PEFT folder step35 wrote (its step35 manifest says so), or anything with `overwrite`; never, even
with `overwrite`, what the export reads (the checkpoint, its run folder, the LoRA run's base, the
folder the run started from, --source, --tokenizer, --model_config), a folder holding one of them,
a path inside one of them, nor an existing entry of the run folder (its checkpoints, logs and
config; a new name there, e.g. `runs/x/hf`, is fine). Before writing, the partial copies that killed
exports left in `out`'s folder are removed when their writer is dead (`publish.dead_partials`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import TensorInfo, model_tensor_infos, own_files, write_hf_folder
from step35.checkpoint.hf.fp8 import (
    FP8_DTYPES,
    QUANTIZATION_KEY,
    SCALE_SUFFIX,
    block_notes,
    export_entry,
    matrix_shapes,
    quantized_tensors,
    read_whole,
    skipped,
    source_entry,
    without_quantization,
)
from step35.checkpoint.hf.modeling import AUTO_MAP, MODELING_FILE
from step35.checkpoint.hf.release import (
    VISION_MODULES,
    Layout,
    is_vision_tensor,
    release_config,
    wrapping_config,
)
from step35.checkpoint.integrity import manifest_info
from step35.checkpoint.publish import dead_partials, partial_writer, remove_path
from step35.checkpoint.training import keys, run_tokenizer
from step35.checkpoint.training.trained import TrainedCheckpoint, open_checkpoint
from step35.config import Step35Config
from step35.model.lora import VISION_TARGETS, is_adapter, is_full_target

# Model card and licence files, by the names the Hugging Face hub gives them.
CARD_FILES = ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "USE_POLICY.md")
# A multimodal release's image processor (Step-3.7-Flash): carried with its vision tensors.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
COMPANION_FILES = run_tokenizer.TOKENIZER_FILES + CARD_FILES + PROCESSOR_FILES
# What an export writes anew (weights, their index, config.json, manifests): not worth a mention when left out.
_REWRITTEN = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".h5",
    ".msgpack",
    ".index.json",
    ".manifest.json",
)
# `from .modeling_utils import x` / `import .x` in remote code: transformers fetches those modules too.
_RELATIVE_IMPORT = re.compile(rb"^\s*(?:from\s+\.(\w+)\s+import|import\s+\.(\w+))", re.MULTILINE)


def remote_code_modules(auto_maps: Iterable[object]) -> list[str]:
    """Module names of auto_map entries ("module.Class", or a [slow, fast] list of them). An entry
    "repo--module.Class" lives in another repository and is not ours to copy."""
    modules = []
    for auto_map in auto_maps:
        if not isinstance(auto_map, dict):
            continue
        for value in auto_map.values():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "--" not in ref and ref.count(".") == 1:
                    modules.append(ref.split(".")[0])
    return list(dict.fromkeys(modules))


def _auto_map(tokenizer_config: Path | bytes | None) -> object:
    """The auto_map of a tokenizer_config.json (its bytes or the file), or None."""
    if tokenizer_config is None:
        return None
    try:
        content = json.loads(tokenizer_config if isinstance(tokenizer_config, bytes) else tokenizer_config.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # unreadable: it names no remote code to take along
    return content.get("auto_map") if isinstance(content, dict) else None


def _remote_code(folder: Path, modules: list[str]) -> tuple[dict[str, Path], list[str]]:
    """{name.py: file} of `modules` and what they import relatively, at the top of `folder`; the
    modules that are not there (or only as a link out of it: `own_files`)."""
    found: dict[str, Path] = {}
    missing = []
    todo = list(modules)
    while todo:
        module = todo.pop(0)
        name = f"{module}.py"
        if name in found or module in missing:
            continue
        # an identifier: no path separator, no ".."
        file = own_files(folder, [name])[0].get(name) if module.isidentifier() else None
        if file is None:
            missing.append(module)
            continue
        found[name] = file
        todo += [a.decode() or b.decode() for a, b in _RELATIVE_IMPORT.findall(file.read_bytes())]
    return found, missing


def _release_model_code(source: Path | None, auto_map: object) -> dict[str, Path] | None:
    """{name.py: file} of the remote code config.json's `auto_map` names in `source` (the release's
    configuration/modeling files, and what they import relatively), or None when `source` brings none
    of its own: no source, no `AutoModelForCausalLM` entry, or a module named but absent."""
    if source is None or not isinstance(auto_map, dict) or "AutoModelForCausalLM" not in auto_map:
        return None
    code, missing = _remote_code(source, remote_code_modules([auto_map]))
    return None if missing or not code else code


def _our_modeling_note(source: Path | None, old: object) -> str:
    """The line saying that our modeling file is written, why, and what became of config.json's auto_map."""
    why = "the run did not start from an HF folder" if source is None else f"{source} brings no modeling code"
    return f"{MODELING_FILE.name} written ({why}; transformers loads it with trust_remote_code); " + (
        f"auto_map {old} -> {AUTO_MAP}" if old else f"auto_map {AUTO_MAP} added"
    )


def carried_tensors(
    carried: Mapping[str, TensorInfo], dtype: torch.dtype, keep_fp8: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a folder carries (Step-3.7's vision side), read file by file, dtype and bytes as stored; those
    stored in FP8 with their scales as stored too when `keep_fp8` (an FP8 export), else dequantised into `dtype`
    (the export's config.json then declares no quantization)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for stored, info in carried.items():
        by_file.setdefault(info.file, []).append(stored)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for stored in names:
                info = carried[stored]
                if info.scales is None:
                    yield stored, f.get_tensor(info.key)
                elif not keep_fp8:
                    yield stored, read_whole(info, dtype)
                else:
                    yield stored, f.get_tensor(info.key)
                    with safe_open(info.scales.file, framework="pt") as holder:
                        yield stored + SCALE_SUFFIX, holder.get_tensor(info.scales.key)


def companion_files(folder: Path) -> dict[str, Path]:
    """{name: file} of the COMPANION_FILES at the top of `folder` (an HF folder: it holds a config.json);
    never a link out of it (`own_files`; `_left_out` says which were left)."""
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder}: the run started from this HF folder (model.checkpoint), which is gone; "
            "pass --source <where it is now> (its remote code, tokenizer and readme are copied)"
        )
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder}: named as the HF folder the run started from, but it holds no config.json; "
            "pass --source <the HF folder> (its remote code, tokenizer and readme are copied)"
        )
    return own_files(folder, COMPANION_FILES)[0]


def _left_out(folder: Path, taken: Iterable[str]) -> list[str]:
    """The lines naming what of `folder` stays behind, besides what the export writes anew: its files that
    link outside it (never copied, `own_files`), then the files of kinds an export does not copy."""
    skip = set(taken) | {"config.json"}
    names = sorted(p.name for p in folder.iterdir() if p.name not in skip and not p.name.endswith(_REWRITTEN))
    links = own_files(folder, names)[1]
    lines = []
    if links:
        shown = ", ".join(f"{name} -> {target}" for name, target in links.items())
        lines.append(
            f"left out of {folder}: {shown}, a link out of the folder, which an export never follows (what it "
            "copies is published); put a copy there instead of the link to export it"
        )
    rest = [name for name in names if name not in links]
    if rest:
        shown = ", ".join(rest[:8]) + (f" and {len(rest) - 8} more" if len(rest) > 8 else "")
        lines.append(f"left out of {folder}: {shown} (only known HF file kinds are copied)")
    return lines


def align_special_ids(config: Step35Config, ids: run_tokenizer.SpecialIds, run_eos: int | None) -> list[str]:
    """Make config's bos/eos/pad ids agree with the tokenizer's (see the module docstring); returns
    one line per change."""
    notes = []
    wanted = [i for i in dict.fromkeys([ids.eos, run_eos]) if i is not None]
    if not wanted:
        raise CheckpointError(
            "the tokenizer names no EOS token and the run recorded none: cannot tell where "
            "documents end; give the tokenizer an eos_token"
        )
    if not set(wanted) <= set(config.eos_token_ids):
        value = wanted if isinstance(config.eos_token_id, list) or len(wanted) > 1 else wanted[0]
        notes.append(
            f"eos_token_id {config.eos_token_id} -> {value} (the tokenizer's EOS is {ids.eos}"
            + (f", the run separated documents with {run_eos}" if run_eos not in (None, ids.eos) else "")
            + ")"
        )
        config.eos_token_id = value
    if config.bos_token_id != ids.bos:
        notes.append(
            f"bos_token_id {config.bos_token_id} -> {ids.bos} (the tokenizer's BOS"
            + (")" if ids.bos is not None else ": it has none)")
        )
        config.bos_token_id = ids.bos
    if config.extra.get("pad_token_id") != ids.pad:
        if ids.pad is None:
            notes.append(f"pad_token_id {config.extra.pop('pad_token_id')} dropped (the tokenizer has no pad token)")
        else:
            notes.append(f"pad_token_id {config.extra.get('pad_token_id')} -> {ids.pad} (the tokenizer's pad token)")
            config.extra["pad_token_id"] = ids.pad
    return notes


# ------------------------------------------------------------------------------ where an export may write
_EXPORT_KINDS = ("hf", "peft")  # the manifest kinds of the HF folders step35 writes (hf/folder.py, hf/peft.py)


def is_step35_export(path: str | Path) -> bool:
    """Whether `path` is an HF or PEFT folder step35 wrote (export, save_pretrained): its step35
    manifest says so. The only thing an export replaces without --overwrite."""
    path = Path(path)
    if not path.is_dir():
        return False
    try:
        return manifest_info(path).get("extra", {}).get("kind") in _EXPORT_KINDS
    except CheckpointError:
        return False


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _what_is_there(path: Path) -> str:
    if path.is_symlink():
        return f"a symlink to {os.readlink(path)}"
    if path.is_dir():
        count = sum(1 for _ in path.iterdir())
        return f"a folder of {count} entr{'y' if count == 1 else 'ies'}"
    return "a file" if path.is_file() else "not a file or folder"


def check_out(
    out: str | Path, reads: Mapping[Path, str], overwrite: bool = False, keep_entries: Mapping[Path, str] | None = None
) -> str | None:
    """Refuse, with a one-line CheckpointError, an `out` whose replacement would destroy data; return
    the line saying what an allowed replacement replaces (None when `out` is new).

    `reads` ({path: what it is}): what the export reads; `out` may not be one, hold one, or lie
    inside one (but inside a `keep_entries` folder), even with `overwrite`: replacing it would
    destroy what is being exported, and the export with it. `keep_entries` ({folder: what it is}):
    folders whose existing entries are not the export's (the run folder: its checkpoints, logs,
    config), where `out` may be a new name or an HF folder step35 wrote, nothing else even with
    `overwrite`. Anything else at `out` is replaced only when step35 wrote it, or with `overwrite`."""
    keep_entries = dict(keep_entries or {})
    target = _real(out)
    keeps = {_real(folder) for folder in keep_entries}
    for path, what in reads.items():
        if target == _real(path):
            raise CheckpointError(
                f"--out {out} is {what}, which this export reads: refused, even with --overwrite; choose another --out"
            )
    for path, what in reads.items():
        real = _real(path)
        if real.is_relative_to(target):
            raise CheckpointError(
                f"--out {out} holds {what} ({path}), which this export reads: refused, even with "
                "--overwrite; choose an --out outside it"
            )
        if real not in keeps and target.is_relative_to(real):
            raise CheckpointError(
                f"--out {out} lies inside {what} ({path}), which this export reads: refused, even "
                "with --overwrite; choose an --out outside it"
            )
    for folder, what in keep_entries.items():
        real = _real(folder)
        if target == real or not target.is_relative_to(real):
            continue
        top = real / target.relative_to(real).parts[0]
        if (top.exists() or top.is_symlink()) and not (top == target and is_step35_export(top)):
            raise CheckpointError(
                f"--out {out}: {top.name} is part of {what} {folder}, not an export: refused, even "
                f"with --overwrite; export to a new name there (e.g. {Path(folder) / 'hf'}) "
                "or elsewhere"
            )
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        return None
    if is_step35_export(out):
        return f"replaced the previous step35 export at {out}"
    if overwrite:
        return f"replaced {out}, {_what_is_there(out)} (--overwrite)"
    raise CheckpointError(
        f"--out {out} exists ({_what_is_there(out)}) and is not a folder step35 exported: "
        "refused; pass --overwrite to replace it, or choose another --out"
    )


def _holds_checkpoints(folder: Path, checkpoint: Path) -> bool:
    """Whether `folder`, which holds `checkpoint`, is a folder of checkpoints (a run's checkpoints/,
    a callback's dirpath) whose other entries are checkpoints too."""
    return folder.name == "checkpoints" or any(
        p.name.endswith(".ckpt") and p.name != checkpoint.name for p in folder.iterdir()
    )


def read_paths(
    trained: TrainedCheckpoint,
    given: str | Path,
    source: str | Path | None = None,
    tokenizer: str | Path | None = None,
    model_config: str | Path | None = None,
    run_folder: str | Path | None = None,
) -> dict[Path, str]:
    """{path: what it is} of everything an export of `trained` (named `given`) reads: what its
    `out` must never replace (check_out)."""
    reads: dict[Path, str] = {}

    def add(path: object, what: str) -> None:
        if isinstance(path, (str, Path)) and str(path) and _real(path) not in {_real(p) for p in reads}:
            reads[Path(path).expanduser()] = what

    add(trained.path, "the checkpoint")
    add(given, "the checkpoint")
    add(run_folder, "the run folder of the checkpoint")
    add((trained.meta.get(keys.LORA_BASE) or {}).get("folder"), "the LoRA run's base (model.checkpoint)")
    add(trained.start_folder(), "the HF folder the run started from (model.checkpoint)")
    add(source, "the --source folder")
    add(tokenizer, "the --tokenizer folder")
    named_config = trained.hyper_parameters.get("config")
    if run_vision(trained) is not None and release_config(named_config) is not None and Path(named_config).exists():
        add(named_config, "the run's model.config (its vision_config is exported)")
    if model_config is not None and Path(model_config).expanduser().exists():
        add(model_config, "the --model_config")
    return reads


def prepare_out(
    trained: TrainedCheckpoint,
    given: str | Path,
    out: str | Path,
    overwrite: bool,
    run_folder: str | Path | None,
    say: Callable[[str], None],
    **named_reads,
) -> str | None:
    """The checks and tidying before an export writes `out`: refuse a destructive `out` (check_out),
    then remove the partial copies dead exports left beside it, saying what was removed. Returns the
    line saying what the export will replace (for the report: nothing is replaced before the publish)."""
    keep = {Path(run_folder): "the run folder"} if run_folder else {}
    folder = trained.path.parent
    if _holds_checkpoints(folder, trained.path):
        keep.setdefault(folder, "the checkpoint folder")
    replaced = check_out(out, read_paths(trained, given, run_folder=run_folder, **named_reads), overwrite, keep)
    parent = Path(out).expanduser().absolute().parent
    dead, unknown = dead_partials(parent)
    for path in dead:
        remove_path(path)
        say(
            f"removed {path}, left by an export that was killed (its process, pid {partial_writer(path)[0]} on this "
            "host, is gone)"
        )
    for path in unknown:
        say(
            f"left {path}: a partial copy written by an older step35, which did not record its host; delete it "
            "if no export into this folder is running"
        )
    return replaced


def _write_peft(trained: TrainedCheckpoint, out: str | Path, dtype: torch.dtype) -> list[str]:
    """A LoRA run's checkpoint -> a PEFT adapter folder at `out` (hf/peft.py): its adapters and full-trained
    targets, over the base it records. Returns the notes on what the folder cannot hold."""
    from step35.checkpoint.hf.peft import write_peft_folder

    lora = trained.lora
    targets = lora.expanded_targets()
    adapters = dict(trained.tensors(only=is_adapter))
    full = dict(trained.tensors(only=lambda n: is_full_target(n, targets)))
    notes = write_peft_folder(
        out, adapters, full, lora, trained.config, trained.meta.get(keys.LORA_BASE), trained.start_folder(), dtype
    )
    if (trained.hyper_parameters.get("moe_bias_update_rate") or 0) > 0:
        notes.append(
            "the run moved the router bias (model.moe_bias_update_rate > 0), which a PEFT folder cannot "
            "hold: serving base + adapters uses the base's bias; export with --merge for the exact model"
        )
    return notes


@dataclass
class ExportReport:
    """What `export_checkpoint` wrote: `copied` maps each file besides the weights, index and
    config.json to where it came from; `notes` holds one line per change or path read."""

    out: Path
    checkpoint: Path
    tokenizer: str
    copied: dict[str, str]
    notes: list[str]


def _check_dtype(dtype: torch.dtype | None) -> bool:
    """Whether the export is in FP8 (float8_e4m3fn, the releases' way); refuses the other FP8 dtypes."""
    if dtype in FP8_DTYPES and dtype != torch.float8_e4m3fn:
        raise CheckpointError(
            f"--dtype {str(dtype).removeprefix('torch.')}: step35 writes FP8 folders the releases' way, float8_e4m3fn "
            "with block scales (--dtype float8_e4m3fn); or export in bfloat16 or float32"
        )
    return dtype == torch.float8_e4m3fn


def _check_lora_options(trained: TrainedCheckpoint, merge: bool, fp8: bool) -> None:
    """Refuse --merge for a run without adapters, and FP8 for a PEFT adapter folder."""
    if merge and trained.lora is None:
        raise CheckpointError(
            f"--merge: {trained.path} is not a LoRA run's checkpoint (it records no model.lora); "
            "export it without --merge"
        )
    if fp8 and trained.lora is not None and not merge:
        raise CheckpointError(
            f"--dtype float8_e4m3fn: {trained.path} is a LoRA run's checkpoint, exported as a PEFT adapter folder, "
            "whose adapters are not quantised; add --merge to write the full model in FP8"
        )


def _export_peft(
    trained: TrainedCheckpoint, out: str | Path, dtype: torch.dtype | None, notes: list[str]
) -> ExportReport:
    """A LoRA run without --merge: its adapters alone, as a PEFT folder over the run's base."""
    dtype = dtype or getattr(torch, trained.config.torch_dtype)
    notes = notes + list(trained.notes) + _write_peft(trained, out, dtype)
    notes.append(
        f"a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) over the base "
        f"{trained.start_folder() or 'drawn from the init'}; --merge writes the full model instead"
    )
    return ExportReport(Path(out), trained.path, "none (an adapter folder)", {}, notes)


def _source_folder(trained: TrainedCheckpoint, source: str | Path | None) -> tuple[Path | None, list[str]]:
    """(the HF folder the files besides the weights come from: --source, else the one the run started from,
    the note saying which when it was not given)."""
    notes = []
    if source is None and trained.start_folder():
        source = trained.start_folder()
        notes.append(
            f"files besides the weights taken from {source}, the HF folder the run started from "
            f"(named in {trained.path}; --source overrides)"
        )
    return (Path(source).expanduser() if source else None), notes


def _take_tokenizer(
    trained: TrainedCheckpoint,
    tokenizer: str | Path | None,
    source: Path | None,
    exported: Step35Config,
    files: dict[str, Path | bytes],
    copied: dict[str, str],
) -> tuple[str, list[str]]:
    """Put the tokenizer the run trained with (or `tokenizer`) into `files` and `copied`, over the source's, and
    make `exported`'s special ids agree with it. Returns (where the tokenizer came from, the notes)."""
    if tokenizer:
        tok_files, run_eos, tok_from = run_tokenizer.folder_files(tokenizer), None, str(tokenizer)
    else:
        tok_files, run_eos, tok_from = trained.tokenizer_files()
    replaced = sorted(
        n
        for n, content in tok_files.items()
        if n in files and (files[n] if isinstance(files[n], bytes) else files[n].read_bytes()) != content
    )
    notes = []
    if replaced:
        notes.append(
            f"{', '.join(replaced)} of {source} replaced by {tok_from}: the run trained with another tokenizer"
        )
    files.update(tok_files)
    copied.update({name: tok_from for name in tok_files if name not in copied or name in replaced})
    notes += align_special_ids(exported, run_tokenizer.special_ids(tok_files, tok_from), run_eos)
    return tok_from, notes


def _take_code(
    source: Path | None,
    wrapper: dict | None,
    exported: Step35Config,
    files: dict[str, Path | bytes],
    copied: dict[str, str],
) -> list[str]:
    """Put the modeling code into `files` and `copied` (the release's, else ours with `exported`'s auto_map
    pointing at it), then the remote code the tokenizer names. Returns the notes, with what `source` keeps."""
    notes = []
    if wrapper is not None:  # transformers, vLLM and SGLang load Step-3.7 natively: never our modeling file
        model_code = _release_model_code(source, wrapper.get("auto_map")) or {}
    else:
        model_code = _release_model_code(source, exported.extra.get("auto_map"))
    if model_code is None:  # the source brings no modeling code: ours, which computes what step35.model does
        files[MODELING_FILE.name] = MODELING_FILE.read_bytes()
        copied[MODELING_FILE.name] = "step35 (its transformers modeling file)"
        notes.append(_our_modeling_note(source, exported.extra.get("auto_map")))
        exported.extra["auto_map"] = dict(AUTO_MAP)
    if source is None:
        return notes
    # remote code for the config.json and tokenizer_config.json written
    code, missing = _remote_code(source, remote_code_modules([_auto_map(files.get("tokenizer_config.json"))]))
    code.update(model_code or {})
    files.update(code)
    copied.update({name: str(file) for name, file in code.items()})
    if missing:
        notes.append(
            f"remote code {', '.join(m + '.py' for m in missing)} (named by tokenizer_config.json's "
            f"auto_map or imported by its code) is not in {source}: loading the tokenizer with "
            "trust_remote_code will fail"
        )
    return notes + _left_out(source, files)


def _quantization(
    source: Path | None,
    wrapper: dict | None,
    exported: Step35Config,
    carried: Mapping[str, TensorInfo],
    fp8: bool,
    dtype: torch.dtype,
    layout: Layout | None = None,
    vision_from_run: bool = False,
) -> tuple[dict | None, dict | None, list[str]]:
    """(config.json's quantization entry of an FP8 export, else None; the wrapper without its quantization
    entry; the note). An FP8 start folder (fp8.py) was read dequantised: its quantization_config describes
    weights not written, unless this export is in FP8 too, which keeps the start folder's block and list of
    modules not converted (without one, the block is the largest up to the releases' that transformers can read
    for `exported`'s matrices, in `layout`'s names: fp8.loadable_block); the run's own vision side
    (`vision_from_run`) is named in its list, left in bf16 as the releases leave it. Removes `exported`'s
    quantization entry."""
    started = source_entry(source) if source is not None and source.is_dir() else None
    quantized = exported.extra.pop(QUANTIZATION_KEY, None) is not None
    if wrapper is not None:
        wrapper, dropped = without_quantization(wrapper)
        quantized = quantized or dropped
    if fp8:
        shapes = matrix_shapes(exported, layout.stored_name if layout else None)
        entry = export_entry(started, carried, shapes)
        if vision_from_run:
            kept = entry["modules_to_not_convert"]
            entry["modules_to_not_convert"] = kept + [m for m in VISION_MODULES if not skipped(m, kept)]
        block, not_converted = list(entry["weight_block_size"]), entry["modules_to_not_convert"]
        own = ", the start folder's own" if started else ""
        return (
            entry,
            wrapper,
            [
                f"weights written in float8_e4m3fn, block-quantised in blocks of {block} with float32 inverse "
                f"scales <name>{SCALE_SUFFIX} (config.json's {QUANTIZATION_KEY}{own}); left in bfloat16: "
                f"{', '.join(not_converted)} and the norms; the router bias in float32",
                *block_notes(started, entry, shapes),
            ],
        )
    if not quantized:
        return None, wrapper, []
    block = tuple(started["weight_block_size"]) if started else None
    stored = f"FP8 (float8_e4m3fn, scale blocks {list(block)})" if block else "FP8"
    return (
        None,
        wrapper,
        [
            f"the run started from a folder stored in {stored}, read dequantised: the weights are written in "
            f"{str(dtype).removeprefix('torch.')}, and config.json has no {QUANTIZATION_KEY} (--dtype "
            "float8_e4m3fn writes the release's FP8 layout)"
        ],
    )


def _export_tensors(
    trained: TrainedCheckpoint,
    layout: Layout | None,
    carried: Mapping[str, TensorInfo],
    entry: dict | None,
    dtype: torch.dtype,
    high: torch.dtype,
    vision_from_run: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trained tensors (adapters merged) in the release's names (`layout`), router_bias in float32 and the
    rest in `dtype`, or quantised as `entry` says from the checkpoint's own precision; then what the start
    folder carries, in place of the run's own vision tensors (a frozen vision side: `_vision_side`), which must
    then be the same tensors by name and shape. A name written twice is refused, and so is an export that should
    write the run's vision side (`vision_from_run`) from a checkpoint that holds none."""
    frozen: dict[str, tuple[int, ...]] = {}  # the run's vision tensors that the carried ones stand for

    def run_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in trained.merged_tensors():
            if carried and is_vision_tensor(name):
                frozen[name] = tuple(tensor.shape)
                continue
            yield (layout.stored_name(name) if layout else name), tensor

    if entry is None:
        written = ((n, t.to(torch.float32 if n.endswith("router_bias") else dtype)) for n, t in run_tensors())
    else:
        written = quantized_tensors(
            run_tensors(), tuple(entry["weight_block_size"]), entry["modules_to_not_convert"], high
        )
    seen: set[str] = set()
    for name, tensor in itertools.chain(written, carried_tensors(carried, dtype, keep_fp8=entry is not None)):
        if name in seen:
            raise CheckpointError(
                f"{trained.path}: the export would write {name} twice (the run's and the start folder's)"
            )
        seen.add(name)
        yield name, tensor
    _check_frozen(trained, frozen, carried)
    if vision_from_run and not any(map(is_vision_tensor, seen)):
        raise CheckpointError(
            f"{trained.path}: the run has a vision side (model.vision) but its checkpoint holds no vision tensor "
            "to export (a LoRA run's frozen base is not saved): pass --source <the Step-3.7 folder it started from>"
        )


def _check_frozen(
    trained: TrainedCheckpoint, frozen: dict[str, tuple[int, ...]], carried: Mapping[str, TensorInfo]
) -> None:
    """Refuse carried vision tensors that are not the ones the run held frozen (names and shapes): a --source
    whose vision side is another model's."""
    if not frozen:
        return
    differ = sorted(
        n for n in set(frozen) | set(carried) if frozen.get(n) != (carried[n].shape if n in carried else None)
    )
    if differ:
        name = differ[0]
        ours, theirs = frozen.get(name), carried[name].shape if name in carried else None
        raise CheckpointError(
            f"{trained.path}: its frozen vision tensor {name} ({list(ours) if ours else 'absent'}) is not the start "
            f"folder's ({list(theirs) if theirs else 'absent'}; {len(differ)} tensor(s) differ): pass --source <the "
            "Step-3.7 folder the run started from>"
        )


def run_vision(trained: TrainedCheckpoint) -> dict | None:
    """The run's `model.vision` ({"train": bool}: its checkpoint holds the vision side), None for a language model
    alone."""
    vision = trained.hyper_parameters.get("vision")
    return vision if isinstance(vision, dict) else None


def _vision_changed(trained: TrainedCheckpoint, vision: dict) -> str | None:
    """How the run changed its vision side (model.vision.train, or LoRA adapters on it, merged), None if frozen."""
    if vision.get("train"):
        return "trained (model.vision.train true)"
    lora = trained.lora
    targets = sorted(set(lora.targets) & set(VISION_TARGETS)) if lora is not None else []
    return f"with LoRA adapters on {', '.join(targets)} merged" if targets else None


def _vision_side(
    trained: TrainedCheckpoint,
    source: Path | None,
    wrapper: dict | None,
    carried: Mapping[str, TensorInfo],
    high: torch.dtype,
) -> tuple[dict | None, bool, list[str]]:
    """(the Step-3.7 config.json to wrap the trained language model's config in, or None for a Step-3.5 export;
    whether the run's own vision tensors are written, in the export's dtype; the note). A run with model.vision
    holds its vision side: written when the run changed it, or when no start folder carries one (from scratch:
    the config.json is then model.config's, `release_config`); a frozen one is copied from the start folder as
    stored (byte for byte). Without model.vision, a Step-3.7 start folder's vision tensors are carried as they are."""
    vision = run_vision(trained)
    if vision is None:
        note = (
            f"a Step-3.7 folder as {source} is: config.json wraps the trained language model's config as "
            "text_config; its vision encoder and projector tensors are copied from there as they are"
        )
        return wrapper, False, [note] if wrapper is not None else []
    changed = _vision_changed(trained, vision)
    where = f"{source}'s"
    if wrapper is None:
        hparams = trained.hyper_parameters
        named = [(key, hparams.get(key)) for key in ("checkpoint", "config") if release_config(hparams.get(key))]
        if not named:
            raise CheckpointError(
                f"{trained.path}: the run trained a Step-3.7 model (model.vision), but neither --source, "
                f"model.checkpoint ({hparams.get('checkpoint')}) nor model.config ({hparams.get('config')}) is a "
                "Step-3.7 config.json to write its vision side with; pass --source <the Step-3.7 folder>"
            )
        key, value = named[0]
        wrapper = release_config(value)
        wrapper["dtype" if "dtype" in wrapper else "torch_dtype"] = str(high).removeprefix("torch.")
        where = f"model.{key} {value}'s (named in {trained.path})"
    head = (
        f"a Step-3.7 folder: config.json is {where} with the trained language model's config as text_config; its "
        "vision encoder and projector tensors are "
    )
    if changed is None and carried:
        return wrapper, False, [head + f"copied from {source} as stored (frozen: model.vision.train false)"]
    state = changed or "frozen, as the run held them (no start folder here carries them)"
    return wrapper, True, [head + f"the run's, {state}, in {str(high).removeprefix('torch.')}"]


def _export_full(
    trained: TrainedCheckpoint,
    out: str | Path,
    dtype: torch.dtype | None,
    fp8: bool,
    max_shard_size: int | str,
    tokenizer: str | Path | None,
    source: str | Path | None,
    notes: list[str],
) -> ExportReport:
    """The whole model (a LoRA run's adapters merged) as an HF folder, with the files besides the weights."""
    exported = Step35Config.from_dict(trained.config.to_dict())
    dtype = dtype or getattr(torch, exported.torch_dtype)
    high = torch.bfloat16 if fp8 else dtype  # what an FP8 export keeps unquantised is bf16, as in the releases
    exported.torch_dtype = str(high).removeprefix("torch.")
    notes = notes + list(trained.notes)
    if trained.lora is not None:
        notes.append(
            f"LoRA adapters merged into their weights: W + (alpha/r)·BA with alpha={trained.lora.scale_alpha:g}, "
            f"r each adapter's rank, computed in float32"
        )
    source, more = _source_folder(trained, source)
    notes += more
    files: dict[str, Path | bytes] = dict(companion_files(source)) if source else {}
    copied = {name: str(file) for name, file in files.items()}
    tok_from, more = _take_tokenizer(trained, tokenizer, source, exported, files, copied)
    notes += more
    wrapper = None if source is None else wrapping_config(source)
    layout, carried = None, {}
    if wrapper is not None:
        _, carried, layout = model_tensor_infos(source)
    wrapper, from_run, more = _vision_side(trained, source, wrapper, carried, high)
    notes += _take_code(source, wrapper, exported, files, copied) + more
    if from_run:
        carried = {}
    entry, wrapper, more = _quantization(source, wrapper, exported, carried, fp8, dtype, layout, from_run)
    notes += more
    tensors = _export_tensors(trained, layout, carried, entry, dtype, high, from_run)
    config = exported if wrapper is None else {**wrapper, "text_config": exported.to_dict()}
    write_hf_folder(out, tensors, config, max_shard_size, copy_files=files, quantization=entry)
    return ExportReport(Path(out), trained.path, tok_from, dict(sorted(copied.items())), notes)


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    config: Step35Config | None = None,
    tokenizer: str | Path | None = None,
    source: str | Path | None = None,
    merge: bool = False,
    overwrite: bool = False,
    run_folder: str | Path | None = None,
    model_config: str | Path | None = None,
    say: Callable[[str], None] | None = None,
) -> ExportReport:
    """Write `out` as an HF checkpoint folder; router_bias stays fp32, other weights take `dtype`
    (default: the config's torch_dtype). `config`: for checkpoints that record none; `tokenizer`: a
    tokenizer folder instead of the run's; `source`: the HF folder the run started from (default: the
    one the checkpoint names); `merge`: a LoRA run's adapters merged into the weights, W + (alpha/r)·BA
    computed in fp32 (refused for a run without adapters); a LoRA run without `merge` writes a PEFT
    adapter folder instead (checkpoint/hf/peft.py). `out` is checked first (`check_out`: `overwrite`
    lets it replace what step35 did not write; `run_folder`, the checkpoint's run folder, and
    `model_config`, the file `config` came from, are never replaced). `say` hears, as they happen,
    which dead exports' partial copies are removed (default: into the notes).
    Returns what was written and every change made to config.json."""
    fp8 = _check_dtype(dtype)
    trained = open_checkpoint(checkpoint, config)
    _check_lora_options(trained, merge, fp8)
    early: list[str] = []
    replaced = prepare_out(
        trained,
        checkpoint,
        out,
        overwrite,
        run_folder,
        say or early.append,
        source=source,
        tokenizer=tokenizer,
        model_config=model_config,
    )
    if replaced:
        early.append(replaced)
    if trained.lora is not None and not merge:  # the adapters alone, as a PEFT folder over the run's base
        return _export_peft(trained, out, dtype, early)
    return _export_full(trained, out, dtype, fp8, max_shard_size, tokenizer, source, early)
