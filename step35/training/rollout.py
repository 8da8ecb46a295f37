"""Rollouts for online RL: G completions of each prompt sampled by the policy itself, with step35's KV-cache
decoding (Step35ForCausalLM.step) under the run's sharding, recording per token the log-probability the sample
was drawn with and every MoE layer's chosen experts (model/routing.py); then the training rows that replay them.

Generation, per prompt: the G rows share the prompt, so they need no padding: the prompt runs once (prefill,
G rows), then one token per step for all G rows until each has met a stop id or `max_new_tokens`. A row that
stopped keeps being fed (its tokens after the stop are cut, never trained). Under FSDP, expert parallelism or
context parallelism every rank must call the model the same number of times: `keep_going` (a world-wide
"anyone still generating?") decides when all stop, so a rank with short answers waits for the others.

Sampling: logits / temperature, then the smallest set of tokens whose probability reaches top_p. The recorded
log-probability is log softmax(logits / temperature)[token] (the tempered policy, which the training forward
computes too), fp32. Each prompt has its own generator, seeded from (seed, step, the prompt's tokens, its
repeat within the micro-batch): the samples do not depend on which rank or micro-batch holds the prompt, and a
resumed run draws exactly what the uninterrupted one did (nothing to save).

Training rows (`pack_rollouts`): each sequence is its prompt and completion; its inputs are every token but
the last, its labels the next tokens, trained on the completion's (the stop token included). Sequences are
packed whole into rows in order, with positions restarting at each (attention keeps them apart), padded to
a multiple of ROW_MULTIPLE tokens (any context-parallel split of 2 x cp chunks for cp <= 32). Padding has
position ids that start a new document, labels -100, sequence id -1 and routes -1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from step35.model import KVCache, Step35ForCausalLM
from step35.model.loss import IGNORE_INDEX
from step35.model.routing import RouteRecorder

ROW_MULTIPLE = 64


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits [N, V] -> tokens [N]: greedy for temperature 0, else one sample per row from the top-p nucleus of
    softmax(logits / temperature)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep each token whose predecessors do not yet reach top_p: the smallest set reaching it (>= 1 token).
    keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)  # [N, 1]
    return order.gather(-1, choice).squeeze(-1)


def prompt_seed(seed: int, step: int, prompt: list[int], repeat: int) -> int:
    """A 63-bit seed for one prompt's samples (this module's docstring)."""
    digest = hashlib.sha256(repr((seed, step, repeat, prompt)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class Group:
    """The G completions of one prompt."""

    prompt: list[int]  # p ids
    completions: list[list[int]]  # G lists of ids (the stop id included when one ended it)
    logp: list[torch.Tensor]  # G [c_g] fp32: log-probability each completion token was sampled with
    routes: list[dict[int, torch.Tensor]]  # G {layer_id: [p + c_g - 1, K] int16}: the routes of the inputs
    truncated: list[bool]  # G: ended by max_new_tokens, not by a stop id


@torch.no_grad()
def generate_group(
    model: Step35ForCausalLM,
    prompt: list[int],
    num_generations: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: set[int],
    generator: torch.Generator,
    keep_going: Callable[[bool], bool] = lambda mine: mine,
    record_routes: bool = True,
) -> Group:
    """G completions of `prompt` (this module's docstring); `keep_going(still_generating)` is True while any rank
    is still generating (every rank calls it once per token)."""
    device = model.lm_head.weight.device
    G = num_generations
    cache, recorder = KVCache(), RouteRecorder() if record_routes else None
    inputs = torch.tensor([prompt] * G, device=device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    done = torch.zeros(G, dtype=torch.bool, device=device)
    lengths = torch.full((G,), max_new_tokens, dtype=torch.long, device=device)
    stops = torch.tensor(sorted(stop_ids), device=device)
    for t in range(max_new_tokens):
        logits = model.step(inputs, cache, last_only=True, routing=recorder)[:, -1].float()  # [G, V]
        token = sample_tokens(logits, temperature, top_p, generator)
        tempered = logits / temperature if temperature > 0 else logits  # (greedy: the plain distribution's)
        logp = torch.log_softmax(tempered, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        tokens.append(token)
        logps.append(logp)
        stopped = torch.isin(token, stops) & ~done
        lengths = torch.where(stopped, t + 1, lengths)
        done |= stopped
        if not keep_going(not bool(done.all())) or t + 1 == max_new_tokens:
            break
        inputs = token[:, None]
    new, logp_rows = torch.stack(tokens, 1), torch.stack(logps, 1)  # [G, n]
    routes = recorder.routes() if recorder is not None else {}
    group = Group(prompt, [], [], [], [])
    for g in range(G):
        c = int(lengths[g].clamp(max=new.shape[1]))
        group.completions.append(new[g, :c].tolist())
        group.logp.append(logp_rows[g, :c].cpu())
        group.routes.append({layer: r[g, : len(prompt) + c - 1].cpu() for layer, r in routes.items()})
        group.truncated.append(not bool(done[g]) or c == 0)
    return group


@dataclass
class TrainingRows:
    """Packed rows of a micro-batch's sequences (this module's docstring); R rows of L tokens."""

    input_ids: torch.Tensor  # [R, L]
    labels: torch.Tensor  # [R, L] (-100: not a completion token's target)
    position_ids: torch.Tensor  # [R, L]
    sequence_ids: torch.Tensor  # [R, L]: the sequence of a label slot, -1 where no label
    rollout_logp: torch.Tensor  # [R, L] fp32: the log-probability the label was sampled with (0 elsewhere)
    routes: dict[int, torch.Tensor]  # {layer_id: [R, L, K] int16}, -1 where none was recorded
    tokens: torch.Tensor  # [R, L] bool: a sequence's token, not padding


def pack_rollouts(
    sequences: list[tuple[list[int], list[int], torch.Tensor, dict[int, torch.Tensor]]],
    row_tokens: int,
) -> TrainingRows:
    """Pack (prompt ids, completion ids, rollout logp [c], routes {layer: [p + c - 1, K]}) into rows of at most
    `row_tokens` inputs (rounded up to ROW_MULTIPLE; a longer sequence gets a row of its own), in order."""
    rows: list[list[int]] = [[]]
    capacity = -(-row_tokens // ROW_MULTIPLE) * ROW_MULTIPLE
    for index, (prompt, completion, _, _) in enumerate(sequences):
        size = len(prompt) + len(completion) - 1
        used = sum(len(sequences[i][0]) + len(sequences[i][1]) - 1 for i in rows[-1])
        if rows[-1] and used + size > capacity:
            rows.append([])
        rows[-1].append(index)
    longest = max(sum(len(sequences[i][0]) + len(sequences[i][1]) - 1 for i in row) for row in rows)
    L = -(-max(longest, 1) // ROW_MULTIPLE) * ROW_MULTIPLE
    K = next((r.shape[-1] for *_, routes in sequences for r in routes.values()), 1)
    layers = sorted({layer for *_, routes in sequences for layer in routes})
    out = TrainingRows(
        torch.zeros(len(rows), L, dtype=torch.long),
        torch.full((len(rows), L), IGNORE_INDEX, dtype=torch.long),
        torch.zeros(len(rows), L, dtype=torch.long),
        torch.full((len(rows), L), -1, dtype=torch.long),
        torch.zeros(len(rows), L, dtype=torch.float32),
        {layer: torch.full((len(rows), L, K), -1, dtype=torch.int16) for layer in layers},
        torch.zeros(len(rows), L, dtype=torch.bool),
    )
    for r, row in enumerate(rows):
        start = 0
        for index in row:
            start = _place(out, r, start, index, sequences[index])
        out.position_ids[r, start:] = torch.arange(L - start)  # padding: a document of its own
    return out


def _place(out: TrainingRows, r: int, start: int, index: int, sequence) -> int:
    """Write one sequence into row r at `start`; returns where the next one starts."""
    prompt, completion, logp, routes = sequence
    tokens = torch.tensor(prompt + completion)
    n = len(tokens) - 1  # inputs: every token but the last
    end = start + n
    out.input_ids[r, start:end] = tokens[:-1]
    out.position_ids[r, start:end] = torch.arange(n)
    out.tokens[r, start:end] = True
    first = len(prompt) - 1  # the slot whose label is the first completion token
    out.labels[r, start + first : end] = tokens[len(prompt) :]
    out.sequence_ids[r, start + first : end] = index
    out.rollout_logp[r, start + first : end] = logp
    for layer, layer_routes in routes.items():
        out.routes[layer][r, start:end] = layer_routes
    return end
