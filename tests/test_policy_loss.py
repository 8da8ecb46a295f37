"""The RL policy loss (step35/training/policy_loss.py) against an independent float64 computation written here
from the formulas (loops over sequences and tokens, one scalar at a time): the step loss and its gradient with
respect to logp for every loss_type x importance_sampling_level, with tokens clipped on both sides, truncated
importance sampling, the k3 KL term and non-finite tokens planted; the ratio at iteration 1; context
parallelism simulated by two threads that each hold half of every sequence and exchange per-sequence tensors
through a differentiable two-rank sum; the advantages against hand numbers; the option refusals.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from step35.training.policy_loss import (
    PolicyLossOptions,
    batch_moments,
    batch_std_of,
    group_advantages,
    policy_loss,
)

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
LEVELS = ("token", "sequence")
EXTRAS = {  # the optional terms switched on
    "plain": {},
    "tis": {"tis_cap": 1.1},
    "kl": {"beta": 0.05},
    "tis+kl": {"tis_cap": 1.1, "beta": 0.05},
}
MAX_LEN = 12
RTOL = 1e-10


# -------------------------------------------------------------------------------------------------- the data
def make_case(seed: int = 0) -> dict:
    """Float64 token tensors of 6 completions with prompt tokens between them. Per sequence: a log-ratio offset
    and an advantage chosen so that sequence 0 is clipped high (ratio ~ e^0.5, A > 0), sequence 1 clipped low
    (ratio ~ e^-0.45, A < 0), sequence 2 unclipped (A > 0), sequence 3 above the range with A < 0 (unclipped: the
    min takes the unclipped side), sequence 4 has only non-finite tokens, sequence 5 has A = 0 and
    ratio ~ e^-0.4 (below the range, not clipped: no gradient to remove). Non-finite values
    are planted in logp, old_logp, rollout_logp and ref_logp of single tokens, and in prompt tokens' logp."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 9, 5, 8, 3, 4]
    offsets = [0.5, -0.45, 0.05, 0.3, 0.0, -0.4]
    advantage = [1.3, -0.8, 0.6, -1.1, 0.9, 0.0]
    ids, adv, shift = [], [], []
    for i, n in enumerate(lengths):
        ids += [-1] * (1 + i % 3) + [i] * n  # a prompt (or padding) before each completion
        adv += [0.0] * (1 + i % 3) + [advantage[i]] * n
        shift += [0.0] * (1 + i % 3) + [offsets[i]] * n
    N = len(ids)
    logp = -torch.rand(N, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp - torch.tensor(shift, dtype=torch.float64) + 0.08 * torch.randn(N, generator=g, dtype=torch.float64)
    rollout = old + 0.15 * torch.randn(N, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    sequence_ids = torch.tensor(ids)
    where = [int(j) for j in (sequence_ids >= 0).nonzero()]
    logp[where[2]] = -math.inf  # sequence 0
    old[where[9]] = math.nan  # sequence 1
    rollout[where[20]] = math.inf  # sequence 2
    ref[where[25]] = math.nan  # sequence 3
    seq4 = [j for j in range(N) if ids[j] == 4]
    logp[seq4[0]], old[seq4[1]], logp[seq4[2]] = math.nan, -math.inf, math.inf
    prompts = [j for j in range(N) if ids[j] < 0]
    logp[prompts[0]], logp[prompts[1]], old[prompts[2]] = math.nan, -math.inf, math.nan
    adv_t = torch.tensor(adv, dtype=torch.float64)
    return dict(
        logp=logp, old_logp=old, rollout_logp=rollout, ref_logp=ref, advantages=adv_t, sequence_ids=sequence_ids
    )


def options_of(loss_type: str, level: str, extra: str) -> PolicyLossOptions:
    return PolicyLossOptions(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=MAX_LEN,
        **EXTRAS[extra],
    )


# ------------------------------------------------------------------------------ the independent computation
def reference_loss(options: PolicyLossOptions, case: dict, num_sequences: int, logp: torch.Tensor) -> dict:
    """The step loss of one call (0-d, differentiable in the leaf `logp`) and the logged sums, from the module
    docstring's formulas, one token at a time."""
    old, adv, ids = case["old_logp"].tolist(), case["advantages"].tolist(), case["sequence_ids"].tolist()
    rollout = case["rollout_logp"].tolist() if options.tis_cap is not None else None
    ref = case["ref_logp"].tolist() if options.beta > 0 else None
    lo, hi = 1 - options.epsilon, 1 + (options.epsilon_high or options.epsilon)

    def is_valid(t: int) -> bool:
        values = [float(logp.detach()[t]), old[t]] + [x[t] for x in (rollout, ref) if x is not None]
        return ids[t] >= 0 and all(math.isfinite(v) for v in values)

    tokens = {i: [t for t in range(len(ids)) if ids[t] == i and is_valid(t)] for i in range(num_sequences)}
    out = dict(tokens=0, nonfinite=sum(1 for t in range(len(ids)) if ids[t] >= 0 and not is_valid(t)))
    out.update(clip_low=0, clip_high=0, kl_sum=0.0, ratio_sum=0.0, sequences=0)
    total, per_sequence_means = 0, []
    for toks in tokens.values():
        if not toks:
            continue
        n, sequence_total = len(toks), 0
        mean_log_ratio = sum(logp[t] - old[t] for t in toks) / n
        for t in toks:
            r = (
                torch.exp(logp[t] - old[t])
                if options.importance_sampling_level == "token"
                else torch.exp(mean_log_ratio)
            )
            a, rv = adv[t], r.item()
            r_clipped = r if lo <= rv <= hi else torch.tensor(lo if rv < lo else hi, dtype=torch.float64)
            unclipped, clipped = r * a, r_clipped * a
            l = -(unclipped if unclipped.item() <= clipped.item() else clipped)
            if rollout is not None:
                l = l * min(math.exp(old[t] - rollout[t]), options.tis_cap)
            if ref is not None:
                d = ref[t] - logp[t]
                k3 = torch.exp(d) - d - 1
                l = l + options.beta * k3
                out["kl_sum"] += k3.item()
            out["clip_low"] += int(rv < lo and a < 0)
            out["clip_high"] += int(rv > hi and a > 0)
            out["ratio_sum"] += rv
            sequence_total = sequence_total + l
        total = total + sequence_total
        per_sequence_means.append(sequence_total / n)
        out["tokens"] += n
        out["sequences"] += 1
    if options.loss_type == "dapo":
        out["loss"] = total / out["tokens"]
    elif options.loss_type == "grpo":
        out["loss"] = sum(per_sequence_means) / len(per_sequence_means)
    else:
        out["loss"] = total / (num_sequences * options.max_completion_length)
    return out


def module_loss(options: PolicyLossOptions, case: dict, num_sequences: int, logp: torch.Tensor, **kw):
    """(terms, the step loss) of one policy_loss call on `case` with the leaf `logp`."""
    extra = {}
    if options.tis_cap is not None:
        extra["rollout_logp"] = case["rollout_logp"]
    if options.beta > 0:
        extra["ref_logp"] = case["ref_logp"]
    terms = policy_loss(
        options, logp, case["old_logp"], case["advantages"], case["sequence_ids"], num_sequences, **extra, **kw
    )
    return terms, terms.numerator / terms.denominator


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> bool:
    return torch.allclose(a, b, rtol=rtol, atol=rtol * max(float(b.abs().max()), 1e-3))


# -------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_match_the_float64_reference(loss_type, level, extra):
    case, options, S = make_case(), options_of(loss_type, level, extra), 6
    logp = case["logp"].clone().requires_grad_()
    terms, loss = module_loss(options, case, S, logp)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = case["logp"].clone().requires_grad_()
    expected = reference_loss(options, case, S, ref_logp)
    (expected_grad,) = torch.autograd.grad(expected["loss"], ref_logp)

    assert torch.isfinite(grad).all()
    assert close(loss.detach(), expected["loss"].detach()), (float(loss), float(expected["loss"]))
    assert close(grad, expected_grad), (grad - expected_grad).abs().max()
    for name in ("tokens", "nonfinite", "clip_low", "clip_high", "sequences"):
        assert float(getattr(terms, name)) == expected[name], name
    for name in ("kl_sum", "ratio_sum"):
        assert math.isclose(float(getattr(terms, name)), expected[name], rel_tol=RTOL, abs_tol=1e-14), name
    # the case exercises what it claims: non-finite tokens left out, both clips, a sequence without valid tokens
    assert expected["nonfinite"] == 5 + (1 if options.tis_cap else 0) + (1 if options.beta else 0)
    assert expected["clip_low"] > 0 and expected["clip_high"] > 0 and expected["sequences"] == 5
    assert terms.denominator.dtype == torch.int64
    assert terms.denominator_counts_sequences == (loss_type != "dapo")
    assert (grad[case["sequence_ids"] < 0] == 0).all()


def test_float32_logp_follows_the_float64_result():
    options, case = options_of("grpo", "sequence", "tis+kl"), make_case(1)
    logp64 = case["logp"].clone().requires_grad_()
    _, loss64 = module_loss(options, case, 6, logp64)
    (grad64,) = torch.autograd.grad(loss64, logp64)
    logp32 = case["logp"].float().requires_grad_()
    terms, loss32 = module_loss(options, case, 6, logp32)
    (grad32,) = torch.autograd.grad(loss32, logp32)
    assert terms.numerator.dtype == torch.float32
    assert close(loss32.double().detach(), loss64.detach(), rtol=1e-5)
    assert close(grad32.double(), grad64, rtol=1e-4)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_first_iteration_ratio_is_exactly_one(loss_type, level):
    case = make_case(2)
    logp = case["logp"].clone().requires_grad_()
    case["old_logp"] = logp.detach().clone()
    terms, loss = module_loss(PolicyLossOptions(loss_type, level, max_completion_length=MAX_LEN), case, 6, logp)
    assert float(terms.ratio_sum) == float(terms.tokens) > 0
    assert float(terms.clip_low) == float(terms.clip_high) == 0
    # at ratio 1 (inside the clip range) l_t = -A_t: every valid token with A != 0 has a gradient
    (grad,) = torch.autograd.grad(loss, logp)
    valid = torch.isfinite(case["logp"]) & (case["sequence_ids"] >= 0)
    if loss_type == "dapo":
        assert loss.item() == pytest.approx(-float((case["advantages"] * valid).sum() / valid.sum()), rel=1e-12)
    assert ((grad != 0) == (valid & (case["advantages"] != 0))).all()


# ----------------------------------------------------------------------------------- context parallelism, simulated
class TwoRanks:
    """A two-rank sum for `sequence_sum`, in one process: each rank's thread deposits its tensor, waits for the
    other, and gets t_0 + t_1, a node of the one autograd graph, so a backward from both ranks' losses sends each
    rank's tensor the sum of both outputs' gradients, as an autograd all-reduce does. `detach_other` gives the
    wrong collective (the other rank's value without its gradient), which the test must catch."""

    def __init__(self, detach_other: bool = False):
        self.detach_other = detach_other
        self.barrier = threading.Barrier(2, timeout=20)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.calls = [0, 0]

    def sequence_sum(self, rank: int):
        def add(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t
            self.barrier.wait()
            other = self.slots[1 - rank]
            out = t + (other.detach() if self.detach_other else other)
            self.barrier.wait()  # neither rank overwrites its slot before the other has read it
            self.calls[rank] += 1
            return out

        return add


def split_tokens(case: dict) -> list[torch.Tensor]:
    """Two ranks' token positions: sequence i's first k_i tokens on rank 0, the rest on rank 1, with k_i of
    every kind: none (sequence 1 all on rank 1), all (sequence 2 all on rank 0), a rank holding only a
    sequence's non-finite tokens (sequence 4), unequal halves. Prompt tokens alternate between the ranks."""
    ids = case["sequence_ids"].tolist()
    first = {0: 3, 1: 0, 2: 5, 3: 6, 4: 1, 5: 2}
    seen, rank0 = {}, []
    for t, i in enumerate(ids):
        if i < 0:
            if t % 2 == 0:
                rank0.append(t)
            continue
        seen[i] = seen.get(i, 0) + 1
        if seen[i] <= first[i]:
            rank0.append(t)
    rank1 = [t for t in range(len(ids)) if t not in set(rank0)]
    return [torch.tensor(rank0), torch.tensor(rank1)]


def cp_step(options: PolicyLossOptions, case: dict, logp: torch.Tensor, collective: TwoRanks):
    """Both ranks' PolicyLossTerms on their shares of `case`, run side by side (the shares index the one leaf)."""
    shares = split_tokens(case)

    def rank_terms(rank: int):
        share = {k: v[shares[rank]] for k, v in case.items()}
        return module_loss(options, share, 6, logp[shares[rank]], sequence_sum=collective.sequence_sum(rank))[0]

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(rank_terms, r) for r in (0, 1)]
        return [f.result() for f in futures]


def cp_loss(options: PolicyLossOptions, terms) -> torch.Tensor:
    """The step loss as the cp caller forms it: the numerators summed; a sequence-counting denominator taken
    from cp rank 0 only, a token-counting one summed."""
    numerator = terms[0].numerator + terms[1].numerator
    if terms[0].denominator_counts_sequences:
        assert int(terms[0].denominator) == int(terms[1].denominator)
        return numerator / terms[0].denominator
    return numerator / (terms[0].denominator + terms[1].denominator)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_context_parallel_shares_give_the_whole_sequences_result(loss_type, level):
    case, options = make_case(3), options_of(loss_type, level, "tis+kl")
    whole_logp = case["logp"].clone().requires_grad_()
    whole, whole_loss = module_loss(options, case, 6, whole_logp)
    (whole_grad,) = torch.autograd.grad(whole_loss, whole_logp)

    logp = case["logp"].clone().requires_grad_()
    collective = TwoRanks()
    terms = cp_step(options, case, logp, collective)
    loss = cp_loss(options, terms)
    (grad,) = torch.autograd.grad(loss, logp)
    assert collective.calls == [1 if level == "token" else 2] * 2
    assert close(loss.detach(), whole_loss.detach(), rtol=1e-12)
    assert close(grad, whole_grad, rtol=1e-12), (grad - whole_grad).abs().max()
    for name in ("tokens", "nonfinite", "clip_low", "clip_high", "kl_sum", "ratio_sum"):  # shares add up
        assert math.isclose(
            float(getattr(terms[0], name) + getattr(terms[1], name)), float(getattr(whole, name)), rel_tol=1e-12
        )
    assert float(terms[0].sequences) == float(terms[1].sequences) == float(whole.sequences)  # counted per group

    # the simulation can fail: without the exchange, or with the other rank's value detached, it differs
    if loss_type == "grpo" or level == "sequence":
        local = [module_loss(options, {k: v[s] for k, v in case.items()}, 6, logp[s])[0] for s in split_tokens(case)]
        assert not close(cp_loss(options, local).detach(), whole_loss.detach(), rtol=1e-6)
    if level == "sequence":
        wrong = cp_loss(options, cp_step(options, case, logp, TwoRanks(detach_other=True)))
        assert close(wrong.detach(), whole_loss.detach(), rtol=1e-12)  # same value ...
        (wrong_grad,) = torch.autograd.grad(wrong, logp)
        assert not close(wrong_grad, whole_grad, rtol=1e-6)  # ... but the gradient misses the other rank's half


# ------------------------------------------------------------------------------------------------ advantages
def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 0.0, 2.0, 5.0], dtype=torch.float64)
    eps = 1e-4
    centred = [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -7 / 3, -1 / 3, 8 / 3]
    # group stds (n - 1): 1, 0 and sqrt(((7/3)^2 + (1/3)^2 + (8/3)^2) / 2) = sqrt(57/9)
    stds = [1.0] * 3 + [0.0] * 3 + [math.sqrt(57 / 9)] * 3
    got = group_advantages(rewards, 3, "group", eps)
    assert torch.allclose(got, torch.tensor([c / (s + eps) for c, s in zip(centred, stds)], dtype=torch.float64))
    assert torch.allclose(group_advantages(rewards, 3, "none"), torch.tensor(centred, dtype=torch.float64))
    # the whole batch's std: mean 25/9, sum of squares 91, so var = (91 - 625/9) / 8
    batch_std = math.sqrt((91 - 625 / 9) / 8)
    expected = torch.tensor([c / (batch_std + eps) for c in centred], dtype=torch.float64)
    assert torch.allclose(group_advantages(rewards, 3, "batch", eps), expected)
    given = torch.tensor(2.0, dtype=torch.float64)
    expected = torch.tensor([c / (2.0 + eps) for c in centred], dtype=torch.float64)
    assert torch.allclose(group_advantages(rewards, 3, "batch", eps, batch_std=given), expected)
    for scale in ("group", "batch", "none"):
        assert (group_advantages(rewards, 1, scale) == 0).all()


