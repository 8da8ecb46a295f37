"""`step35 fit --config configs/tiny.yaml`: LightningCLI over the module, the data and the trainer.

Every option comes from YAML and can be overridden on the command line; the resolved config is
saved into the run folder and sent to the loggers together with the code version.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import step35.accelerators  # noqa: F401  (registers --trainer.accelerator npu)
from step35.module import Step35LightningModule


def code_version() -> str:
    """The git commit of the step35 checkout (with '+dirty' when it has changes), or the package version."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from step35 import __version__

        return __version__


class Step35SaveConfig(SaveConfigCallback):
    """Writes config.yaml into the run folder and sends the resolved config to every logger."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        config = self.config.as_dict()
        config["code_version"] = code_version()
        for logger in trainer.loggers:
            logger.log_hyperparams(config)


class Step35CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.default_root_dir": "runs"})

    def before_instantiate_classes(self) -> None:
        # The HF checkpoint folder carries its own tokenizer: use it unless data.tokenizer says otherwise.
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.get("data") is not None and not config.data.get("tokenizer") and config.model.get("checkpoint"):
            config.data.tokenizer = config.model.checkpoint


SUBCOMMANDS = """usage: step35 {fit,validate,export,plan} ...

  fit       train (LightningCLI): step35 fit --config configs/tiny.yaml
  validate  validate a model or checkpoint (LightningCLI)
  export    write a training checkpoint as an HF folder: step35 export --help
  plan      will a training config fit on its devices, and how fast could it go:
            step35 plan --config configs/flash-196b-4k-npu.yaml [any fit option]

`step35 <subcommand> --help` lists each one's options."""


def main(args: list[str] | None = None) -> None:
    """`step35 fit|validate ...` (LightningCLI), `step35 export ...`, `step35 plan ...`."""
    import sys

    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(SUBCOMMANDS)
        return None
    if argv and argv[0] in ("export", "plan"):
        if argv[0] == "export":
            from step35.checkpoint.export import main as run
        else:
            from step35.plan.cli import run
        return run(argv[1:])
    from step35.data import Step35DataModule

    Step35CLI(
        Step35LightningModule,
        Step35DataModule,
        save_config_callback=Step35SaveConfig,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
