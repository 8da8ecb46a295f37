"""The policy-gradient math of online RL (`model.objective: grpo`): group-relative advantages and the clipped
surrogate loss over per-token tensors, in the GRPO (Shao et al., 2024), DAPO (Yu et al., 2025), Dr. GRPO (Liu
et al., 2025) and GSPO (Zheng et al., 2025) variants. Pure tensor code: no model, no Lightning, no process
group; the objective (rollouts, log-probabilities, the step's reduction) calls it.

Advantages (`group_advantages`): the completions of a prompt are G consecutive rewards; A = r - mean of its
group, divided by the group's std (`scale_rewards: group`), by the whole global batch's std (`batch`; the
caller sums `batch_moments` over the ranks and passes `batch_std_of` them) or by nothing (`none`, Dr. GRPO).
Stds are unbiased (n - 1); eps keeps the division finite for a group of equal rewards (whose A is 0).

Per completion token t of sequence i (`policy_loss`), with log_ratio_t = logp_t - old_logp_t:
- ratio_t = exp(log_ratio_t) (`importance_sampling_level: token`), or exp(s_i) for every token of i with
  s_i = mean over i's valid tokens of log_ratio_t (`sequence`, GSPO; the gradient flows through s_i);
- l_t = -min(ratio_t A_i, clamp(ratio_t, 1 - epsilon, 1 + epsilon_high) A_i);
- times min(exp(old_logp_t - rollout_logp_t), tis_cap), detached, when tis_cap is set (truncated importance
  sampling: the rollout engine sampled from a slightly different distribution than the trainer's pi_old);
- plus beta k3_t, k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (Schulman's unbiased KL estimator),
  when beta > 0.
A token is valid when it is a completion token (sequence_ids >= 0) and logp, old_logp and the given ones of
rollout_logp and ref_logp are finite there; the other completion tokens are counted in `nonfinite` and take
part in no sum and no denominator (their inputs are replaced by 0 before any arithmetic, so no inf or NaN
reaches the loss or the gradient).

The step's loss, over every micro-batch and rank of an optimizer step:
- `dapo`: sum of l_t over the valid tokens / the number of valid tokens;
- `grpo`: mean over the sequences with a valid token of (sum of their l_t / n_i), n_i their valid tokens;
- `dr_grpo`: sum of l_t / (num_sequences x max_completion_length), every sequence counted.
A micro-batch cannot divide by the step's total (later micro-batches are not computed yet), so `policy_loss`
returns the micro-batch's `numerator` (to backpropagate) and its `denominator`; the caller backpropagates each
micro-batch's numerator and divides the step's gradient by the step's summed denominators.

Context parallelism: under cp each rank holds a share of every sequence's tokens. The per-sequence quantities
(n_i; for `sequence` level the summed log-ratio) go through the caller's `sequence_sum`, which adds a
[num_sequences] tensor over the cp group, differentiably (an all-reduce whose backward all-reduces the
gradients, e.g. torch.distributed.nn.functional.all_reduce); it is called once at token level and twice at
sequence level, in the same order on every rank. Everything else stays the rank's share: the numerators and
the token counts add up over the cp ranks to those of the whole sequences. The sequence counts do not: see
PolicyLossTerms.denominator_counts_sequences.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from step35.training.options import check_rules

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")


# ------------------------------------------------------------------------------------------------ advantages
def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale: str,
    eps: float = 1e-4,
    batch_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [P * G] of `rewards` [P * G] (the G = `num_generations` completions of a prompt consecutive):
    r minus its group's mean, divided by (its group's std + eps) for `scale` group, by (`batch_std` + eps) for
    batch (None: the std of `rewards` themselves, right only without data parallelism), undivided for none.
    A group of one completion has A = 0."""
    if scale not in SCALES:
        raise ValueError(f"model.rl.scale_rewards={scale!r}: must be one of {list(SCALES)}")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"model.rl.num_generations={num_generations!r}: must be an integer >= 1")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"group_advantages: rewards {tuple(rewards.shape)} must be 1-D with a multiple of "
            f"model.rl.num_generations={num_generations} elements (G completions per prompt, consecutive)"
        )
    if num_generations == 1:
        return torch.zeros_like(rewards)
    groups = rewards.view(-1, num_generations)  # [P, G]
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "group":
        std = groups.std(dim=1).repeat_interleave(num_generations)
    elif scale == "batch":
        std = rewards.std() if batch_std is None else batch_std.to(rewards.dtype)
    else:
        return centred
    return centred / (std + eps)


