"""step35/eval/metrics.py and Step35ForCausalLM.draft_logits, against independent computations: pass@k
against math.comb and a brute-force count over all k-subsets; the quality gate on planted loops, cut and
empty answers and on clean ones; the draft logits against the MTP layers run by hand from the model's
submodules and against the MTP losses of `model.loss`; the acceptance counts against a hand count."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from step35.eval.metrics import (
    AcceptanceCount,
    GateThresholds,
    Sample,
    death_loop,
    gate_failures,
    mean_pass_at_k,
    mtp_acceptance,
    pass_at_k,
    quality_report,
)
from step35.model.transformer import DecoderLayer
from tests.helpers.models import tiny_config, tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 against fp32 computed in another order


# ================================================================================================ pass@k
def _comb_pass_at_k(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_comb_and_brute_force_on_a_grid():
    checked = 0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(_comb_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
                assert got == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
                checked += 1
    assert checked == sum(n * (n + 1) for n in range(1, 9))


@pytest.mark.parametrize("n,c,k", [(200, 13, 100), (1000, 1, 1), (10_000, 5000, 100), (500, 3, 250)])
def test_pass_at_k_is_stable_where_binomials_overflow_floats(n, c, k):
    assert math.comb(n, k) > 1e15 or k == 1
    assert pass_at_k(n, c, k) == pytest.approx(_comb_pass_at_k(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # 4 wrong samples cannot fill 5 draws
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)  # pass@1 = c / n
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert mean_pass_at_k([(4, 1), (4, 0), (4, 4)], k=1) == pytest.approx((0.25 + 0 + 1) / 3, abs=1e-15)
    assert mean_pass_at_k([(5, 2), (8, 3)], k=2) == pytest.approx(
        (_comb_pass_at_k(5, 2, 2) + _comb_pass_at_k(8, 3, 2)) / 2, abs=1e-12
    )


@pytest.mark.parametrize(
    "n,c,k,match",
    [
        (5, 2, 0, r"n >= k >= 1"),
        (5, 2, 6, r"n >= k >= 1"),
        (0, 0, 1, r"n >= k >= 1"),
        (5, 6, 1, r"0 <= c <= n"),
        (5, -1, 1, r"0 <= c <= n"),
        (5.0, 2, 1, r"n must be an int"),
        (5, True, 1, r"c must be an int"),
    ],
)
def test_pass_at_k_refusals_name_the_arguments(n, c, k, match):
    with pytest.raises(ValueError, match=match) as caught:
        pass_at_k(n, c, k)
    assert "pass_at_k(n=" in str(caught.value)


def test_mean_pass_at_k_refuses_no_tasks_and_bad_counts():
    with pytest.raises(ValueError, match="no tasks"):
        mean_pass_at_k([], k=1)
    with pytest.raises(ValueError, match=r"pass_at_k\(n=2, c=1, k=3\)"):
        mean_pass_at_k([(4, 1), (2, 1)], k=3)


# ========================================================================================= quality gate
CLEAN_ANSWERS = [
    "The answer is 42. To see why, multiply 6 by 7: six sevens make forty-two.",
    "Paris is the capital of France. It lies on the Seine, and it has been the capital since the 10th "
    "century. The city is known for the Louvre, the Eiffel Tower and its cafes.",
    # repeats a word, and a short phrase, a few times: legitimate
    "Yes, yes, I see. The cat sat on the mat, the cat ate, and then the cat slept on the mat again. "
    "The dog did not. Cats sleep a lot!",
    "To sort a list in Python:\n\n```python\nitems = [3, 1, 2]\nitems.sort()\nprint(items)\n```\n\n"
    "Or, without changing the list:\n\n```python\nprint(sorted(items))\n```\n\nBoth print [1, 2, 3].",
    "Step 1: add 2 and 3 to get 5.\nStep 2: multiply 5 by 4 to get 20.\nStep 3: subtract 1 to get 19.\n"
    "So the result is 19.",
    "1. Preheat the oven to 180 C.\n2. Mix the flour and the sugar.\n3. Add the eggs and the milk.\n"
    "4. Bake for 30 minutes.\nEnjoy!",
    # C code: 7 of its 23 lines repeat an earlier one ("}" and the fences): lines without a word do not count
    "Two versions:\n```c\nint sign(int x) {\n    if (x > 0) {\n        return 1;\n    }\n    if (x < 0) {\n"
    "        return -1;\n    }\n    return 0;\n}\n```\nand with loops:\n```c\nvoid clear(int *a, int n) {\n"
    "    for (int i = 0; i < n; i++) {\n        if (a[i] < 0) {\n            a[i] = 0;\n        }\n    }\n}\n```\n"
    "Both compile with gcc -Wall.",
]

LOOPS = {
    "repeated sentences": "I think so. I think so. I think so. I think so. Maybe.",
    "repeated lines": "The answer is 4.\nThe answer is 4.\nThe answer is 4.\nCheck: 2 + 2 = 4.",
    "a repeated clause without punctuation": "we need to check the value and then we go back " * 6,
    "a a a": "a " * 40,
    "one word forever after an answer": "The answer is 7 because 3 + 4 = 7 " + "the " * 30,
}


@pytest.mark.parametrize("text", CLEAN_ANSWERS)
def test_clean_answers_are_not_death_loops(text):
    assert not death_loop(text)


@pytest.mark.parametrize("text", LOOPS.values(), ids=LOOPS.keys())
def test_planted_death_loops_are_found(text):
    assert death_loop(text)


def test_death_loop_thresholds_are_where_the_rule_says():
    # 1 repeat among 4 sentences: 0.25 <= 0.3; among 3: 0.33 > 0.3 (case and spaces do not matter)
    assert not death_loop("One here. Two there. One  HERE. Three.")
    assert death_loop("One here. Two there. One  HERE.")
    assert not death_loop("One here. One here.")  # fewer than 3 sentences: the sentence rule waits
    seven = ["s1", "s2", "s3", "s4", "s5", "s6", "s7"]
    assert not death_loop(". ".join([*seven, "s1", "s2", "s3"]))  # 3 repeats among 10: 0.3, not over
    assert death_loop(". ".join([*seven[:6], "s1", "s2", "s3", "s4"]))  # 4 among 10
    # the n-gram rule: an 8-gram 4 times passes, 5 times fails (overlapping counts: 11 vs 12 words of "a")
    assert not death_loop("a " * 11)
    assert death_loop("a " * 12)
    assert death_loop("x y " * 3, ngram=2, max_ngram_repeats=2)
    assert not death_loop("x y " * 3, ngram=2, max_ngram_repeats=3)


def test_quality_report_counts_each_check_and_keeps_three_examples():
    samples = [Sample(t, stopped=True) for t in CLEAN_ANSWERS[:6]]  # 0..5
    samples += [Sample(LOOPS["repeated sentences"], stopped=False)]  # 6: loop, cut
    samples += [Sample("", stopped=True), Sample("  \n\t ", stopped=True)]  # 7, 8: empty
    samples += [Sample(LOOPS["a a a"], stopped=False)]  # 9: loop, cut
    samples += [Sample("Fine. But then it ran out of", stopped=False)]  # 10: cut
    samples += [Sample(LOOPS["repeated lines"], stopped=True), Sample(LOOPS["a a a"], stopped=True)]  # 11, 12
    report = quality_report(samples)
    assert report.num_samples == 13
    assert (report.death_loop.count, report.death_loop.examples) == (4, [6, 9, 11])
    assert report.death_loop.rate == pytest.approx(4 / 13)
    assert (report.missing_eos.count, report.missing_eos.examples) == (3, [6, 9, 10])
    assert (report.empty.count, report.empty.examples, report.empty.rate) == (2, [7, 8], pytest.approx(2 / 13))
    flat = report.as_dict()
    assert flat["num_samples"] == 13 and flat["empty_count"] == 2 and flat["missing_eos_examples"] == [6, 9, 10]


def test_gate_failures_name_the_failed_checks():
    samples = [Sample("Good answer.", stopped=True)] * 19 + [Sample("", stopped=False)] * 31
    report = quality_report(samples)  # 50 samples: missing_eos 0.62, empty 0.62, death_loop 0
    assert gate_failures(report, GateThresholds()) == []  # nothing checked
    failures = gate_failures(report, GateThresholds(death_loop=0.0, missing_eos=0.1, empty=0.7))
    assert failures == ["missing_eos: 0.62 of 50 samples > 0.10"]
    failures = gate_failures(report, GateThresholds(missing_eos=0.62, empty=0.5))
    assert failures == ["empty: 0.62 of 50 samples > 0.50"]  # a rate equal to its threshold passes
    clean = quality_report([Sample(t, stopped=True) for t in CLEAN_ANSWERS])
    assert gate_failures(clean, GateThresholds(death_loop=0.0, missing_eos=0.0, empty=0.0)) == []


def test_gate_refusals():
    with pytest.raises(ValueError, match=r"GateThresholds.empty=1.5"):
        GateThresholds(empty=1.5)
    with pytest.raises(ValueError, match="no samples"):
        quality_report([])


# ================================================================================== MTP draft logits
def _mtp_overrides(num_mtp: int) -> dict:
    """The tiny preset with `num_mtp` MTP layers (the per-layer lists repeat the MTP layer's entry)."""
    raw = tiny_config().to_dict()
    extra = num_mtp - raw["num_nextn_predict_layers"]
    lists = ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared")
    return dict(num_nextn_predict_layers=num_mtp, **{k: raw[k] + raw[k][-1:] * extra for k in lists})


@pytest.fixture(scope="module")
def three_mtp_model():
    return tiny_model(seed=31, **_mtp_overrides(3)).eval()


def _hand_drafts(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MTP depth run step by step from the model's submodules: u = eh_proj([enorm(E[x_{t+k}]),
    hnorm(h_t)]) (x past the row end: token 0), the decoder block, the shared head's norm and output."""
    B, S = ids.shape
    inner = model.model
    with torch.no_grad():
        h = inner(ids)  # residual stream after the last main layer, before the final norm
        drafts = []
        for k, mtp in enumerate(inner.mtp_layers, start=1):
            read = torch.zeros_like(ids)
            read[:, : S - k] = ids[:, k:]
            u = mtp.eh_proj(torch.cat([mtp.enorm(inner.embed_tokens(read)), mtp.hnorm(h)], dim=-1))
            cos, sin = inner.rotary_tables(S, ids.device)[inner.rope_keys[mtp.spec.layer_id]]
            h = DecoderLayer.forward(mtp, u, cos, sin)
            head = mtp.transformer["shared_head"]
            drafts.append(head.output(head.norm(h)))
    return drafts


