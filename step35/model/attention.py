"""Step-3.5 attention (docs/architecture.md §2.4): GQA with per-head q/k RMSNorm before partial RoPE, full-causal or
a 512-key sliding window, and a head-wise sigmoid output gate before o_proj.

Shape legend: B batch, S sequence, H hidden, Hq query heads, Hkv key/value heads (Hq a multiple),
D head dim, r rotated dims of a head (r <= D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from step35.config import LayerSpec
from step35.kernels.attention import attention
from step35.kernels.masks import DocumentMask, SequenceShard
from step35.model.cache import LayerKV
from step35.model.norm import RMSNorm
from step35.model.rope import apply_rotary


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        spec: LayerSpec,
        *,
        sliding_window: int,
        use_qk_norm: bool,
        use_gate: bool,
        eps: float,
        zero_centered: bool,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.window = sliding_window if spec.sliding else None
        self.uses_rope = spec.uses_rope
        self.q_proj = nn.Linear(hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden_size, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.num_heads, bias=False) if use_gate else None
        self.q_norm = RMSNorm(self.head_dim, eps, zero_centered) if use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, zero_centered) if use_qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: DocumentMask | SequenceShard | None = None,
        cache: LayerKV | None = None,
    ) -> torch.Tensor:
        """x: [B, S, H]; cos, sin: [S, r] or [B, 1, S, r] (per-document positions). With `cache` (decoding,
        no documents), x holds the tokens that follow the cached ones, which they read as well."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        if self.uses_rope:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        past = 0
        if cache is not None:
            k, v, past = cache.update(k, v)
        if past == 0:
            # [B, Hq, S, D]; the prompt of a decode takes this path too
            o = attention(q, k, v, self.window, scale=self.head_dim**-0.5, documents=documents)
        else:
            o = attention_after(q, k, v, past, self.window, scale=self.head_dim**-0.5)
        o = o.transpose(1, 2)  # [B, S, Hq, D]
        if self.g_proj is None:
            return self.o_proj(o.reshape(B, S, self.num_heads * self.head_dim))
        gate = torch.sigmoid(self.g_proj(x))  # [B, S, Hq]: one gate per head per token
        if torch.is_autocast_enabled(x.device.type):
            return self.o_proj((o * gate.unsqueeze(-1)).reshape(B, S, self.num_heads * self.head_dim))
        out = _GatedOutput.apply(o, gate, self.o_proj.weight)
        # A LoRA adapter on o_proj (model/lora.py) reads the gated product, unless switched off (adapters_off).
        if hasattr(self.o_proj, "delta") and not self.o_proj.lora_off:
            out = out + self.o_proj.delta((o * gate.unsqueeze(-1)).reshape(B, S, self.num_heads * self.head_dim))
        return out


def attention_after(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, window: int | None, scale: float
) -> torch.Tensor:
    """Attention of S new queries at positions past..past+S-1 over keys [B, Hkv, K, D] that are the
    latest K tokens, the new ones last (a cache's kept keys, then the step's): causal, and within the
    window on sliding layers. q: [B, Hq, S, D] -> [B, Hq, S, D]."""
    S, K = q.shape[-2], k.shape[-2]
    query_pos = torch.arange(past, past + S, device=q.device)[:, None]
    key_pos = torch.arange(past + S - K, past + S, device=q.device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    groups = q.shape[1] // k.shape[1]  # query head h reads KV head h // groups
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


class _GatedOutput(torch.autograd.Function):
    """o_proj(o * gate): keeps o (attention keeps it anyway) and the gate, and recomputes the gated
    product in backward, instead of keeping that [B, S, Hq * D] product as o_proj's input."""

    @staticmethod
    def forward(ctx, o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(o, gate, weight)
        B, S, H, D = o.shape
        return F.linear((o * gate.unsqueeze(-1)).reshape(B, S, H * D), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        o, gate, weight = ctx.saved_tensors
        B, S, H, D = o.shape
        grad_2d = grad.reshape(B * S, -1)
        grad_weight = None
        if ctx.needs_input_grad[2]:
            gated = (o * gate.unsqueeze(-1)).reshape(B * S, H * D)
            grad_weight = grad_2d.t().mm(gated)
        grad_gated = grad_2d.mm(weight).view(B, S, H, D)
        return grad_gated * gate.unsqueeze(-1), (grad_gated * o).sum(-1), grad_weight
