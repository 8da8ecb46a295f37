"""Muon (MomentUm Orthogonalized by Newton–Schulz) for the matrices, AdamW for the rest, in one optimizer.

A Muon parameter keeps one fp32 momentum buffer M (the parameter's shape). Per step, with gradient G:

    M <- momentum * M + (1 - momentum) * G                   (an EMA, as torch.optim.Muon)
    U <- (1 - momentum) * G + momentum * M  if nesterov, else M
    O <- NS(U), for each logical matrix of U on its own        (Newton–Schulz: about U's polar factor)
    W <- W * (1 - lr * weight_decay) - lr * ratio(A, B) * O    (decoupled decay; A x B the logical matrix)

with ratio `original` = sqrt(max(1, A / B)) (Keller Jordan's) or `match_rms_adamw` = 0.2 * sqrt(max(A, B))
(Moonlight's: the update's RMS is about AdamW's, so AdamW's lr and weight decay carry over).

Newton–Schulz on one matrix X [A, B] (transposed first when A > B, so X X^T is the smaller Gram matrix):
X <- X / max(margin * ||X||_F, eps); then per step k with coefficients (a_k, b_k, c_k):
    S = X X^T;  X <- a_k X + (b_k S + c_k S S) X
`classic` repeats (3.4445, -4.7750, 2.0315) with margin 1 (torch.optim.Muon's defaults); `polar_express`
is the per-step list of the Polar Express paper (Amsel, Persson, Musco, Gower, arXiv:2505.16932, its
Algorithm 1), the first seven divided by (1.01, 1.01^3, 1.01^5) for bf16 safety and the last repeated past
the list, with margin 1.01: the values and the rule StepFun's SteptronOss uses for Step-3.5
(steptronoss/optimizer/_helpers.py, `polar_express_coeffs_list`; recipe playground/sft/step3/muon_optimizer.py:
`muon_ns_steps = 6`, `muon_newtonschulz_fn = "polar_express"`). NS runs in `ns_dtype` (default: fp32 on CPU,
bf16 on an accelerator, where its matmuls are fast); momentum and the AdamW moments stay fp32.

Logical matrices: a parameter's last two dims are a matrix and any leading dims index separate matrices
(stacked experts [E, out, in] are E matrices; LoRA expert adapters [E, in, r] likewise); a fused 2-D
parameter may declare `row_splits` (sizes along dim 0 that sum to its rows, e.g. q, k, v, g of a fused
projection), each block orthogonalised and lr-scaled on its own.

Param groups: a group with `use_muon: True` is Muon's (keys lr, momentum, nesterov, weight_decay, ns_steps,
coefficients, lr_adjust, ns_dtype, ns_eps and `row_splits`, one entry per param, None when whole); any other
group is AdamW's (lr, betas, eps, weight_decay), stepped by torch's own AdamW function, so it is AdamW's
update bit for bit and keeps AdamW's state (step, exp_avg, exp_avg_sq).

Sharded (FSDP2 / EP) parameters: momentum and decay act on the local shards (elementwise), and
Newton–Schulz sees whole matrices: parallel/whole_matrices.py deals each logical matrix split over an
FSDP mesh dim to one owner rank of that dim, which gets the slices (all_to_all), orthogonalises, and
sends every rank its slice back; experts split whole over `ep` need no exchange. The result is the
single-process update up to float rounding (tests/test_distributed_equivalence.py, tests/test_lora_dist.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
from torch.optim.adamw import adamw as adamw_step

from step35.parallel.whole_matrices import BUCKET_BYTES, buckets, split_of, transform_whole

CLASSIC = (3.4445, -4.7750, 2.0315)

# arXiv:2505.16932 Algorithm 1 (degree 5), as listed in StepFun's SteptronOss steptronoss/optimizer/_helpers.py;
# safety-scaled below like there. Values are facts of the paper; the list is written here from them.
_POLAR_EXPRESS_PAPER = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_SAFETY = 1.01
POLAR_EXPRESS = tuple((a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5) for a, b, c in _POLAR_EXPRESS_PAPER[:-1]) + (
    _POLAR_EXPRESS_PAPER[-1],
)

# name -> (coefficients per step, the last repeated past the list; margin on the Frobenius norm)
COEFFICIENT_SETS: dict[str, tuple[tuple[tuple[float, float, float], ...], float]] = {
    "classic": ((CLASSIC,), 1.0),
    "polar_express": (POLAR_EXPRESS, _SAFETY),
}
LR_ADJUSTS = ("match_rms_adamw", "original")
NS_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def step_coefficients(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` NS steps of the named set."""
    listed, _ = COEFFICIENT_SETS[name]
    return [listed[min(k, len(listed) - 1)] for k in range(steps)]


