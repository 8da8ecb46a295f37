"""The optimizer room: which parameters train in which group, the optimizer and its LR schedule, the checks
of their options, the state an optimizer keeps per parameter, and what a resume may change of them.

`model.optimizer` chooses the optimizer: `adamw` (default; torch's AdamW with `betas`, `eps`) or the class
path of any `torch.optim.Optimizer` (e.g. `torch.optim.SGD`), built with `lr`, `weight_decay` (when the
class has one) and `model.optimizer_options` (its own keyword arguments, e.g. `{momentum: 0.9}`).
Every optimizer gets two param groups, `decay` and `no_decay` (norm weights: no weight decay), so
LearningRateMonitor logs `lr/decay` and `lr/no_decay`; frozen parameters (the LoRA base, untrained MTP
layers) are in neither.

`muon` (training/muon.py): Muon on the matrices and AdamW on the rest, one optimizer with three groups:
`muon` (the matrices training/muon.matrix_role gives Muon), `decay` and `no_decay` (AdamW's, as above). Its
options are `model.optimizer_options` (training/muon.MuonOptions: ns_steps, coefficients, momentum,
nesterov, lr_adjust, lr, weight_decay, ns_dtype, adamw_lr, adamw_betas, preset `stepfun`), not a `model.muon`
group: they are the chosen optimizer's own options, as for any other, and a resume may change them like
those. Under FSDP2 + EP Newton–Schulz still sees whole matrices (parallel/whole_matrices.py).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from step35.schedule import WarmupCosineLR
from step35.training.muon import EXCHANGE_BYTES, MUON_ROLE, Muon, MuonOptions, matrix_role, step_temporaries
from step35.training.options import check_rules

# Above this peak lr a warning is printed (see OptimizerOptions.check).
LR_WARN_ABOVE = 0.1


class OptimizerKind:
    """A named optimizer, answering what the rest of step35 asks of it (the module builds it, `step35 plan`
    counts it, a resume overwrites its group settings), so nothing outside this room asks it by name:
    how it is built from its param groups, which group a parameter goes to and with which settings, and
    what it keeps and moves beside the parameters (state slots: state_slots_per_group probes them)."""

    group_keys: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay")  # the settings step35's options give
    exchange_label = ""  # what the plan calls its exchange ("" : none)

    def build(self, groups: list[dict], options: OptimizerOptions) -> torch.optim.Optimizer:
        params = [p for g in groups for p in g["params"]]
        return torch.optim.AdamW(
            groups,
            lr=options.lr,
            betas=tuple(options.betas),
            eps=options.eps,
            foreach=foreach_ok(params),
            **options.extra,
        )

    def check(self, options: OptimizerOptions) -> None:
        """Refuse model.optimizer_options it does not take (AdamW's keyword arguments, less step35's own)."""
        accepted = set(inspect.signature(torch.optim.AdamW).parameters) - {
            "params",
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "foreach",
        }
        unknown = sorted(set(options.extra) - accepted)
        if unknown:
            raise ValueError(
                f"model.optimizer_options={options.extra}: {unknown} are not options of AdamW "
                f"(accepted: {sorted(accepted)}; lr, betas, eps and weight_decay are model.* options)"
            )

    def group_settings(self, options: OptimizerOptions) -> list[dict[str, Any]]:
        """The settings of the two param groups (decayed, then the norms without decay)."""
        values = {"lr": options.lr, "betas": tuple(options.betas), "eps": options.eps}
        common = {k: v for k, v in values.items() if k in self.group_keys}
        if "weight_decay" not in self.group_keys:
            return [{**common, "name": "decay"}, {**common, "name": "no_decay"}]
        return [
            {**common, "weight_decay": options.weight_decay, "name": "decay"},
            {**common, "weight_decay": 0.0, "name": "no_decay"},
        ]

    def group_of(self, name: str, shape: tuple[int, ...]) -> int:
        """The index of the param group a trained parameter goes to: `decay`, or `no_decay` (norm weights)."""
        return 1 if name.endswith("norm.weight") else 0

    def exchange_bytes(self, group: int) -> int:
        """Bytes per value of a parameter of `group` sent each way per step to bring whole matrices together
        (parallel/whole_matrices.py), for a parameter split over ranks; 0: nothing moves."""
        return 0

    def temporaries(self, trainable_bytes: int, largest_param_bytes: int, foreach: bool) -> int:
        """Bytes the step holds at once beside the states: a foreach step a copy of all local states (their
        bytes as the trained parameters'), a per-parameter step about twice the biggest parameter."""
        return trainable_bytes if foreach else 2 * largest_param_bytes

    def describe_state(self, slots: tuple[float, ...]) -> str:
        return f"{max(slots):g}x the trained parameters' bytes"


class ClassPathOptimizer(OptimizerKind):
    """Any torch.optim.Optimizer named by its class path, built with lr, weight_decay (when it has one) and
    model.optimizer_options."""

    def __init__(self, name: str, cls: type[torch.optim.Optimizer], weight_decay: float):
        defaults = inspect.signature(cls).parameters
        if weight_decay > 0 and "weight_decay" not in defaults:
            raise ValueError(
                f"model.optimizer={name} has no weight_decay, but model.weight_decay={weight_decay}; "
                "set model.weight_decay 0"
            )
        self.cls = cls
        self.group_keys = ("lr", "weight_decay") if "weight_decay" in defaults else ("lr",)

    def build(self, groups: list[dict], options: OptimizerOptions) -> torch.optim.Optimizer:
        try:
            return self.cls(groups, lr=options.lr, **options.extra)
        except TypeError as err:
            raise ValueError(
                f"model.optimizer={options.name} with model.optimizer_options={options.extra}: {err}"
            ) from None

    def check(self, options: OptimizerOptions) -> None:
        pass  # its own keyword arguments: checked when it is built


class MuonOptimizer(OptimizerKind):
    """`muon` (training/muon.py): Muon's `muon` group (the matrices matrix_role gives it), then AdamW's
    `decay` and `no_decay`; its options are model.optimizer_options (MuonOptions)."""

    exchange_label = "Muon"

    def build(self, groups: list[dict], options: OptimizerOptions) -> Muon:
        return Muon(groups, lr=options.lr, eps=options.eps)  # every group carries its own settings

    def check(self, options: OptimizerOptions) -> None:
        MuonOptions.of(options.extra)

    def group_settings(self, options: OptimizerOptions) -> list[dict[str, Any]]:
        muon = MuonOptions.of(options.extra)
        adamw = {
            "lr": options.lr if muon.adamw_lr is None else muon.adamw_lr,
            "betas": tuple(options.betas) if muon.adamw_betas is None else muon.adamw_betas,
            "eps": options.eps,
        }
        matrices = {
            "name": "muon",
            "use_muon": True,
            "lr": options.lr if muon.lr is None else muon.lr,
            "weight_decay": options.weight_decay if muon.weight_decay is None else muon.weight_decay,
            **{k: getattr(muon, k) for k in ("momentum", "nesterov", "ns_steps", "coefficients", "lr_adjust")},
            "ns_dtype": muon.ns_dtype,
        }
        return [
            matrices,
            {**adamw, "weight_decay": options.weight_decay, "name": "decay"},
            {**adamw, "weight_decay": 0.0, "name": "no_decay"},
        ]

    def group_of(self, name: str, shape: tuple[int, ...]) -> int:
        if matrix_role(name, shape).optimizer == MUON_ROLE:
            return 0
        return 2 if name.endswith("norm.weight") else 1

    def exchange_bytes(self, group: int) -> int:
        return EXCHANGE_BYTES if group == 0 else 0

    def temporaries(self, trainable_bytes: int, largest_param_bytes: int, foreach: bool) -> int:
        return step_temporaries(largest_param_bytes)

    def describe_state(self, slots: tuple[float, ...]) -> str:
        return f"{slots[0]:g}x the Muon matrices' bytes (momentum), {slots[1]:g}x the AdamW parameters'"


# model.optimizer's short names (a class path names any other torch.optim.Optimizer).
OPTIMIZERS: dict[str, OptimizerKind] = {"adamw": OptimizerKind(), "muon": MuonOptimizer()}
DEFAULT_OPTIMIZER = "adamw"


@dataclass(frozen=True)
class OptimizerOptions:
    """The module's optimisation options (`model.optimizer`, `model.lr`, ...), checked on creation."""

    name: str = DEFAULT_OPTIMIZER
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    extra: dict[str, Any] = field(default_factory=dict)  # model.optimizer_options

    @classmethod
    def of(cls, hparams: dict[str, Any]) -> OptimizerOptions:
        """The options of a module's hyper-parameters (a key not given: its default)."""
        names = ("lr", "min_lr_ratio", "warmup_steps", "decay_steps", "weight_decay", "eps")
        values = {k: hparams[k] for k in names if k in hparams}
        if "betas" in hparams:
            values["betas"] = tuple(hparams["betas"])
        return cls(
            name=hparams.get("optimizer") or DEFAULT_OPTIMIZER,
            extra=dict(hparams.get("optimizer_options") or {}),
            **values,
        )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse options that cannot mean anything, naming the option (`model.lr=-1: must be >= 0`); warn
        about an lr above LR_WARN_ABOVE (allowed, but it diverges)."""
        check_rules(
            {
                "lr": (
                    self.lr,
                    lambda v: v >= 0,
                    ">= 0",
                ),  # 0 is allowed: the weights stay, e.g. to study the router alone
                "min_lr_ratio": (self.min_lr_ratio, lambda v: 0 <= v <= 1, "between 0 and 1"),
                "warmup_steps": (self.warmup_steps, lambda v: v >= 0, ">= 0"),
                "decay_steps": (
                    self.decay_steps,
                    lambda v: v is None or v > self.warmup_steps,
                    "> model.warmup_steps (or null: trainer.max_steps)",
                ),
                "weight_decay": (self.weight_decay, lambda v: v >= 0, ">= 0"),
                "betas": (self.betas, lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
                "eps": (self.eps, lambda v: v > 0, "> 0"),
            }
        )
        self.kind().check(self)  # an unknown name or class path, or options it lacks: now, not at configure_optimizers
        if self.lr > LR_WARN_ABOVE:
            # Legal but almost surely a slip (1e6 for 1e-6): said, not refused, so an experiment can still try it.
            warnings.warn(
                f"model.lr={self.lr} is above {LR_WARN_ABOVE}: AdamW moves every weight by about lr per "
                f"step whatever the gradient's size, and Step-3.5's weights start with std 0.02, so a step "
                f"would change each weight by more than its own size and training diverges (pretraining "
                f"uses about 1e-5 to 1e-2; a slip such as 1e6 for 1e-6?)",
                stacklevel=4,
            )

    def kind(self) -> OptimizerKind:
        """The named optimizer, or one made from a class path of a torch.optim.Optimizer."""
        if self.name in OPTIMIZERS:
            return OPTIMIZERS[self.name]
        return ClassPathOptimizer(self.name, _optimizer_class(self.name), self.weight_decay)

    def group_settings(self) -> list[dict[str, Any]]:
        """The settings of the optimizer's param groups, as it gets them and as a resume restores them."""
        return self.kind().group_settings(self)


def _optimizer_class(path: str) -> type[torch.optim.Optimizer]:
    module, _, name = path.rpartition(".")
    known = ", ".join(OPTIMIZERS)
    if not module:
        raise ValueError(f"model.optimizer={path!r}: not one of {known}, nor a class path (e.g. torch.optim.SGD)")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"model.optimizer={path!r}: cannot import it ({err}); use one of {known} or the "
            "class path of a torch.optim.Optimizer"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"model.optimizer={path!r} is not a torch.optim.Optimizer subclass")
    return cls


