"""A training checkpoint -> an HF folder that loads as it is (the library behind `step35 export`).

The weights come from `trained.open_checkpoint` and are written by `hf.write_hf_folder` (shards,
index, manifest, one atomic publish); a LoRA run's are exported with `merge`, its adapters merged
into the weights (`TrainedCheckpoint.merged_tensors`), or without it as a PEFT adapter folder
(`peft.write_peft_folder`, nothing else written). What lands next to a full export's weights:
- From the HF folder the run started from (`--source`, else the `model.checkpoint` the checkpoint
  names), only files of the kinds an HF model folder publishes, looked up by name at its top level,
  never by walking it: the tokenizer files, chat template and generation config
  (`run_tokenizer.TOKENIZER_FILES`), the model card and licence (`CARD_FILES`), and the remote code
  `auto_map` names (with the modules that code imports relatively). The folder is named by a file
  from elsewhere; a checkpoint naming a home folder must not publish its `id_rsa`. config.json keeps
  the start folder's fields (auto_map included), as training read them.
- Our own transformers modeling file (`hf_modeling/modeling_step35.py`, config and causal LM in one
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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from step35.checkpoint import run_tokenizer
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf_modeling import AUTO_MAP, MODELING_FILE
from step35.checkpoint.hf import write_hf_folder
from step35.checkpoint.trained import open_checkpoint
from step35.config import Step35Config

# Model card and licence files, by the names the Hugging Face hub gives them.
CARD_FILES = ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "USE_POLICY.md")
COMPANION_FILES = run_tokenizer.TOKENIZER_FILES + CARD_FILES
# What an export writes anew (weights, their index, config.json, manifests): not worth a mention when left out.
_REWRITTEN = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json",
              ".manifest.json")
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
    modules that are not there."""
    found: dict[str, Path] = {}
    missing = []
    todo = list(modules)
    while todo:
        module = todo.pop(0)
        name = f"{module}.py"
        if name in found or module in missing:
            continue
        file = folder / name
        if not module.isidentifier() or not file.is_file():  # an identifier: no path separator, no ".."
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
    return (f"{MODELING_FILE.name} written ({why}; transformers loads it with trust_remote_code); "
            + (f"auto_map {old} -> {AUTO_MAP}" if old else f"auto_map {AUTO_MAP} added"))


