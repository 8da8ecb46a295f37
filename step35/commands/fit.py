"""`step35 fit|validate`: LightningCLI over the module, the data and the trainer.

Every option comes from YAML and can be overridden on the command line (whole option names only: a
prefix such as `--trainer.max_step` is an error, not `max_steps`). A run lives in one folder,
`--run_dir` (default `runs/<name of the config file>`; layout in step35/run/layout.py), across all
its attempts. Before the Trainer is built the run is resolved (step35/run/): `fit` takes the run
folder's lock on rank 0, `--ckpt_path last|auto|<path>` becomes one checkpoint (or a fresh start),
its saved options are checked against the run's once, and the result is handed to the Trainer.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

from jsonargparse import Namespace
from jsonargparse._common import debug_mode_active
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

import step35.accelerators  # noqa: F401  (registers --trainer.accelerator npu)
import step35.strategy  # noqa: F401  (imported before the parser is built: --help then lists Step35Strategy)
from step35 import faults, job
from step35 import run as runs
from step35.checkpoint.errors import CheckpointError
from step35.commands.console import rank_prefix, step35_console
from step35.module import Step35LightningModule
from step35.run import lock


def code_version() -> str:
    """The git commit of the step35 checkout (with '+dirty' when it has changes), or the package version."""
    root = Path(__file__).resolve().parent.parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from step35 import __version__

        return __version__


class Step35SaveConfig(SaveConfigCallback):
    """Writes config.yaml into the run folder (each fit attempt replaces it; `validate` does not, it may run
    beside the live fit of the folder) and gives every attempt's config to its loggers (e.g.
    csv/version_N/hparams.yaml) with the code version."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # `validate` runs beside a live fit of the folder without its lock: its loggers only
            folder = runs.RunFolder(trainer.default_root_dir)
            folder.root.mkdir(parents=True, exist_ok=True)
            self.parser.save(
                self.config,
                folder.root / self.config_filename,
                skip_none=False,
                overwrite=True,
                multifile=self.multifile,
            )
        config = self.config.as_dict()
        config["code_version"] = code_version()
        for logger in trainer.loggers:
            logger.log_hyperparams(config)


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _logger_configs(logger) -> list:
    return [entry for entry in _as_list(logger) if isinstance(entry, (Namespace, dict))]


def say(message: str, stream=None) -> None:
    """A line of the job, printed by its rank 0 only (step35.job: known before the Trainer sets
    Lightning's rank_zero_only), to `stream` (default: sys.stderr as it is at the call)."""
    if job.this_process().is_rank_zero:
        print(f"step35: {message}", file=stream or sys.stderr, flush=True)


def devices_per_node(devices) -> int | None:
    """The processes per node that `trainer.devices` asks for (2, "2", "0,1", [0, 1]); None for "auto"/-1."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip().rstrip(",")
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
        devices = int(text) if text.lstrip("-").isdigit() else None
    return devices if isinstance(devices, int) and devices > 0 else None


def launcher_mismatch(place: job.JobPlace, devices, num_nodes: int) -> str | None:
    """A line when the launcher started another number of processes than trainer.devices x trainer.num_nodes
    (torchrun --nproc-per-node 2 with trainer.devices 1: each process would train alone, and rank 1 would
    find rank 0's lock as another run's); else None."""
    per_node = devices_per_node(devices)
    if place.world_size is None or per_node is None or place.world_size == per_node * num_nodes:
        return None
    started = place.set_by.get("LOCAL_WORLD_SIZE") or place.set_by.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    local = int(started) if started.isdigit() else max(place.world_size // num_nodes, 1)
    nodes = "" if local * num_nodes == place.world_size else f" --trainer.num_nodes {place.world_size // local}"
    return (
        f"{place.origin()} has {place.world_size} processes, but trainer.devices={devices} x trainer.num_nodes="
        f"{num_nodes} make {per_node * num_nodes}: each process would train on its own and find the others' run "
        f"folder lock held. Set --trainer.devices {local}{nodes} (the processes the launcher starts per node)"
    )


class Step35ArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with a did-you-mean for an unknown option or YAML key (abbreviations are off),
    and the error said alone: one line, not after the ~90 lines of usage jsonargparse prints first."""

    def error(self, message: str, ex: Exception | None = None):
        parser = getattr(ex, "subcommand_parser", None) or self
        message = _unknown_class_option(message) or message + _did_you_mean(_unknown_options(message), parser)
        if not self.exit_on_error or debug_mode_active():  # a caller that catches the error gets it as it was
            super().error(message, ex)
        # "step35 fit" however the process was started (its prog is `python -m step35`'s "__main__.py fit")
        command = " ".join(["step35", *parser.prog.replace(" [options]", "").split()[1:]])
        sys.stderr.write(f"{command}: error: {message} (`{command} --help` lists the options)\n")
        self.exit(2)