def param_groups(model: nn.Module, options: OptimizerOptions) -> list[dict]:
    """The trained parameters in their groups (OptimizerKind.group_of), each with its settings (group_settings)."""
    kind = options.kind()
    groups = [{"params": [], **values} for values in kind.group_settings(options)]
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[kind.group_of(name, tuple(param.shape))]["params"].append(param)
    return groups


def build_optimizer(model: nn.Module, options: OptimizerOptions) -> torch.optim.Optimizer:
    return options.kind().build(param_groups(model, options), options)


def lr_schedule(optimizer: torch.optim.Optimizer, options: OptimizerOptions, max_steps: int | None) -> WarmupCosineLR:
    """Warmup then cosine over `model.decay_steps` (default: the trainer's max_steps). A resumed run keeps
    the length its checkpoint was started with, unless decay_steps is set."""
    total = options.decay_steps or max_steps
    if total is None or total < 0:
        raise ValueError("set trainer.max_steps or model.decay_steps: the cosine schedule needs a length")
    return WarmupCosineLR(
        optimizer, options.warmup_steps, total, options.min_lr_ratio, length_from_option=options.decay_steps is not None
    )


def foreach_ok(params: list[torch.Tensor]) -> bool:
    """Whether torch's foreach kernels can take these parameters: they group tensors by device and dtype
    but cannot mix DTensors of different meshes (dense params on the FSDP mesh, experts on efsdp x ep)."""
    meshes = {id(getattr(p, "device_mesh", None)) for p in params}
    return len(meshes) <= 1


