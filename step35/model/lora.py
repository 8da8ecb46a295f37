"""LoRA: low-rank adapters on a frozen Step-3.5 model, routed experts included (docs/lora.md).

`apply_lora(model, lora)` turns a model built by `build_model` (on any device, meta included) into
a LoRA model in place, before it is sharded or filled:
- dense projections (nn.Linear) become `LoraLinear`: the same `weight`, plus `lora_A` [r, in] and
  `lora_B` [out, r]; y = x @ W.T + (dropout(x) @ A.T @ B.T) * alpha / r;
- routed experts (`ExpertWeight`, weight [E, out, in]) get one pair per expert, stacked
  `lora_A` [E, in, r] and `lora_B` [E, r, out], computed through the experts' own grouped GEMM
  (model/moe.py), so expert parallelism shards and runs them like the experts;
- every other parameter is frozen and cast to the base dtype (the checkpoint's, by default), except
  the full targets "router", "lm_head" and "embed", which are trained in full (fp32). Norms are
  always frozen. Adapters are fp32.

Step-3.7's vision side (a Step35VLForConditionalGeneration, model/vision.py) has two targets of its own: "vision"
(each encoder block's linears: attn.out_proj, mlp.c_fc, mlp.c_proj; their biases stay frozen; the fused
attn.in_proj_weight is a plain parameter, not adapted) and "vision_projector" (vit_large_projector).

Adapter names end in `lora_A` / `lora_B`; the deterministic init (model/init.py) draws A
kaiming-uniform-like (bound 1 / sqrt(in)) and sets B to zero, so a fresh LoRA model computes
exactly what its base does.

Shape legend: r rank of a dense adapter, re the expert rank, E experts, in/out a projection's widths.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from step35.config import Step35Config

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj")
VISION_TARGETS = ("vision", "vision_projector")  # a vision-language model's encoder linears and projector
ADAPTER_TARGETS = ATTENTION_TARGETS + ("attention", "mlp", "shared_expert", "experts", "mtp") + VISION_TARGETS
FULL_TARGETS = ("router", "lm_head", "embed")
VALID_TARGETS = ADAPTER_TARGETS + FULL_TARGETS
DEFAULT_TARGETS = ["attention", "mlp", "shared_expert", "experts"]
ADAPTER_SUFFIXES = ("lora_A", "lora_B")
BASE_DTYPES = ("bfloat16", "float16", "float32")


class LoraError(ValueError):
    """A LoRA option that cannot work, named in the message (`model.lora.rank=0: ...`)."""


@dataclass
class LoraConfig:
    """LoRA options (`model.lora`).

    Args:
        rank: rank r of the dense adapters (attention, dense MLP, shared expert, MTP).
        alpha: scaling numerator: each adapter adds (alpha / its own rank) * B @ A. Default: rank.
        dropout: dropout probability on an adapter's input (the base path never sees it).
        targets: where adapters go: "q_proj", "k_proj", "v_proj", "o_proj", "g_proj" (the per-head
            gate), "attention" (those five), "mlp" (dense layers' gate/up/down), "shared_expert",
            "experts" (routed experts, one pair per expert), "mtp" (the same targets inside the MTP
            layers, plus their eh_proj); "router", "lm_head", "embed" are trained in full when named;
            a Step-3.7 model with model.vision: "vision" (the encoder's linears), "vision_projector".
        expert_rank: rank of the routed-expert adapters. Default max(1, rank // moe_top_k): each
            token passes through top-k experts, so its expert update has about rank dims in all.
        base_dtype: dtype the frozen base is stored and computed in ("bfloat16", "float16",
            "float32"). Default: the model config's torch_dtype (the checkpoint's own dtype).
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    expert_rank: int | None = None
    base_dtype: str | None = None

    @classmethod
    def of(cls, value: LoraConfig | dict | None) -> LoraConfig | None:
        """A LoraConfig from a LoraConfig, a dict of its fields, or None (LoRA off)."""
        if value is None or isinstance(value, LoraConfig):
            return value
        if hasattr(value, "as_dict"):  # a jsonargparse Namespace (a config parsed without instantiation)
            value = value.as_dict()
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise LoraError(f"model.lora: unknown field(s) {unknown}; valid: {sorted(cls.__dataclass_fields__)}")
            if "rank" not in value:
                raise LoraError("model.lora: `rank` is required")
            return cls(**value)
        raise LoraError(f"model.lora must be a mapping of LoRA options or null, got {type(value).__name__}")

    @property
    def scale_alpha(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)

    def resolved_expert_rank(self, config: Step35Config) -> int:
        return self.expert_rank if self.expert_rank is not None else max(1, self.rank // config.moe_top_k)

    def resolved_base_dtype(self, config: Step35Config) -> torch.dtype:
        return getattr(torch, self.base_dtype or config.torch_dtype)

    def expanded_targets(self) -> set[str]:
        """The targets with "attention" spelled out as its five projections."""
        out = set(self.targets)
        if "attention" in out:
            out |= set(ATTENTION_TARGETS)
        return out

    def validate(
        self, config: Step35Config, *, num_mtp_layers: int | None = None, mtp_loss_weight: float | None = None
    ) -> None:
        """Refuse options that cannot work, naming the field; sizes are checked in apply_lora."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"model.lora.rank={self.rank!r}: must be an integer >= 1")
        if self.expert_rank is not None and (
            isinstance(self.expert_rank, bool) or not isinstance(self.expert_rank, int) or self.expert_rank < 1
        ):
            raise LoraError(
                f"model.lora.expert_rank={self.expert_rank!r}: must be an integer >= 1 (or null: "
                f"max(1, rank // moe_top_k))"
            )
        if self.alpha is not None and not self.alpha > 0:
            raise LoraError(f"model.lora.alpha={self.alpha!r}: must be > 0 (or null: the rank)")
        if not 0 <= self.dropout < 1:
            raise LoraError(f"model.lora.dropout={self.dropout!r}: must be in [0, 1)")
        if isinstance(self.targets, str) or not self.targets:
            raise LoraError(f"model.lora.targets={self.targets!r}: must be a non-empty list of {list(VALID_TARGETS)}")
        unknown = [t for t in self.targets if t not in VALID_TARGETS]
        if unknown:
            raise LoraError(f"model.lora.targets: unknown target(s) {unknown}; valid targets: {list(VALID_TARGETS)}")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise LoraError(
                f"model.lora.base_dtype={self.base_dtype!r}: must be one of {list(BASE_DTYPES)} "
                f"(or null: the config's torch_dtype)"
            )
        targets = self.expanded_targets()
        if not targets - {"mtp"}:
            raise LoraError(
                "model.lora.targets=['mtp']: 'mtp' adds the other targets inside the MTP layers; "
                "name at least one of them too"
            )
        if "mtp" in targets:
            built = config.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
            if built == 0:
                raise LoraError(
                    "model.lora.targets names 'mtp' but no MTP layer is built "
                    f"(model.num_mtp_layers={num_mtp_layers}); drop 'mtp' from the targets"
                )
            if mtp_loss_weight is not None and mtp_loss_weight == 0:
                raise LoraError(
                    "model.lora.targets names 'mtp' but model.mtp_loss_weight=0: the MTP adapters "
                    "would never get a gradient; set model.mtp_loss_weight > 0 or drop 'mtp'"
                )
        if "experts" in targets and not config.use_moe:
            raise LoraError("model.lora.targets names 'experts' but the model config has no MoE layers")


def is_adapter(name: str) -> bool:
    """True for a LoRA adapter parameter name (`...q_proj.lora_A`, `...moe.up_proj.lora_B`)."""
    return name.endswith(ADAPTER_SUFFIXES)


def lora_delta(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, dropout: float, training: bool
) -> torch.Tensor:
    """(dropout(x) @ A.T @ B.T) * scale in x's dtype (the compute dtype: the fp32 adapters are cast
    as FSDP's param_dtype would). x [..., in], A [r, in], B [out, r] -> [..., out]."""
    h = F.dropout(x, dropout, training) if dropout > 0 else x
    return F.linear(F.linear(h, A.to(x.dtype)), B.to(x.dtype)) * scale


class LoraLinear(nn.Linear):
    """nn.Linear with a low-rank adapter: weight [out, in] (frozen), lora_A [r, in], lora_B [out, r]; the
    layer's bias (the vision encoder's linears have one), frozen, or None."""

    lora_rank: int
    lora_scale: float
    lora_dropout: float
    lora_off = False  # set by adapters_off: the base layer alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_off:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + self.delta(x)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution alone for input x [..., in] -> [..., out]."""
        return lora_delta(x, self.lora_A, self.lora_B, self.lora_scale, self.lora_dropout, self.training)


def _check_rank(name: str, rank: int, in_features: int, out_features: int, field_name: str) -> None:
    if rank > min(in_features, out_features):
        raise LoraError(
            f"model.lora.{field_name}={rank} is larger than layer {name} ({in_features} -> "
            f"{out_features}) can use (at most {min(in_features, out_features)}); lower it or drop "
            f"that layer from model.lora.targets"
        )


def _adapt_linear(parent: nn.Module, child: str, name: str, rank: int, scale: float, dropout: float) -> None:
    linear = getattr(parent, child)
    if type(linear) is not nn.Linear:
        raise LoraError(f"{name}: LoRA adapts nn.Linear layers, got {type(linear).__name__}")
    _check_rank(name, rank, linear.in_features, linear.out_features, "rank")
    device = linear.weight.device
    adapted = LoraLinear.__new__(LoraLinear)
    nn.Module.__init__(adapted)
    adapted.in_features, adapted.out_features = linear.in_features, linear.out_features
    adapted.weight = linear.weight  # the same parameter object: names and tying stay
    adapted.register_parameter("bias", linear.bias)  # the same parameter object too, or None
    adapted.lora_A = nn.Parameter(torch.zeros(rank, linear.in_features, device=device, dtype=torch.float32))
    adapted.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=device, dtype=torch.float32))
    adapted.lora_rank, adapted.lora_scale, adapted.lora_dropout = rank, scale, dropout
    adapted.train(linear.training)
    setattr(parent, child, adapted)


def _adapt_experts(proj: nn.Module, name: str, rank: int, scale: float, dropout: float) -> None:
    E, out_features, in_features = proj.weight.shape
    _check_rank(name, rank, in_features, out_features, "expert_rank")
    device = proj.weight.device
    proj.lora_A = nn.Parameter(torch.zeros(E, in_features, rank, device=device, dtype=torch.float32))
    proj.lora_B = nn.Parameter(torch.zeros(E, rank, out_features, device=device, dtype=torch.float32))
    proj.lora_scale, proj.lora_dropout = scale, dropout


def _layer_targets(layer: nn.Module, targets: set[str]) -> list[tuple[nn.Module, str, str]]:
    """(parent module, child name, kind) of each dense Linear of one decoder/MTP layer to adapt."""
    out = [
        (layer.self_attn, proj, proj)
        for proj in ATTENTION_TARGETS
        if proj in targets and getattr(layer.self_attn, proj, None) is not None
    ]
    if hasattr(layer, "mlp") and "mlp" in targets:
        out += [(layer.mlp, p, "mlp") for p in ("gate_proj", "up_proj", "down_proj")]
    if hasattr(layer, "share_expert") and "shared_expert" in targets:
        out += [(layer.share_expert, p, "shared_expert") for p in ("gate_proj", "up_proj", "down_proj")]
    if hasattr(layer, "eh_proj"):
        out.append((layer, "eh_proj", "mtp"))
    return out


def apply_lora(model: nn.Module, lora: LoraConfig) -> None:
    """Add the adapters `lora` asks for to a Step35ForCausalLM in place, freeze the rest and cast the
    frozen parameters to the base dtype. Call it after build_model and before parallelize/materialize
    (FSDP2 fixes which parameters are trainable at the first forward). Raises LoraError on bad options."""
    config: Step35Config = model.config
    lora.validate(config, num_mtp_layers=model.num_mtp_layers)
    targets = lora.expanded_targets()
    for i, layer in enumerate(model.model.layers):
        if not layer.spec.is_mtp or "mtp" in targets:
            _adapt_layer(layer, f"model.layers.{i}", lora, config, targets)
    _adapt_vision(model, lora, targets)
    _freeze_base(model, targets, lora.resolved_base_dtype(config))


def _adapt_vision(model: nn.Module, lora: LoraConfig, targets: set[str]) -> None:
    """The vision targets of a vision-language model; LoraError naming them for a model without a vision side."""
    named = sorted(targets & set(VISION_TARGETS))
    if not named:
        return
    if getattr(model, "vision_model", None) is None:
        raise LoraError(
            f"model.lora.targets names {named} but the model has no vision side: set model.vision with a Step-3.7"
            " model, or drop them"
        )
    scale = lora.scale_alpha / lora.rank
    if "vision_projector" in targets:
        _adapt_linear(model, "vit_large_projector", "vit_large_projector", lora.rank, scale, lora.dropout)
    if "vision" in targets:
        for i, block in enumerate(model.vision_model.transformer.resblocks):
            prefix = f"vision_model.transformer.resblocks.{i}"
            for parent, child, sub in ((block.attn, "out_proj", "attn"), (block.mlp, "c_fc", "mlp"),
                                       (block.mlp, "c_proj", "mlp")):  # fmt: skip
                _adapt_linear(parent, child, f"{prefix}.{sub}.{child}", lora.rank, scale, lora.dropout)


def check_sizes(
    lora: LoraConfig, config: Step35Config, num_mtp_layers: int | None = None, mtp_loss_weight: float | None = None
) -> None:
    """Check the options (`LoraConfig.validate`), then raise the LoraError apply_lora would raise for a
    too-large rank, without building the model: one meta layer of each distinct kind (dense / MoE / MTP,
    head counts) is adapted instead."""
    from step35.model.transformer import DecoderLayer, MTPLayer  # the layers this module adapts

    lora.validate(config, num_mtp_layers=num_mtp_layers, mtp_loss_weight=mtp_loss_weight)
    targets = lora.expanded_targets()
    built = config.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
    seen = set()
    for i in range(config.num_hidden_layers + built):
        spec = config.layer(i)
        kind = (spec.is_moe, spec.is_mtp, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        if kind in seen or (spec.is_mtp and "mtp" not in targets):
            continue
        seen.add(kind)
        with torch.device("meta"):
            layer = (MTPLayer if spec.is_mtp else DecoderLayer)(config, spec)
        _adapt_layer(layer, f"model.layers.{i}", lora, config, targets)


def _adapt_layer(layer: nn.Module, prefix: str, lora: LoraConfig, config: Step35Config, targets: set[str]) -> None:
    rank, expert_rank, alpha = lora.rank, lora.resolved_expert_rank(config), lora.scale_alpha
    for parent, child, _ in _layer_targets(layer, targets):
        sub = [n for n, m in layer.named_modules() if m is parent][0]
        name = ".".join(p for p in (prefix, sub, child) if p)
        _adapt_linear(parent, child, name, rank, alpha / rank, lora.dropout)
    if layer.spec.is_moe and "experts" in targets:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _adapt_experts(
                getattr(layer.moe, proj), f"{prefix}.moe.{proj}", expert_rank, alpha / expert_rank, lora.dropout
            )


def is_full_target(name: str, targets: set[str]) -> bool:
    """True for a parameter the expanded `targets` train in full (router, lm_head, embed)."""
    return _full_target(name, targets)


def _full_target(name: str, targets: set[str]) -> bool:
    if name.endswith("moe.gate.weight"):
        return "router" in targets
    if name == "lm_head.weight":
        return "lm_head" in targets
    if name == "model.embed_tokens.weight":
        return "embed" in targets
    return False


def _freeze_base(model: nn.Module, targets: set[str], base_dtype: torch.dtype) -> None:
    """Adapters and named full targets train in fp32; everything else is frozen in `base_dtype`.
    A tied embedding / lm_head is one parameter: trained when either is named."""
    trainable = {
        id(p) for n, p in model.named_parameters(remove_duplicate=False) if is_adapter(n) or _full_target(n, targets)
    }
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in trainable:
                param.requires_grad_(True)
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(param.detach().to(base_dtype), requires_grad=False)
            module._parameters[pname] = converted[id(param)]
    if base_dtype == torch.float32:
        return
    # Full targets train in fp32 inside a bf16 (or fp16) model: cast at their edges. (Under FSDP's
    # param_dtype they are gathered in the compute dtype already and these casts do nothing.)
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None or id(weight) not in trainable:
            continue
        if isinstance(module, nn.Embedding):  # the residual stream starts in the base dtype
            module.register_forward_hook(lambda m, args, out: out.to(base_dtype))
        elif isinstance(module, nn.Linear):  # lm_head, router: read the bf16 activations in the weight's dtype
            module.register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype), *args[1:]))


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base inside the block: every LoRA adapter (LoraLinear, routed experts) is
    skipped, no delta is computed (its A and B are not read). The reference model of LoRA preference
    optimisation (training/dpo.py). Full targets (router, lm_head, embed) are not undone: they are the
    trained weights themselves. Restored on exit, also after an exception."""
    adapted = [m for m in model.modules() if "lora_A" in m._parameters]
    for module in adapted:
        module.lora_off = True
    try:
        yield
    finally:
        for module in adapted:
            module.lora_off = False


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter of every LoRA adapter of `model` (in model order)."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


@torch.no_grad()
def merged_weight(name: str, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float) -> torch.Tensor:
    """W + (alpha / r) * (the adapter's B A), in float32, for `step35 export --merge`.

    Dense: weight [out, in], A [r, in], B [out, r] -> W + s * B @ A. Routed experts: weight
    [E, out, in], A [E, in, r], B [E, r, out] -> per expert W_e + s * (A_e @ B_e)^T (the forward
    computes x @ A_e @ B_e beside x @ W_e^T), as one batched matmul. r is read from A's shape;
    `name` (the weight's) is for the error on shapes that do not fit."""
    W, A, B = weight.float(), A.float(), B.float()
    if W.dim() == 2 and A.dim() == 2 and B.shape == (W.shape[0], A.shape[0]) and A.shape[1] == W.shape[1]:
        return W + (alpha / A.shape[0]) * (B @ A)
    if (
        W.dim() == 3
        and A.dim() == 3
        and A.shape[:2] == (W.shape[0], W.shape[2])
        and B.shape == (W.shape[0], A.shape[2], W.shape[1])
    ):
        return W + (alpha / A.shape[2]) * torch.bmm(A, B).transpose(1, 2)
    raise LoraError(
        f"{name}: adapter shapes A {list(A.shape)}, B {list(B.shape)} do not fit weight {list(weight.shape)}"
    )
