"""Activation memory of one micro-batch: the bytes a training forward keeps for backward, predicted
module by module from what the code in step35/model saves (unique storages, parameters excluded).

Each function below mirrors one module's forward and lists the tensors autograd keeps from it. When
the model code changes what it saves, change the matching function here; tests/test_plan.py compares
the total against a count of the real saved tensors for none, selective and full checkpointing.

Conventions: T tokens of the micro-batch one rank holds (batch x seq / cp under context parallelism), `a` bytes per element of the compute dtype
(activations), fp32 = 4. A tensor that several ops save is counted once, by the first module that
saves it (as the storage count does). Where the saved set depends on the kernel (the attention
statistics) `device_type` picks the kernel's behaviour (step35/kernels/).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from step35.config import LayerSpec, Step35Config
from step35.kernels.sequence_split import rank_tokens
from step35.plan.context import exchange_tokens

FP32, INT64, INT32 = 4, 8, 4
PARTS = (
    "embedding",
    "attention_norm",
    "attention",
    "ffn_norm",
    "router",
    "dispatch",
    "experts",
    "shared_expert",
    "dense_mlp",
    "mtp_input",
    "final_norm",
    "loss",
    "checkpoint_inputs",
    "rope",
)


@dataclass
class Shape:
    """The micro-batch and the dtypes that set activation sizes."""

    batch: int
    seq: int
    act_bytes: int  # bytes per element of activations (the compute dtype: param_dtype, or the stored dtype)
    device_type: str = "cuda"  # cpu | cuda | npu: kernels differ in what they keep
    expert_parallel_size: int = 1
    autocast: bool = False  # bf16-mixed: ops cast their inputs themselves
    document_masking: bool = False  # per-sequence RoPE tables [B, 1, S, r]
    context_parallel: int = 1  # cp: each rank holds seq / cp tokens of every sequence

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch on one rank."""
        return rank_tokens(self.batch * self.seq, self.context_parallel)

    @property
    def act_is_fp32(self) -> bool:
        return self.act_bytes == FP32


@dataclass
class Saved:
    """Bytes kept for backward, by part of the model."""

    parts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, part: str, nbytes: int) -> None:
        self.parts[part] += int(nbytes)

    def merge(self, other: Saved) -> None:
        for part, nbytes in other.parts.items():
            self.parts[part] += nbytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())


# ------------------------------------------------------------------------------------- modules
def rms_norm(
    saved: Saved, part: str, rows: int, dim: int, s: Shape, *, output_saved: bool = True, input_counted: bool = False
) -> None:
    """model/norm.py _RMSNormFunction: keeps its input x and the inverse RMS [rows, 1] fp32 (the weight is
    a parameter); the output (x.dtype) is kept by the op after it when that op saves its input (a linear,
    the loss). `input_counted`: x is already kept by an earlier module (the same tensor)."""
    if not input_counted:
        saved.add(part, rows * dim * s.act_bytes)
    saved.add(part, rows * FP32)
    if output_saved:
        saved.add(part, rows * dim * s.act_bytes)


def attention(saved: Saved, config: Step35Config, spec: LayerSpec, s: Shape) -> None:
    """model/attention.py + kernels.attention. The layer input (the norm output) is counted by the norm."""
    T, a, nq, nkv, d = s.tokens, s.act_bytes, spec.num_heads, spec.num_kv_heads, spec.head_dim
    if config.use_qk_norm:  # q, k projections kept as the norms' inputs; the norm outputs go to RoPE
        rms_norm(saved, "attention", T * nq, d, s, output_saved=False)
        rms_norm(saved, "attention", T * nkv, d, s, output_saved=False)
    # RoPE (model/rope.py _Rotary) keeps only the shared cos/sin tables (counted once, under "rope").
    # The kernel keeps q, k, v, its output and the softmax statistics per query and head: the log-sum-exp
    # (fp32) for SDPA / FlexAttention / the CPU masked kernel; npu_fusion_attention keeps softmax max and
    # sum, [B, N, S, 8] fp32 each.
    stats = 2 * 8 * FP32 if s.device_type == "npu" else FP32
    saved.add("attention", T * (nq + 2 * nkv + nq) * d * a + T * nq * stats)
    # Context parallelism: the kernel also keeps the K/V the exchange brought (plan/context.py).
    saved.add("attention", s.batch * exchange_tokens(config, spec, s.seq, s.context_parallel) * 2 * nkv * d * a)
    if config.use_head_wise_attn_gate:
        saved.add("attention", T * nq * a)  # sigmoid(g_proj(x)) [T, heads]; _GatedOutput recomputes o * gate
        if s.autocast:
            saved.add("attention", T * nq * d * a)  # under autocast the gated product is o_proj's kept input
    else:
        saved.add("attention", T * nq * d * a)  # o_proj input (a contiguous copy of the transposed output)