def newton_schulz(
    update: torch.Tensor, coefficients: str, steps: int, dtype: torch.dtype, eps: float = 1e-7
) -> torch.Tensor:
    """About the polar factor of each matrix of `update` [..., A, B] (the last two dims a matrix, leading dims
    separate matrices), computed in `dtype`; returned in `dtype`, same shape."""
    _, margin = COEFFICIENT_SETS[coefficients]
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / (x.norm() * margin).clamp(min=eps)
        for a, b, c in step_coefficients(coefficients, steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        lead = x.shape[:-2]
        x = x.reshape(-1, *x.shape[-2:])
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * margin).clamp(min=eps)
        for a, b, c in step_coefficients(coefficients, steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        x = x.reshape(*lead, *x.shape[-2:])
    return x.mT if tall else x


def lr_ratio(lr_adjust: str, rows: int, cols: int) -> float:
    """The factor on lr for a logical matrix [rows, cols]."""
    if lr_adjust == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: in-place changes are the DTensor's), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "device_mesh") else tensor


def _describe(group: dict[str, Any], i: int, param: torch.Tensor) -> str:
    return f"param {i} of group {group.get('name', '?')!r} {tuple(param.shape)}"


def _check_same_count(count: int, group: dict[str, Any]) -> None:
    """Every rank must bring the same matrices to the exchange: refuse (instead of a hang in it) a step
    where ranks differ in which Muon parameters have a gradient."""
    if not _sharded_group(group):
        return
    counts = torch.tensor([count, -count], dtype=torch.int64)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    if counts[0].item() != -counts[1].item():
        raise RuntimeError(
            f"Muon group {group.get('name', '?')!r}: ranks differ in how many of its parameters have a gradient "
            f"this step ({-counts[1].item()} to {counts[0].item()}; this rank {count}): Newton–Schulz of sharded "
            "matrices needs every rank's slices"
        )


def _sharded_group(group: dict[str, Any]) -> bool:
    return any(hasattr(p, "device_mesh") for p in group["params"])


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `use_muon`, AdamW on the others (see the module docstring)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        coefficients: str = "classic",
        lr_adjust: str = "original",
        ns_dtype: str = "auto",
        ns_eps: float = 1e-7,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            coefficients=coefficients,
            lr_adjust=lr_adjust,
            ns_dtype=ns_dtype,
            ns_eps=ns_eps,
            betas=betas,
            eps=eps,
            use_muon=False,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            check_muon_group(group)
            splits = group.setdefault("row_splits", [None] * len(group["params"]))
            if len(splits) != len(group["params"]):
                raise ValueError(f"row_splits has {len(splits)} entries for {len(group['params'])} params")
            for i, (param, split) in enumerate(zip(group["params"], splits)):
                split_of(param, _describe(group, i, param))  # a sharding the exchange cannot take: now
                if param.dim() < 2:
                    raise ValueError(f"Muon takes matrices; param {i} of its group has shape {tuple(param.shape)}")
                if split is not None and (param.dim() != 2 or sum(split) != param.shape[0]):
                    raise ValueError(f"row_splits {split} do not split the rows of a 2-D {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        params = [
            (i, p, rows) for i, (p, rows) in enumerate(zip(group["params"], group["row_splits"])) if p.grad is not None
        ]
        _check_same_count(len(params), group)
        if not params:
            return
        device = _local(params[0][1]).device
        dtype = NS_DTYPES[group["ns_dtype"]] or (torch.float32 if device.type == "cpu" else torch.bfloat16)

        def orthogonalize(matrices: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
            """[n, A, B] -> NS of each matrix (of each row block with row_splits), times its lr ratio, fp32."""
            blocks = matrices.split(list(rows), dim=1) if rows is not None else (matrices,)
            return torch.cat(
                [
                    newton_schulz(block, group["coefficients"], group["ns_steps"], dtype, group["ns_eps"]).float()
                    * lr_ratio(group["lr_adjust"], *block.shape[-2:])
                    for block in blocks
                ],
                dim=1,
            )

        splits = [split_of(p, _describe(group, i, p)) for i, p, _ in params]
        for bucket in buckets([p for _, p, _ in params]):
            updates = [self._momentum_update(params[j][1], group) for j in bucket]
            results = transform_whole(
                updates, [splits[j] for j in bucket], [params[j][2] for j in bucket], orthogonalize
            )
            lr = group["lr"]
            for j, result in zip(bucket, results):
                local = _local(params[j][1])
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(result.to(local.dtype), alpha=-lr)

    def _momentum_update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The momentum buffer moved by this step's gradient (local shards, fp32); the update to orthogonalise."""
        momentum = group["momentum"]
        grad = _local(param.grad).float()
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
        buf = _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_step(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def check_muon_group(group: dict[str, Any]) -> None:
    """Refuse settings of a Muon group that mean nothing, naming the option (`model.optimizer_options.<key>`)."""
    rules = {
        "coefficients": (group["coefficients"] in COEFFICIENT_SETS, f"one of {sorted(COEFFICIENT_SETS)}"),
        "lr_adjust": (group["lr_adjust"] in LR_ADJUSTS, f"one of {list(LR_ADJUSTS)}"),
        "ns_dtype": (group["ns_dtype"] in NS_DTYPES, f"one of {list(NS_DTYPES)}"),
        "ns_steps": (isinstance(group["ns_steps"], int) and 1 <= group["ns_steps"] < 100, "an integer in [1, 99]"),
        "momentum": (0 <= group["momentum"] < 1, "in [0, 1)"),
        "weight_decay": (group["weight_decay"] >= 0, ">= 0"),
    }
    for key, (ok, requirement) in rules.items():
        if not ok:
            raise ValueError(
                f"model.optimizer_options.{key}={group[key]!r}: must be {requirement} (model.optimizer muon)"
            )


# ------------------------------------------------------------------------------ which matrices, and the options
# Parameters that Muon does not take, by the end of their name (docs/architecture.md §3): embeddings and the
# output heads (rows looked up or one per token, not a linear map to orthogonalise), the router (its logits pick
# experts), norms and biases. A LoRA adapter goes with its base: the adapters of these stay on AdamW.
ADAMW_NAMES = ("embed_tokens", "lm_head", "shared_head.output", "moe.gate", "router_bias")


MUON_ROLE, ADAMW_ROLE = "muon", "adamw"  # matrix_role's answers


class MatrixRole(NamedTuple):
    """How the optimizer takes one parameter: `muon` or `adamw`; for Muon, the number of logical matrices
    (the product of the leading dims: E for stacked experts) and the shape [A, B] of each."""

    optimizer: str
    matrices: int = 0
    shape: tuple[int, int] | None = None


def matrix_role(name: str, shape: tuple[int, ...]) -> MatrixRole:
    """Muon or AdamW for a step35 parameter, e.g. `model.layers.3.self_attn.q_proj.weight` [12288, 4096]:
    muon, 1 matrix; `model.layers.3.moe.up_proj.weight` [288, 1280, 4096]: muon, 288 matrices [1280, 4096];
    `...moe.up_proj.lora_A` [288, 4096, r]: muon, 288 matrices; `model.norm.weight`, `lm_head.weight`,
    `...moe.gate.weight` (router), `...moe.router_bias`: adamw. q, k, v, g, o and gate, up, down are separate
    parameters in step35 (HF layout, nothing fused), so each is its own matrix; MTP layers go by the same names."""
    base = name.removesuffix(".weight").removesuffix(".lora_A").removesuffix(".lora_B").removesuffix(".bias")
    if len(shape) < 2 or base.endswith(ADAMW_NAMES) or name.endswith("norm.weight"):
        return MatrixRole(ADAMW_ROLE)
    return MatrixRole(MUON_ROLE, math.prod(shape[:-2]), (shape[-2], shape[-1]))


# ------------------------------------------------------------------------------ what a step holds and moves
# A matrix split over k ranks goes whole to its owner and comes back (parallel/whole_matrices.py): its values
# cross the network twice, in fp32 (the momentum's dtype), each rank sending (k - 1) / k of its slices each way.
EXCHANGE_BYTES = 4


def step_temporaries(largest_param_bytes: int) -> int:
    """Bytes a Muon step holds at once beside its state: AdamW's part steps one tensor at a time (twice the
    biggest parameter); the exchange holds about 8 buckets (the updates, what is sent and received, the whole
    matrices, Newton-Schulz's terms, the results), a bucket one parameter when that is larger."""
    return 2 * largest_param_bytes + 8 * max(BUCKET_BYTES, largest_param_bytes)


PRESETS: dict[str, dict[str, Any]] = {
    # StepFun's Step-3.5 SFT (SteptronOss playground/sft/step3/muon_optimizer.py and steptronoss/optimizer/muon.py):
    # 6 polar-express steps, lr scaled to AdamW's update RMS (0.2), AdamW betas (0.95, 0.95) for the rest;
    # its weight decay 0.1 is model.weight_decay's default. (StepFun also decays 1-D params; step35 never decays norms.)
    "stepfun": {
        "ns_steps": 6,
        "coefficients": "polar_express",
        "lr_adjust": "match_rms_adamw",
        "momentum": 0.95,
        "nesterov": True,
        "adamw_betas": (0.95, 0.95),
    },
}


@dataclass(frozen=True)
class MuonOptions:
    """`model.optimizer_options` of `model.optimizer muon` (a preset first, then the keys given win).
    lr / weight_decay: Muon's (None: model.lr / model.weight_decay); adamw_lr / adamw_betas: the AdamW part's
    (None: model.lr / model.betas; its eps is model.eps)."""

    preset: str | None = None
    lr: float | None = None
    weight_decay: float | None = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficients: str = "polar_express"
    lr_adjust: str = "match_rms_adamw"
    ns_dtype: str = "auto"
    adamw_lr: float | None = None
    adamw_betas: tuple[float, float] | None = None

    @classmethod
    def of(cls, extra: dict[str, Any]) -> MuonOptions:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"model.optimizer_options={extra}: {unknown} are not options of model.optimizer muon (accepted: {known})"
            )
        preset = extra.get("preset")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"model.optimizer_options.preset={preset!r}: must be one of {sorted(PRESETS)}")
        values = {**PRESETS.get(preset, {}), **extra}
        if values.get("adamw_betas") is not None:
            values["adamw_betas"] = tuple(values["adamw_betas"])
        options = cls(**values)
        check_muon_group(asdict(options) | {"weight_decay": options.weight_decay or 0.0})
        for key in ("lr", "adamw_lr"):
            value = getattr(options, key)
            if value is not None and not value >= 0:
                raise ValueError(f"model.optimizer_options.{key}={value}: must be >= 0 (model.optimizer muon)")
        return options
