"""Step-3.5-Flash: decoder layers, the MTP layers and the causal LM (docs/architecture.md §2).

Module and parameter names are the HF checkpoint names (docs/architecture.md §3), so `state_dict()` is a
checkpoint: `model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.moe.gate_proj.weight`
[E, out, in], `model.layers.{i}.share_expert.*`, MTP layers at `model.layers.{45+j}.*`.

`Step35ForCausalLM.forward` returns logits, `Step35ForCausalLM.loss` a LossOutput (the training
loss, chunked: the full logits never exist).

Shape legend: B batch, S sequence, H hidden, V vocabulary, E experts, k MTP depth (1-based);
input_ids, labels, position_ids [B, S]; residual stream h [B, S, H]; logits [B, S, V].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from step35.config import LayerSpec, Step35Config
from step35.kernels.masks import DocumentMask, SequenceShard
from step35.model.attention import Attention
from step35.model.cache import KVCache, LayerKV
from step35.model.init import init_tensor
from step35.model.loss import IGNORE_INDEX, chunked_cross_entropy, chunked_token_logprobs
from step35.model.mlp import SwiGLU
from step35.model.moe import MoE, RouterAuxLosses
from step35.model.norm import RMSNorm
from step35.model.rope import inverse_frequencies, rotary_cos_sin
from step35.model.routing import RouteRecorder, RouteReplay, Routing

# What attention is told about the rows besides causality: packed documents, or (context
# parallelism) this rank's share of each row and how to reach the other shares' keys.
Documents = DocumentMask | SequenceShard


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += ffn(norm(h)). The FFN is MoE + shared expert or dense."""

    def __init__(self, config: Step35Config, spec: LayerSpec):
        super().__init__()
        H, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered
        self.spec = spec
        self.input_layernorm = RMSNorm(H, eps, zc)
        self.self_attn = Attention(
            H,
            spec,
            sliding_window=config.sliding_window,
            use_qk_norm=config.use_qk_norm,
            use_gate=config.use_head_wise_attn_gate,
            eps=eps,
            zero_centered=zc,
        )
        self.post_attention_layernorm = RMSNorm(H, eps, zc)
        if spec.is_moe:
            self.moe = MoE(
                H,
                config.moe_num_experts,
                config.moe_top_k,
                config.moe_intermediate_size,
                limit=spec.swiglu_limit,
                scaling_factor=config.moe_router_scaling_factor,
                renormalize=config.norm_expert_weight,
                use_bias=config.use_moe_router_bias,
                fp32_router=config.need_fp32_gate,
            )
            self.share_expert = SwiGLU(H, config.share_expert_dim, limit=spec.swiglu_limit_shared)
        else:
            # Dense layers (and MTP layers) use the shared-expert clamp list (docs/architecture.md §2.7).
            self.mlp = SwiGLU(H, config.intermediate_size, limit=spec.swiglu_limit_shared)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        router_aux: RouterAuxLosses | None = None,
        documents: Documents | None = None,
        cache: LayerKV | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """router_aux: where an MoE layer adds its sequence balance loss (None: not computed);
        documents: packed documents that attention must keep apart (None: one document per row), or
        this rank's SequenceShard under context parallelism; cache: this layer's keys and values of
        earlier tokens (decoding, see Step35ForCausalLM.step); routing: records or replays the MoE
        layer's expert choice (model/routing.py)."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, documents, cache)
        x = self.post_attention_layernorm(h)
        if not self.spec.is_moe:
            return h + self.mlp(x)
        routes = routing.layer(self.spec.layer_id, tuple(x.shape[:-1])) if routing is not None else None
        return h + (self.moe(x, router_aux, routes) + self.share_expert(x))  # (the order the sums always had)


class SharedHead(nn.Module):
    def __init__(self, config: Step35Config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """Multi-token prediction layer (docs/architecture.md §2.10): u = eh_proj([enorm(E[x_{t+k}]), hnorm(h_t)]), one dense
    sliding-window decoder block, then its own head predicting x_{t+k+1}."""

    def __init__(self, config: Step35Config, spec: LayerSpec):
        super().__init__(config, spec)
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps, config.zero_centered)
        self.hnorm = RMSNorm(H, config.rms_norm_eps, config.zero_centered)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.transformer = nn.ModuleDict({"shared_head": SharedHead(config)})

    def forward(
        self,
        h: torch.Tensor,
        next_embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        labels: torch.Tensor | None = None,
        chunk_size: int = 1024,
        documents: Documents | None = None,
    ):
        """Returns (block output [B, S, H], summed loss, counted tokens); loss parts are None without labels."""
        u = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h)], dim=-1))
        out = super().forward(u, cos, sin, documents=documents)
        if labels is None:
            return out, None, None
        head = self.transformer["shared_head"]
        loss_sum, count = chunked_cross_entropy(head.norm(out), head.output.weight, labels, chunk_size)
        return out, loss_sum, count

    def logits(self, block_out: torch.Tensor) -> torch.Tensor:
        head = self.transformer["shared_head"]
        return head.output(head.norm(block_out))


class Step35Model(nn.Module):
    """Embedding, the decoder layers (main, then MTP) and the final norm: the `model.` prefix."""

    def __init__(self, config: Step35Config, num_mtp_layers: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        specs = [config.layer(i) for i in range(config.num_hidden_layers + num_mtp_layers)]
        self.layers = nn.ModuleList(MTPLayer(config, s) if s.is_mtp else DecoderLayer(config, s) for s in specs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered)
        # RoPE frequencies per distinct (rotary dim, theta, scaled): plain CPU tensors, not buffers,
        # so meta-device construction and sharding never see them.
        self.rope_keys = [(s.rotary_dim, s.rope_theta, s.rope_scaled) for s in specs]
        self._inv_freq = {
            key: inverse_frequencies(key[0], key[1], config.rope_scaling if key[2] else None)
            for key in set(self.rope_keys)
        }

    @property
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.layers)[: self.config.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.layers)[self.config.num_hidden_layers :]

    def rotary_tables(self, seq_len: int, device: torch.device, position_ids: torch.Tensor | None = None) -> dict:
        """(cos, sin) per RoPE kind: [S, r] for positions 0..S-1 or for `position_ids` [S] (one
        sequence's positions, e.g. a context-parallel share), or [B, 1, S, r] for `position_ids` [B, S]."""
        if position_ids is None or position_ids.dim() == 1:
            positions = torch.arange(seq_len, device=device) if position_ids is None else position_ids
            return {key: rotary_cos_sin(positions, inv) for key, inv in self._inv_freq.items()}
        tables = {key: rotary_cos_sin(position_ids, inv) for key, inv in self._inv_freq.items()}
        return {key: (cos[:, None], sin[:, None]) for key, (cos, sin) in tables.items()}

    def forward(
        self,
        input_ids: torch.Tensor,
        rope: dict | None = None,
        router_aux: RouterAuxLosses | None = None,
        documents: Documents | None = None,
        cache: KVCache | None = None,
        routing: Routing | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] -> residual stream after the last main layer, before the final norm [B, S, H].

        router_aux: collects the MoE layers' sequence balance losses (None: not computed);
        documents: packed documents kept apart by attention (RoPE then comes from their positions);
        cache: earlier tokens' keys and values, which the layers read and extend (`rope` must then
        hold the new tokens' positions); routing: records or replays the experts chosen (model/routing.py);
        inputs_embeds [B, S, H]: the embeddings to start from instead of input_ids' (a vision-language model's,
        image features spliced in: model/vision.py)."""
        if rope is None:
            position_ids = documents.position_ids if documents is not None else None
            rope = self.rotary_tables(input_ids.shape[1], input_ids.device, position_ids)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for i, (layer, key) in enumerate(zip(self.main_layers, self.rope_keys)):
            kv = cache.layer(i, layer.self_attn.window) if cache is not None else None
            extra = {"cache": kv} if kv is not None else {}
            if routing is not None:
                extra["routing"] = routing
            # Without them, the call training, FSDP and activation checkpointing see, unchanged.
            h = layer(h, *rope[key], router_aux=router_aux, documents=documents, **extra)
        return h


@dataclass
class LossOutput:
    loss: torch.Tensor  # this batch's loss: lm_loss + mtp_weight * mean(mtp_losses) + aux_loss
    lm_loss: torch.Tensor  # mean next-token loss of the main head
    mtp_losses: list[torch.Tensor] = field(default_factory=list)  # mean loss of MTP depth 1, 2, ...
    num_tokens: torch.Tensor | None = None  # tokens counted by the main loss
    aux_loss: torch.Tensor | None = None  # coef x sequence balance loss, mean over MoE layers (None: coef 0)
    # The sums behind the means, for a loss over many micro-batches and ranks (module.py):
    lm_sum: torch.Tensor | None = None  # summed next-token loss of the main head (fp32)
    mtp_sums: list[torch.Tensor] = field(default_factory=list)  # summed loss of MTP depth 1, 2, ...
    mtp_counts: list[torch.Tensor] = field(default_factory=list)  # targets counted by each depth


@dataclass
class TokenShare:
    """Step35ForCausalLM.token_logprobs' result: this rank's tokens (all of them without context parallelism)."""

    logp: torch.Tensor  # [B, L] log-probability of each label (0 where none)
    carried: list[torch.Tensor]  # the `carried` whole-row tensors, taken as the tokens were
    sum: Callable[[torch.Tensor], torch.Tensor]  # sums over the context-parallel group (identity without)
    routing: RouteReplay | None = None  # the replay this forward consumed (its counts; check_recompute)


class Step35ForCausalLM(nn.Module):
    """The whole checkpoint: `model.*` and `lm_head`.

    num_mtp_layers: MTP layers to build (default all of the config's; 0 builds none and loading
    then ignores the checkpoint's MTP tensors).
    """

    # Context parallelism (step35.parallel.context.ContextParallel), installed by `parallelize` when
    # cp > 1: `loss` then takes whole rows and computes on this rank's share of each (split, take)
    # and sums loss parts over the cp ranks (sum). None: the whole sequence is local. `forward`
    # (logits, e.g. for generation) is not split.
    context_parallel = None

    def __init__(self, config: Step35Config, num_mtp_layers: int | None = None):
        super().__init__()
        if num_mtp_layers is None:
            num_mtp_layers = config.num_nextn_predict_layers
        if not 0 <= num_mtp_layers <= config.num_nextn_predict_layers:
            raise ValueError(
                f"num_mtp_layers={num_mtp_layers} must be between 0 and "
                f"num_nextn_predict_layers={config.num_nextn_predict_layers}"
            )
        self.config = config
        self.num_mtp_layers = num_mtp_layers
        self.model = Step35Model(config, num_mtp_layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V] of the main head (the MTP layers do not run).

        position_ids [B, S] (packed documents, see step35.data.packing.document_positions): positions
        restarting at 0 where a document starts; attention then never crosses a document boundary."""
        _check_positions(input_ids, position_ids)
        h, _, _ = self._trunk(input_ids, position_ids)
        return self.lm_head(self.model.norm(h))

    def step(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
        routing: RouteRecorder | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoding: logits [B, S, V] (or [B, 1, V] with `last_only`) for input_ids [B, S], the tokens
        that follow the `cache.length` tokens the cache holds (none at first: the prompt); the cache
        then holds these as well. Each token costs attention over the kept keys only, so a long sample
        is not quadratic. Equal to `forward` over the whole sequence (tests/test_generate_cache.py).
        `routing`: a RouteRecorder keeping the experts each MoE layer chose (rollouts for RL). `inputs_embeds`
        [B, S, H]: these tokens' embeddings instead of input_ids' (a prompt with images: model/vision.py)."""
        S = input_ids.shape[1]
        positions = torch.arange(cache.length, cache.length + S, device=input_ids.device)
        rope = {key: rotary_cos_sin(positions, inv) for key, inv in self.model._inv_freq.items()}
        h = self.model(input_ids, rope, cache=cache, routing=routing, inputs_embeds=inputs_embeds)
        cache.length += S
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.model.norm(h))

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        mtp_loss_weight: float = 0.0,
        moe_aux_loss_coef: float = 0.0,
        loss_chunk_size: int = 1024,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> LossOutput:
        """input_ids [B, S], labels [B, S] (-100 = no loss) -> LossOutput; the [B, S, V] logits never
        exist at once (chunked_cross_entropy holds `loss_chunk_size` rows of them).

        The MTP layers run only when mtp_loss_weight > 0; depth k at position t predicts labels[t + k],
        ignored where that label is -100 or, with position_ids, where position t + k lies in another
        document than t. With moe_aux_loss_coef > 0 the loss adds coef x the sequence balance loss
        averaged over the MoE layers (moe.sequence_balance_loss), each sequence's weighted by its share
        of trained labels (1 without masked labels); 0 does not compute it. position_ids:
        as in `forward`. Besides the means, the output holds the sums and counts behind them.
        inputs_embeds [B, S, H]: the whole rows' input embeddings to start from instead of input_ids' (a
        vision-language model's, image features spliced in; under context parallelism each rank takes its share);
        the MTP layers still embed the tokens they read.

        Under context parallelism (`context_parallel` set) every rank of a cp group passes the same
        whole rows; each computes its share and the returned losses and count are those of the
        whole rows (sums over the cp group), identical on its ranks.

        A separate method, not a `forward` flag: under FSDP2 the sharding code registers it as a
        forward method (register_fsdp_forward_method), so the root's parameters are gathered for it."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
        _check_positions(input_ids, position_ids)
        cp = self.context_parallel
        shard = None
        if cp is not None:
            if moe_aux_loss_coef > 0:
                raise ValueError(
                    "moe_aux_loss_coef > 0 with context parallelism: the sequence balance loss needs "
                    "each whole sequence on one rank; set it to 0 or context_parallel_size to 1"
                )
            shard = cp.split(input_ids, position_ids)
        take = (lambda x: x) if shard is None else (lambda x: cp.take(shard, x))
        parts = (lambda t: t) if cp is None else cp.sum  # loss sums and counts of the whole rows
        router_aux = None
        if moe_aux_loss_coef > 0:
            # Each sequence's balance loss counts by its share of trained labels (1 for plain text).
            trained = (labels != IGNORE_INDEX).sum(1)  # [B]
            router_aux = RouterAuxLosses(trained / trained.new_full((), max(labels.shape[1], 1)))
        h, rope, documents = self._trunk(
            take(input_ids), None if position_ids is None else take(position_ids), router_aux, shard,
            inputs_embeds=None if inputs_embeds is None else take(inputs_embeds),
        )  # fmt: skip
        total, count = chunked_cross_entropy(self.model.norm(h), self.lm_head.weight, take(labels), loss_chunk_size)
        total, count = parts(total), parts(count)
        lm_loss = total / count.clamp(min=1)
        mtp_sums, mtp_counts = [], []
        if mtp_loss_weight > 0:
            # Document ids of the whole rows (the MTP shift runs on whole rows, also under cp).
            document_ids = DocumentMask(position_ids).ids if position_ids is not None else None
            mtp_sums, mtp_counts = self._mtp_losses(
                h, input_ids, labels, rope, loss_chunk_size, documents, document_ids, take, parts
            )
        mtp_losses = [s / c.clamp(min=1) for s, c in zip(mtp_sums, mtp_counts)]
        loss = lm_loss + mtp_loss_weight * torch.stack(mtp_losses).mean() if mtp_losses else lm_loss
        aux_loss = None
        if router_aux is not None and router_aux.losses:
            aux_loss = moe_aux_loss_coef * torch.stack(router_aux.losses).mean()
            loss = loss + aux_loss
        return LossOutput(
            loss=loss,
            lm_loss=lm_loss,
            mtp_losses=mtp_losses,
            num_tokens=count,
            aux_loss=aux_loss,
            lm_sum=total,
            mtp_sums=mtp_sums,
            mtp_counts=mtp_counts,
        )

    def sequence_logprobs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        sequence_ids: torch.Tensor,
        num_sequences: int,
        *,
        position_ids: torch.Tensor | None = None,
        loss_chunk_size: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probabilities of packed sequences: input_ids, labels (-100 = not counted),
        sequence_ids [B, S] (the sequence in [0, num_sequences) a slot belongs to, -1 none) ->
        (sums [num_sequences] fp32, counts [num_sequences] int64): sums[q] is the sum over the slots of
        sequence q with a label of log softmax(logits)[label], counts[q] their number.

        Memory-bounded as `loss` (chunked_token_logprobs holds `loss_chunk_size` rows of logits) and
        differentiable. Under context parallelism every rank of a cp group passes the same whole rows,
        computes its share, and the sums and counts are those of the whole rows (summed over the cp
        group, differentiably, as the loss sums). MTP layers do not run. Registered as an FSDP forward
        method beside `loss`."""
        if labels.shape != input_ids.shape or sequence_ids.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} and sequence_ids {tuple(sequence_ids.shape)} must have "
                f"input_ids' shape {tuple(input_ids.shape)}"
            )
        _check_positions(input_ids, position_ids)
        cp = self.context_parallel
        shard = cp.split(input_ids, position_ids) if cp is not None else None
        take = (lambda x: x) if shard is None else (lambda x: cp.take(shard, x))
        h, _, _ = self._trunk(take(input_ids), None if position_ids is None else take(position_ids), None, shard)
        labels, sequence_ids = take(labels), take(sequence_ids)
        logp = chunked_token_logprobs(self.model.norm(h), self.lm_head.weight, labels, loss_chunk_size)
        counted = (labels != IGNORE_INDEX) & (sequence_ids >= 0) & (sequence_ids < num_sequences)
        slot = torch.where(counted, sequence_ids, num_sequences).reshape(-1)  # uncounted slots go to a spare bin
        sums = logp.new_zeros(num_sequences + 1).index_add(0, slot, (logp * counted).reshape(-1))[:num_sequences]
        counts = torch.zeros(num_sequences + 1, dtype=torch.int64, device=slot.device)
        counts = counts.index_add(0, slot, counted.reshape(-1).long())[:num_sequences]
        if cp is not None:
            sums, counts = cp.sum(sums), cp.sum(counts)
        return sums, counts

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        routing: RouteReplay | None = None,
        temperature: float = 1.0,
        loss_chunk_size: int = 1024,
        carried: tuple[torch.Tensor, ...] = (),
    ) -> TokenShare:
        """Per-token log softmax(logits / temperature)[label] of whole rows input_ids, labels [B, S] (0 where
        the label is -100), differentiable and memory-bounded as `loss`; MTP layers do not run.

        routing: recorded routes {layer_id: [B, S, K]} that every MoE layer uses instead of choosing (rollout
        routing replay, model/routing.py); checked to be used exactly once per layer. Under context
        parallelism every rank of a cp group passes the same whole rows and gets its share of the tokens
        [B, L], with `carried` (whole-row tensors [B, S, ...]) taken the same way and `sum`, which sums a
        tensor over the cp group, differentiably (identity without cp). Registered as an FSDP forward method."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
        _check_positions(input_ids, position_ids)
        cp = self.context_parallel
        shard = cp.split(input_ids, position_ids) if cp is not None else None
        take = (lambda x: x) if shard is None else (lambda x: cp.take(shard, x))
        replay = routing.taken(take) if routing is not None else None
        h, _, _ = self._trunk(
            take(input_ids), None if position_ids is None else take(position_ids), None, shard, replay
        )
        if replay is not None:
            replay.check_forward()
        hidden = self.model.norm(h)
        if temperature != 1.0:
            hidden = hidden / temperature  # logits / T: the logits are linear in the normed hidden state
        logp = chunked_token_logprobs(hidden, self.lm_head.weight, take(labels), loss_chunk_size)
        # (a copy: FSDP warns about a forward method returning a view, and chunked_token_logprobs reshapes)
        return TokenShare(logp.clone(), [take(t) for t in carried], (lambda t: t) if cp is None else cp.sum, replay)

    @torch.no_grad()
    def draft_logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(main head's logits [B, S, V], [logits [B, S, V] of MTP depth 1, 2, ...]) for whole rows, without grad:
        what speculative decoding would draft (step35/eval/metrics.py mtp_acceptance compares them).

        Depth k at position t reads x_{t+k} and drafts x_{t+k+1}, as in `_mtp_losses`: where t + k is past the
        row end the token read is 0, and with position_ids t + k may lie in another document; those
        positions are meaningless and the caller masks them. Every depth's logits exist at once (eval-sized
        batches). Not split under context parallelism: refused there."""
        if self.context_parallel is not None:
            raise ValueError(
                "Step35ForCausalLM.draft_logits takes whole rows on one rank: not supported with context "
                "parallelism (context_parallel_size > 1)"
            )
        _check_positions(input_ids, position_ids)
        h, rope, documents = self._trunk(input_ids, position_ids)
        main = self.lm_head(self.model.norm(h))
        drafts = []
        for k, layer in enumerate(self.model.mtp_layers, start=1):
            next_embeds = self.model.embed_tokens(_shift_left(input_ids, k, fill=0))
            key = self.model.rope_keys[layer.spec.layer_id]
            h, _, _ = layer(h, next_embeds, *rope[key], documents=documents)
            drafts.append(layer.logits(h))
        return main, drafts

    def _trunk(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        router_aux: RouterAuxLosses | None = None,
        shard: SequenceShard | None = None,
        routing: RouteReplay | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict, Documents | None]:
        """The main layers: (residual stream before the final norm [B, S, H], RoPE tables, document mask).
        shard: this rank's share under context parallelism (input_ids and position_ids are then the
        local tokens; RoPE takes their global positions, attention the shard's exchanges). inputs_embeds:
        the (local) input embeddings, instead of input_ids' (Step35Model.forward)."""
        extra = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {}
        if shard is not None:
            rope = self.model.rotary_tables(
                input_ids.shape[1], input_ids.device, shard.positions if position_ids is None else position_ids
            )
            h = self.model(input_ids, rope, router_aux=router_aux, documents=shard, routing=routing, **extra)
            return h, rope, shard
        documents = DocumentMask(position_ids) if position_ids is not None else None
        rope = self.model.rotary_tables(input_ids.shape[1], input_ids.device, position_ids)
        h = self.model(input_ids, rope, router_aux=router_aux, documents=documents, routing=routing, **extra)
        return h, rope, documents

    def _mtp_losses(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        rope: dict,
        chunk_size: int,
        documents: Documents | None = None,
        document_ids: torch.Tensor | None = None,
        take=lambda x: x,
        parts=lambda t: t,
    ) -> tuple[list, list]:
        """(summed loss, counted targets) per MTP depth.

        Depth k (1-based) at position t reads token x_{t+k} = input_ids[t+k] and predicts
        x_{t+k+1} = labels[t+k]; the last k positions have no target. The token read comes from
        input_ids, not labels: a masked label (-100: prompt, padding) still has its token there.
        With packed documents (`document_ids` [B, S] of the whole rows), position t + k in another
        document than t gives no target: its token is not in t's context (a document alone would end
        before it). Under context parallelism input_ids and labels are the whole rows: the shift is
        done on them and the result taken (`take`), so a token k ahead on another rank needs no
        exchange; `parts` sums the loss sum and count over the cp ranks."""
        sums, counts = [], []
        for k, layer in enumerate(self.model.mtp_layers, start=1):
            next_ids = _shift_left(input_ids, k, fill=0)
            targets = _shift_left(labels, k, fill=IGNORE_INDEX)
            if document_ids is not None:
                crosses = _shift_left(document_ids, k, fill=-1) != document_ids  # [B, S]
                targets = targets.masked_fill(crosses, IGNORE_INDEX)
            key = self.model.rope_keys[layer.spec.layer_id]
            h, total, count = layer(
                h,
                self.model.embed_tokens(take(next_ids)),
                *rope[key],
                labels=take(targets),
                chunk_size=chunk_size,
                documents=documents,
            )
            sums.append(parts(total))
            counts.append(parts(count))
        return sums, counts

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic from-scratch init (see model/init.py); zero-centred norms start at 0."""
        for name, tensor in self.state_dict(keep_vars=True).items():
            tensor.copy_(init_tensor(name, tuple(tensor.shape), self.config, seed, dtype=tensor.dtype))

    def checkpoint_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each tensor has in an HF checkpoint of this config (router_bias is always fp32)."""
        stored = getattr(torch, self.config.torch_dtype)
        return {name: torch.float32 if name.endswith("router_bias") else stored for name in self.state_dict()}


def _shift_left(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    if n == 0:
        return x
    return torch.cat([x[:, n:], x.new_full((x.shape[0], min(n, x.shape[1])), fill)], dim=1)


def _check_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, input_ids {tuple(input_ids.shape)}")