def swiglu(saved: Saved, part: str, rows: int, width: int, limit: float, s: Shape) -> None:
    """model/mlp.py _ClampedSwiGLU keeps its two inputs (gate and up projections) and recomputes the
    activation in backward; the down projection keeps the product. The input x is counted by the norm."""
    saved.add(part, 3 * rows * width * s.act_bytes)


def moe(saved: Saved, config: Step35Config, spec: LayerSpec, s: Shape, aux_loss: bool) -> None:
    """model/moe.py MoE.forward (+ parallel/expert_parallel.py under EP). Rows are spread evenly over
    experts, so a rank receives as many rows as it sends (N = tokens x top-k)."""
    T, a, H, E, K, I = (
        s.tokens,
        s.act_bytes,
        config.hidden_size,
        config.moe_num_experts,
        config.moe_top_k,
        config.moe_intermediate_size,
    )
    N = T * K
    ep = s.expert_parallel_size
    # router: fp32 logits (moe._Fp32Linear keeps x and the weight as they are; under autocast the
    # default autograd keeps fp32 copies of both), sigmoid scores, the top-k ids, the renormalised
    # weights and their denominator.
    if config.need_fp32_gate and not s.act_is_fp32 and s.autocast:
        saved.add("router", T * H * FP32 + E * H * FP32)
    saved.add("router", T * E * FP32 + T * K * INT64)
    if config.norm_expert_weight:
        saved.add("router", T * K * FP32 + T * FP32)
    if aux_loss:  # sequence_balance_loss: the score sums and the normalised probabilities
        saved.add("router", T * FP32 + T * E * FP32)
    # dispatch: which token each row came from (the rows' gather and the combine keep it; the combine keeps no
    # rows: they arrive weighted); under EP the regrouping order and its inverse.
    saved.add("dispatch", N * INT64)
    if ep > 1:
        saved.add("dispatch", 2 * N * INT64)
    # routed experts: the rows they ran on only where they cannot be gathered again in backward (model/moe.py
    # `regathered`): the rows received under EP, or autocast's cast copy; three offset vectors; the SwiGLU on N
    # rows with each row's routing weight (fp32) and the `order` index that gathered those weights.
    if ep > 1 or s.autocast:
        saved.add("experts", N * H * a)
    saved.add("experts", 3 * (E // ep) * INT32)
    swiglu(saved, "experts", N, I, spec.swiglu_limit, s)
    saved.add("experts", N * FP32 + N * INT64)


def decoder_layer(config: Step35Config, spec: LayerSpec, s: Shape, aux_loss: bool = False) -> Saved:
    """model/transformer.py DecoderLayer.forward without checkpointing."""
    saved = Saved()
    T, H = s.tokens, config.hidden_size
    rms_norm(saved, "attention_norm", T, H, s)
    attention(saved, config, spec, s)
    rms_norm(saved, "ffn_norm", T, H, s)
    if spec.is_moe:
        moe(saved, config, spec, s, aux_loss)
        swiglu(saved, "shared_expert", T, config.share_expert_dim, spec.swiglu_limit_shared, s)
    else:
        swiglu(saved, "dense_mlp", T, config.intermediate_size, spec.swiglu_limit_shared, s)
    return saved


def matmul_outputs(config: Step35Config, spec: LayerSpec, s: Shape) -> int:
    """Bytes of the matmul results a layer keeps under selective checkpointing (parallelize._save_matmuls:
    mm, addmm, bmm, grouped mm, the flash / efficient SDPA kernels and, under EP, the all-to-alls;
    everything else is recomputed)."""
    T, a, H = s.tokens, s.act_bytes, config.hidden_size
    nq, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    total = T * (nq + 2 * nkv) * d * a + T * H * a  # q, k, v, o projections
    if config.use_head_wise_attn_gate:
        total += T * nq * a
    window = config.sliding_window if spec.sliding else None
    if s.device_type == "cuda" and s.context_parallel == 1 and (window is None or window >= s.seq):
        # flash SDPA output and log-sum-exp (FlexAttention, which cp shares always use, is recomputed)
        total += T * nq * d * a + T * nq * FP32
    if spec.is_moe:
        E, K, I = config.moe_num_experts, config.moe_top_k, config.moe_intermediate_size
        total += T * E * (FP32 if config.need_fp32_gate else a)  # router logits
        total += T * K * (2 * I + H) * a  # grouped gate, up, down
        if s.expert_parallel_size > 1:  # the all-to-all results are kept too: rows and weights received, rows
            total += 2 * T * K * H * a + T * K * FP32 + E * INT64  # returned, counts
        total += T * (2 * config.share_expert_dim + H) * a
    else:
        total += T * (2 * config.intermediate_size + H) * a
    return total


# ------------------------------------------------------------------------------------- the model
@dataclass
class ActivationEstimate:
    mode: str
    total: int  # bytes kept from the forward until backward, one micro-batch
    parts: dict[str, int]
    recompute: int  # bytes one checkpointed block rebuilds in backward (0 without checkpointing)
    largest_layer: int  # the biggest per-layer set without checkpointing


def rope_tables(config: Step35Config, layers: list[LayerSpec], s: Shape) -> int:
    """cos and sin [S, rotary_dim] fp32, one pair per distinct (rotary dim, theta, scaled), shared by layers."""
    keys = {(spec.rotary_dim, spec.rope_theta, spec.rope_scaled) for spec in layers if spec.uses_rope}
    rows = s.tokens if s.document_masking else rank_tokens(s.seq, s.context_parallel)  # a cp rank's own positions
    return sum(2 * rows * rd * FP32 for rd, _, _ in keys)


def model_activations(
    config: Step35Config, s: Shape, *, mode: str = "none", num_mtp_layers: int = 0, aux_loss: bool = False
) -> ActivationEstimate:
    """Step35ForCausalLM.loss(input_ids, labels) with `num_mtp_layers` MTP layers computing their loss
    (0 when mtp_loss_weight is 0: they are then not run), under activation checkpointing `mode`
    (none | selective | full, applied to every decoder and MTP layer as parallelize does)."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"activation_checkpointing must be none, selective or full, got {mode!r}")
    T, a, H = s.tokens, s.act_bytes, config.hidden_size
    main = [config.layer(i) for i in range(config.num_hidden_layers)]
    mtp = [config.layer(config.num_hidden_layers + k) for k in range(num_mtp_layers)]
    saved = Saved()
    saved.add("embedding", T * INT64)  # the token ids (embedding backward)
    saved.add("rope", rope_tables(config, main + mtp, s))
    largest = 0
    recompute = 0
    for spec in main:
        layer = decoder_layer(config, spec, s, aux_loss)
        largest = max(largest, layer.total)
        if mode == "none":
            saved.merge(layer)
            continue
        saved.add("checkpoint_inputs", T * H * a)  # the block input, kept by the checkpoint
        if mode == "selective":
            saved.add("checkpoint_inputs", matmul_outputs(config, spec, s))
        recompute = max(recompute, layer.total)
    # Final norm and the main loss: the norm keeps its input, the last block's output h.
    rms_norm(saved, "final_norm", T, H, s)
    saved.add("loss", T * INT64 + INT64)  # the labels (a contiguous copy) and the token count
    for k, spec in enumerate(mtp, start=1):
        saved.add("mtp_input", T * INT64)  # the shifted token ids, kept by the embedding
        layer = Saved()
        # eh_proj(cat([enorm(E[x_{t+k}]), hnorm(h)])): enorm keeps the embeddings, the concat is kept by
        # eh_proj (the norm outputs are not); h is already kept as the input of the norm before the
        # previous loss (the final norm for k = 1, the previous MTP head's norm after that).
        rms_norm(layer, "mtp_input", T, H, s, output_saved=False)
        rms_norm(layer, "mtp_input", T, H, s, output_saved=False, input_counted=True)
        layer.add("mtp_input", T * 2 * H * a)
        layer.merge(decoder_layer(config, spec, s))
        rms_norm(layer, "loss", T, H, s)  # shared_head.norm; its output is kept by the chunked loss
        layer.add("loss", T * INT64 + INT64)  # shifted labels, count
        largest = max(largest, layer.total)
        if mode == "none":
            saved.merge(layer)
            continue
        # Checkpoint inputs: h (for k = 1 the final norm's input, already counted), the embeddings, the labels.
        h_separate = k > 1
        saved.add("checkpoint_inputs", (T * H * a if h_separate else 0) + T * H * a + T * INT64)
        if mode == "selective":
            saved.add(
                "checkpoint_inputs",
                matmul_outputs(config, spec, s)
                + T * H * a  # eh_proj
                + T * config.vocab_size * a,
            )  # the loss's chunk logits h @ W^T (mm) are kept too
        recompute = max(recompute, layer.total)
    parts = {p: saved.parts[p] for p in PARTS if saved.parts.get(p)}
    return ActivationEstimate(mode, saved.total, parts, recompute, largest)