def test_draft_logits_equal_the_main_forward_and_the_mtp_layers_by_hand(three_mtp_model):
    model = three_mtp_model
    ids = torch.randint(0, 1024, (2, 19), generator=torch.Generator().manual_seed(32))
    main, drafts = model.draft_logits(ids)
    assert len(drafts) == 3 and all(d.shape == (2, 19, 1024) for d in drafts)
    assert not main.requires_grad and not any(d.requires_grad for d in drafts)
    torch.testing.assert_close(main, model(ids), **TOL)
    for k, (got, want) in enumerate(zip(drafts, _hand_drafts(model, ids), strict=True), start=1):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=k: f"depth {k}: {m}")
    # depths differ from each other and from the main head (a wrong shift would still have the shape)
    assert not torch.allclose(drafts[0], drafts[1], atol=1e-2) and not torch.allclose(main, drafts[0], atol=1e-2)


def _draft_loss_sums(drafts, labels, crosses=None) -> list[torch.Tensor]:
    """Depth k: summed cross-entropy of drafts[k-1][t] against labels[t + k], t < S - k; crosses[k] [B, S - k]
    marks the t whose t + k lies in another document (no target)."""
    S = labels.shape[1]
    sums = []
    for k, logits in enumerate(drafts, start=1):
        target = labels[:, k:].clone()
        if crosses is not None:
            target[crosses[k]] = -100
        sums.append(F.cross_entropy(logits[:, : S - k].double().reshape(-1, 1024), target.reshape(-1), reduction="sum"))
    return sums


