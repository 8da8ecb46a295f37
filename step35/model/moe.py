"""Step-3.5 mixture of experts (docs/architecture.md §2.9): fp32 sigmoid router with a selection-only bias, top-k
weights from unbiased scores renormalised and scaled, routed SwiGLU experts stacked [E, out, in]
and computed through one grouped GEMM per projection.

Router statistics: `tokens_per_expert` counts routed rows per expert in training forwards (read
and reset by step35/balancing.py); `sequence_balance_loss` is the optional auxiliary
loss, collected through a `RouterAuxLosses` passed down the layers.

The shared expert is a sibling module of the layer (`share_expert.*`), not part of this one; the
decoder layer adds the two. Expert parallelism plugs in through `dispatcher` (see
step35/parallel): this file knows nothing of process groups.

Shape legend: T tokens, H hidden, E experts, K top-k, N = T*K routed rows, I expert width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from step35.kernels.grouped_gemm import grouped_mm
from step35.model.mlp import clamped_swiglu
from step35.model.routing import LayerRoutes, in_backward_recompute


class ExpertWeight(nn.Module):
    """One stacked projection of all experts, nn.Linear layout per expert: weight [E, out, in].

    With LoRA (model/lora.py adds `lora_A` [E, in, r] and `lora_B` [E, r, out]) each expert adds
    its own (dropout(x) @ A_e @ B_e) * lora_scale, through the same grouped GEMM as the weight, unless
    `lora_off` (model.lora.adapters_off) is set."""

    lora_off = False

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, in] rows sorted by expert, counts: [E_held] rows per expert held here -> [N, out].

        Under expert parallelism this module holds a slice of the experts (see kernels.grouped_gemm.grouped_mm)."""
        y = grouped_mm(x, self.weight, counts)
        if "lora_A" not in self._parameters or self.lora_off:
            return y
        return y + expert_lora_delta(
            x, self.lora_A, self.lora_B, counts, self.lora_scale, self.lora_dropout, self.training
        )