# jsonargparse's words for a key of a YAML config (or a --config given inline) that no option has
_UNKNOWN_KEY = re.compile(r"(?:Subcommand '[^']+'|Group '([^']+)') does not accept option '([^']+)'")


def _unknown_options(message: str) -> list[str]:
    """The unknown options a parse error names: `--name` for the command line's, `name` for a config key."""
    if message.startswith("unrecognized arguments:"):
        return [w.split("=", 1)[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
    found = _UNKNOWN_KEY.search(message)
    if found is None:
        return []
    group, key = found.groups()
    return [f"{group}.{key}" if group else key]


# ... and for an option of a class given by class_path (a callback's init_args, model.lora), inside the list of
# everything the value failed to validate against
_UNKNOWN_CLASS_OPTION = re.compile(
    r'Parser key "([^"]+)":.*?Problem with given class_path \'([\w.]+)\':\s+Option \'([^\']+)\' is not accepted', re.S
)


def _unknown_class_option(message: str) -> str | None:
    """The one line for an init_args key that the class named by class_path does not take (with a did-you-mean
    from its parameters), instead of jsonargparse's list of every type the value did not validate against."""
    found = _UNKNOWN_CLASS_OPTION.search(message)
    if found is None:
        return None
    key, class_path, option = found.groups()
    try:
        cls = _imported(class_path)
        known = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, ValueError, TypeError):
        known = []
    close = difflib.get_close_matches(option, known, n=3, cutoff=0.75)
    hint = f": did you mean {' or '.join(close)}?" if close else f" (it takes: {', '.join(known)})" if known else ""
    return f"{key}: {class_path} takes no option {option!r}{hint}"


def _did_you_mean(words: list[str], parser) -> str:
    """For each word close to one of `parser`'s options, "; <word>: did you mean <option>?" (a config key is
    compared, and answered, without the leading dashes); "" when none is."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for word in words:
        dashes = "" if word.startswith("--") else "--"
        close = difflib.get_close_matches(dashes + word, known, n=3, cutoff=0.75)
        if close:
            hints.append(f"{word}: did you mean {' or '.join(c[len(dashes) :] for c in close)}?")
    return ("; " + "; ".join(hints)) if hints else ""


class Step35CLI(LightningCLI):
    """LightningCLI for fit and validate: whole option names only, `--run_dir`, and the run resolved
    (lock, checkpoint, resume rule) between building the module and building the Trainer. It adds the
    step progress bar, the model summary, FaultTolerance and DivergenceGuard unless configured, counts an integer
    `trainer.val_check_interval` in optimizer steps, and says why an EarlyStopping ended a fit."""

    def __init__(self, *args, parser_class=Step35ArgumentParser, **kwargs):
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # test and predict are left out: the module has no test_step / predict_step and the data
        # module no test / predict loaders (generation is `step35 generate`).
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def init_parser(self, **kwargs):
        # argparse would take `--trainer.max_step 5` for `--trainer.max_steps`: whole names only
        # (subcommand parsers inherit it).
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help="The run folder (checkpoints/, config.yaml, logs of every attempt); "
            "default: trainer.default_root_dir if set, else runs/<config file name>.",
        )
        parser.add_argument(
            "--checkpoint.every_n_train_steps",
            type=int | None,
            default=None,
            help="Save every N optimizer steps: sets the RunCheckpoint callback of trainer.callbacks "
            "(adds one when there is none). `--trainer.callbacks.every_n_train_steps` would "
            "set the last callback of the list instead, whatever its class.",
        )
        parser.add_argument(
            "--checkpoint.keep_last",
            type=int | None,
            default=None,
            help="Complete checkpoints kept: sets RunCheckpoint's keep_last, as above.",
        )
        parser.add_argument(
            "--checkpoint.async_save",
            type=bool | None,
            default=None,
            help="Write checkpoints in the background: sets RunCheckpoint's async_save, as above.",
        )
        parser.add_argument(
            "--plan_device",
            type=str | None,
            default=None,
            help="The device model this config is sized for (h100, h200, 910b, ...): `step35 plan` "
            "plans for it unless given --device. Training does not read it.",
        )
        parser.add_argument(
            runs.ALLOW_UNVERIFIED,
            type=bool,
            default=False,
            help="Load a --ckpt_path that has no manifest (its integrity cannot be checked); "
            "without it such a checkpoint is refused.",
        )

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI would replace the command line's model options by the hyper_parameters saved in
        # a single-file checkpoint (not a sharded one). step35 resolves --ckpt_path itself (step35/run),
        # so the value is held back from Lightning until the classes are built.
        config = self._subcommand_config()
        self._ckpt_arg = config.get("ckpt_path") if self.subcommand_name() else None
        if self._ckpt_arg is not None:
            config.ckpt_path = None

    def subcommand_name(self) -> str | None:
        return self.config.get("subcommand") if "subcommand" in self.config else None

    def _subcommand_config(self):
        name = self.subcommand_name()
        return self.config.get(name, self.config) if name else self.config

    def before_instantiate_classes(self) -> None:
        config = self._subcommand_config()
        if getattr(self, "_ckpt_arg", None) is not None:
            config.ckpt_path = self._ckpt_arg  # back in the saved config.yaml
        _strategy_class_path_to_class(config)
        _apply_checkpoint_options(config)
        # The HF checkpoint folder carries its own tokenizer: use it unless data.tokenizer says otherwise.
        if config.get("data") is not None and not config.data.get("tokenizer") and config.model.get("checkpoint"):
            config.data.tokenizer = config.model.checkpoint
        if config.get("trainer") is None:
            return
        folder = runs.RunFolder(
            runs.run_dir_of(config.get("run_dir"), config.trainer.get("default_root_dir"), config.get("config"))
        )
        config.run_dir = str(folder.root)
        config.trainer.default_root_dir = str(folder.root)
        for logger in _logger_configs(config.trainer.get("logger")):
            init_args = logger.get("init_args")
            if init_args is not None and "save_dir" in init_args and not init_args.get("save_dir"):
                init_args["save_dir"] = str(folder.logs)

    def instantiate_classes(self) -> None:
        if self.subcommand in ("fit", "validate"):
            # before the module reads model.checkpoint's config.json: a run folder there is answered by name
            checkpoint = (self._subcommand_config().get("model") or {}).get("checkpoint")
            refusal = training_checkpoint_as_start(checkpoint)
            if refusal:
                raise CheckpointError(refusal)
            super().instantiate_classes()
            for note in start_folder_notes(checkpoint):
                say(note)
            return
        super().instantiate_classes()

    def instantiate_trainer(self, **kwargs):
        from lightning.fabric.plugins import CheckpointIO
        from lightning.pytorch.callbacks import ModelSummary, ProgressBar

        from step35.callbacks import DivergenceGuard, FaultTolerance
        from step35.callbacks.progress import Step35ProgressBar
        from step35.callbacks.summary import Step35ModelSummary
        from step35.checkpoint.training.plugin import Step35CheckpointIO

        trainer = self._get(self.config_init, "trainer", default={})
        callbacks = _as_list(trainer.get("callbacks"))
        self.resume = self._resolve_run(callbacks) if self.subcommand in ("fit", "validate") else None
        # Checkpoints are data: unless a CheckpointIO is configured, single-file checkpoints go through
        # step35's (atomic, manifest, weights_only with an allowlist, NaN check). Step35Strategy uses the same code.
        plugins = _as_list(trainer.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs.setdefault("plugins", [*plugins, Step35CheckpointIO()])
        added = []
        # Unless one is configured (or bars are off), the step/max_steps bar (step35/callbacks/progress.py).
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            added.append(Step35ProgressBar())
        # Lightning's summary has a FLOPs column that reads 0 for this module (step35/callbacks/summary.py).
        if trainer.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in callbacks):
            added.append(Step35ModelSummary())
        # Pre-emption handling and the hang watchdog belong to every run (see step35.faults);
        # listing FaultTolerance under trainer.callbacks sets its options.
        if not any(isinstance(c, FaultTolerance) for c in callbacks):
            added.append(FaultTolerance())
        # So does the divergence guard: one NaN gradient must not turn every later weight and checkpoint NaN
        # (the default skips such a step and stops after 5 in a row); listing DivergenceGuard sets its options.
        if not any(isinstance(c, DivergenceGuard) for c in callbacks):
            added.append(DivergenceGuard())
        if added:
            kwargs.setdefault("callbacks", [*callbacks, *added])
        interval = optimizer_step_interval(trainer.get("val_check_interval"), trainer.get("accumulate_grad_batches"))
        if interval is not None:
            kwargs.setdefault("val_check_interval", interval)
        strategy, why = default_strategy(trainer)
        if strategy is not None:
            kwargs.setdefault("strategy", strategy)
            say(why)
        built = super().instantiate_trainer(**kwargs)
        if trainer.get("strategy", "auto") == "auto" and strategy is None and built.world_size > 1:
            say(lightnings_strategy_note(built, trainer.get("devices")))
        return built

    def _resolve_run(self, callbacks: list) -> runs.Resume | str | None:
        """Before the Trainer exists, once per job: the run folder's lock (fit), the checkpoint to resume,
        and the resume rule applied to the module. For fit, the job's rank 0 (step35.job, whichever launcher
        started the job) takes the lock and resolves `--ckpt_path`; the other ranks wait for its lock and
        take its answer from the lock file. A refusal ends the process with one line."""
        config = self._subcommand_config()
        folder = runs.RunFolder(config.run_dir)
        place = job.this_process(devices_per_node(config.trainer.get("devices")))
        refusal = launcher_mismatch(place, config.trainer.get("devices"), config.trainer.get("num_nodes") or 1)
        if refusal:
            raise SystemExit(f"{rank_prefix()}step35: {refusal}")
        note = job.lightning_rank_mismatch(place)
        if note:
            say(note)
        try:
            if self.subcommand != "fit":
                return self._resume_of(self._ckpt_arg, folder, callbacks)
            if not place.is_rank_zero:
                # A rank Lightning's launcher started dies with rank 0 (its launcher), even while it waits here.
                faults.watch_launcher(place.global_rank)
                record = lock.wait_for_rank0(folder, until="resume")
                return self._resume_of(record["resume"], folder, callbacks, decided=True)
            note = lock.acquire(folder)  # before anything is tidied, logged or saved
            if note:
                say(note)
            resume = self._resume_of(self._ckpt_arg, folder, callbacks)
            lock.publish(folder, resume=str(resume.path) if isinstance(resume, runs.Resume) else resume)
            return resume
        except (runs.RunFolderBusy, runs.NoCheckpoint, runs.ResumeMismatchError, CheckpointError) as error:
            lock.release(folder)
            raise SystemExit(f"{rank_prefix()}step35: {error}") from None

    def _resume_of(self, value, folder: runs.RunFolder, callbacks: list, decided: bool = False):
        """`value` (a --ckpt_path, or rank 0's answer when `decided`) resolved, and the module checked
        against the checkpoint's saved options."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        config = self._subcommand_config()
        if value is None or runs.is_lightning_value(value):
            return value  # a fresh start, or one of Lightning's own values
        if decided:  # rank 0 found it and checked its files; read its saved options only
            resume = runs.resolve(value, [], allow_unverified=True, say=lambda line: None)
        else:
            dirpaths = [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
            resume = runs.resolve(
                value, folder.checkpoint_folders(dirpaths), config.get(runs.ALLOW_UNVERIFIED[2:]), say=say
            )
        if resume is not None:
            notes = resume.check(self.model.model_config, dict(self.model.hparams))
            self.model.resume_checked = True
            if notes:
                say(
                    f"resuming {resume.path} with these settings changed by this run's options (the "
                    f"checkpoint's are ignored): " + "; ".join(notes),
                    stream=sys.stdout,
                )
        return resume

    def before_fit(self) -> None:
        self._hand_over_checkpoint()

    def after_fit(self) -> None:
        for note in early_stopping_notes(self.trainer):
            say(note)
        if job.this_process().is_rank_zero:  # the run's curves as a PNG (step35/commands/plot.py)
            from lightning.pytorch.loggers import CSVLogger

            from step35.commands.plot import plot_after_fit

            csv_roots = [logger.root_dir for logger in self.trainer.loggers if isinstance(logger, CSVLogger)]
            if csv_roots:
                say(plot_after_fit(self._subcommand_config().run_dir, csv_roots[0]))

    def before_validate(self) -> None:
        self._hand_over_checkpoint()

    def _hand_over_checkpoint(self) -> None:
        kwargs = self.config_init[self.subcommand]
        if not isinstance(self.resume, runs.Resume):
            kwargs["ckpt_path"] = self.resume  # None, or a value Lightning resolves itself
            return
        # Set on the trainer rather than passed to fit: the path is then known from the setup hooks on
        # (configure_model skips the HF weights; the checkpoint callback protects it), not only once
        # Lightning starts loading it.
        self.trainer.ckpt_path = str(self.resume.path)
        kwargs["ckpt_path"] = None


def default_strategy(trainer: dict) -> tuple[object | None, str]:
    """(Step35Strategy, the line saying why) for a job of several processes whose trainer.strategy is left at
    "auto", where Lightning would run DDP: a whole copy of the model, its gradients and its optimizer state on
    every rank, and no expert parallelism. (None, "") otherwise, or when the number of processes is not known
    before the Trainer exists (trainer.devices "auto": `lightnings_strategy_note` then says what ran)."""
    if trainer.get("strategy", "auto") != "auto":
        return None, ""
    devices, num_nodes = trainer.get("devices", "auto"), trainer.get("num_nodes") or 1
    per_node = devices_per_node(devices)
    processes = per_node * num_nodes if per_node is not None else job.this_process().world_size
    if not processes or processes < 2:
        return None, ""
    from step35.strategy import Step35Strategy

    return Step35Strategy(), (
        f"trainer.strategy is not set for {processes} processes (trainer.devices={devices} x trainer.num_nodes="
        f"{num_nodes}): training with step35.strategy.Step35Strategy (FSDP2 over the ranks, experts not split: "
        "--trainer.strategy.expert_parallel_size N splits them), not Lightning's default DDP, which keeps a whole "
        "copy of the model and its optimizer state on every rank; --trainer.strategy ddp asks for DDP"
    )


def lightnings_strategy_note(trainer, devices) -> str:
    """The line naming the strategy Lightning chose for a multi-process job whose devices and strategy were
    both left to it (the number of processes was not known before the Trainer existed)."""
    return (
        f"trainer.strategy is not set and trainer.devices={devices} made {trainer.world_size} processes: Lightning "
        f"chose {type(trainer.strategy).__name__}; --trainer.strategy step35.strategy.Step35Strategy shards the "
        "model (FSDP2 + expert parallelism) instead"
    )


def training_checkpoint_as_start(checkpoint) -> str | None:
    """The line for a `model.checkpoint` that is a step35 run folder or training checkpoint, not an HF folder
    (config.json + safetensors): export it first (`step35 export`, naming an export already there). None for
    anything else, which the module reads or refuses itself."""
    if not checkpoint:
        return None
    path = Path(checkpoint).expanduser()
    if not path.exists() or (path / "config.json").is_file() or (path.is_file() and path.suffix != ".ckpt"):
        return None
    try:
        newest = runs.checkpoint_of(path, say=lambda line: None)
    except CheckpointError:
        return None  # neither a run folder nor a checkpoint: the module's own error names what is missing
    is_run = newest != path
    run = path if is_run else newest.parent.parent if newest.parent.name == "checkpoints" else newest.parent
    export = run / "hf"
    what = f"a step35 run folder (newest checkpoint: {newest.name})" if is_run else "a step35 training checkpoint"
    command = f"step35 export --checkpoint {checkpoint} --out {export}"
    if (export / "config.json").is_file():
        return (
            f"model.checkpoint={checkpoint} is {what}, not an HF folder (config.json + safetensors): start from its"
            f" export, --model.checkpoint {export} (`{command}` writes it again from this checkpoint)"
        )
    return (
        f"model.checkpoint={checkpoint} is {what}, not an HF folder (config.json + safetensors): export it first,"
        f" `{command}`, then start from --model.checkpoint {export}"
    )


def start_folder_notes(checkpoint) -> list[str]:
    """What a run does with the parts of its HF start folder that it does not train, said at its start in the words
    of `step35 plan` and `step35 export`: a Step-3.7 folder's vision encoder and projector (checkpoint/hf/carried.py) and
    an FP8 folder's block scales (checkpoint/hf/fp8.py)."""
    from step35.checkpoint.hf.carried import carried_weights
    from step35.checkpoint.hf.folder import model_tensor_infos
    from step35.checkpoint.hf.fp8 import SCALE_SUFFIX, block_size

    if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
        return []
    notes = []
    carried, _ = carried_weights(checkpoint)
    if carried is not None:
        size = f"{carried.bytes / 1024**3:.2f} GiB" if carried.bytes >= 1024**3 else f"{carried.bytes / 1024:,.1f} KiB"
        size += f" {'/'.join(carried.dtypes)}"
        notes.append(
            f"model.checkpoint {checkpoint} is a Step-3.7 folder: its vision encoder and projector ({carried.params:,}"
            f" parameters, {carried.tensors} tensors, {size}) are not trained and stay in the folder, never loaded on"
            " a device nor saved in this run's checkpoints; `step35 export` copies them from there as they are"
        )
    block = block_size(checkpoint)
    if block is not None:
        model, _, _ = model_tensor_infos(checkpoint)
        quantised = sum(1 for info in model.values() if info.scales is not None)
        notes.append(
            f"model.checkpoint {checkpoint} is stored in FP8 (float8_e4m3fn, scale blocks {list(block)}): its "
            f"{quantised} FP8 tensors are read dequantised (each block times its inverse scale <name>{SCALE_SUFFIX},"
            " in float32) into the model's weights, which this run trains and saves unquantised; `step35 export`"
            " writes them without quantization_config, or in the release's FP8 layout with --dtype float8_e4m3fn"
        )
    return notes


def optimizer_step_interval(val_check_interval, accumulate_grad_batches) -> int | None:
    """`trainer.val_check_interval` as an integer counts optimizer steps under step35 (the stream has no
    epochs): Lightning counts training batches, so with gradient accumulation the Trainer is given the
    interval times `accumulate_grad_batches`. None when there is nothing to translate (no accumulation,
    a fraction, a time)."""
    accumulate = accumulate_grad_batches or 1
    if isinstance(val_check_interval, bool) or not isinstance(val_check_interval, int) or accumulate == 1:
        return None
    return val_check_interval * accumulate


def early_stopping_notes(trainer) -> list[str]:
    """One line per EarlyStopping callback that stopped the run: at which step, the metric, its last and
    best values and the rule (patience, min_delta, or the threshold) that ended it. Lightning's own
    message needs `verbose` and counts epochs."""
    from lightning.pytorch.callbacks import EarlyStopping
    from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

    notes = []
    for callback in trainer.callbacks:
        if not isinstance(callback, EarlyStopping) or callback.stopping_reason == EarlyStoppingReason.NOT_STOPPED:
            continue
        last = trainer.callback_metrics.get(callback.monitor)
        last = f"{float(last):.4f}" if last is not None else "?"
        best = f"{float(callback.best_score):.4f}"
        rule = {
            EarlyStoppingReason.PATIENCE_EXHAUSTED: f"not better than the best by more than min_delta={abs(callback.min_delta):g} in "
            f"{callback.wait_count} validations (patience={callback.patience})",
            EarlyStoppingReason.STOPPING_THRESHOLD: f"stopping_threshold={callback.stopping_threshold} reached",
            EarlyStoppingReason.DIVERGENCE_THRESHOLD: f"divergence_threshold={callback.divergence_threshold} crossed",
            EarlyStoppingReason.NON_FINITE_METRIC: "the value is not finite",
        }.get(callback.stopping_reason, callback.stopping_reason.value)
        notes.append(
            f"early stopping at step {trainer.global_step}: {callback.monitor}={last} (best {best}, mode "
            f"{callback.mode}): {rule}"
        )
    return notes


def _apply_checkpoint_options(config) -> None:
    """`--checkpoint.every_n_train_steps N` / `--checkpoint.keep_last K` / `--checkpoint.async_save true`: set
    on every RunCheckpoint entry of trainer.callbacks (a subclass counts), or on a RunCheckpoint added when the
    list has none."""
    from step35.callbacks import RunCheckpoint

    options = config.get("checkpoint")
    chosen = {k: v for k, v in (options or {}).items() if v is not None} if options is not None else {}
    if not chosen or config.get("trainer") is None:
        return
    callbacks = _as_list(config.trainer.get("callbacks"))
    entries = [c for c in _logger_configs(callbacks) if _is_subclass(c.get("class_path"), RunCheckpoint)]
    if not entries:
        entries = [Namespace(class_path="step35.callbacks.RunCheckpoint", init_args=Namespace())]
        config.trainer.callbacks = [*callbacks, *entries]
    for entry in entries:
        if entry.get("init_args") is None:
            entry.init_args = Namespace()
        for name, value in chosen.items():
            entry.init_args[name] = value


def _is_subclass(class_path, cls: type) -> bool:
    try:
        found = _imported(class_path)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(found, type) and issubclass(found, cls)


def _imported(class_path):
    """What the dotted path `module.Name` names (ImportError / AttributeError / ValueError when it names nothing)."""
    if not isinstance(class_path, str) or "." not in class_path:
        raise ValueError(f"{class_path!r} is not a dotted class path")
    module_name, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


def _strategy_class_path_to_class(config) -> None:
    """`--trainer.strategy step35.strategy.Step35Strategy` with no sub-option: the Trainer types the
    option `str | Strategy`, so jsonargparse keeps a bare class path as a string (which Lightning then
    takes for a registered strategy name and refuses). A dotted path naming a Strategy class is turned
    into the class_path form jsonargparse instantiates, exactly as if a sub-option had been given."""
    from lightning.pytorch.strategies import Strategy

    trainer = config.get("trainer")
    value = trainer.get("strategy") if trainer is not None else None
    if not isinstance(value, str) or "." not in value:
        return
    try:
        cls = _imported(value)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"trainer.strategy={value!r}: cannot import it ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"trainer.strategy={value!r} is not a lightning.pytorch.strategies.Strategy class")
    trainer.strategy = Namespace(class_path=value, init_args=Namespace())


def run(args: list[str] | None = None) -> None:
    """`step35 fit|validate <args>`; the run folder's lock is released however it ends."""
    from step35.data import Step35DataModule

    job.this_process(fresh=True)  # where this process stands in its job, read before the Trainer changes it
    # A fresh phase before any callback's setup: FaultTolerance's begin_run comes last among them (a Checkpoint
    # callback), after RunCheckpoint's, whose refusals must not be reported in an earlier fit's phase and step.
    faults.begin_run()
    try:
        with step35_console():  # libraries' notices not meant for the user dropped; step35's warnings as step35's
            Step35CLI(
                Step35LightningModule,
                Step35DataModule,
                save_config_callback=Step35SaveConfig,
                save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
                args=args,
                auto_configure_optimizers=False,
            )
    except Exception as error:
        # Already printed with its rank and traceback, or raised while ending after such a failure
        # (then said in one line): no second traceback.
        if faults.was_reported(error) or faults.report_aftermath(error):
            raise SystemExit(faults.EXIT_FAILED) from None
        if faults.is_refusal(error):  # refused while the module is built: its one line
            raise SystemExit(f"{rank_prefix()}step35: {error}") from None
        raise
    finally:
        lock.release_all()
        if args is not None:  # called as a function: the caller's process goes on (faults.end_in_caller)
            faults.end_in_caller()
