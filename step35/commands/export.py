"""`step35 export`: a training checkpoint -> an HF folder that loads as it is.

    step35 export --checkpoint runs/tiny --out hf_out/ [--dtype bfloat16] [--max_shard_size 5GB]
                  [--source <the HF folder the run started from>] [--tokenizer <folder>]
                  [--merge true]  (a LoRA run: the adapters merged into the weights; without: a PEFT folder)

The work is `step35.checkpoint.export.export_checkpoint` (what lands in the folder is described
there); this command parses the options and prints each file written besides the weights, with
where it came from, then every change to config.json and every path read from the checkpoint.
"""

from __future__ import annotations

import sys
from typing import Literal

import torch

from step35.checkpoint.export import export_checkpoint
from step35.commands.function_cli import run_function
from step35.config import load_config
from step35.run import checkpoint_of


def export(checkpoint: str, out: str, dtype: Literal["bfloat16", "float32", "float16"] | None = None,
           max_shard_size: str = "5GB", tokenizer: str | None = None, source: str | None = None,
           model_config: str | None = None, merge: bool = False) -> None:
    """Write a training checkpoint as an HF folder (config.json, safetensors shards, index, tokenizer),
    published atomically with a manifest.

    Args:
        checkpoint: a .ckpt file, a sharded checkpoint folder, or a run folder (its newest intact checkpoint,
            the one --ckpt_path last resumes).
        out: the HF folder to write (replaced atomically if it exists).
        dtype: dtype of the exported weights (router_bias stays float32); default: the config's torch_dtype.
        max_shard_size: largest safetensors shard, e.g. 5GB, 500MiB.
        tokenizer: a tokenizer folder to export instead of the one the run trained with.
        source: the HF folder the run started from, whose tokenizer, chat template, generation config, readme,
            licence and auto_map remote code are copied (default: the model.checkpoint the checkpoint names).
        model_config: the model config (preset, config.json or folder) for checkpoints that record none.
        merge: for a LoRA run (model.lora): write the full model with the adapters merged into the weights,
            W + (alpha/r)·BA (docs/lora.md); without it a LoRA run is written as a PEFT adapter folder. Refused
            for a run without adapters.
    """
    say = lambda line: print(f"step35 export: {line}", file=sys.stderr)  # noqa: E731
    done = export_checkpoint(checkpoint_of(checkpoint, say), out, getattr(torch, dtype) if dtype else None, max_shard_size,
                             load_config(model_config) if model_config else None, tokenizer, source, merge)
    for name, origin in done.copied.items():
        print(f"step35 export: copied {name} from {origin}")
    for note in done.notes:
        print(f"step35 export: {note}", file=sys.stderr)
    print(f"step35 export: wrote {done.out} from {done.checkpoint} (tokenizer: {done.tokenizer})")


def main(argv: list[str] | None = None) -> None:
    run_function(export, "step35 export", argv)


if __name__ == "__main__":
    main()
