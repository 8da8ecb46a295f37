"""`step35 fit --config configs/tiny.yaml`: LightningCLI over the module, the data and the trainer;
`step35 export|generate|plan` dispatched to their modules (`step35 --help` lists them all).

Every option comes from YAML and can be overridden on the command line. A run lives in one folder,
`--run_dir` (default `runs/<name of the config file>`), across all its attempts:

    runs/tiny/config.yaml            the resolved config of the latest attempt
    runs/tiny/checkpoints/           step=NNNNNN.ckpt (+ manifests), last.ckpt -> the newest
    runs/tiny/csv/version_N/         metrics (and hparams.yaml) of attempt N
    runs/tiny/wandb/                 when the wandb logger is on

`--ckpt_path last` resumes the newest complete checkpoint of the run, `--ckpt_path auto` the same
or, when there is none, starts from scratch (for automatic restarts). What a resume may change is
decided in step35/resume.py: the command line wins, a different model shape is refused.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import step35.accelerators  # noqa: F401  (registers --trainer.accelerator npu)
from step35.checkpoint import catalog
from step35.checkpoint.integrity import verify
from step35.module import Step35LightningModule

# LightningCLI replaces the command line's model options by the hyper_parameters saved in a
# single-file checkpoint (but not in a sharded one) in this private method; step35 switches that
# off (see Step35CLI._parse_ckpt_path). If Lightning renames it, the switch would silently stop.
if not callable(getattr(LightningCLI, "_parse_ckpt_path", None)):
    raise ImportError("lightning.pytorch.cli.LightningCLI._parse_ckpt_path is gone: step35.cli overrides it so that "
                      "--ckpt_path does not replace command-line model options; adapt Step35CLI to this Lightning")


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
    """Writes config.yaml into the run folder (each attempt replaces it; every attempt's config also
    reaches its loggers, e.g. csv/version_N/hparams.yaml) with the code version."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        run_dir = Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, run_dir / self.config_filename, skip_none=False, overwrite=True,
                         multifile=self.multifile)
        config = self.config.as_dict()
        config["code_version"] = code_version()
        for logger in trainer.loggers:
            logger.log_hyperparams(config)


def run_dir_of(run_dir: str | None, default_root_dir: str | None, config_files: list | None) -> Path:
    """The run folder: --run_dir, else trainer.default_root_dir, else runs/<stem of the last --config>,
    else runs/default."""
    if run_dir:
        return Path(run_dir)
    if default_root_dir:
        return Path(default_root_dir)
    if config_files:
        return Path("runs") / Path(str(config_files[-1])).stem
    return Path("runs/default")


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _logger_configs(logger) -> list:
    return [entry for entry in _as_list(logger) if isinstance(entry, (Namespace, dict))]


def checkpoint_folders(trainer) -> list[Path]:
    """Where a run's checkpoints can be: each checkpoint callback's dirpath and <run_dir>/checkpoints
    (the folder of pre-emption saves when the callback names none)."""
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    return list(dict.fromkeys([*folders, Path(trainer.default_root_dir) / "checkpoints"]))


@rank_zero_only
def say(message: str) -> None:
    print(f"step35: {message}", file=sys.stderr, flush=True)


def resolve_ckpt_path(value: str | None, folders: list[Path]) -> str | None:
    """`last`: the newest complete checkpoint of `folders` (an error when there is none); `auto`: the
    same, or None (start from scratch) when there is none. Any other value is returned as it is."""
    if value not in ("last", "auto"):
        return value
    newest = catalog.newest_complete(folders)
    where = ", ".join(str(f) for f in folders)
    if newest is None:
        unfinished = [str(p) for f in folders for p in catalog.incomplete_checkpoints(f)]
        detail = f" (saves that did not finish, ignored: {', '.join(unfinished)})" if unfinished else ""
        if value == "last":
            raise SystemExit(f"step35: --ckpt_path last: no complete checkpoint in {where}{detail}. Start without "
                             f"--ckpt_path (or with --ckpt_path auto), or name a checkpoint file")
        say(f"--ckpt_path auto: no complete checkpoint in {where}{detail}: starting from scratch")
        return None
    verify(newest.path, sizes_only=True)  # every listed file present at its size (checksums: at load)
    say(f"--ckpt_path {value}: resuming from {newest.path} (global step {newest.global_step}, the newest "
        f"complete checkpoint in {where})")
    return str(newest.path)


