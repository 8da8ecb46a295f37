"""`step35 <subcommand> ...`: the dispatcher. Each subcommand's module is imported only when it runs:
fit and validate are LightningCLI (step35/commands/fit.py), export, generate, eval, plan and plot their own."""

from __future__ import annotations

import atexit
import gc
import sys

SUBCOMMANDS = """usage: step35 {fit,validate,export,generate,eval,plan,plot} ...

  fit       train (LightningCLI): step35 fit --config configs/tiny.yaml
  validate  the validation loss of a model or checkpoint (LightningCLI):
            step35 validate --config configs/tiny.yaml --ckpt_path last
  export    write a training checkpoint as an HF folder with its tokenizer:
            step35 export --checkpoint runs/tiny --out hf_out [--dtype bfloat16]
  generate  text from a run checkpoint or an HF folder:
            step35 generate --checkpoint runs/tiny --prompt "The for statement"
  eval      how good is it: held-out loss, tasks with pass@k, the quality gate, MTP drafts, lm-eval:
            step35 eval --checkpoint runs/tiny-sft [--data held_out.jsonl] [--gate]
  plan      will a training config fit on its devices, and how fast could it go:
            step35 plan --config configs/flash-196b-4k-npu.yaml [any fit option]
  plot      a run's training curves (loss, learning rate, grad norm, tokens/s, rewards) as a PNG:
            step35 plot runs/tiny        (-> runs/tiny/plots/training.png; fit writes it at its end too)

`step35 <subcommand> --help` lists each one's options."""


def main(args: list[str] | None = None) -> None:
    """`step35 fit|validate ...` (LightningCLI), `step35 export|generate|eval|plan|plot ...`."""
    if args is None:  # this process is the command (not a caller's `main([...])`)
        # Registered before anything else, so run after every other exit handler: the objects that
        # torch, Lightning and the model left are frozen, and the interpreter's final garbage
        # collections skip them (about 2 s of every process's exit on a 2-core machine, per rank).
        # Nothing is lost: atexit handlers have run, and files are closed as their modules clear.
        atexit.register(gc.freeze)
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(SUBCOMMANDS)
        return None
    if argv[0] in ("export", "generate", "eval", "plan", "plot"):
        if argv[0] == "export":
            from step35.commands.export import main as run
        elif argv[0] == "generate":
            from step35.commands.generate import main as run
        elif argv[0] == "eval":
            from step35.commands.eval import main as run
        elif argv[0] == "plot":
            from step35.commands.plot import main as run
        else:
            from step35.plan.cli import run
        return run(argv[1:])
    from step35.commands.fit import run

    return run(args)


if __name__ == "__main__":
    main()
