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

EvalCallback's generation (callbacks/evaluation.py, eval/generative.py sample_answers) is the same decoding
without routes: after an optimizer step, one prompt record at a time, its num_samples rows together, at most
max_new_tokens each, the training model in eval mode (`eval_generation_memory`). Its prompt is bounded by
S + 1 ids as a rollout's is: the callback cuts no record, so that is the plan's assumption, said in its report.
It runs outside the training step's autocast: its keys and values are in FSDP's param_dtype, else in the dtype
the weights are held in (fp32 under bf16-mixed), not in the training forward's compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from step35.config import LayerSpec, Step35Config
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


@dataclass
class GenerationMemory:
    """One prompt's generation on the device, without routes (this module's docstring): `rows` sequences fed the
    prompt's S + 1 ids, then each sampled token but the last."""

    rows: int  # G: the prompt's rows, decoded together
    max_new_tokens: int  # n
    window_tokens: int  # S + n: the most tokens one row feeds
    prefill_cache: int  # every layer's K/V of the prompt's S + 1 tokens
    prefill_work: int  # one layer's intermediates in the prefill forward (its largest saved set)
    decode_cache: int  # the K/V at the end of decoding
    decode_copy: int  # one layer's old storage beside its concatenation (the largest layer's)


def generation_memory(
    cfg: Step35Config, rows: int, seq_len: int, max_new_tokens: int, shape: Shape
) -> GenerationMemory:
    """The KV cache and prefill work of `rows` sequences of one prompt of at most seq_len + 1 ids and up to
    max_new_tokens new ones, in `shape`'s dtype and kernels (its batch and seq are not read)."""
    S, n, a = seq_len, max_new_tokens, shape.act_bytes
    layers = [cfg.layer(i) for i in range(cfg.num_hidden_layers)]  # generation runs the main layers only

    def window(spec: LayerSpec) -> int | None:
        return cfg.sliding_window if spec.sliding else None

    per_token = [rows * kv_bytes_per_token(spec, a) for spec in layers]
    decode = [b * cached_tokens(window(spec), S, n) for b, spec in zip(per_token, layers)]
    prefill_shape = Shape(
        rows, S + 1, a, shape.device_type, shape.expert_parallel_size, autocast=shape.autocast
    )  # one sequence per row, whole on every cp rank
    work = max((decoder_layer(cfg, spec, prefill_shape).total for spec in layers), default=0)
    return GenerationMemory(
        rows=rows,
        max_new_tokens=n,
        window_tokens=S + n,
        prefill_cache=sum(per_token) * (S + 1),
        prefill_work=work,
        decode_cache=sum(decode),
        decode_copy=max(decode, default=0),
    )


def rollout_memory(s: RunSettings, shape: Shape) -> RolloutMemory | None:
    """What the rollouts of `s` hold (None: its objective generates nothing); `shape`: the training forward's
    activation shape (the dtypes, kernels and expert parallelism the prefill shares)."""
    if s.objective_needs.generates is None:
        return None
    G, n = s.objective_needs.generates
    cfg, S = s.model_config, s.seq_len
    generation = generation_memory(cfg, G, S, n, shape)
    moe_layers = sum(cfg.layer(i).is_moe for i in range(cfg.num_hidden_layers))
    K = cfg.moe_top_k if moe_layers else 0
    routes_per_token = G * moe_layers * K * ROUTE_BYTES
    micro_batch_routes = s.micro_batch_size * routes_per_token * (S + n)
    packed = s.rows_per_micro_batch * s.row_tokens * moe_layers * K * ROUTE_BYTES
    return RolloutMemory(
        num_generations=G,
        max_new_tokens=n,
        window_tokens=generation.window_tokens,
        prefill_cache=generation.prefill_cache,
        prefill_work=generation.prefill_work,
        prefill_routes=routes_per_token * (S + 1),
        decode_cache=generation.decode_cache,
        decode_copy=generation.decode_copy,
        decode_routes=2 * routes_per_token * (S + n),
        host_routes=s.accumulate_grad_batches * micro_batch_routes + packed,
    )


def eval_generation_memory(s: RunSettings, shape: Shape) -> GenerationMemory | None:
    """One prompt's generation by the run's EvalCallback (None: there is none), num_samples rows of prompts
    counted at S + 1 ids, in the dtype it runs in (RunSettings.eval_dtype); `shape`: the training forward's."""
    e = s.eval_generation
    if e is None:
        return None
    dtype_bytes = torch.empty((), dtype=s.eval_dtype).element_size()
    eval_shape = replace(shape, act_bytes=dtype_bytes, autocast=False)
    return generation_memory(s.model_config, e.num_samples, s.seq_len, e.max_new_tokens, eval_shape)
