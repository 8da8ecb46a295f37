"""Step-3.5-Flash as a transformers causal LM, written by the step35 trainer for its exports.

Load an export with
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
and call it or `generate` it as any causal LM. It computes what step35's own model computes: hybrid
full / sliding-window GQA attention with per-head q/k RMSNorm, partial RoPE per layer kind (llama3
frequency scaling on the kinds `yarn_only_types` names) and a per-head sigmoid output gate; MoE layers
with a sigmoid router whose bias only selects experts, renormalised and scaled top-k weights, and a
shared expert; dense SwiGLU layers; optional SwiGLU clamps; zero-centred RMSNorms. The multi-token
prediction (MTP) layers are loaded, so that every tensor of the folder has a home, but never run.

Generation keeps a transformers `Cache` (a `DynamicCache` unless one is passed): every layer reads the
keys its cache layer returns, which are always the latest contiguous tokens, so a sliding-window cache
that keeps only the window works as well as one that keeps everything.

This file imports only torch and transformers: it runs in other people's processes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4 spells it PretrainedConfig
    from transformers import PretrainedConfig as PreTrainedConfig

# The fields this file reads, with the defaults of the released Step-3.5-Flash config.json.
_DEFAULTS = {
    "hidden_size": 4096,
    "intermediate_size": 11264,
    "num_hidden_layers": 45,
    "vocab_size": 128896,
    "max_position_embeddings": 262144,
    "use_qk_norm": True,
    "moe_layers_enum": None,
    "num_attention_heads": 64,
    "num_attention_groups": 8,
    "head_dim": 128,
    "use_moe": True,
    "moe_num_experts": 288,
    "moe_top_k": 8,
    "moe_intermediate_size": 1280,
    "share_expert_dim": 1280,
    "moe_layer_offset": 0,
    "moe_every_n_layer": 1,
    "norm_expert_weight": True,
    "moe_router_scaling_factor": 3.0,
    "step35_rope_theta": 10000.0,
    "step35_rope_scaling": None,
    "yarn_only_types": ["full_attention"],
    "use_head_wise_attn_gate": True,
    "sliding_window": 512,
    "use_moe_router_bias": True,
    "need_fp32_gate": True,
    "step35_layer_types": None,
    "use_rope_layers": [],
    "num_nextn_predict_layers": 0,
    "partial_rotary_factors": [],
    "attention_other_setting": None,
    "swiglu_limits": [],
    "swiglu_limits_shared": [],
    "zero_centered": True,
    "rms_norm_eps": 1e-5,
    "use_cache": True,
}
_ALIASES = {"share_expert_dims": "share_expert_dim"}
# transformers reads rope_theta / rope_scaling itself (and rewrites them into its own RoPE parameters)
# and wants one layer_types entry per main layer; Step-3.5's are per global layer (MTP layers included),
# so they are kept under names of their own and written back under the file's.
_OWN_NAMES = {
    "rope_theta": "step35_rope_theta",
    "rope_scaling": "step35_rope_scaling",
    "layer_types": "step35_layer_types",
}


class Step3p5Config(PreTrainedConfig):
    """The export's config.json as it is (the released Step-3.5-Flash layout)."""

    model_type = "step3p5"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(self, **kwargs):
        for alias, name in _ALIASES.items():
            if alias in kwargs:
                kwargs.setdefault(name, kwargs.pop(alias))
        for name, own in _OWN_NAMES.items():
            if name in kwargs:
                kwargs[own] = kwargs.pop(name)
        for name, default in _DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        if self.step35_layer_types is None:
            self.step35_layer_types = ["full_attention"] * (self.num_hidden_layers + self.num_nextn_predict_layers)
        # What transformers' caches read: the main layers' kinds (DynamicCache keeps the window on sliding ones).
        self.layer_types = list(self.step35_layer_types[: self.num_hidden_layers])
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def to_dict(self):
        out = super().to_dict()
        out.pop("layer_types", None)
        for name, own in _OWN_NAMES.items():
            if own in out:
                out[name] = out.pop(own)
        return out

    def layer(self, i: int) -> dict:
        """Attention shape, RoPE and FFN kind of global layer `i` (main layers, then MTP layers)."""
        kind = self.step35_layer_types[i]
        heads, groups, head_dim = self.num_attention_heads, self.num_attention_groups, self.head_dim
        other = self.attention_other_setting
        if other and other.get("attention_type") == kind:
            heads = other.get("num_attention_heads", heads)
            groups = other.get("num_attention_groups", groups)
            head_dim = other.get("head_dim", head_dim)
        theta = self.step35_rope_theta
        theta = float(theta[i] if isinstance(theta, list) else theta)
        factor = self.partial_rotary_factors[i] if self.partial_rotary_factors else 1.0
        return {
            "sliding": kind == "sliding_attention",
            "heads": heads,
            "groups": groups,
            "head_dim": head_dim,
            "theta": theta,
            "rotary_dim": int(head_dim * factor),
            "scaling": self.step35_rope_scaling if kind in self.yarn_only_types else None,
            "uses_rope": bool(self.use_rope_layers[i]) if self.use_rope_layers else True,
            "is_moe": i < self.num_hidden_layers and i in self.moe_layer_ids(),
            "limit": float(self.swiglu_limits[i]) if self.swiglu_limits else 0.0,
            "limit_shared": float(self.swiglu_limits_shared[i]) if self.swiglu_limits_shared else 0.0,
        }

    def moe_layer_ids(self) -> set[int]:
        if not self.use_moe:
            return set()
        if self.moe_layers_enum:
            return {int(x) for x in str(self.moe_layers_enum).split(",") if x.strip()}
        return {
            i
            for i in range(self.num_hidden_layers)
            if i >= self.moe_layer_offset and (i - self.moe_layer_offset) % self.moe_every_n_layer == 0
        }