class Step35CLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # test and predict are left out: the module has no test_step / predict_step and the data
        # module no test / predict loaders (generation is `step35 generate`).
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="The run folder (checkpoints/, config.yaml, logs of every attempt); "
                                 "default: trainer.default_root_dir if set, else runs/<config file name>.")

    def _parse_ckpt_path(self) -> None:
        """Lightning would overwrite the model options with the checkpoint's saved hyper_parameters
        (single-file checkpoints only; unpickled here before any other check). step35 keeps the
        command line for both formats; the module reads the checkpoint's settings through the safe
        loader and checks them against the run's (step35/resume.py)."""

    def _subcommand_config(self):
        return self.config.get(self.subcommand, self.config) if self.subcommand else self.config

    def instantiate_trainer(self, **kwargs):
        from lightning.fabric.plugins import CheckpointIO
        from lightning.pytorch.callbacks import ProgressBar

        from step35.callbacks import FaultTolerance
        from step35.callbacks.progress import Step35ProgressBar
        from step35.checkpoint.trainer_io import Step35CheckpointIO

        trainer = self._get(self.config_init, "trainer", default={})
        # Checkpoints are data: unless a CheckpointIO is configured, single-file checkpoints go through
        # step35's (atomic, manifest, weights_only with an allowlist, NaN check). Step35Strategy uses the same code.
        plugins = _as_list(trainer.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs.setdefault("plugins", [*plugins, Step35CheckpointIO()])
        callbacks = _as_list(trainer.get("callbacks"))
        added = []
        # Unless one is configured (or bars are off), the step/max_steps bar (step35/callbacks/progress.py).
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            added.append(Step35ProgressBar())
        # Pre-emption handling and the hang watchdog belong to every run (see step35.faults);
        # listing FaultTolerance under trainer.callbacks sets its options.
        if not any(isinstance(c, FaultTolerance) for c in callbacks):
            added.append(FaultTolerance())
        if added:
            kwargs.setdefault("callbacks", [*callbacks, *added])
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        config = self._subcommand_config()
        _strategy_class_path_to_class(config)
        # The HF checkpoint folder carries its own tokenizer: use it unless data.tokenizer says otherwise.
        if config.get("data") is not None and not config.data.get("tokenizer") and config.model.get("checkpoint"):
            config.data.tokenizer = config.model.checkpoint
        if config.get("trainer") is None:
            return
        run_dir = run_dir_of(config.get("run_dir"), config.trainer.get("default_root_dir"), config.get("config"))
        config.run_dir = str(run_dir)
        config.trainer.default_root_dir = str(run_dir)
        for logger in _logger_configs(config.trainer.get("logger")):
            init_args = logger.get("init_args")
            if init_args is not None and "save_dir" in init_args and not init_args.get("save_dir"):
                init_args["save_dir"] = str(run_dir)

    def before_fit(self) -> None:
        self._resolve_ckpt_path()

    def before_validate(self) -> None:
        self._resolve_ckpt_path()

    def _resolve_ckpt_path(self) -> None:
        kwargs = self.config_init[self.subcommand]
        path = resolve_ckpt_path(kwargs.get("ckpt_path"), checkpoint_folders(self.trainer))
        if path in (None, "best", "hpc", "registry") or str(path).startswith("registry:"):
            kwargs["ckpt_path"] = path  # Lightning's own special values
            return
        # Set on the trainer rather than passed to fit: the path is then known from the setup hooks on
        # (the module checks it against the run's options before building; the checkpoint callback
        # protects it), not only once Lightning starts loading it.
        self.trainer.ckpt_path = path
        kwargs["ckpt_path"] = None


def _strategy_class_path_to_class(config) -> None:
    """`--trainer.strategy step35.strategy.Step35Strategy` with no sub-option: the Trainer types the
    option `str | Strategy`, so jsonargparse keeps a bare class path as a string (which Lightning then
    takes for a registered strategy name and refuses). A dotted path naming a Strategy class is turned
    into the class_path form jsonargparse instantiates, exactly as if a sub-option had been given."""
    from jsonargparse import Namespace
    from lightning.pytorch.strategies import Strategy

    trainer = config.get("trainer")
    value = trainer.get("strategy") if trainer is not None else None
    if not isinstance(value, str) or "." not in value:
        return
    module_name, _, class_name = value.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"trainer.strategy={value!r}: cannot import it ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"trainer.strategy={value!r} is not a lightning.pytorch.strategies.Strategy class")
    trainer.strategy = Namespace(class_path=value, init_args=Namespace())


SUBCOMMANDS = """usage: step35 {fit,validate,export,generate,plan} ...

  fit       train (LightningCLI): step35 fit --config configs/tiny.yaml
  validate  the validation loss of a model or checkpoint (LightningCLI):
            step35 validate --config configs/tiny.yaml --ckpt_path last
  export    write a training checkpoint as an HF folder with its tokenizer:
            step35 export --checkpoint runs/tiny --out hf_out [--dtype bfloat16]
  generate  text from a run checkpoint or an HF folder:
            step35 generate --checkpoint runs/tiny --prompt "The for statement"
  plan      will a training config fit on its devices, and how fast could it go:
            step35 plan --config configs/flash-196b-4k-npu.yaml [any fit option]

`step35 <subcommand> --help` lists each one's options."""


def main(args: list[str] | None = None) -> None:
    """`step35 fit|validate ...` (LightningCLI), `step35 export|generate|plan ...`."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(SUBCOMMANDS)
        return None
    if argv[0] in ("export", "generate", "plan"):
        if argv[0] == "export":
            from step35.commands.export import main as run
        elif argv[0] == "generate":
            from step35.commands.generate import main as run
        else:
            from step35.plan.cli import run
        return run(argv[1:])
    from step35 import faults
    from step35.data import Step35DataModule

    try:
        Step35CLI(
            Step35LightningModule,
            Step35DataModule,
            save_config_callback=Step35SaveConfig,
            save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
            args=args,
            auto_configure_optimizers=False,
        )
    except Exception as error:
        if faults.was_reported(error):  # already printed with its rank and traceback
            raise SystemExit(faults.EXIT_FAILED) from None
        raise


if __name__ == "__main__":
    main()
