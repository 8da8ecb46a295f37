"""Training FLOPs per token of Step-3.5 (docs/architecture.md §5): 6 x matmul-active parameters
plus the attention core (QK^T and PV) counted causally-exact for full and sliding layers."""

from __future__ import annotations

from step35.config import LayerSpec, Step35Config


def _attention_params(config: Step35Config, spec: LayerSpec) -> int:
    H, q, kv = config.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    gate = spec.num_heads * H if config.use_head_wise_attn_gate else 0
    return 2 * H * q + 2 * H * kv + gate


def _ffn_active_params(config: Step35Config, spec: LayerSpec) -> int:
    H = config.hidden_size
    if not spec.is_moe:
        return 3 * H * config.intermediate_size
    experts = config.moe_top_k * 3 * H * config.moe_intermediate_size
    return experts + 3 * H * config.share_expert_dim + config.moe_num_experts * H  # + router


def matmul_active_params(config: Step35Config, num_mtp_layers: int = 0) -> int:
    """Weights each token multiplies through (norms and the router bias excluded), incl. lm_head."""
    H, V = config.hidden_size, config.vocab_size
    total = V * H  # lm_head (the embedding is a lookup)
    for i in range(config.num_hidden_layers + num_mtp_layers):
        spec = config.layer(i)
        total += _attention_params(config, spec) + _ffn_active_params(config, spec)
        if spec.is_mtp:
            total += 2 * H * H + V * H  # eh_proj + its own output head
    return total


def mean_keys_per_query(seq_len: int, window: int | None) -> float:
    """Average keys a causal query attends to: (S+1)/2 for full attention, (1/S) sum min(i+1, W) with a window."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops_per_token(config: Step35Config, seq_len: int, num_mtp_layers: int = 0) -> float:
    """Forward + backward FLOPs of QK^T and PV per token: 3 x sum over layers of 4 n_q d keys."""
    forward = 0.0
    for i in range(config.num_hidden_layers + num_mtp_layers):
        spec = config.layer(i)
        keys = mean_keys_per_query(seq_len, config.sliding_window if spec.sliding else None)
        forward += 4 * spec.num_heads * spec.head_dim * keys
    return 3 * forward


def training_flops_per_token(config: Step35Config, seq_len: int, num_mtp_layers: int = 0) -> float:
    """6 N + attention: the model FLOPs behind MFU (no recomputation counted)."""
    return 6 * matmul_active_params(config, num_mtp_layers) + attention_flops_per_token(config, seq_len, num_mtp_layers)
