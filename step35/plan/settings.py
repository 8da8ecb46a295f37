"""The run to plan, read with the parser of `step35 fit` itself (same YAML, same overrides, same names,
same defaults), without instantiating the trainer, the model or the data."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from step35.config import Step35Config, load_config

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
STEP35_STRATEGY = "step35.strategy.Step35Strategy"


class PlanInputError(ValueError):
    """A training config the plan cannot read; the message names the field."""


@dataclass
class RunSettings:
    model_config: Step35Config
    model_source: str  # where the model shape came from
    num_mtp_layers: int  # MTP layers built (held in memory)
    train_mtp: bool  # mtp_loss_weight > 0: they also run and learn
    aux_loss: bool
    accelerator: str  # cuda | npu | cpu (the kernels and the default device come from it)
    devices_per_node: int
    num_nodes: int
    sharded: bool  # Step35Strategy (FSDP2 + EP); False: one device, unsharded
    expert_parallel_size: int = 1
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
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype parameters, gradients and AdamW states are kept in (Lightning's precision)."""
        return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(self.precision, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of gathered weights and activations: FSDP's param_dtype, else autocast, else stored."""
        if self.param_dtype is not None:
            return self.param_dtype
        if self.precision == "bf16-mixed":
            return torch.bfloat16
        return self.stored_dtype

    def with_layout(self, **changes: Any) -> "RunSettings":
        return replace(self, notes=list(self.notes), **changes)


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


def _model_config(model) -> tuple[Step35Config, str, list[str]]:
    notes = []
    checkpoint = model.get("checkpoint")
    if checkpoint:
        if (Path(checkpoint) / "config.json").is_file() or Path(checkpoint).suffix == ".json":
            config, source = load_config(checkpoint), f"model.checkpoint {checkpoint}"
        elif model.get("config") and model.get("config") != "tiny":
            config, source = load_config(model.config), f"model.config {model.config}"
            notes.append(f"model.checkpoint {checkpoint} is not readable here: planned with the shape of "
                         f"model.config={model.config}")
        else:
            raise PlanInputError(f"model.checkpoint {checkpoint}: no config.json here. Give the model's shape with "
                                 "--model.config (a preset such as flash-196b, or a config.json)")
    else:
        config, source = load_config(model.config), f"model.config {model.config}"
    if model.get("config_overrides"):
        config = Step35Config.from_dict({**config.to_dict(), **model.config_overrides})
        source += " + model.config_overrides"
    return config, source, notes


def _count(value, name: str) -> int:
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, int) and value > 0:
        return value
    raise PlanInputError(f"{name}={value!r}: the plan needs an explicit count (e.g. --{name} 8)")


def settings_from_namespace(cfg) -> RunSettings:
    trainer, model, data = cfg.trainer, cfg.model, cfg.data
    config, source, notes = _model_config(model)
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
        model_config=config, model_source=source, num_mtp_layers=num_mtp,
        train_mtp=num_mtp > 0 and model.mtp_loss_weight > 0, aux_loss=model.moe_aux_loss_coef > 0,
        accelerator=device, devices_per_node=devices, num_nodes=nodes, sharded=class_path == STEP35_STRATEGY,
        precision=str(trainer.precision), seq_len=data.seq_len, micro_batch_size=data.micro_batch_size,
        loss_chunk_size=model.loss_chunk_size, accumulate_grad_batches=int(trainer.accumulate_grad_batches or 1),
        document_masking=bool(data.get("document_masking", False)), notes=notes)
    if settings.sharded:
        args = strategy.init_args
        settings = settings.with_layout(
            expert_parallel_size=args.expert_parallel_size, replicate_size=args.replicate_size,
            reshard_after_forward=args.reshard_after_forward, activation_checkpointing=args.activation_checkpointing,
            param_dtype=_DTYPES[args.param_dtype] if args.param_dtype else None,
            reduce_dtype=_DTYPES[args.reduce_dtype] if args.reduce_dtype else None)
        settings.notes = notes
    elif settings.world_size > 1:
        raise PlanInputError(f"trainer.strategy={class_path or strategy!r} on {settings.world_size} devices: the plan "
                             f"models {STEP35_STRATEGY} (FSDP2 + expert parallel), or one unsharded device")
    if settings.precision not in ("32-true", "32", "bf16-true", "bf16-mixed", "16-true"):
        raise PlanInputError(f"trainer.precision={settings.precision!r}: plan knows 32-true, bf16-true, bf16-mixed, 16-true")
    return settings


def read_settings(args: list[str]) -> RunSettings:
    return settings_from_namespace(parse_fit_args(args))
