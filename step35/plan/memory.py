"""Peak device memory of one rank over a training step, phase by phase.

The step is cut where the big transient buffers live (see docs/plan.md):
  forward     state + root gathered + activations + one block gathered + the loss's logits chunk
  loss bwd    state + root gathered + activations + the loss backward (fp32 [V, H] weight gradient)
  block bwd   state + gradients + root gathered + lm_head gradient + activations + two blocks gathered
              (prefetch) + one block's gradients and reduce-scatter input + one block rebuilt or its
              activation gradients + the expert all-to-all receive buffers + under context parallelism
              the whole-sequence dK/dV of a gathering layer before its reduce-scatter (plan/context.py)
  end of bwd  state + gradients + root gathered + root gradients and reduce-scatter input
  optimizer   state + gradients + the optimizer's temporaries (asked of it: training/optimizer.py)
and, for an objective that generates (Needs.generates: online RL), before each micro-batch's forward, one
prompt's rollout (plan/rollout.py; the training forward's activations are not yet kept):
  rollout prefill  state + gradients + root gathered + one block gathered + the prompt's KV cache, one
                   layer's prefill work and the prompt's recorded routes
  rollout decode   state + gradients + root gathered + one block gathered + the KV cache at the end of
                   decoding, one layer's concatenation copy and the recorded routes (chunks and joined)
and, with an EvalCallback in trainer.callbacks, after the optimizer step (gradients still held: Lightning frees
them in the next step's first micro-batch, before its backward), one prompt record's generation (plan/rollout.py,
eval_generation_memory; no routes recorded, no activations kept):
  eval prefill     state + gradients + root gathered + one block gathered + the prompt's KV cache of its
                   num_samples rows and one layer's prefill work
  eval decode      state + gradients + root gathered + one block gathered + the KV cache at the end of
                   decoding and one layer's concatenation copy
  eval MTP drafts  (mtp_batches > 0, MTP layers built) state + gradients + root gathered + one MTP layer
                   gathered + draft_logits' peak on one validation micro-batch: the main head's and every
                   depth's logits at once and the last head's hidden states, or, where larger, the logits
                   before the last depth's and that MTP layer's work (plan/drafts.py)
and, with Step-3.7's vision side on the devices (model.vision, plan/vision.py), whose activations are part of
`activations` in every phase above:
  vision forward   state + root gathered + the vision activations + one block gathered + the larger of one
                   encoder block's tensors (as training keeps them) and the image features before the splice
  vision backward  (when a gradient reaches it) state + gradients + root gathered + the vision activations + two
                   blocks gathered + one block's gradients and reduce-scatter input + one encoder block's
                   activation gradients (taken as its kept tensors); the language model's activations are gone
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from step35.plan.activations import ActivationEstimate
from step35.plan.context import gathered_gradient_bytes
from step35.plan.drafts import DraftMemory
from step35.plan.rollout import GenerationMemory, RolloutMemory
from step35.plan.settings import RunSettings
from step35.plan.state import FsdpGroup, RankState
from step35.plan.vision import VisionActivations


def _bytes(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Phase:
    name: str
    rows: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.rows.values())


@dataclass
class Transients:
    root_gathered: int  # embedding + final norm + lm_head gathered for the whole step (not resharded)
    block_gather: int  # the biggest block (its dense part and its experts) gathered, compute dtype
    gathered_blocks: int  # blocks gathered at once in backward: 2 with prefetch; all without resharding
    block_grads: int  # that block's unsharded gradients (compute dtype)
    reduce_scatter: int  # their copy in reduce_dtype for the reduce-scatter (0 when the dtypes match)
    root_grads: int  # root gradients at the end of backward, plus their reduce-scatter copy
    lm_head_grad: int  # the lm_head gradient, from the loss backward to the end of backward
    all_to_all: int  # expert-parallel receive rows and their regrouped copy, one MoE layer
    loss_forward: int  # logits of one loss chunk
    loss_backward: int  # fp32 weight gradient accumulator + one chunk's addend + logits/softmax of a chunk
    optimizer: int  # the optimizer step's temporaries (OptimizerKind.temporaries)


def transients(s: RunSettings, state: RankState, groups: list[FsdpGroup]) -> Transients:
    cfg = s.model_config
    a, r = _bytes(s.compute_dtype), _bytes(s.reduce_dtype or s.compute_dtype)
    V, H = cfg.vocab_size, cfg.hidden_size
    chunk = min(s.loss_chunk_size, s.tokens_per_rank)
    root = next(g for g in groups if g.name == "root")
    by_layer: dict[str, list[FsdpGroup]] = {}
    for g in groups:
        if g.name != "root" and g.runs:
            by_layer.setdefault(g.name.split(".moe")[0], []).append(g)
    blocks = [sum(g.unsharded_numel for g in gs) for gs in by_layer.values()]
    trainable_blocks = [sum(g.grad_numel for g in gs) for gs in by_layer.values()]
    biggest = max(blocks, default=0)
    rs_copy = r if r != a else 0
    # lm_head trained (always in a full fine-tune; under LoRA only when named): its gradient is
    # unsharded from the loss backward on, and the loss builds it in an fp32 accumulator.
    lm_head_trained = root.trainable if s.lora is None else s.lora.adapts("lm_head")
    lm_head = V * H if lm_head_trained else 0
    tokens = s.tokens_per_rank
    ep_rows = tokens * cfg.moe_top_k if cfg.use_moe and s.expert_parallel_size > 1 else 0
    loss_fwd = chunk * V * (a + 2 * 4)  # h @ W^T, its fp32 copy, the exp of logsumexp
    loss_bwd = (2 * V * H * 4 + V * H * a if lm_head_trained else 0) + chunk * V * (2 * a + 2 * 4)
    foreach = s.expert_parallel_size == 1  # training/optimizer.foreach_ok: one mesh only
    optimizer = s.optimizer_kind.temporaries(state.grads, state.largest_local_param, foreach)
    if not s.sharded:
        return Transients(0, 0, 0, 0, 0, 0, 0, 0, loss_fwd, loss_bwd, optimizer)
    gathered = 2 if s.reshard_after_forward else max(1, len(blocks))
    block_gather = biggest * a if s.reshard_after_forward else sum(blocks) * a // max(1, len(blocks))
    return Transients(
        root_gathered=root.unsharded_numel * a,
        block_gather=block_gather,
        gathered_blocks=gathered,
        block_grads=max(trainable_blocks, default=0) * a,
        reduce_scatter=max(trainable_blocks, default=0) * rs_copy,
        root_grads=root.grad_numel * (a + rs_copy),
        lm_head_grad=lm_head * a,
        all_to_all=2 * ep_rows * H * a,
        loss_forward=loss_fwd,
        loss_backward=loss_bwd,
        optimizer=optimizer,
    )


def held_outside_training(persistent: dict[str, int], gradients: int, t: Transients, block_gather: int) -> dict:
    """What a forward without gradients (a rollout, EvalCallback) runs beside: the state, the gradients, the root
    and one block gathered."""
    return {**persistent, "gradients": gradients, "root gathered": t.root_gathered, "block all-gather": block_gather}


def rollout_phases(persistent: dict[str, int], gradients: int, t: Transients, r: RolloutMemory) -> list[Phase]:
    """The two moments of one prompt's rollout (this module's docstring)."""
    held = held_outside_training(persistent, gradients, t, t.block_gather)
    return [
        Phase(
            "rollout prefill",
            {**held, "KV cache": r.prefill_cache, "prefill layer work": r.prefill_work, "routes": r.prefill_routes},
        ),
        Phase(
            "rollout decode",
            {**held, "KV cache": r.decode_cache, "KV concatenation": r.decode_copy, "routes": r.decode_routes},
        ),
    ]


def eval_phases(persistent: dict[str, int], gradients: int, t: Transients, e: GenerationMemory) -> list[Phase]:
    """The two moments of one prompt record's generation by EvalCallback (this module's docstring)."""
    held = held_outside_training(persistent, gradients, t, t.block_gather)
    return [
        Phase("eval prefill", {**held, "KV cache": e.prefill_cache, "prefill layer work": e.prefill_work}),
        Phase("eval decode", {**held, "KV cache": e.decode_cache, "KV concatenation": e.decode_copy}),
    ]


def draft_phase(persistent: dict[str, int], gradients: int, t: Transients, d: DraftMemory) -> Phase:
    """EvalCallback's MTP drafts of one validation micro-batch at their peak (this module's docstring)."""
    held = held_outside_training(persistent, gradients, t, d.block_gather)  # the MTP layer gathered
    return Phase("eval MTP drafts", {**held, "draft logits": d.logits, "draft hidden states + work": d.beside})


def vision_phases(
    persistent: dict[str, int], gradients: int, grads_in_forward: int, t: Transients, v: VisionActivations
) -> tuple[list[Phase], list[Phase]]:
    """The vision forward (before the language model's) and, when a gradient reaches it, the vision backward
    (after the language model's): this module's docstring."""
    held = {**persistent, "root gathered": t.root_gathered, "vision activations": v.total}
    forward = Phase(
        "vision forward",
        {
            **held,
            "gradients": grads_in_forward,
            "block all-gather": t.block_gather,
            "vision forward work": max(v.block_work, v.features_bytes),
        },
    )
    if v.mode == "frozen":
        return [forward], []
    backward = Phase(
        "vision backward",
        {
            **held,
            "gradients": gradients,
            "block all-gather": t.gathered_blocks * t.block_gather,
            "block gradients": t.block_grads,
            "reduce-scatter": t.reduce_scatter,
            "vision backward work": v.block_work,
        },
    )
    return [forward], [backward]


def phases(
    s: RunSettings,
    state: RankState,
    t: Transients,
    act: ActivationEstimate,
    rollout: RolloutMemory | None = None,
    vision: VisionActivations | None = None,
    evaluation: GenerationMemory | None = None,
    drafts: DraftMemory | None = None,
) -> list[Phase]:
    persistent = {"parameters": state.params, "optimizer states": state.optimizer, "buffers": state.buffers}
    if state.reference:
        persistent["reference copy"] = state.reference  # the objective's frozen copy (full-fine-tuning DPO)
    grads_in_forward = state.grads if s.accumulate_grad_batches > 1 else 0
    acts = act.total
    block_work = act.recompute if act.mode != "none" else act.largest_layer
    cp_rows = {}
    if s.context_parallel_size > 1:
        cfg = s.model_config
        layers = [cfg.layer(i) for i in range(cfg.num_hidden_layers + (s.num_mtp_layers if s.train_mtp else 0))]
        cp_rows["cp K/V gradients"] = gathered_gradient_bytes(
            cfg, layers, s.rows_per_micro_batch, s.row_tokens, s.context_parallel_size, _bytes(s.compute_dtype)
        )
    generation = rollout_phases(persistent, grads_in_forward, t, rollout) if rollout is not None else []
    before, after = vision_phases(persistent, state.grads, grads_in_forward, t, vision) if vision else ([], [])
    evaluating = eval_phases(persistent, state.grads, t, evaluation) if evaluation is not None else []
    evaluating += [draft_phase(persistent, state.grads, t, drafts)] if drafts is not None else []
    return [
        *generation,
        *before,
        Phase(
            "forward",
            {
                **persistent,
                "gradients": grads_in_forward,
                "root gathered": t.root_gathered,
                "activations": acts,
                "block all-gather": t.block_gather,
                "loss chunk": t.loss_forward,
            },
        ),
        Phase(
            "loss backward",
            {
                **persistent,
                "gradients": grads_in_forward,
                "root gathered": t.root_gathered,
                "activations": acts,
                "loss backward": t.loss_backward,
            },
        ),
        Phase(
            "block backward",
            {
                **persistent,
                "gradients": state.grads,
                "root gathered": t.root_gathered,
                "lm_head gradient": t.lm_head_grad,
                "activations": acts,
                "block all-gather": t.gathered_blocks * t.block_gather,
                "block gradients": t.block_grads,
                "reduce-scatter": t.reduce_scatter,
                "block backward work": block_work,
                "all-to-all buffers": t.all_to_all,
                **cp_rows,
            },
        ),
        *after,
        Phase(
            "end of backward",
            {
                **persistent,
                "gradients": state.grads,
                "root gathered": t.root_gathered,
                "root gradients + reduce-scatter": t.root_grads,
            },
        ),
        Phase("optimizer step", {**persistent, "gradients": state.grads, "optimizer temporaries": t.optimizer}),
        *evaluating,
    ]


@dataclass
class Verdict:
    peak_phase: str
    peak: int  # bytes allocated at the peak phase
    allocator_margin: int  # fragmentation / caching allowance
    runtime_reserve: int
    required: int
    device_memory: int
    free: int
    margin_pct: float
    fits: bool


def verdict(phase_list: list[Phase], device_memory: int, allocator_margin: float, runtime_reserve: int) -> Verdict:
    worst = max(phase_list, key=lambda p: p.total)
    margin = int(worst.total * allocator_margin)
    required = worst.total + margin + runtime_reserve
    free = device_memory - required
    pct = 100.0 * free / device_memory if device_memory else float("nan")
    return Verdict(worst.name, worst.total, margin, runtime_reserve, required, device_memory, free, pct, free >= 0)