def state_slots(options: OptimizerOptions) -> int:
    """Tensors the size of the parameter that the optimizer keeps per trained parameter (AdamW: exp_avg
    and exp_avg_sq; SGD with momentum: one; without: none), asked of the optimizer itself: one step of it
    on a probe parameter, its state counted; the most of any group (muon: 1 in its `muon` group, AdamW's
    2 in the others, so 2; the plan counts per group, state_slots_per_group and OptimizerKind.group_of)."""
    return round(max(state_slots_per_group(options)))


def state_slots_per_group(options: OptimizerOptions, dtype: torch.dtype = torch.float32) -> list[float]:
    """state_slots of each param group, in the optimizer's group order, for parameters of `dtype`: the bytes
    of its parameter-sized state tensors over the parameter's (Muon's fp32 momentum beside a bf16 param: 2)."""
    slots = []
    for settings in options.group_settings():
        probe = nn.Parameter(torch.zeros(4, 4, dtype=dtype))
        optimizer = options.kind().build([{"params": [probe], **settings}], options)
        probe.grad = torch.ones_like(probe)
        optimizer.step()
        states = [v for v in optimizer.state[probe].values() if torch.is_tensor(v) and v.shape == probe.shape]
        slots.append(sum(v.element_size() for v in states) / probe.element_size())
    return slots


