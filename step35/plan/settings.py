"""The run to plan, read with the parser of `step35 fit` itself (same YAML, same overrides, same names,
same defaults), without instantiating the trainer, the model or the data."""

from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from step35.checkpoint.hf.carried import CarriedWeights, carried_weights
from step35.config import Step35Config, VisionConfig
from step35.data.image_records import ImageOptions
from step35.kernels.sequence_split import rank_tokens
from step35.plan.lora import LoraInputError, LoraSettings, parse_lora
from step35.plan.vision import ViewGroup, VisionGrad
from step35.training.objective import DEFAULT_OBJECTIVE, OPTION_FIELDS, Needs, ObjectiveInputs, objective_class
from step35.training.optimizer import (
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    OptimizerKind,
    OptimizerOptions,
    state_slots_per_group,
)
from step35.training.reference import FROZEN_COPY, reference_dtype
from step35.training.rollout import ROW_MULTIPLE
from step35.training.setup import model_config_of
from step35.training.vision import VisionOptions, vision_config_of

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def lightning_precision(precision) -> str:
    """trainer.precision as Lightning reads it: unset is its default "32-true", and its short spellings
    (32, "32", "bf16", 16, "16") are the settings they stand for."""
    if precision is None:
        return "32-true"
    return {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(str(precision), str(precision))


def stored_dtype_of(precision: str) -> torch.dtype:
    """The dtype Lightning's `precision` keeps trained parameters, gradients and optimizer states in."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


STEP35_STRATEGY = "step35.strategy.Step35Strategy"


@dataclass(frozen=True)
class EvalGeneration:
    """What the plan reads of an EvalCallback in trainer.callbacks (callbacks/evaluation.py): every
    `every_n_steps` optimizer steps it answers `limit` prompt records, one at a time, with `num_samples` rows of
    at most `max_new_tokens` new tokens each (plan/rollout.py eval_generation_memory), then scores the MTP drafts
    on `mtp_batches` validation batches (0: none; plan/drafts.py)."""

    num_samples: int
    max_new_tokens: int
    limit: int
    every_n_steps: int
    mtp_batches: int = 1


class PlanInputError(ValueError):
    """A training config the plan cannot read; the message names the field."""


@dataclass
class RunSettings:
    model_config: Step35Config
    model_source: str  # where the model shape came from
    num_mtp_layers: int  # MTP layers built (held in memory)
    mtp_loss_weight: float  # > 0 (with MTP layers built): they also run and learn
    aux_loss: bool
    accelerator: str  # cuda | npu | cpu (the kernels and the default device come from it)
    devices_per_node: int
    num_nodes: int
    sharded: bool  # Step35Strategy (FSDP2 + EP); False: one device, unsharded
    expert_parallel_size: int = 1
    context_parallel_size: int = 1  # cp: ranks that split every sequence (trainer.strategy.context_parallel_size)
    replicate_size: int = 1
    reshard_after_forward: bool = True
    activation_checkpointing: str = "none"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    precision: str = "32-true"
    seq_len: int = 256
    micro_batch_size: int = 4
    loss_chunk_size: int = 1024
    accumulate_grad_batches: int = 1
    document_masking: bool = False
    lora: LoraSettings | None = None  # model.lora: frozen base in the compute dtype, adapters trained
    finetune: bool = False  # model.checkpoint given: the run starts from trained weights
    notes: list[str] = field(default_factory=list)
    plan_device: str | None = None  # the device the config says it is sized for (top-level `plan_device`)
    optimizer: str = DEFAULT_OPTIMIZER  # model.optimizer
    # what it keeps and moves, asked of it (training/optimizer.py OptimizerKind)
    optimizer_kind: OptimizerKind = field(default_factory=lambda: OPTIMIZERS[DEFAULT_OPTIMIZER])
    # state bytes the optimizer keeps per byte of a trained parameter, per param group
    # (training/optimizer.state_slots_per_group: AdamW 2; Muon's fp32 momentum 1, or 2 beside bf16 params)
    optimizer_slots: tuple[float, ...] = (2, 2)
    objective: str = DEFAULT_OBJECTIVE  # model.objective
    # what it needs of the model and adds to a step, asked of it (training/objective.py Objective.needs)
    objective_needs: Needs = field(default_factory=Needs)
    carried: CarriedWeights | None = None  # a Step-3.7 folder's vision weights without model.vision: on the host
    vision: VisionConfig | None = None  # model.vision: Step-3.7's encoder and projector, built on the devices
    train_vision: bool = False  # model.vision.train: they learn (else frozen; LoRA adapts them by target)
    images: ImageOptions | None = None  # data.images: the views and crops one window carries
    async_save: bool = False  # a RunCheckpoint(async_save=true) in trainer.callbacks: checkpoints staged on the host
    eval_generation: EvalGeneration | None = None  # an EvalCallback in trainer.callbacks: its generation

    def slots_of(self, name: str, shape: tuple[int, ...]) -> float:
        """Optimizer states of the trained parameter `name` (its group's, OptimizerKind.group_of)."""
        return self.optimizer_slots[self.optimizer_kind.group_of(name, shape)]

    def exchange_of(self, name: str, shape: tuple[int, ...]) -> int:
        """Bytes per value the optimizer sends each way per step to see this trained parameter's matrices
        whole (Muon's); 0: none."""
        return self.optimizer_kind.exchange_bytes(self.optimizer_kind.group_of(name, shape))

    def describe_slots(self) -> str:
        return self.optimizer_kind.describe_state(self.optimizer_slots)

    @property
    def reference_copy(self) -> bool:
        """The objective holds a frozen copy of the start model (DPO's full fine-tuning; with LoRA its reference
        is the policy with its adapters off, and reference_free has none: no extra bytes)."""
        return self.objective_needs.reference == FROZEN_COPY

    @property
    def reference_dtype(self) -> torch.dtype:
        """The frozen copy's dtype, by the rule the module builds it with (training/reference.py)."""
        return reference_dtype(self.param_dtype, self.stored_dtype)

    @property
    def train_mtp(self) -> bool:
        return self.num_mtp_layers > 0 and self.mtp_loss_weight > 0

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows of one micro-batch's training forward: its records, or under an objective that generates
        (Needs.generates) their G sequences each, at most one row each (training/rollout.py pack_rollouts)."""
        generates = self.objective_needs.generates
        return self.micro_batch_size * (generates[0] if generates else 1)

    @property
    def row_tokens(self) -> int:
        """Tokens of one such row: data.seq_len, or under an objective that generates the packer's longest row:
        its capacity, the longest prompt and completion (seq_len + 1 + max_new_tokens ids), rounded up to
        ROW_MULTIPLE (a row of one sequence holds its inputs, one id fewer; several may fill the capacity)."""
        generates = self.objective_needs.generates
        if not generates:
            return self.seq_len
        return -(-(self.seq_len + 1 + generates[1]) // ROW_MULTIPLE) * ROW_MULTIPLE

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one micro-batch's training forward a rank holds: its 1 / cp share of every row."""
        return rank_tokens(self.rows_per_micro_batch * self.row_tokens, self.context_parallel_size)

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype trained parameters, their gradients and optimizer states are kept in (Lightning's precision)."""
        return stored_dtype_of(self.precision)

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype of the parameters held: the stored dtype, or under LoRA the frozen base's (model.lora.base_dtype,
        default the config's torch_dtype: the rule apply_lora follows)."""
        return self.lora.options.resolved_base_dtype(self.model_config) if self.lora is not None else self.stored_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of gathered weights and activations: FSDP's param_dtype, else autocast, else stored."""
        if self.param_dtype is not None:
            return self.param_dtype
        if self.precision == "bf16-mixed":
            return torch.bfloat16
        return self.stored_dtype

    @property
    def eval_dtype(self) -> torch.dtype:
        """The dtype EvalCallback's keys and values are in: it runs after the optimizer step, outside the training
        step's autocast, so FSDP's param_dtype, else the dtype the weights are held in (LoRA: the base's)."""
        return self.param_dtype if self.param_dtype is not None else self.base_dtype

    @property
    def vision_grad(self) -> VisionGrad:
        """What of the vision side asks for gradients (plan/vision.py): trained, LoRA adapters, or frozen."""
        if self.train_vision:
            return VisionGrad("trained")
        if self.lora is not None and (self.lora.adapts("vision") or self.lora.adapts("vision_projector")):
            lora = self.lora
            return VisionGrad("lora", lora.adapts("vision"), lora.adapts("vision_projector"), lora.rank, lora.dropout)
        return VisionGrad("frozen")

    @property
    def vision_views(self) -> list[ViewGroup]:
        """The views one micro-batch encodes at most: per window (micro_batch_size of them) data.images.max_images
        global views and max_crops crops; without data.images none (the encoder still runs, on no view)."""
        if self.images is None:
            return [ViewGroup(0, self.vision.image_size)]
        windows, images = self.micro_batch_size, self.images
        return [
            ViewGroup(windows * images.max_images, images.view_size),
            ViewGroup(windows * images.max_crops, images.crop_size),
        ]

    @property
    def vision_dtype(self) -> torch.dtype:
        """The dtype the encoder computes in: its weights' as gathered (FSDP's param_dtype), else as held (a LoRA
        base's dtype); under bf16-mixed autocast bf16 (its LayerNorms run in fp32: not modelled)."""
        if self.param_dtype is not None:
            return self.param_dtype
        if self.lora is not None:
            return self.base_dtype
        return self.compute_dtype

    def with_layout(self, **changes: Any) -> RunSettings:
        return replace(self, notes=list(self.notes), **changes)


def _yaml(text: str, where: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PlanInputError(f"{where}: not valid YAML ({str(err).splitlines()[0]})") from None


def split_lora_args(args: list[str], folder: str) -> tuple[list[str], Any]:
    """`args` without model.lora, and model.lora's value (None when absent). The plan reads and checks
    model.lora itself (lora.parse_lora), so that its messages are the same whether or not the trainer's
    parser knows the option (a parser without it would refuse the key). A YAML given by --config that holds
    model.lora is copied into `folder` without it; --model.lora / --model.lora.<key> overrides are
    taken out and applied over the YAML's value (last one wins, as in the fit parser)."""
    out: list[str] = []
    lora: Any = None
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        takes_value = not eq and i + 1 < len(args)
        if name in ("--config", "-c") and (eq or takes_value):
            path = inline if eq else args[i + 1]
            i += 1 if eq else 2
            raw = _yaml(Path(path).read_text(), f"--config {path}") if Path(path).is_file() else None
            model = raw.get("model") if isinstance(raw, dict) else None
            if isinstance(model, dict) and "lora" in model:
                lora = model.pop("lora")
                import yaml

                path = str(Path(folder) / f"{len(out)}-{Path(path).name}")
                Path(path).write_text(yaml.safe_dump(raw, sort_keys=False))
            out += ["--config", path]
            continue
        if name == "--model.lora" or name.startswith("--model.lora."):
            if not (eq or takes_value):
                raise PlanInputError(f"{name}: needs a value")
            value = _yaml(inline if eq else args[i + 1], name)
            i += 1 if eq else 2
            if name == "--model.lora":
                lora = value
            else:
                lora = dict(lora) if isinstance(lora, dict) else {}
                lora[name.removeprefix("--model.lora.")] = value
            continue
        out.append(arg)
        i += 1
    return out, lora


def parse_fit_args(args: list[str]):
    """The namespace `step35 fit <args>` would run with (its `fit` section), parsed only."""
    from step35.commands.fit import Step35CLI
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    class _Parsed(Exception):
        pass

    class _ParseOnly(Step35CLI):
        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            raise _Parsed(self.config)  # stop before any class is instantiated

    seed_logger = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_logger.level
    seed_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            warnings.filterwarnings("ignore", message="No seed found")
            _ParseOnly(Step35LightningModule, Step35DataModule, args=["fit", *args], auto_configure_optimizers=False)
    except _Parsed as parsed:
        return parsed.args[0]["fit"]
    finally:
        seed_logger.setLevel(level)
    raise AssertionError("unreachable: LightningCLI returned without reaching before_instantiate_classes")


def _model_config(model) -> tuple[Step35Config, str, list[str], str | None]:
    """The model config fit would train (training/setup.model_config_of), or, when model.checkpoint is not
    readable on this machine, the shape model.config gives (said in a note); and the checkpoint read (None then)."""
    notes = []
    checkpoint, overrides = model.get("checkpoint"), model.get("config_overrides")
    if checkpoint and not ((Path(checkpoint) / "config.json").is_file() or Path(checkpoint).suffix == ".json"):
        if not model.get("config") or model.get("config") == "tiny":
            raise PlanInputError(
                f"model.checkpoint {checkpoint}: no config.json here. Give the model's shape with "
                "--model.config (a preset such as flash-196b, or a config.json)"
            )
        notes.append(
            f"model.checkpoint {checkpoint} is not readable here: planned with the shape of model.config={model.config}"
        )
        checkpoint = None
    source = f"model.checkpoint {checkpoint}" if checkpoint else f"model.config {model.config}"
    config = model_config_of(model.config, checkpoint, overrides)  # a ConfigError names the option
    return config, source + (" + model.config_overrides" if overrides else ""), notes, checkpoint


def _optimizer(model, precision: str) -> dict[str, Any]:
    """model.optimizer and the state bytes it keeps per byte of a trained parameter stored as `precision`
    keeps it, per param group, asked of the optimizer itself."""
    try:
        options = OptimizerOptions.of(
            {
                k: model.get(k)
                for k in ("optimizer", "optimizer_options", "lr", "weight_decay", "betas", "eps")
                if model.get(k) is not None
            }
        )
        slots = state_slots_per_group(options, stored_dtype_of(precision))
        return {"optimizer": options.name, "optimizer_kind": options.kind(), "optimizer_slots": tuple(slots)}
    except ValueError as err:
        raise PlanInputError(str(err)) from None


def _objective(model, lora: LoraSettings | None) -> dict[str, Any]:
    """model.objective and what it needs of the model, asked of its class (no model, no objective built)."""
    name = str(model.get("objective") or DEFAULT_OBJECTIVE)
    inputs = ObjectiveInputs(
        lora=lora.options if lora is not None else None,
        options={key: model.get(key) for key in OPTION_FIELDS},
    )
    try:
        return {"objective": name, "objective_needs": objective_class(name).needs(inputs)}
    except ValueError as err:
        raise PlanInputError(str(err)) from None


def _plain(value):
    """A jsonargparse Namespace as a dict; anything else as it is."""
    return value.as_dict() if hasattr(value, "as_dict") else value


def _vision(model, data, checkpoint, lora: LoraSettings | None) -> dict[str, Any]:
    """model.vision and data.images, read and checked as the module and the data module read them (the vision
    config from the checkpoint folder, else model.config: training/vision.vision_config_of)."""
    try:
        options = VisionOptions.of(_plain(model.get("vision")))
        images = ImageOptions.of(_plain(data.get("images")))
        vision = vision_config_of(options, model.get("config"), checkpoint)
    except ValueError as err:  # ConfigError included
        raise PlanInputError(str(err)) from None
    train = options is not None and options.train
    if train and lora is not None:
        raise PlanInputError(
            "model.vision.train: true with model.lora: under LoRA the vision side trains through adapters; name"
            " 'vision' and/or 'vision_projector' in model.lora.targets and leave model.vision.train false"
        )
    named = [t for t in (lora.targets if lora is not None else ()) if t in ("vision", "vision_projector")]
    if named and vision is None:
        raise PlanInputError(
            f"model.lora.targets names {named} but the model has no vision side: set model.vision with a Step-3.7"
            " model, or drop them"
        )
    if images is not None and vision is None:
        raise PlanInputError(
            "data.images is set but the model has no vision side: set model.vision (e.g. {train: false}) with a"
            " Step-3.7 model (model.config tiny-vl, or a Step-3.7 folder as model.checkpoint)"
        )
    return {"vision": vision, "train_vision": train, "images": images}


def _count(value, name: str) -> int:
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, int) and value > 0:
        return value
    raise PlanInputError(f"{name}={value!r}: the plan needs an explicit count (e.g. --{name} 8)")


def _get(options, key: str):
    """options[key] of a mapping or jsonargparse Namespace (None: absent)."""
    if options is None:
        return None
    return options.get(key) if hasattr(options, "get") else getattr(options, key, None)


def _init_args_of(callbacks, class_name: str) -> list:
    """The init_args of each trainer.callbacks entry whose class_path ends in `class_name`."""
    if callbacks is None:
        return []
    entries = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    named = [c for c in entries if str(_get(c, "class_path") or "").rsplit(".", 1)[-1] == class_name]
    return [_get(c, "init_args") for c in named]


def _saves_in_background(callbacks) -> bool:
    """Whether trainer.callbacks holds a RunCheckpoint with async_save true."""
    return any(_get(args, "async_save") for args in _init_args_of(callbacks, "RunCheckpoint"))


def _eval_generation(callbacks) -> EvalGeneration | None:
    """The EvalCallback of trainer.callbacks (class_path ending in EvalCallback), with the callback's own
    defaults for what its init_args leave out; of several, the one that decodes the most tokens at once, with the
    most mtp_batches of any (one that scores the drafts is enough)."""
    import inspect

    from step35.callbacks.evaluation import EvalCallback

    defaults = {k: v.default for k, v in inspect.signature(EvalCallback.__init__).parameters.items()}
    found = []
    for args in _init_args_of(callbacks, "EvalCallback"):
        values = {}
        for name in ("num_samples", "max_new_tokens", "limit", "every_n_steps"):
            value = _get(args, name)
            value = defaults[name] if value is None else value
            if not isinstance(value, int) or value < 1:
                raise PlanInputError(f"trainer.callbacks EvalCallback {name}={value!r}: must be an integer >= 1")
            values[name] = value
        mtp_batches = _get(args, "mtp_batches")
        mtp_batches = defaults["mtp_batches"] if mtp_batches is None else mtp_batches
        if not isinstance(mtp_batches, int) or mtp_batches < 0:
            raise PlanInputError(f"trainer.callbacks EvalCallback mtp_batches={mtp_batches!r}: must be an integer >= 0")
        found.append(EvalGeneration(**values, mtp_batches=mtp_batches))
    if not found:
        return None
    chosen = max(found, key=lambda e: e.num_samples * e.max_new_tokens)
    return replace(chosen, mtp_batches=max(e.mtp_batches for e in found))


def settings_from_namespace(cfg, lora: Any = None) -> RunSettings:
    """The run of a parsed `fit` namespace; `lora` is model.lora's raw value (split_lora_args)."""
    trainer, model, data = cfg.trainer, cfg.model, cfg.data
    config, source, notes, checkpoint = _model_config(model)
    try:
        lora = parse_lora(lora, config)
    except LoraInputError as err:
        raise PlanInputError(str(err)) from None
    vision = _vision(model, data, checkpoint, lora)
    carried = None
    if vision["vision"] is None:  # without model.vision a Step-3.7 folder's vision weights stay on the host
        carried, carried_notes = carried_weights(model.get("checkpoint"))
        notes += carried_notes
    precision = lightning_precision(trainer.precision)
    accelerator = str(trainer.accelerator)
    device = {"gpu": "cuda", "cuda": "cuda", "npu": "npu", "cpu": "cpu"}.get(accelerator)
    if device is None:
        device = "cuda"
        notes.append(f"trainer.accelerator={accelerator}: planned for CUDA kernels")
    devices, nodes = _count(trainer.devices, "trainer.devices"), _count(trainer.num_nodes, "trainer.num_nodes")
    strategy = trainer.strategy
    class_path = strategy.get("class_path") if hasattr(strategy, "get") else None
    num_mtp = config.num_nextn_predict_layers if model.num_mtp_layers is None else model.num_mtp_layers
    settings = RunSettings(
        model_config=config,
        carried=carried,
        model_source=source,
        num_mtp_layers=num_mtp,
        mtp_loss_weight=float(model.mtp_loss_weight),
        aux_loss=model.moe_aux_loss_coef > 0,
        accelerator=device,
        devices_per_node=devices,
        num_nodes=nodes,
        sharded=class_path == STEP35_STRATEGY,
        precision=precision,
        seq_len=data.seq_len,
        micro_batch_size=data.micro_batch_size,
        loss_chunk_size=model.loss_chunk_size,
        accumulate_grad_batches=int(trainer.accumulate_grad_batches or 1),
        document_masking=bool(data.get("document_masking", False)),
        lora=lora,
        finetune=bool(model.get("checkpoint")),
        notes=notes,
        plan_device=cfg.get("plan_device"),
        async_save=_saves_in_background(trainer.get("callbacks")),
        eval_generation=_eval_generation(trainer.get("callbacks")),
        **vision,
        **_optimizer(model, precision),
        **_objective(model, lora),
    )
    if settings.sharded:
        args = strategy.init_args
        settings = settings.with_layout(
            expert_parallel_size=args.expert_parallel_size,
            replicate_size=args.replicate_size,
            context_parallel_size=int(args.get("context_parallel_size", 1) or 1),
            reshard_after_forward=args.reshard_after_forward,
            activation_checkpointing=args.activation_checkpointing,
            param_dtype=_DTYPES[args.param_dtype] if args.param_dtype else None,
            reduce_dtype=_DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
        )
        settings.notes = notes
    elif settings.world_size > 1:
        raise PlanInputError(
            f"trainer.strategy={class_path or strategy!r} on {settings.world_size} devices: the plan "
            f"models {STEP35_STRATEGY} (FSDP2 + expert parallel), or one unsharded device"
        )
    if lora is not None and lora.adapts("mtp") and not settings.train_mtp:
        settings.notes.append(
            "model.lora.targets names mtp but no MTP loss is trained (model.mtp_loss_weight 0 "
            "or no MTP layers): their adapters are held but get no gradient"
        )
    if settings.precision not in ("32-true", "bf16-true", "bf16-mixed", "16-true"):
        raise PlanInputError(
            f"trainer.precision={settings.precision!r}: plan knows 32-true, bf16-true, bf16-mixed, 16-true"
        )
    return settings


def read_settings(args: list[str]) -> RunSettings:
    with tempfile.TemporaryDirectory(prefix="step35-plan-") as folder:
        args, lora = split_lora_args(args, folder)
        return settings_from_namespace(parse_fit_args(args), lora)
