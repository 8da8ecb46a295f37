"""Online RL with verifiable rewards (`model.objective: grpo`; issue 44): GRPO, DAPO, Dr. GRPO and GSPO on the
MoE, with rollout routing replay, as an objective of the objective room (training/objective.py).

Per micro-batch of prompt records (`data.format: prompt`, data/prompts.py), on every data-parallel rank:
1. rollouts (training/rollout.py): `num_generations` (G) completions per prompt, sampled by the policy itself
   with KV-cache decoding under the run's sharding, recording each token's log-probability and every MoE
   layer's chosen experts; all ranks decode in lockstep;
2. rewards (training/rewards.py): the reward functions of `model.rl.reward_funcs`, weighted;
3. advantages: normalised within each prompt's G completions (policy_loss.group_advantages; `scale_rewards`
   group | batch | none);
4. the loss (training/policy_loss.py): the clipped surrogate over the completion tokens of packed rows whose
   forward replays the rollout's routes (model/routing.py), so the ratio measures the policy, not router flips.
   The step's loss is the mean the loss type defines over every completion of the optimizer step (all
   micro-batches, all data-parallel ranks): a micro-batch backpropagates its numerator and StepResult's factor
   divides the step's gradient by the step's denominator.

`num_iterations` (mu) > 1: the same rollouts train mu optimizer steps; the data side hands each step's prompt
batches mu times in a row (the module asks it: Needs.batch_repeats) and the objective keeps the step's rollouts,
with the policy's log-probabilities of the first iteration as pi_old. At mu = 1, pi_old is the forward's own
log-probabilities, detached: the ratio is exactly 1 and nothing clips. A checkpoint inside a repetition keeps
no rollouts: `mu` must divide the checkpoint interval (RL_REPEAT_RULE), so a resumed run starts a fresh one.

The reference (KL term, beta > 0) is the policy with its adapters off under LoRA, else a frozen copy of the start
model (training/reference.py), its forward replaying the same routes. MTP layers are not trained.

Logged each step (train/ and rl/): reward and its std, per reward function, advantage std, completion length
(mean, max), the truncated fraction, clip fractions (low, high), KL when beta > 0, rl/logprob_diff_{max,mean}:
|log pi_train - log pi_rollout| over the completion tokens (about 0 with replay at the first iteration: the
honesty check; later iterations of mu show how far the updates moved the policy), rl/route_agreement: the share of token-layer routes the live router would have chosen anyway,
rl/route_fallbacks (tokens replayed with no record), rl/nonfinite_tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from step35.data.prompts import decode_prompt_records
from step35.model import Step35ForCausalLM
from step35.model.lora import LoraConfig
from step35.model.routing import RouteReplay
from step35.training.objective import (
    MicroBatch,
    Needs,
    Objective,
    ObjectiveContext,
    ObjectiveInputs,
    StepResult,
    refuse_language_model_terms,
)
from step35.training.options import check_rules, options_of
from step35.training.policy_loss import PolicyLossOptions, batch_std_of, group_advantages, policy_loss
from step35.training.reference import ComparesWithReference, reference_kind
from step35.training.rewards import RewardFunction, load_reward_functions, reward_names, score_completions
from step35.training.rollout import Group, generate_group, pack_rollouts, prompt_seed

# The step's sums (float64, this order), then one (sum, sum of squares, applicable) triple per reward function.
SUMS = (
    "denominator",
    "sequences",
    "tokens",
    "nonfinite",
    "clip_low",
    "clip_high",
    "kl",
    "numerator",
    "completions",
    "reward",
    "reward_sq",
    "advantage_sq",
    "completion_length",
    "truncated",
    "logprob_diff",
    "logprob_diff_tokens",
    "route_agreed",
    "route_compared",
    "route_fallbacks",
)
MAXES = ("completion_length_max", "logprob_diff_max")


@dataclass
class GrpoOptions:
    """`model.rl` of `model.objective: grpo`.

    Args:
        reward_funcs: reward functions: built-in names (training/rewards.py) or `package.module:function` paths.
        reward_weights: one weight per function (None: all 1).
        num_generations: completions per prompt (G), >= 2 for a group to compare.
        temperature: sampling temperature (> 0); the trained policy is softmax(logits / temperature).
        top_p: nucleus sampling, in (0, 1].
        max_new_tokens: the longest completion.
        scale_rewards: advantages divided by the group's std (`group`), the whole step's (`batch`) or not
            at all (`none`, Dr. GRPO).
        loss_type: `dapo` (token mean over the step), `grpo` (sequence means, averaged), `dr_grpo` (token sum
            over completions x max_new_tokens).
        importance_sampling_level: `token`, or `sequence` (GSPO).
        epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] (None: epsilon).
        num_iterations: optimizer steps per rollout batch (mu).
        beta: weight of the KL term against the reference (0: none, no reference is built).
        tis_cap: truncated importance sampling against the rollout's log-probabilities (None: off).
        routing_replay: `rollout` (replay the rollout's experts in training) or `off`.
        seed: seeds the rollouts (with the step and the prompt).
        sample_every: every N steps rank 0 writes a table of completions with their rewards (0: never).
    """

    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    num_generations: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    beta: float = 0.0
    tis_cap: float | None = None
    routing_replay: str = "rollout"
    seed: int = 0
    sample_every: int = 10

    @classmethod
    def of(cls, value: GrpoOptions | dict | None) -> GrpoOptions:
        return options_of(cls, value, "rl", "grpo")

    def check(self) -> None:
        def whole(low: int) -> Callable[[Any], bool]:
            return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low

        check_rules(
            {
                "rl.num_generations": (self.num_generations, whole(2), "an integer >= 2"),
                "rl.max_new_tokens": (self.max_new_tokens, whole(1), "an integer >= 1"),
                "rl.num_iterations": (self.num_iterations, whole(1), "an integer >= 1"),
                "rl.sample_every": (self.sample_every, whole(0), "an integer >= 0"),
                "rl.temperature": (self.temperature, lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
                "rl.top_p": (self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
                "rl.routing_replay": (self.routing_replay, lambda v: v in ("rollout", "off"), "rollout or off"),
            }
        )

    def loss_options(self) -> PolicyLossOptions:
        options = PolicyLossOptions(
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            tis_cap=self.tis_cap,
            max_completion_length=self.max_new_tokens,
        )
        options.check()
        return options


@dataclass
class Rollouts:
    """One micro-batch's rollouts, kept for the later iterations of mu."""

    prompts: torch.Tensor  # the batch's input_ids, to check that the data side repeated it
    groups: list[Group]
    advantages: torch.Tensor  # [P * G] float64
    stats: torch.Tensor  # float64: the reward and length sums of SUMS, then the reward functions' triples
    old_logp: torch.Tensor | None = None  # [R, L] the first iteration's log-probabilities (whole rows)


class GrpoObjective(ComparesWithReference, Objective):
    """GRPO and its variants (this module's docstring)."""

    name = "grpo"
    record_kinds = {"prompt": "prompt records"}
    logged = ("loss", "reward", "reward_std", "reward/<fn>", "advantage_std", "completion_length", "kl")
    options_field = "rl"

    def __init__(self, options: GrpoOptions, functions: list[RewardFunction], loss_chunk_size: int = 1024,
                 lora: LoraConfig | None = None):  # fmt: skip
        options.check()
        self.options, self.functions = options, functions
        self.loss_options = options.loss_options()
        self.names = reward_names(functions)
        self.loss_chunk_size = loss_chunk_size
        self.reference = reference_kind(self.name, lora) if options.beta > 0 else None
        self.reference_model: Step35ForCausalLM | None = None
        self.context = ObjectiveContext()
        self._kept: list[Rollouts] = []  # this repetition's rollouts, by micro-batch
        self._calls = 0  # micro-batches since the last reduce
        self._maxes: torch.Tensor | None = None

    @classmethod
    def needs(cls, inputs: ObjectiveInputs) -> Needs:
        options = GrpoOptions.of(inputs.options.get(cls.options_field))
        reference = reference_kind(cls.name, inputs.lora) if options.beta > 0 else None
        return Needs(
            reference=reference,
            extra_forwards=1 if reference else 0,
            trains_mtp=False,
            generates=(options.num_generations, options.max_new_tokens),
            batch_repeats=options.num_iterations,
        )

    @classmethod
    def from_inputs(cls, inputs: ObjectiveInputs) -> GrpoObjective:
        refuse_language_model_terms(cls.name, inputs)
        options = GrpoOptions.of(inputs.options.get(cls.options_field))
        options.check()
        functions = load_reward_functions(options.reward_funcs, options.reward_weights, field="model.rl")
        return cls(options, functions, inputs.loss_chunk_size, inputs.lora)

    def bind(self, context: ObjectiveContext) -> None:
        self.context = context

    # ----------------------------------------------------------------------------- rollouts and rewards
    def _prompts(self, batch: dict) -> list[list[int]]:
        self.check_records(batch)
        if "prompt" not in batch or "prompt_record" not in batch:
            raise ValueError(
                "model.objective=grpo needs prompt records, but the batch has no `prompt` ids: give it "
                'data.format: prompt sources ({"prompt": ...} records), or set model.objective: lm'
            )
        ids, lengths = batch["input_ids"].cpu(), batch["prompt"].cpu()
        return [ids[b, : int(lengths[b])].tolist() for b in range(ids.shape[0])]

    def _generate(self, model: Step35ForCausalLM, prompts: list[list[int]], step: int, num: int) -> list[Group]:
        """`num` completions of each prompt, in eval mode (no dropout, no expert-load counts)."""
        o, ctx = self.options, self.context
        training = model.training
        model.eval()
        try:
            groups = []
            for repeat, prompt in enumerate(prompts):
                seed = prompt_seed(o.seed, step, prompt, sum(p == prompt for p in prompts[:repeat]))
                generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
                groups.append(
                    generate_group(
                        model, prompt, num, max_new_tokens=o.max_new_tokens, temperature=o.temperature,
                        top_p=o.top_p, stop_ids=ctx.stop_ids, generator=generator, keep_going=ctx.keep_going,
                    )
                )  # fmt: skip
            return groups
        finally:
            model.train(training)

    def _score(self, batch: dict, groups: list[Group]):
        """RewardScores of every completion (prompt-major, G per prompt)."""
        records = decode_prompt_records(batch)
        prompts, completions, columns = [], [], {}
        for record, group in zip(records, groups):
            for ids in group.completions:
                text = self.context.decode([i for i in ids if i not in self.context.stop_ids])
                conversational = isinstance(record["prompt"], list)
                prompts.append(record["prompt"])
                completions.append([{"role": "assistant", "content": text}] if conversational else text)
                for key, value in record.items():
                    if key != "prompt":
                        columns.setdefault(key, []).append(value)
                columns.setdefault("completion_ids", []).append(ids)
            columns.setdefault("truncated", []).extend(group.truncated)
        missing = {k: v for k, v in columns.items() if len(v) != len(completions)}
        for key in missing:  # a column some records lack: None where absent
            columns[key] = [r.get(key) for r in records for _ in range(len(groups[0].completions))]
        return prompts, completions, score_completions(self.functions, prompts, completions, columns)

    def _rollouts(self, model: Step35ForCausalLM, batch: dict) -> Rollouts:
        prompts = self._prompts(batch)
        step = self.context.step()
        groups = self._generate(model, prompts, step, self.options.num_generations)
        texts, completions, scores = self._score(batch, groups)
        advantages = self._advantages(scores.total)
        lengths = torch.tensor([len(c) for g in groups for c in g.completions], dtype=torch.float64)
        truncated = torch.tensor([t for g in groups for t in g.truncated], dtype=torch.float64)
        total = scores.total
        stats = [
            float(total.numel()),
            total.sum(),
            (total**2).sum(),
            (advantages**2).sum(),
            lengths.sum(),
            truncated.sum(),
        ]
        per_function = []
        for f in range(len(self.functions)):
            value = torch.where(scores.applicable[f], scores.per_function[f], 0)
            per_function += [value.sum(), (value**2).sum(), scores.applicable[f].sum()]
        self._note_max(0, float(lengths.max()))
        if self.options.sample_every and step % self.options.sample_every == 0:
            self.context.write_samples(step, self._samples(texts, completions, scores, advantages))
        values = torch.tensor([float(v) for v in stats + per_function], dtype=torch.float64)
        return Rollouts(batch["input_ids"].cpu().clone(), groups, advantages, values)

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        scale, batch_std = self.options.scale_rewards, None
        if scale == "batch":  # the std over the step's completions on every data-parallel rank
            moments = torch.stack([rewards.new_tensor(float(rewards.numel())), rewards.sum(), (rewards**2).sum()])
            moments = self.context.sum_over_ranks(moments)
            batch_std = batch_std_of(*moments)
        return group_advantages(rewards, self.options.num_generations, scale, batch_std=batch_std)

    def _samples(self, prompts: list, completions: list, scores, advantages: torch.Tensor) -> list[dict]:
        rows = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            row = {"prompt": prompt, "completion": completion, "reward": float(scores.total[i]),
                   "advantage": float(advantages[i])}  # fmt: skip
            for f, name in enumerate(self.names):
                row[name] = float(scores.per_function[f, i]) if bool(scores.applicable[f, i]) else None
            rows.append(row)
        return rows

    # ----------------------------------------------------------------------------- the loss
    def micro_batch(self, model: Step35ForCausalLM, batch: dict, training: bool = True) -> MicroBatch:
        slot, self._calls = self._calls, self._calls + 1
        first = self.context.step() % self.options.num_iterations == 0 or slot >= len(self._kept)
        if first:  # (nothing kept inside a repetition: a run resumed there generates afresh)
            rollouts = self._rollouts(model, batch)
            self._kept = self._kept[:slot] + [rollouts]
        else:
            rollouts = self._repeated(batch, slot)
        return self._loss(model, rollouts, first=first)

    def _repeated(self, batch: dict, slot: int) -> Rollouts:
        if not torch.equal(self._kept[slot].prompts, batch["input_ids"].cpu()):
            raise RuntimeError(
                f"model.rl.num_iterations={self.options.num_iterations}: micro-batch {slot} of this step is not the "
                "one its rollouts were generated for; the data side must repeat each step's prompt batches"
            )
        return self._kept[slot]

    def _loss(self, model: Step35ForCausalLM, rollouts: Rollouts, first: bool) -> MicroBatch:
        groups, o = rollouts.groups, self.options
        sequences = [(g.prompt, c, lp, r) for g in groups for c, lp, r in zip(g.completions, g.logp, g.routes)]
        rows = pack_rollouts(sequences, max(len(s[0]) + len(s[1]) for s in sequences))
        device = model.lm_head.weight.device
        rows_on = {k: v.to(device) for k, v in vars(rows).items() if k != "routes"}
        advantages = rollouts.advantages.to(device=device, dtype=torch.float64)
        slot_advantage = torch.where(rows_on["sequence_ids"] >= 0, advantages[rows_on["sequence_ids"].clamp(min=0)], 0)

        def forward(m: Step35ForCausalLM):
            impose = o.routing_replay == "rollout"
            replay = RouteReplay(rows.routes, impose, counted=rows_on["tokens"]) if rows.routes else None
            return m.token_logprobs(
                rows_on["input_ids"], rows_on["labels"], position_ids=rows_on["position_ids"], routing=replay,
                temperature=o.temperature, loss_chunk_size=self.loss_chunk_size,
                carried=(rows_on["sequence_ids"], rows_on["rollout_logp"], slot_advantage),
            )  # fmt: skip

        ref = self.on_reference(model, lambda m: forward(m).logp) if self.reference is not None else None
        share = forward(model)
        sequence_ids, rollout_logp, slot_advantage = share.carried
        if first:  # pi_old: this forward's own log-probabilities (kept on the host for the later iterations)
            old = share.logp.detach()
            rollouts.old_logp = old.cpu() if o.num_iterations > 1 else None
        else:  # the same rows and split as the first iteration: the kept share is this rank's
            old = rollouts.old_logp.to(device)
        terms = policy_loss(
            self.loss_options, share.logp.flatten(), old.flatten(), slot_advantage.flatten(), sequence_ids.flatten(),
            len(sequences), rollout_logp=rollout_logp.flatten(), ref_logp=None if ref is None else ref.flatten(),
            sequence_sum=share.sum,
        )  # fmt: skip
        values = self._values(share, terms, rollouts, sequence_ids, rollout_logp)
        return MicroBatch(share.sum(terms.numerator), values, int(rows_on["labels"].numel()))

    def _values(self, share, terms, rollouts: Rollouts, sequence_ids, rollout_logp) -> torch.Tensor:
        """float64 [len(SUMS) + 3 F] of the micro-batch: token counts summed over the cp group (whole rows), the
        rollouts' reward and length sums (the same on every cp rank; a later iteration of mu logs the rewards of
        the rollouts it trains on again)."""
        device = share.logp.device

        def f64(value) -> torch.Tensor:
            return torch.as_tensor(value, dtype=torch.float64, device=device)

        completion = sequence_ids >= 0
        diff = (share.logp.detach() - rollout_logp).abs().double()
        diff = torch.where(completion & torch.isfinite(diff), diff, 0)
        routing = share.routing
        token_parts = {
            "tokens": terms.tokens, "nonfinite": terms.nonfinite, "clip_low": terms.clip_low,
            "clip_high": terms.clip_high, "kl": terms.kl_sum, "numerator": terms.numerator.detach(),
            "logprob_diff": diff.sum(), "logprob_diff_tokens": completion.sum(),
            **{f"route_{k}": getattr(routing, k) if routing is not None else 0 for k in ("agreed", "compared", "fallbacks")},
        }  # fmt: skip
        values = dict(zip(token_parts, share.sum(torch.stack([f64(v) for v in token_parts.values()]))))
        values["sequences"] = f64(terms.sequences)  # counted from whole sequences: the same on every cp rank
        values["denominator"] = self._denominator(values["tokens"], values["sequences"], len(rollouts.advantages))
        self._note_max(1, float(diff.max()) if diff.numel() else 0.0)  # this rank's share of the rows
        stats = rollouts.stats.to(device)
        rollout_names = ("completions", "reward", "reward_sq", "advantage_sq", "completion_length", "truncated")
        values.update(zip(rollout_names, stats[: len(rollout_names)]))
        return torch.cat([torch.stack([values[name] for name in SUMS]), stats[len(rollout_names) :]])

    def _denominator(self, tokens: torch.Tensor, sequences: torch.Tensor, completions: int) -> torch.Tensor:
        """What the step's numerators are divided by, per loss type (policy_loss's docstring)."""
        kind = self.options.loss_type
        if kind == "dapo":
            return tokens
        if kind == "grpo":
            return sequences
        return tokens.new_tensor(float(completions * self.options.max_new_tokens))

    def _note_max(self, index: int, value: float) -> None:
        if self._maxes is None:
            self._maxes = torch.zeros(len(MAXES), dtype=torch.float64)
        self._maxes[index] = max(float(self._maxes[index]), value)

    def reduce(self, sums: torch.Tensor, group=None, over_ranks: bool = True) -> StepResult:
        """Sum over the data-parallel ranks (and the maxima's max); the step's logged values and a gradient factor
        of accumulate_grad_batches x ranks / the loss type's denominator."""
        maxes = (self._maxes if self._maxes is not None else torch.zeros(len(MAXES), dtype=torch.float64)).to(
            sums.device
        )
        self._maxes, self._calls = None, 0
        if over_ranks:
            torch.distributed.all_reduce(sums, group=group)
            torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)
        values = dict(zip(SUMS, sums.tolist()))
        denominator = int(round(values["denominator"]))
        logged = self.means(values, sums.tolist()[len(SUMS) :], dict(zip(MAXES, maxes.tolist())))
        return StepResult(denominator, logged, 1, denominator)

    def means(self, values: dict, per_function: list[float], maxes: dict) -> dict[str, float]:
        def mean_std(total: float, squares: float, n: float) -> tuple[float, float]:
            if n <= 0:
                return 0.0, 0.0
            mean = total / n
            return mean, math.sqrt(max(squares / n - mean * mean, 0.0) * n / max(n - 1, 1))

        n = values["completions"]
        logged = {"train/loss": values["numerator"] / max(values["denominator"], 1)}
        if n > 0:
            logged["train/reward"], logged["train/reward_std"] = mean_std(values["reward"], values["reward_sq"], n)
            logged["train/advantage_std"] = math.sqrt(values["advantage_sq"] / max(n - 1, 1))
            logged["train/completion_length"] = values["completion_length"] / n
            logged["rl/completion_length_max"] = maxes["completion_length_max"]
            logged["rl/truncated_fraction"] = values["truncated"] / n
            for f, name in enumerate(self.names):
                total, squares, count = per_function[3 * f : 3 * f + 3]
                logged[f"train/reward/{name}"], logged[f"train/reward_std/{name}"] = mean_std(total, squares, count)
            if values["logprob_diff_tokens"] > 0:
                logged["rl/logprob_diff_mean"] = values["logprob_diff"] / values["logprob_diff_tokens"]
                logged["rl/logprob_diff_max"] = maxes["logprob_diff_max"]
        tokens = max(values["tokens"], 1)
        logged["rl/clip_low"], logged["rl/clip_high"] = values["clip_low"] / tokens, values["clip_high"] / tokens
        if self.options.beta > 0:
            logged["train/kl"] = values["kl"] / tokens
        if values["route_compared"] > 0:
            logged["rl/route_agreement"] = values["route_agreed"] / values["route_compared"]
        logged["rl/route_fallbacks"] = values["route_fallbacks"]
        logged["rl/nonfinite_tokens"] = values["nonfinite"]
        return logged

    # ----------------------------------------------------------------------------- validation
    def validation(self, model: Step35ForCausalLM, batch: dict) -> dict[str, tuple[torch.Tensor, int]]:
        """val/reward (and per function): the mean reward of one completion per prompt, drawn with a seed fixed
        for the run (the same draws at every validation, so the curve compares the policy alone)."""
        prompts = self._prompts(batch)
        groups = self._generate(model, prompts, -1, 1)
        _, _, scores = self._score(batch, groups)
        n = scores.total.numel()
        out = {"val/reward": (scores.total.mean().float(), n)}
        for f, name in enumerate(self.names):
            applicable = scores.applicable[f]
            count = int(applicable.sum())
            if count:
                out[f"val/reward/{name}"] = (scores.per_function[f][applicable].mean().float(), count)
        return out