# ---------------------------------------------------------------------------------------------- resume
# Options a resume may change (the command line wins; each is reported when it does).
RESUMABLE = ("lr", "min_lr_ratio", "warmup_steps", "decay_steps", "weight_decay", "betas", "eps", "optimizer_options")


def resume_refusals(saved: dict[str, Any], hparams: dict[str, Any]) -> list[str]:
    """Why the run's optimizer cannot take the checkpoint's state: another optimizer keeps other state."""
    before = saved.get("optimizer") or DEFAULT_OPTIMIZER
    after = hparams.get("optimizer") or DEFAULT_OPTIMIZER
    if before != after:
        return [
            f"model.optimizer: {before} -> {after}: the checkpoint's optimizer state belongs to {before}; "
            f"resume with model.optimizer={before}"
        ]
    return []


def apply_resumed_settings(
    optimizer: torch.optim.Optimizer,
    group_settings: list[dict[str, Any]],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    """After a restore, give each param group the run's settings (`group_settings[i]`: lr, betas,
    eps, weight_decay of group i) and rebase the LR schedule on the run's lr at the restored step.
    With unchanged settings the values are the ones the restore produced, bit for bit."""
    if len(group_settings) != len(optimizer.param_groups):
        raise ValueError(f"{len(optimizer.param_groups)} param groups restored, {len(group_settings)} configured")
    for group, settings in zip(optimizer.param_groups, group_settings):
        for key, value in settings.items():
            if key != "lr":
                group[key] = value
    if scheduler is None:
        for group, settings in zip(optimizer.param_groups, group_settings):
            group["lr"] = settings["lr"]
        return
    scheduler.base_lrs = [settings["lr"] for settings in group_settings]
    # The multiplier per group: step35's WarmupCosineLR has one (`lr_factor`), torch's LambdaLR one per group.
    factors = getattr(scheduler, "lr_lambdas", None) or [scheduler.lr_factor] * len(scheduler.base_lrs)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, factors):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)  # as the scheduler's get_lr computes it
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