def batch_moments(rewards: torch.Tensor) -> torch.Tensor:
    """[count, sum r, sum r^2] (float64) of this rank's rewards: all-reduce (sum) them, then `batch_std_of`."""
    r = rewards.detach().double()
    return torch.stack(
        [torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device), r.sum(), r.square().sum()]
    )


def batch_std_of(count, total, total_sq) -> torch.Tensor:
    """The unbiased std (float64 scalar) of values with `count` elements, sum `total` and sum of squares
    `total_sq` (tensors or numbers); 0 for fewer than 2 values (where torch.std gives NaN)."""
    n, s, sq = (torch.as_tensor(v, dtype=torch.float64) for v in (count, total, total_sq))
    var = (sq - s * s / n.clamp(min=1)) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.clamp(min=0).sqrt(), torch.zeros_like(var))  # clamp: rounding below 0


# --------------------------------------------------------------------------------------------------- options
def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class PolicyLossOptions:
    """The loss's options (`model.rl.<field>`).

    Args:
        loss_type: how the step's token losses are averaged: grpo (per sequence, then over sequences), dapo (over
            the step's tokens) or dr_grpo (summed, over num_sequences x max_completion_length).
        importance_sampling_level: token (a ratio per token) or sequence (GSPO: the exp of the sequence's mean
            log-ratio, for each of its tokens).
        epsilon: the clip range's lower half: ratios below 1 - epsilon are clipped; in (0, 1).
        epsilon_high: its upper half (DAPO's clip-higher); None: epsilon. > 0.
        beta: the weight of the k3 KL estimate against the reference policy; >= 0 (0: no reference needed).
        tis_cap: the cap of the truncated importance weight exp(old_logp - rollout_logp); None: no weight.
        max_completion_length: the rollouts' completion length limit, dr_grpo's constant denominator; needed for
            dr_grpo.
    """

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    tis_cap: float | None = None
    max_completion_length: int | None = None

    @property
    def upper_epsilon(self) -> float:
        """epsilon_high, or epsilon where it is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check(self) -> None:
        """Refuse a bad value naming model.rl.<field>."""

        def length(v) -> bool:
            if v is None:
                return self.loss_type != "dr_grpo"
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        check_rules(
            {
                "rl.loss_type": (self.loss_type, lambda v: v in LOSS_TYPES, f"one of {list(LOSS_TYPES)}"),
                "rl.importance_sampling_level": (
                    self.importance_sampling_level,
                    lambda v: v in LEVELS,
                    f"one of {list(LEVELS)}",
                ),
                "rl.epsilon": (self.epsilon, lambda v: _real(v) and 0 < v < 1, "a number in (0, 1)"),
                "rl.epsilon_high": (
                    self.epsilon_high,
                    lambda v: v is None or (_real(v) and v > 0),
                    "a number > 0 or null",
                ),
                "rl.beta": (self.beta, lambda v: _real(v) and v >= 0, "a finite number >= 0"),
                "rl.tis_cap": (self.tis_cap, lambda v: v is None or (_real(v) and v > 0), "a number > 0 or null"),
                "rl.max_completion_length": (
                    self.max_completion_length,
                    length,
                    "an integer >= 1 (null only when model.rl.loss_type is not dr_grpo, which divides by it)",
                ),
            }
        )


# ------------------------------------------------------------------------------------------------------ loss
@dataclass
class PolicyLossTerms:
    """What `policy_loss` gives for one micro-batch (on one cp rank).

    numerator: scalar with grad, this micro-batch's (and cp rank's) share of the step loss's numerator.
    denominator: int64 scalar: dapo its valid tokens, grpo its sequences with a valid token, dr_grpo
        num_sequences x max_completion_length.
    denominator_counts_sequences: True for grpo and dr_grpo. Then, under cp, every cp rank holding shares of the
        same sequences returns the same denominator (it counts whole sequences): the caller adds it once per cp
        group, e.g. multiplies it by (cp_rank == 0) before summing the step's denominators over all ranks. False
        (dapo): it is this rank's share of the tokens, and every rank adds its own.
    The float64 detached sums for logging are this rank's shares (they add up over cp ranks), except `sequences`,
    which, like a sequence-counting denominator, is the same on every cp rank of a group:
    tokens (valid), nonfinite (completion tokens left out), clip_low, clip_high (tokens clipped, see
    `clip_indicators`), kl_sum (k3 over the valid tokens; 0 when beta = 0), ratio_sum (ratio_t over the valid
    tokens), sequences (those with a valid token).
    """

    numerator: torch.Tensor
    denominator: torch.Tensor
    denominator_counts_sequences: bool
    tokens: torch.Tensor
    nonfinite: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    kl_sum: torch.Tensor
    ratio_sum: torch.Tensor
    sequences: torch.Tensor

    def loss(self) -> torch.Tensor:
        """numerator / denominator: the step loss when this micro-batch is the whole step on one rank."""
        return self.numerator / self.denominator.clamp(min=1)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _check_inputs(options: PolicyLossOptions, tokens: dict[str, torch.Tensor | None], num_sequences: int) -> None:
    shape = tokens["logp"].shape
    for name, t in tokens.items():
        if t is not None and (t.dim() != 1 or t.shape != shape):
            raise ValueError(f"policy_loss: {name} {tuple(t.shape)} must be flat [N] like logp {tuple(shape)}")
    if not tokens["logp"].is_floating_point() or tokens["sequence_ids"].dtype != torch.int64:
        raise ValueError(
            f"policy_loss: logp ({tokens['logp'].dtype}) must be floating and sequence_ids "
            f"({tokens['sequence_ids'].dtype}) int64"
        )
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 0:
        raise ValueError(f"policy_loss: num_sequences={num_sequences!r} must be an integer >= 0")
    if options.tis_cap is not None and tokens["rollout_logp"] is None:
        raise ValueError(
            f"policy_loss: model.rl.tis_cap={options.tis_cap} needs rollout_logp (the sampler's log-probs)"
        )
    if options.beta > 0 and tokens["ref_logp"] is None:
        raise ValueError(f"policy_loss: model.rl.beta={options.beta} needs ref_logp (the reference's log-probs)")


def _per_sequence(values: torch.Tensor, index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """[num_sequences]: `values` [N] summed per sequence (`index` [N], in range)."""
    return values.new_zeros(num_sequences).index_add(0, index, values)


def clip_indicators(
    ratio: torch.Tensor, advantages: torch.Tensor, options: PolicyLossOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) [N] bool: the tokens whose gradient the clip removes, ratio < 1 - epsilon with A < 0 and
    ratio > 1 + epsilon_high with A > 0."""
    ratio = ratio.detach()
    low = (ratio < 1 - options.epsilon) & (advantages < 0)
    high = (ratio > 1 + options.upper_epsilon) & (advantages > 0)
    return low, high