def test_batch_std_of_summed_moments_is_torch_std():
    rewards = torch.randn(37, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3 + 5
    moments = sum(batch_moments(part) for part in rewards.split([10, 20, 7]))  # the ranks' all-reduce
    assert float(moments[0]) == 37
    assert math.isclose(float(batch_std_of(*moments)), float(rewards.std()), rel_tol=1e-12)
    assert math.isclose(float(batch_std_of(2, 1.0 + 3.0, 1.0 + 9.0)), math.sqrt(2), rel_tol=1e-12)
    assert float(batch_std_of(1, 3.0, 9.0)) == 0 and float(batch_std_of(0, 0.0, 0.0)) == 0


def test_bad_advantage_arguments_refused():
    rewards = torch.zeros(6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"model\.rl\.scale_rewards='grouped'"):
        group_advantages(rewards, 3, "grouped")
    with pytest.raises(ValueError, match=r"model\.rl\.num_generations=4"):
        group_advantages(rewards, 4, "group")
    with pytest.raises(ValueError, match=r"model\.rl\.num_generations=0"):
        group_advantages(rewards, 0, "group")


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "field, value",
    [
        ("loss_type", "ppo"),
        ("importance_sampling_level", "sentence"),
        ("epsilon", 0.0),
        ("epsilon", 1.0),
        ("epsilon", math.nan),
        ("epsilon_high", 0.0),
        ("epsilon_high", -0.1),
        ("beta", -0.1),
        ("beta", math.inf),
        ("tis_cap", 0.0),
        ("max_completion_length", 0),
        ("max_completion_length", 2.5),
    ],
)
def test_bad_options_refused_naming_the_field(field, value):
    options = PolicyLossOptions(**{"max_completion_length": MAX_LEN, field: value})
    with pytest.raises(ValueError, match=rf"model\.rl\.{field}="):
        options.check()


def test_dr_grpo_needs_max_completion_length_and_inputs_are_checked():
    with pytest.raises(ValueError, match=r"model\.rl\.max_completion_length=None"):
        PolicyLossOptions(loss_type="dr_grpo").check()
    PolicyLossOptions().check()  # the defaults are good
    case = make_case()
    args = (case["logp"], case["old_logp"], case["advantages"], case["sequence_ids"], 6)
    with pytest.raises(ValueError, match=r"model\.rl\.tis_cap=1\.1 needs rollout_logp"):
        policy_loss(PolicyLossOptions(tis_cap=1.1), *args)
    with pytest.raises(ValueError, match=r"model\.rl\.beta=0\.1 needs ref_logp"):
        policy_loss(PolicyLossOptions(beta=0.1), *args)
    with pytest.raises(ValueError, match=r"policy_loss: old_logp \(5,\) must be flat"):
        policy_loss(PolicyLossOptions(), case["logp"], case["old_logp"][:5], *args[2:])
    with pytest.raises(ValueError, match=r"sequence_ids \(torch.int32\) int64"):
        policy_loss(PolicyLossOptions(), *args[:3], case["sequence_ids"].int(), 6)