# ----------------------------------------------------------------------------------------- blocks


class Step3p5RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w) (zero-centred) or * w, computed in fp32."""

    def __init__(self, dim: int, eps: float, zero_centered: bool):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        return (y * scale).to(x.dtype)


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies, llama3-scaled when `scaling` is given."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim))
    if scaling is not None:
        factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelength = 2 * math.pi / inv
        smooth = (original / wavelength - low) / (high - low)
        interpolated = (1 - smooth) * inv / factor + smooth * inv
        scaled = torch.where(wavelength > original / low, inv / factor, interpolated)
        inv = torch.where(wavelength < original / high, inv, scaled)
    return inv.float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first r = cos.shape[-1] dims of x [B, heads, S, D]; cos, sin [B, 1, S, r]."""
    r = cos.shape[-1]
    rot32 = x[..., :r].float()
    rotated = torch.cat([-rot32[..., r // 2 :], rot32[..., : r // 2]], dim=-1)
    out = (rot32 * cos + rotated * sin).to(x.dtype)
    return torch.cat([out, x[..., r:]], dim=-1)


class Step3p5Attention(nn.Module):
    def __init__(self, config: Step3p5Config, layer_idx: int):
        super().__init__()
        spec = config.layer(layer_idx)
        H, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec["heads"], spec["groups"], spec["head_dim"]
        self.window = config.sliding_window if spec["sliding"] else None
        self.uses_rope = spec["uses_rope"]
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.g_proj = nn.Linear(H, self.num_heads, bias=False) if config.use_head_wise_attn_gate else None
        self.q_norm = Step3p5RMSNorm(self.head_dim, eps, zc) if config.use_qk_norm else None
        self.k_norm = Step3p5RMSNorm(self.head_dim, eps, zc) if config.use_qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None,
        query_index: torch.Tensor,
        key_padding: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, S, H]; query_index [S]: the tokens' indices in the whole sequence (cache included);
        key_padding [B, T] (True: a real token) over the whole sequence, or None."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        if self.uses_rope:
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # The keys are the latest K tokens, ending with this step's: their indices in the sequence.
        K = k.shape[-2]
        end = query_index[-1] + 1
        key_index = torch.arange(end - K, end, device=x.device)
        allowed = key_index[None, :] <= query_index[:, None]
        if self.window is not None:
            allowed = allowed & (key_index[None, :] > query_index[:, None] - self.window)
        mask = allowed[None, None]
        if key_padding is not None:
            mask = mask & key_padding[:, None, None, -K:]
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        o = o.transpose(1, 2)  # [B, S, heads, D]
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)  # one gate per head per token
        return self.o_proj(o.reshape(B, S, self.num_heads * self.head_dim))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """min(SiLU(gate), L) * clip(up, -L, L); plain SiLU(gate) * up when L is 0."""
    act = F.silu(gate)
    if limit > 0:
        act, up = act.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return act * up


class Step3p5MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Step3p5ExpertWeight(nn.Module):
    """One projection of every routed expert, stacked: weight [E, out, in] (nn.Linear layout per expert).

    The weight is read only inside this module's forward, so that a wrapper of the parameter (PEFT's
    `target_parameters`, which adds the LoRA delta while the owning module runs) takes effect."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [N, in], grouped by expert (counts[e] rows for expert e, in order) -> [N, out]."""
        weight = self.weight
        out = [group @ weight[e].T for e, group in enumerate(rows.split(counts)) if counts[e]]
        return torch.cat(out) if out else rows.new_zeros(0, weight.shape[1])


class Step3p5MoE(nn.Module):
    """Sigmoid router (fp32 when need_fp32_gate); the bias picks the top-k experts, the unbiased scores
    of those weight them (renormalised when norm_expert_weight, then scaled)."""

    def __init__(self, config: Step3p5Config, limit: float):
        super().__init__()
        H, E, I = config.hidden_size, config.moe_num_experts, config.moe_intermediate_size
        self.top_k, self.limit = config.moe_top_k, limit
        self.scaling, self.renormalize, self.fp32 = (
            config.moe_router_scaling_factor,
            config.norm_expert_weight,
            config.need_fp32_gate,
        )
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_proj = Step3p5ExpertWeight(E, H, I)
        self.up_proj = Step3p5ExpertWeight(E, H, I)
        self.down_proj = Step3p5ExpertWeight(E, I, H)
        if config.use_moe_router_bias:
            self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.router_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        logits = F.linear(x.float(), self.gate.weight.float()) if self.fp32 else self.gate(x).float()
        scores = torch.sigmoid(logits)  # [T, E]
        choice = scores if self.router_bias is None else scores + self.router_bias.float()
        expert_ids = torch.topk(choice, self.top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(-1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        order = expert_ids.flatten().argsort(stable=True)  # token-slot pairs grouped by expert
        token, slot = order // self.top_k, order % self.top_k
        counts = torch.bincount(expert_ids.flatten(), minlength=scores.shape[-1]).tolist()
        rows = x[token]  # [T*K, H]
        hidden = clamped_swiglu(self.gate_proj(rows, counts), self.up_proj(rows, counts), self.limit)
        y = self.down_proj(hidden, counts)
        out = torch.zeros_like(x)
        out.index_add_(0, token, (y.float() * weights[token, slot, None]).to(x.dtype))
        return out.view(shape)


class Step3p5DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += ffn(norm(h)), the FFN MoE + shared expert or dense."""

    def __init__(self, config: Step3p5Config, layer_idx: int):
        super().__init__()
        spec = config.layer(layer_idx)
        H, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered
        self.is_moe = spec["is_moe"]
        self.input_layernorm = Step3p5RMSNorm(H, eps, zc)
        self.self_attn = Step3p5Attention(config, layer_idx)
        self.post_attention_layernorm = Step3p5RMSNorm(H, eps, zc)
        if self.is_moe:
            self.moe = Step3p5MoE(config, spec["limit"])
            self.share_expert = Step3p5MLP(H, config.share_expert_dim, spec["limit_shared"])
        else:
            self.mlp = Step3p5MLP(H, config.intermediate_size, spec["limit_shared"])

    def forward(self, h: torch.Tensor, rope, cache, query_index, key_padding) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, cache, query_index, key_padding)
        x = self.post_attention_layernorm(h)
        return h + (self.moe(x) + self.share_expert(x) if self.is_moe else self.mlp(x))


class Step3p5SharedHead(nn.Module):
    def __init__(self, config: Step3p5Config):
        super().__init__()
        self.norm = Step3p5RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class Step3p5MTPLayer(Step3p5DecoderLayer):
    """A multi-token prediction layer: loaded with the checkpoint, not run by this file."""

    def __init__(self, config: Step3p5Config, layer_idx: int):
        super().__init__(config, layer_idx)
        H = config.hidden_size
        self.enorm = Step3p5RMSNorm(H, config.rms_norm_eps, config.zero_centered)
        self.hnorm = Step3p5RMSNorm(H, config.rms_norm_eps, config.zero_centered)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.transformer = nn.ModuleDict({"shared_head": Step3p5SharedHead(config)})


# ----------------------------------------------------------------------------------------- models


class Step3p5PreTrainedModel(PreTrainedModel):
    config_class = Step3p5Config
    base_model_prefix = "model"
    _no_split_modules = ["Step3p5DecoderLayer", "Step3p5MTPLayer"]
    _keep_in_fp32_modules = ["router_bias"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, Step3p5ExpertWeight):
            module.weight.normal_(0.0, std)
        elif isinstance(module, Step3p5RMSNorm):
            module.weight.fill_(0.0 if module.zero_centered else 1.0)
        elif isinstance(module, Step3p5MoE) and module.router_bias is not None:
            module.router_bias.zero_()


class Step3p5Model(Step3p5PreTrainedModel):
    """Embedding, the main layers and the MTP layers (`model.layers.{n + j}`), the final norm."""

    def __init__(self, config: Step3p5Config):
        super().__init__(config)
        n, total = config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Step3p5MTPLayer(config, i) if i >= n else Step3p5DecoderLayer(config, i) for i in range(total)
        )
        self.norm = Step3p5RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered)
        specs = [config.layer(i) for i in range(n)]
        # Frequencies per RoPE kind (rotary dims, theta, llama3 scaling): plain tensors, not buffers, so
        # that loading and dtype casts never touch them.
        self.rope_keys = [(s["rotary_dim"], s["theta"], s["scaling"] is not None) for s in specs]
        self._inv_freq = {
            key: inverse_frequencies(key[0], key[1], config.step35_rope_scaling if key[2] else None)
            for key in set(self.rope_keys)
        }
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> hidden states after the final norm [B, S, H]."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, S, _ = h.shape
        past = cache.get_seq_length() if cache is not None else 0
        query_index = torch.arange(past, past + S, device=h.device)
        if position_ids is None:
            position_ids = query_index[None].expand(B, S)
        key_padding = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] != past + S:
                raise ValueError(
                    f"attention_mask must be [batch, cached + new tokens] = [{B}, {past + S}], "
                    f"got {tuple(attention_mask.shape)}"
                )
            if not bool(attention_mask.all()):
                key_padding = attention_mask.to(torch.bool)
        rope = {}
        for key, inv in self._inv_freq.items():
            angles = position_ids.float()[..., None] * inv.to(h.device)  # [B, S, r/2]
            angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, S, r]
            rope[key] = (angles.cos(), angles.sin())
        for layer, key in zip(self.layers[: self.config.num_hidden_layers], self.rope_keys):
            h = layer(h, rope[key], cache, query_index, key_padding)
        return self.norm(h)


class Step3p5ForCausalLM(Step3p5PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Step3p5Config):
        super().__init__(config)
        self.model = Step3p5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits [B, S, V] (the last `logits_to_keep` positions when > 0) and, with `labels`, the mean
        next-token loss. `cache` (`past_key_values` in older transformers) holds the earlier tokens."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        h = self.model(input_ids, position_ids, cache if use_cache else None, inputs_embeds, attention_mask)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        out = {"loss": loss, "logits": logits}
        if use_cache:  # the output's cache field: `cache` in transformers 5, `past_key_values` before
            names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
            out["cache" if "cache" in names else "past_key_values"] = cache
        return CausalLMOutputWithPast(**out)