def expert_lora_delta(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    dropout: float,
    training: bool,
) -> torch.Tensor:
    """Per-expert (dropout(x) @ A_e @ B_e) * scale on rows sorted by expert, in x's dtype (the
    compute dtype: the fp32 adapters are cast like FSDP's param_dtype would). x [N, in],
    A [E, in, r], B [E, r, out] (held experts), counts [E_held] -> [N, out]. Two grouped GEMMs; the
    rank is zero-padded to the kernel's 16-byte row alignment (exact: the pads multiply zeros)."""
    # Expert-parallel adapters are DTensors sharded over experts: use the experts held here.
    A, B = (t.to_local() if hasattr(t, "to_local") else t for t in (A, B))
    A, B = A.to(x.dtype), B.to(x.dtype)
    r = A.shape[-1]
    step = max(1, 16 // x.element_size())
    if r % step:
        A = F.pad(A, (0, step - r % step))  # [E, in, r'] zero columns
        B = F.pad(B, (0, 0, 0, step - r % step))  # [E, r', out] zero rows
    h = F.dropout(x, dropout, training) if dropout > 0 else x
    # grouped_mm takes nn.Linear-layout stacks [E, out, in]: hand it A and B transposed (views).
    h = grouped_mm(h, A.transpose(-2, -1), counts)  # [N, r']
    return grouped_mm(h, B.transpose(-2, -1), counts) * scale  # [N, out]


def expert_swiglu(moe: MoE, x: torch.Tensor, counts: torch.Tensor, row_weight: torch.Tensor) -> torch.Tensor:
    """Routed experts on rows sorted by expert, each output row scaled by its routing weight. x: [N, H];
    counts: [E_held]; row_weight: [N] fp32 -> [N, H]. The weight scales the SwiGLU product (the down
    projection is linear): its gradient comes from the gate and up outputs kept anyway, not from the
    [N, H] expert outputs (model/mlp.py)."""
    hidden = clamped_swiglu(moe.gate_proj(x, counts), moe.up_proj(x, counts), moe.limit, row_weight)  # [N, I]
    return moe.down_proj(hidden, counts)


class _CombineRows(torch.autograd.Function):
    """out[t] = sum of the (weighted) rows y[r] routed from token t. Keeps only the row-to-token map:
    default autograd of index_add_ would keep the [N, H] rows too."""

    @staticmethod
    def forward(ctx, y, token_of_row, num_tokens: int):
        ctx.save_for_backward(token_of_row)
        return y.new_zeros((num_tokens, y.shape[-1])).index_add_(0, token_of_row, y)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None


def combine_rows(y: torch.Tensor, token_of_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """y [N, H] weighted expert outputs, token_of_row [N] -> [num_tokens, H]."""
    return _CombineRows.apply(y, token_of_row, num_tokens)


class _Gather:
    """`source[index]`, computed again when backward first asks for it and shared by what asks next."""

    def __init__(self, source: torch.Tensor, index: torch.Tensor):
        self.source, self.index, self._rows = source, index, None

    def rows(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = self.source.detach()[self.index]
        return self._rows


@contextlib.contextmanager
def regathered(rows: torch.Tensor, source: torch.Tensor, index: torch.Tensor):
    """Inside the block, autograd does not keep `rows` (= source[index], contiguous) or views of it for
    backward: it keeps a note, and backward gathers the rows again from `source` and `index`, which the layer
    keeps anyway (the FFN input for the shared expert, the row-to-token map for the combine). Saves K x H
    values per token per MoE layer for one gather per layer in backward."""
    storage, dtype = rows.untyped_storage().data_ptr(), rows.dtype  # (not `rows`: autograd keeps these hooks)
    gather = _Gather(source, index)

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == storage and t.dtype == dtype:
            return gather, t.shape, t.stride(), t.storage_offset()
        return t

    def unpack(packed):
        if isinstance(packed, tuple):
            gather_, shape, stride, offset = packed
            return gather_.rows().as_strided(shape, stride, offset)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _Fp32Linear(torch.autograd.Function):
    """F.linear(x.float(), weight.float()) that keeps x and the weight as they are for backward and
    upcasts again there: under bf16 the default autograd would keep an fp32 copy of the router's
    input [T, H] per MoE layer (the layer keeps x itself anyway, for the shared expert)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.mm(weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight[out, in].T computed in fp32 -> [T, out] fp32 (the fp32 router)."""
    return _Fp32Linear.apply(x, weight)


class ExpertDispatcher(Protocol):
    """Runs the routed experts on the rows `x[token_of_row]` (sorted by global expert id) and returns their
    outputs, each scaled by its routing weight `row_weight`, in the same order. The default runs every
    expert locally; expert parallelism swaps in an all-to-all."""

    def __call__(
        self, x: torch.Tensor, token_of_row: torch.Tensor, counts: torch.Tensor, moe: MoE, row_weight: torch.Tensor
    ) -> torch.Tensor: ...


def local_dispatch(
    x: torch.Tensor, token_of_row: torch.Tensor, counts: torch.Tensor, moe: MoE, row_weight: torch.Tensor
) -> torch.Tensor:
    rows = x[token_of_row]  # [N, H]
    if not moe.regather_rows or torch.compiler.is_compiling():
        return expert_swiglu(moe, rows, counts, row_weight)
    with regathered(rows, x, token_of_row):
        return expert_swiglu(moe, rows, counts, row_weight)


class RouterAuxLosses:
    """Collects each MoE layer's sequence-level balance loss during one forward.

    Passed down through the layers (not a module attribute). Deliberately a plain class, not a list
    or dataclass: FSDP2's input casting (its _apply_to_tensors helper) rebuilds lists
    and copies dataclasses but hands other objects through, so every layer adds to this one.
    Activation-checkpoint replays (in_backward_recompute) compute the loss again, so the recomputed
    graph matches the saved one, but do not add it a second time.

    sequence_weights [B] (optional): each sequence's weight in the mean over sequences (its share of
    trained labels, so that the loss over a global batch does not depend on how it is split)."""

    def __init__(self, sequence_weights: torch.Tensor | None = None) -> None:
        self.losses: list[torch.Tensor] = []
        self.sequence_weights = sequence_weights

    def add(self, loss: torch.Tensor) -> None:
        if not in_backward_recompute():
            self.losses.append(loss)


def sequence_balance_loss(
    scores: torch.Tensor, expert_ids: torch.Tensor, num_sequences: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Sequence-level balance loss (DeepSeek-V3 style), before its coefficient, averaged over sequences
    (each multiplied by its entry of `weights` [B] first, when given).

    scores [T, E] sigmoid router scores (fp32), expert_ids [T, K] the chosen experts (biased top-k),
    tokens grouped by sequence (T = num_sequences * S). Per sequence, with S its tokens:
        P_e = mean_t scores[t, e] / sum_e' scores[t, e']        (differentiable: the router learns from it)
        f_e = E / (K * S) * (tokens of the sequence routed to e)  (a count: no gradient)
        loss = sum_e f_e * P_e   (= 1 when routing and scores are uniform)
    """
    T, E = scores.shape
    K = expert_ids.shape[-1]
    S = T // num_sequences
    probs = (scores / scores.sum(-1, keepdim=True)).view(num_sequences, S, E)  # [B, S, E]
    P = probs.mean(1)  # [B, E]
    ids = expert_ids.reshape(num_sequences, S * K)
    routed = scores.new_zeros(num_sequences, E).scatter_add_(1, ids, scores.new_ones(ids.shape))  # [B, E]
    f = routed * (E / (K * S))
    per_sequence = (f * P).sum(-1)  # [B]
    return (per_sequence if weights is None else per_sequence * weights).mean()


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        limit: float = 0.0,
        scaling_factor: float = 3.0,
        renormalize: bool = True,
        use_bias: bool = True,
        fp32_router: bool = True,
    ):
        super().__init__()
        self.num_experts, self.top_k, self.limit = num_experts, top_k, limit
        self.scaling_factor, self.renormalize, self.fp32_router = scaling_factor, renormalize, fp32_router
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.gate_proj = ExpertWeight(num_experts, hidden_size, intermediate_size)
        self.up_proj = ExpertWeight(num_experts, hidden_size, intermediate_size)
        self.down_proj = ExpertWeight(num_experts, intermediate_size, hidden_size)
        # Selection-only bias: a buffer, so no optimizer or FSDP shard ever touches it; kept in
        # fp32 whatever the module is cast to (see _apply). Updated by load balancing, not by grads.
        self.register_buffer("router_bias", torch.zeros(num_experts, dtype=torch.float32) if use_bias else None)
        # Tokens routed to each expert since the last reset, counted in training forwards only
        # (not in eval, not again when activation checkpointing recomputes). Readers reset it.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.dispatcher: ExpertDispatcher = local_dispatch
        # Rebuild the expert rows x[token_of_row] in backward instead of keeping them (`regathered`); off inside
        # activation checkpointing, which keeps nothing of the layer anyway (parallelize.py turns it off there)
        self.regather_rows = True

    def route(
        self, x: torch.Tensor, routes: LayerRoutes | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] -> scores [T, E] fp32, expert ids [T, K], weights [T, K] fp32. `routes` (model/routing.py)
        records the chosen ids, or replaces them by recorded ones; the weights are then the live scores at
        the replayed ids, so the router still learns from them."""
        if self.fp32_router and not torch.is_autocast_enabled(x.device.type):
            logits = fp32_linear(x, self.gate.weight)
        elif self.fp32_router:  # autocast decides the matmul dtype: leave it to default autograd
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x).float()
        scores = torch.sigmoid(logits)  # [T, E]
        choice = scores + self.router_bias if self.router_bias is not None else scores
        expert_ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, K]
        if routes is not None:
            expert_ids = routes.choose(expert_ids)
        weights = scores.gather(-1, expert_ids)  # unbiased scores of the chosen experts
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, expert_ids, weights * self.scaling_factor

    def forward(
        self, x: torch.Tensor, router_aux: RouterAuxLosses | None = None, routes: LayerRoutes | None = None
    ) -> torch.Tensor:
        """x [B, S, H] (or [T, H]: one sequence) -> [same]. With `router_aux`, this layer's sequence
        balance loss (sequence_balance_loss) is added to it; `routes`: see `route`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        scores, expert_ids, weights = self.route(x, routes)
        if router_aux is not None:
            router_aux.add(
                sequence_balance_loss(
                    scores, expert_ids, shape[0] if len(shape) == 3 else 1, router_aux.sequence_weights
                )
            )
        flat_ids = expert_ids.reshape(-1)  # [N]
        order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert
        token_of_row = order // self.top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts)  # [E]
        if self.training and not in_backward_recompute():
            self.tokens_per_expert += counts.detach()
        y = self.dispatcher(x, token_of_row, counts, self, weights.reshape(-1)[order])  # [N, H], weighted
        if routes is not None:  # rollouts and their replay (RL) combine in fp32 alike, whatever the compute dtype
            return combine_rows(y.float(), token_of_row, x.shape[0]).to(y.dtype).view(shape)
        return combine_rows(y, token_of_row, x.shape[0]).view(shape)

    def take_tokens_per_expert(self) -> torch.Tensor:
        """The counts since the last take [E] (int64, on the buffer's device), and reset them. No host sync."""
        counts = self.tokens_per_expert.clone()
        self.tokens_per_expert.zero_()
        return counts

    def _apply(self, fn: Callable, recurse: bool = True):
        # Module casts (model.to(bfloat16), Lightning's bf16-true) must not round the fp32 router
        # bias: keep its values and dtype, follow only the device change.
        bias = self.router_bias
        super()._apply(fn, recurse)
        if bias is not None and self.router_bias.dtype != torch.float32:
            moved = self.router_bias
            self.router_bias = torch.empty_like(bias, device=moved.device) if bias.is_meta else bias.to(moved.device)
        return self


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """(qualified name, module) of every MoE block of a model, in model order: the router statistics
    readers and the load balancer walk these."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            yield name, module