def test_draft_logits_imply_the_mtp_losses_of_model_loss(three_mtp_model):
    model = three_mtp_model
    ids = torch.randint(0, 1024, (2, 21), generator=torch.Generator().manual_seed(33))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, 4] = -100  # a masked label
    _, drafts = model.draft_logits(ids)
    with torch.no_grad():
        out = model.loss(ids, labels, mtp_loss_weight=1.0, loss_chunk_size=6)
    for got, want in zip(out.mtp_sums, _draft_loss_sums(drafts, labels), strict=True):
        torch.testing.assert_close(got.double(), want, **TOL)


def test_draft_logits_with_packed_documents_imply_the_masked_mtp_losses(three_mtp_model):
    model = three_mtp_model
    S = 20
    ids = torch.randint(0, 1024, (1, S), generator=torch.Generator().manual_seed(34))
    positions = torch.cat([torch.arange(8), torch.arange(12)])[None]  # documents [0, 8) and [8, 20)
    doc = (torch.arange(S) >= 8).long()[None]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, 7] = -100  # no next-token target across the boundary
    crosses = {k: doc[:, k:] != doc[:, :-k] for k in (1, 2, 3)}  # [1, S - k]: t + k in another document
    main, drafts = model.draft_logits(ids, position_ids=positions)
    torch.testing.assert_close(main, model(ids, position_ids=positions), **TOL)
    with torch.no_grad():
        out = model.loss(ids, labels, mtp_loss_weight=1.0, position_ids=positions)
    for got, want in zip(out.mtp_sums, _draft_loss_sums(drafts, labels, crosses), strict=True):
        torch.testing.assert_close(got.double(), want, **TOL)
    # the second document's drafts do not see the first: equal to running it alone
    _, alone = model.draft_logits(ids[:, 8:])
    for k in (1, 2, 3):
        torch.testing.assert_close(drafts[k - 1][:, 8 : S - k], alone[k - 1][:, : 12 - k], **TOL)


