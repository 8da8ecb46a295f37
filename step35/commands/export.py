"""`step35 export`: a training checkpoint -> an HF folder that loads as it is.

    step35 export --checkpoint runs/tiny --out hf_out/ [--dtype bfloat16] [--max_shard_size 5GB]
                  [--source <the HF folder the run started from>] [--tokenizer <folder>]
                  [--merge true]  (a LoRA run: the adapters merged into the weights; without: a PEFT folder)
                  [--overwrite true]  (replace an --out that step35 did not write)

The work is `step35.checkpoint.training.export.export_checkpoint` (what lands in the folder, and which
`--out` it refuses, is described there); this command parses the options, finds the checkpoint's
run folder (never to be replaced), and prints each file written besides the weights, with where it
came from, then every change to config.json and every path read from the checkpoint. A run that trained
Step-3.7's vision side (`model.vision`) exports it under the release's names, or copies a frozen one from its
start folder as stored.

A run folder may be live (another job training in it, pruning old checkpoints with keep_last): when
the checkpoint picked from it is removed or replaced while it is read, the export starts again from
the run's newest intact checkpoint then, and says so. A failed write (a full disk above all) ends in
one line naming the file, the partial copy removed and any previous `--out` untouched.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Literal

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.peft import check_not_adapter_folder
from step35.checkpoint.training.export import export_checkpoint
from step35.checkpoint.training.trainer_io import disk_full, file_size_limit
from step35.commands.function_cli import run_function
from step35.config import load_config
from step35.run import RunFolder
from step35.run.layout import CHECKPOINTS
from step35.run.lock import live_holder
from step35.run.resolution import read_checkpoint


def _is_run_folder(folder: Path) -> bool:
    run = RunFolder(folder)
    return run.config.is_file() or run.lock_file.exists() or run.checkpoints.is_dir()


def run_folder_of(given: Path, chosen: Path) -> Path | None:
    """The run folder of the checkpoint exported: `given` when it names a run folder (or its
    checkpoints/ folder), else the folder above the checkpoint's checkpoints/ (or the checkpoint's
    own folder when it holds a run's config or lock); None for a checkpoint outside any run folder."""
    if given.is_dir() and not given.is_symlink() and given != chosen:  # a run folder or its checkpoints/
        return given.parent if given.name == CHECKPOINTS and _is_run_folder(given.parent) else given
    folder = Path(os.path.realpath(chosen)).parent
    if folder.name == CHECKPOINTS and _is_run_folder(folder.parent):
        return folder.parent
    return folder if RunFolder(folder).config.is_file() or RunFolder(folder).lock_file.exists() else None


def _write_failure(error: BaseException, out: Path) -> str:
    """The one line for an export that failed writing (its partial copy already removed)."""
    where = getattr(error, "filename", None) or out
    parent = out.expanduser().absolute().parent
    after = f"the partial export was removed; {out} is as it was before"
    if disk_full(error, parent):
        try:
            free = f"{shutil.disk_usage(parent).free / 2**30:.2f} GiB free there now, "
        except OSError:
            free = ""
        return (
            f"step35: export failed: no space left on device writing {where} ({free}the export needs room for "
            f"a full copy of the weights); {after}"
        )
    limit = file_size_limit(error)
    if limit is not None:
        return f"step35: export failed: {where} would be larger than {limit} (EFBIG); {after}"
    reason = os.strerror(error.errno) if isinstance(error, OSError) and error.errno else str(error)
    return f"step35: export failed: {reason} ({where}); {after}"


def export(
    checkpoint: str,
    out: str,
    dtype: Literal["bfloat16", "float32", "float16", "float8_e4m3fn"] | None = None,
    max_shard_size: str = "5GB",
    tokenizer: str | None = None,
    source: str | None = None,
    model_config: str | None = None,
    merge: bool = False,
    overwrite: bool = False,
) -> None:
    """Write a training checkpoint as an HF folder (config.json, safetensors shards, index, tokenizer),
    published atomically with a manifest.

    Args:
        checkpoint: a .ckpt file, a sharded checkpoint folder, or a run folder (its newest intact checkpoint,
            the one --ckpt_path last resumes).
        out: the HF folder to write. An existing one is replaced atomically when step35 wrote it (an export);
            anything else only with --overwrite. Never the checkpoint, its run folder or its entries, the LoRA
            base or any folder the export reads, nor a folder holding one, nor a live run's folder (its lock
            held) or one holding it.
        dtype: dtype of the exported weights (router_bias stays float32); default: the config's torch_dtype.
            float8_e4m3fn writes the FP8 releases' layout: matrices block-quantised with float32 inverse scales
            <name>_scale_inv (the start folder's block, else the largest up to 128 x 128 that cuts every matrix
            whole, which transformers' FP8 loader needs), the embedding, LM heads, router and norms in bfloat16,
            and config.json's quantization_config (docs/checkpoints.md).
        max_shard_size: largest safetensors shard, e.g. 5GB, 500MiB.
        tokenizer: a tokenizer folder to export instead of the one the run trained with.
        source: the HF folder the run started from, whose tokenizer, chat template, generation config, readme,
            licence and auto_map remote code are copied (default: the model.checkpoint the checkpoint names).
        model_config: the model config (preset, config.json or folder) for checkpoints that record none.
        merge: for a LoRA run (model.lora): write the full model with the adapters merged into the weights,
            W + (alpha/r)·BA (docs/lora.md); without it a LoRA run is written as a PEFT adapter folder. Refused
            for a run without adapters.
        overwrite: replace an existing --out that is not a step35 export (a file, another folder).
    """
    say = lambda line: print(f"step35 export: {line}", file=sys.stderr)  # noqa: E731

    def export_from(chosen: Path):
        return export_checkpoint(
            chosen,
            out,
            getattr(torch, dtype) if dtype else None,
            max_shard_size,
            load_config(model_config) if model_config else None,
            tokenizer,
            source,
            merge,
            overwrite=overwrite,
            run_folder=run_folder_of(Path(checkpoint), chosen),
            model_config=model_config,
            say=say,
        )

    check_not_adapter_folder(checkpoint, "--checkpoint")
    holder = live_holder(out) if Path(out).is_dir() else None
    if holder:  # its lock is proof of life: replacing the folder would delete a running job's saves and logs
        raise CheckpointError(
            f"--out {out} is, or holds, the folder of a live run ({holder}): refused, even with --overwrite; "
            "choose another --out, or wait for that run to end"
        )
    try:
        done = read_checkpoint(checkpoint, export_from, say)
    except CheckpointError:
        raise
    except OSError as error:  # a write that failed (reads failing on a checkpoint as it was are CheckpointErrors)
        raise SystemExit(_write_failure(error, Path(out))) from None
    except Exception as error:  # e.g. safetensors' own error type for a failed write
        if not disk_full(error, Path(out).expanduser().absolute().parent) and file_size_limit(error) is None:
            raise
        raise SystemExit(_write_failure(error, Path(out))) from None
    for name, origin in done.copied.items():
        print(f"step35 export: copied {name} from {origin}")
    for note in done.notes:
        print(f"step35 export: {note}", file=sys.stderr)
    print(f"step35 export: wrote {done.out} from {done.checkpoint} (tokenizer: {done.tokenizer})")


def main(argv: list[str] | None = None) -> None:
    run_function(export, "step35 export", argv)


if __name__ == "__main__":
    main()