def _ratio(
    options: PolicyLossOptions,
    log_ratio: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    count: torch.Tensor,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """ratio_t [N]: exp(log_ratio_t) at token level; exp(s_i) of the token's sequence at sequence level."""
    if options.importance_sampling_level == "token":
        return torch.exp(log_ratio)
    summed = sequence_sum(_per_sequence(log_ratio * weight, index, count.numel()))
    return torch.exp((summed / count.clamp(min=1))[index])


def _token_losses(
    options: PolicyLossOptions,
    ratio: torch.Tensor,
    A: torch.Tensor,
    lp: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor | None,
    ref: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(l_t [N], k3_t [N] or None without beta) from finite inputs (the invalid tokens' zeroed)."""
    clipped = ratio.clamp(1 - options.epsilon, 1 + options.upper_epsilon)
    loss = -torch.minimum(ratio * A, clipped * A)
    if options.tis_cap is not None:
        loss = loss * torch.exp(old - rollout).clamp(max=options.tis_cap)  # inputs detached: a constant weight
    if options.beta == 0:
        return loss, None
    diff = ref - lp
    k3 = torch.exp(diff) - diff - 1
    return loss + options.beta * k3, k3


def _aggregate(
    options: PolicyLossOptions, loss: torch.Tensor, valid: torch.Tensor, count: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the micro-batch from its token losses [N] (0 on the invalid tokens)."""
    if options.loss_type == "dapo":
        return loss.sum(), valid.sum()
    if options.loss_type == "grpo":
        return (loss / count.clamp(min=1)[index]).sum(), (count > 0).sum()
    denominator = count.numel() * options.max_completion_length  # dr_grpo: every sequence, valid tokens or not
    return loss.sum(), torch.tensor(denominator, device=loss.device)


def policy_loss(
    options: PolicyLossOptions,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    sequence_ids: torch.Tensor,
    num_sequences: int,
    *,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> PolicyLossTerms:
    """This micro-batch's PolicyLossTerms (the formulas of this module's docstring). Flat [N] token tensors:
    `logp` (with grad) log pi_theta; `old_logp` log pi_old; `advantages` each token's sequence advantage;
    `sequence_ids` int64 the token's completion in [0, num_sequences), -1 for prompt and padding tokens;
    `rollout_logp` the sampler's log-probs (needed when tis_cap is set); `ref_logp` the reference's (needed when
    beta > 0). `sequence_sum` adds a [num_sequences] tensor over the cp group (identity without cp; see the
    module docstring). The computation runs in logp's dtype. No host sync."""
    options.check()
    inputs = dict(logp=logp, old_logp=old_logp, advantages=advantages, sequence_ids=sequence_ids)
    _check_inputs(options, {**inputs, "rollout_logp": rollout_logp, "ref_logp": ref_logp}, num_sequences)
    completion = sequence_ids >= 0
    valid = completion.clone()
    for t in (logp, old_logp, rollout_logp, ref_logp):
        if t is not None:
            valid &= torch.isfinite(t)

    def zeroed(t: torch.Tensor | None) -> torch.Tensor | None:  # the inputs without grad, invalid tokens at 0
        return None if t is None else torch.where(valid, t.detach().to(logp.dtype), 0)

    weight, index = valid.to(logp.dtype), torch.where(valid, sequence_ids, 0)
    count = sequence_sum(_per_sequence(weight, index, num_sequences))  # n_i, whole sequences
    lp = torch.where(valid, logp, 0)  # replaced before any arithmetic: no inf or NaN reaches a gradient
    old, A, rollout, ref = (zeroed(t) for t in (old_logp, advantages, rollout_logp, ref_logp))
    ratio = _ratio(options, lp - old, weight, index, count, sequence_sum)
    loss, k3 = _token_losses(options, ratio, A, lp, old, rollout, ref)
    numerator, denominator = _aggregate(options, loss * weight, valid, count, index)
    low, high = clip_indicators(ratio, A, options)
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    return PolicyLossTerms(
        numerator=numerator,
        denominator=denominator.to(torch.int64),
        denominator_counts_sequences=options.loss_type != "dapo",
        tokens=valid.sum().double(),
        nonfinite=(completion & ~valid).sum().double(),
        clip_low=(low & valid).sum().double(),
        clip_high=(high & valid).sum().double(),
        kl_sum=zero if k3 is None else (k3.detach() * weight).double().sum(),
        ratio_sum=(ratio.detach() * weight).double().sum(),
        sequences=(count > 0).sum().double(),
    )