def test_draft_logits_refuses_context_parallelism_and_bad_positions():
    model = tiny_model(seed=35)
    ids = torch.randint(0, 1024, (1, 6))
    with pytest.raises(ValueError, match="position_ids has shape"):
        model.draft_logits(ids, position_ids=torch.arange(5)[None])
    model.context_parallel = object()
    with pytest.raises(ValueError, match="draft_logits .*context parallelism"):
        model.draft_logits(ids)
    no_mtp = tiny_model(seed=35, num_mtp_layers=0)
    main, drafts = no_mtp.draft_logits(ids)
    assert drafts == [] and main.shape == (1, 6, 1024)


# ================================================================================= MTP acceptance
def _logits_of(tokens: list[list[int]], V: int = 5) -> torch.Tensor:
    """[B, S, V] logits whose argmax is `tokens`, with noise below the winner so that argmax must look."""
    noise = torch.rand(len(tokens), len(tokens[0]), V, generator=torch.Generator().manual_seed(36))
    return noise + 2.0 * F.one_hot(torch.tensor(tokens), V)


def test_mtp_acceptance_equals_a_hand_count():
    main = _logits_of([[0, 1, 2, 3, 4, 0], [4, 4, 3, 2, 1, 0]])
    # depth 1, t = 0..4, compared with main at t + 1: row 0 wants 1 2 3 4 0, row 1 wants 4 3 2 1 0
    draft1 = _logits_of([[1, 2, 0, 4, 0, 3], [4, 0, 2, 0, 0, 2]])
    #            accepted:  y  y  n  y  y  -     y  n  y  n  y  -   -> 7 of 10
    # depth 2, t = 0..3, compared with main at t + 2: row 0 wants 2 3 4 0, row 1 wants 3 2 1 0
    draft2 = _logits_of([[2, 0, 0, 0, 1, 1], [3, 3, 1, 1, 2, 2]])
    #            accepted:  y  n  n  y  -  -     y  n  y  n  -  -   -> 4 of 8
    counts = mtp_acceptance(main, [draft1, draft2], valid=None)
    assert counts == [AcceptanceCount(1, 7, 10), AcceptanceCount(2, 4, 8)]
    assert counts[0].rate == pytest.approx(0.7) and counts[1].rate == pytest.approx(0.5)

    # valid[t + k]: row 0 counts positions 3.. (a completion after a 3-token prompt), row 1 all but the last
    valid = torch.tensor([[False, False, False, True, True, True], [True, True, True, True, True, False]])
    counts = mtp_acceptance(main, [draft1, draft2], valid=valid)
    # depth 1: row 0 t = 2, 3, 4 (n y y); row 1 t = 0..3 (y n y n) -> 4 of 7
    # depth 2: row 0 t = 1, 2, 3 (n n y); row 1 t = 0..2 (y n y) -> 3 of 6
    assert counts == [AcceptanceCount(1, 4, 7), AcceptanceCount(2, 3, 6)]
    assert (counts[0] + AcceptanceCount(1, 1, 3)).rate == pytest.approx(0.5)


def test_mtp_acceptance_edges_and_refusals():
    main = _logits_of([[0, 1]])
    assert mtp_acceptance(main, [_logits_of([[1, 1]])] * 3) == [
        AcceptanceCount(1, 1, 1),
        AcceptanceCount(2, 0, 0),
        AcceptanceCount(3, 0, 0),
    ]
    assert AcceptanceCount(2, 0, 0).rate == 0.0
    with pytest.raises(ValueError, match="draft depth 1 has shape"):
        mtp_acceptance(main, [torch.zeros(1, 3, 5)])
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        mtp_acceptance(main, [main], valid=torch.ones(1, 2))
    with pytest.raises(ValueError, match="cannot add depth 2 to depth 1"):
        AcceptanceCount(1, 0, 0) + AcceptanceCount(2, 0, 0)