def companion_files(folder: Path) -> dict[str, Path]:
    """{name: file} of the COMPANION_FILES at the top of `folder` (an HF folder: it holds a config.json)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: the run started from this HF folder (model.checkpoint), which is gone; "
                              "pass --source <where it is now> (its remote code, tokenizer and readme are copied)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: named as the HF folder the run started from, but it holds no config.json; "
                              "pass --source <the HF folder> (its remote code, tokenizer and readme are copied)")
    return {name: folder / name for name in COMPANION_FILES if (folder / name).is_file()}


def _left_out(folder: Path, taken: Iterable[str]) -> str | None:
    """One line naming what of `folder` stays behind, besides what the export writes anew."""
    skip = set(taken) | {"config.json"}
    rest = sorted(p.name for p in folder.iterdir() if p.name not in skip and not p.name.endswith(_REWRITTEN))
    if not rest:
        return None
    shown = ", ".join(rest[:8]) + (f" and {len(rest) - 8} more" if len(rest) > 8 else "")
    return f"left out of {folder}: {shown} (only known HF file kinds are copied)"


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
    """What `export_checkpoint` wrote: `copied` maps each file besides the weights, index and
    config.json to where it came from; `notes` holds one line per change or path read."""

    out: Path
    checkpoint: Path
    tokenizer: str
    copied: dict[str, str]
    notes: list[str]


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                      max_shard_size: int | str = "5GB", config: Step35Config | None = None,
                      tokenizer: str | Path | None = None, source: str | Path | None = None,
                      merge: bool = False) -> ExportReport:
    """Write `out` as an HF checkpoint folder; router_bias stays fp32, other weights take `dtype`
    (default: the config's torch_dtype). `config`: for checkpoints that record none; `tokenizer`: a
    tokenizer folder instead of the run's; `source`: the HF folder the run started from (default: the
    one the checkpoint names); `merge`: a LoRA run's adapters merged into the weights, W + (alpha/r)·BA
    computed in fp32 (refused for a run without adapters); a LoRA run without `merge` writes a PEFT
    adapter folder instead (checkpoint/peft.py). Returns what was written and every change made to
    config.json."""
    trained = open_checkpoint(checkpoint, config)
    lora = trained.lora
    if merge and lora is None:
        raise CheckpointError(f"--merge: {trained.path} is not a LoRA run's checkpoint (it records no model.lora); "
                              "export it without --merge")
    if lora is not None and not merge:  # the adapters alone, as a PEFT folder over the run's base
        from step35.checkpoint.peft import write_peft_folder

        dtype = dtype or getattr(torch, trained.config.torch_dtype)
        notes = list(trained.notes) + write_peft_folder(trained, out, dtype)
        notes.append(f"a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) over the base "
                     f"{trained.start_folder() or 'drawn from the init'}; --merge writes the full model instead")
        return ExportReport(Path(out), trained.path, "none (an adapter folder)", {}, notes)
    exported = Step35Config.from_dict(trained.config.to_dict())
    dtype = dtype or getattr(torch, exported.torch_dtype)
    exported.torch_dtype = str(dtype).removeprefix("torch.")
    notes = list(trained.notes)
    if lora is not None:
        notes.append(f"LoRA adapters merged into their weights: W + (alpha/r)·BA with alpha={lora.scale_alpha:g}, "
                     f"r each adapter's rank, computed in float32")

    if source is None and trained.start_folder():
        source = trained.start_folder()
        notes.append(f"files besides the weights taken from {source}, the HF folder the run started from "
                     f"(named in {trained.path}; --source overrides)")
    source = Path(source).expanduser() if source else None
    files: dict[str, Path | bytes] = dict(companion_files(source)) if source else {}
    copied = {name: str(file) for name, file in files.items()}

    if tokenizer:
        tok_files, run_eos, tok_from = run_tokenizer.folder_files(tokenizer), None, str(tokenizer)
    else:
        tok_files, run_eos, tok_from = trained.tokenizer_files()
    replaced = sorted(n for n, content in tok_files.items()
                      if n in files and (files[n] if isinstance(files[n], bytes) else files[n].read_bytes()) != content)
    if replaced:
        notes.append(f"{', '.join(replaced)} of {source} replaced by {tok_from}: the run trained with another tokenizer")
    files.update(tok_files)
    copied.update({name: tok_from for name in tok_files if name not in copied or name in replaced})
    notes += align_special_ids(exported, run_tokenizer.special_ids(tok_files, tok_from), run_eos)

    model_code = _release_model_code(source, exported.extra.get("auto_map"))
    if model_code is None:  # the source brings no modeling code: ours, which computes what step35.model does
        files[MODELING_FILE.name] = MODELING_FILE.read_bytes()
        copied[MODELING_FILE.name] = "step35 (its transformers modeling file)"
        notes.append(_our_modeling_note(source, exported.extra.get("auto_map")))
        exported.extra["auto_map"] = dict(AUTO_MAP)
    if source is not None:  # remote code for the config.json and tokenizer_config.json written
        code, missing = _remote_code(source, remote_code_modules([_auto_map(files.get("tokenizer_config.json"))]))
        code.update(model_code or {})
        files.update(code)
        copied.update({name: str(file) for name, file in code.items()})
        if missing:
            notes.append(f"remote code {', '.join(m + '.py' for m in missing)} (named by tokenizer_config.json's "
                         f"auto_map or imported by its code) is not in {source}: loading the tokenizer with "
                         "trust_remote_code will fail")
        left = _left_out(source, files)
        if left:
            notes.append(left)

    def cast() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in trained.merged_tensors():  # = tensors() without adapters
            yield name, tensor.to(torch.float32 if name.endswith("router_bias") else dtype)

    write_hf_folder(out, cast(), exported, max_shard_size, copy_files=files)
    return ExportReport(Path(out), trained.path, tok_from, dict(sorted(copied.items())), notes)

