"""What online RL's rollouts add to a step, for an objective whose Needs declares `generates` (G sequences of up
to n new tokens per record: `model.objective: grpo`), counted from what training/rollout.py and
training/grpo.py hold on one rank.

Every rank generates for its own prompts, one prompt at a time (its G rows together), and under context
parallelism each rank of a cp group decodes the whole prompts (generation is not split). The prompt window
is data.seq_len S (a prompt is at most S + 1 ids, data/prompts.py), so a rollout feeds at most S + n tokens:
the prompt, then each sampled token but the last.

On the device, for one prompt (the peak: the next prompt starts with an empty cache), two moments:
- prefill (the prompt's S + 1 tokens, G rows, one forward without gradients): every layer's KV cache holds
  the prompt's S + 1 tokens, and one layer's intermediates live (bounded by what its training forward
  would keep, activations.decoder_layer, for G x (S + 1) tokens); the recorded routes of the prompt;
- end of decoding: full-attention layers hold S + n tokens of keys and values; sliding layers keep the
  last window - 1 in the storage of the step's concatenation, `window` tokens (model/cache.py), or S + n
  when that is shorter. One layer at a time concatenates the step's keys to its cache, its old storage
  alive beside the new (one layer's cache more). The route recorder holds the prompt's routes twice: the
  per-step chunks and their joined copy (model/routing.py RouteRecorder.routes).
  Keys and values: [G, kv heads, tokens, head dim] each, in the compute dtype; routes: [G, tokens, top-k]
  int16 per MoE layer. The sampling's [G, vocab] buffers are left to the allocator margin.
On the host: each completion's routes move off the device as its prompt finishes (Group.routes) and stay
there with the step's rollouts, every micro-batch of the step (grpo.py keeps them for num_iterations);
pack_rollouts copies a micro-batch's into its training rows, and the replay moves one layer at a time to
the device.

The training forward's rows (RunSettings.rows_per_micro_batch, row_tokens) are counted by the plan's
activations as any micro-batch's: at most B x G rows (one sequence each, packed documents), each at most the
packer's capacity, S + 1 + n rounded up to ROW_MULTIPLE.
"""

from __future__ import annotations

from dataclasses import dataclass

from step35.config import LayerSpec
from step35.plan.activations import Shape, decoder_layer
from step35.plan.context import kv_bytes_per_token
from step35.plan.settings import RunSettings

ROUTE_BYTES = 2  # int16 expert ids


@dataclass
class RolloutMemory:
    """Bytes one rank holds for the rollouts (this module's docstring); device terms are one prompt's."""

    num_generations: int  # G
    max_new_tokens: int  # n
    window_tokens: int  # S + n: the most tokens one rollout feeds
    prefill_cache: int  # every layer's K/V of the prompt's S + 1 tokens
    prefill_work: int  # one layer's intermediates in the prefill forward (its largest saved set)
    prefill_routes: int  # the prompt's routes, as recorded at the prefill
    decode_cache: int  # the K/V at the end of decoding
    decode_copy: int  # one layer's old storage beside its concatenation (the largest layer's)
    decode_routes: int  # the recorded routes and their joined copy, S + n tokens
    host_routes: int  # the step's micro-batches' routes on the host, plus one micro-batch's packed copy


def cached_tokens(window: int | None, seq_len: int, max_new_tokens: int) -> int:
    """Tokens of keys and values a layer's cache storage holds at the end of decoding (model/cache.py)."""
    fed = seq_len + max_new_tokens
    if window is None or max_new_tokens == 1:  # a full layer, or the prefill alone: nothing was cut
        return fed
    return min(fed, window)


def rollout_memory(s: RunSettings, shape: Shape) -> RolloutMemory | None:
    """What the rollouts of `s` hold (None: its objective generates nothing); `shape`: the training forward's
    activation shape (the dtypes, kernels and expert parallelism the prefill shares)."""
    if s.objective_needs.generates is None:
        return None
    G, n = s.objective_needs.generates
    cfg, S, a = s.model_config, s.seq_len, shape.act_bytes
    layers = [cfg.layer(i) for i in range(cfg.num_hidden_layers)]  # generation runs the main layers only
    moe_layers = sum(spec.is_moe for spec in layers)
    K = cfg.moe_top_k if moe_layers else 0

    def window(spec: LayerSpec) -> int | None:
        return cfg.sliding_window if spec.sliding else None

    per_token = [G * kv_bytes_per_token(spec, a) for spec in layers]
    decode = [b * cached_tokens(window(spec), S, n) for b, spec in zip(per_token, layers)]
    prefill_shape = Shape(
        G, S + 1, a, shape.device_type, shape.expert_parallel_size, autocast=shape.autocast
    )  # one sequence per row, whole on every cp rank
    work = max((decoder_layer(cfg, spec, prefill_shape).total for spec in layers), default=0)
    routes_per_token = G * moe_layers * K * ROUTE_BYTES
    micro_batch_routes = s.micro_batch_size * routes_per_token * (S + n)
    packed = s.rows_per_micro_batch * s.row_tokens * moe_layers * K * ROUTE_BYTES
    return RolloutMemory(
        num_generations=G,
        max_new_tokens=n,
        window_tokens=S + n,
        prefill_cache=sum(per_token) * (S + 1),
        prefill_work=work,
        prefill_routes=routes_per_token * (S + 1),
        decode_cache=sum(decode),
        decode_copy=max(decode, default=0),
        decode_routes=2 * routes_per_token * (S + n),
        host_routes=s.accumulate_grad_batches * micro_batch_routes + packed,
    )
