"""The measurements of `step35 eval`: pure functions on counts, texts and logits (no model, no I/O).

Three kinds:
- pass@k (`pass_at_k`, `mean_pass_at_k`): the unbiased estimator of Chen et al. 2021 ("Evaluating Large
  Language Models Trained on Code"): with n samples of a task of which c are correct, the probability that
  at least one of k samples drawn without replacement is correct, 1 - C(n - c, k) / C(n, k). Computed as
  1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms a binomial (C(200, 100) overflows a float).
- the quality gate (`quality_report`, `gate_failures`): each sample is checked for a death loop
  (`death_loop`), a missing end of sequence (`Sample.stopped` False: cut at max_new_tokens) and an empty
  answer; the report counts each, and the gate fails a check whose rate exceeds its threshold.
- MTP draft acceptance (`mtp_acceptance`): how often MTP depth k's greedy draft at position t equals the
  token the main head emits greedily at t + k, the token it drafts (Step35ForCausalLM.draft_logits gives
  both). The inputs are teacher-forced (depth k reads the true x_{t+k}), so this is the acceptance rate of
  a speculative decoder whose earlier drafts were all accepted: a proxy, an upper bound per depth.
"""

from __future__ import annotations

import numbers
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# ------------------------------------------------------------------------------------------------ pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: n samples, c of them correct, k drawn; needs n >= k >= 1, 0 <= c <= n."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"pass_at_k(n={n!r}, c={c!r}, k={k!r}): {name} must be an int")
    if not n >= k >= 1:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): needs n >= k >= 1")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): needs 0 <= c <= n")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (i - k) / i
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean pass@k over tasks, each given as (n samples, c correct)."""
    if not counts:
        raise ValueError(f"mean_pass_at_k(k={k}): no tasks (counts is empty)")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


# ------------------------------------------------------------------------------------------ quality gate

CHECKS = ("death_loop", "missing_eos", "empty")
MAX_EXAMPLES = 3

_SENTENCE_END = re.compile(r"[.!?\n]+")
_ALNUM = re.compile(r"\w")


@dataclass
class Sample:
    """One generated answer: its text (thinking stripped) and whether a stop id ended it within max_new_tokens."""

    text: str
    stopped: bool


def _sentences(text: str) -> list[str]:
    """Sentences lower-cased with whitespace collapsed; pieces without a letter or digit ("```", "}") dropped."""
    pieces = (" ".join(p.lower().split()) for p in _SENTENCE_END.split(text))
    return [p for p in pieces if _ALNUM.search(p)]


def _words(text: str) -> list[str]:
    """Lower-cased words with the punctuation around them stripped ("store," -> "store")."""
    stripped = (w.strip("\"'.,;:!?()[]{}*_`") for w in text.lower().split())
    return [w for w in stripped if w]


def death_loop(
    text: str, *, max_repeated_sentence_share: float = 0.3, ngram: int = 8, max_ngram_repeats: int = 4
) -> bool:
    """True when the text loops. Two rules, either suffices:

    1. Repeated sentences: the text is split into sentences at runs of . ! ? and newlines; pieces with no
       letter or digit (blank lines, code fences, lone braces) are ignored; sentences compare lower-cased
       with whitespace collapsed. With at least 3 sentences, it loops when the share of sentences equal to
       an earlier one exceeds `max_repeated_sentence_share` (0.3: 1 repeat among 4 sentences or 3 among 10
       pass; 1 among 3 fails).
    2. A repeated word n-gram: it loops when some run of `ngram` consecutive words (lower-cased, surrounding
       punctuation stripped) occurs more than `max_ngram_repeats` times, overlapping occurrences counted.
       This catches loops without sentence ends: "the the the ..." (13 words give the 8-gram 6 times) or a
       clause repeated over and over in one sentence.
    """
    sentences = _sentences(text)
    if len(sentences) >= 3:
        repeats = len(sentences) - len(set(sentences))  # each sentence equal to an earlier one
        if repeats / len(sentences) > max_repeated_sentence_share:
            return True
    words = _words(text)
    grams = Counter(tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1))
    return bool(grams) and max(grams.values()) > max_ngram_repeats


def missing_eos(sample: Sample) -> bool:
    return not sample.stopped


def empty(sample: Sample) -> bool:
    return not sample.text.strip()


@dataclass
class CheckCount:
    """One check over the samples: how many failed it, their share, and the indices of the first few."""

    count: int
    rate: float
    examples: list[int] = field(default_factory=list)


@dataclass
class QualityReport:
    num_samples: int
    death_loop: CheckCount
    missing_eos: CheckCount
    empty: CheckCount

    def check(self, name: str) -> CheckCount:
        if name not in CHECKS:
            raise ValueError(f"QualityReport.check: unknown check {name!r}; known: {', '.join(CHECKS)}")
        return getattr(self, name)

    def as_dict(self) -> dict:
        """Flat numbers for logs and JSON: num_samples, then <check>_count, <check>_rate, <check>_examples."""
        out: dict = {"num_samples": self.num_samples}
        for name in CHECKS:
            result = self.check(name)
            out |= {f"{name}_count": result.count, f"{name}_rate": result.rate, f"{name}_examples": result.examples}
        return out


def quality_report(samples: Sequence[Sample]) -> QualityReport:
    """Runs every check on every sample (an empty answer is not also a death loop; the checks are independent)."""
    if not samples:
        raise ValueError("quality_report: no samples to check")
    flags = {
        "death_loop": [death_loop(s.text) for s in samples],
        "missing_eos": [missing_eos(s) for s in samples],
        "empty": [empty(s) for s in samples],
    }
    counts = {}
    for name, failed in flags.items():
        indices = [i for i, f in enumerate(failed) if f]
        counts[name] = CheckCount(len(indices), len(indices) / len(samples), indices[:MAX_EXAMPLES])
    return QualityReport(num_samples=len(samples), **counts)


@dataclass
class GateThresholds:
    """The highest rate each check may have (a share in [0, 1]); None: not checked."""

    death_loop: float | None = None
    missing_eos: float | None = None
    empty: float | None = None

    def __post_init__(self):
        for name in CHECKS:
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"GateThresholds.{name}={value!r}: a rate must be between 0 and 1 (or None)")


def gate_failures(report: QualityReport, thresholds: GateThresholds) -> list[str]:
    """One line per check whose rate exceeds its threshold, e.g. "missing_eos: 0.62 of 50 samples > 0.10"."""
    lines = []
    for name in CHECKS:
        limit = getattr(thresholds, name)
        result = report.check(name)
        if limit is not None and result.rate > limit:
            lines.append(f"{name}: {result.rate:.2f} of {report.num_samples} samples > {limit:.2f}")
    return lines


# --------------------------------------------------------------------------------- MTP draft acceptance


@dataclass
class AcceptanceCount:
    """Drafts of one MTP depth (1-based) that the main head would accept, of those counted."""

    depth: int
    accepted: int
    total: int

    @property
    def rate(self) -> float:
        """accepted / total; 0.0 when nothing was counted (total says so)."""
        return self.accepted / self.total if self.total else 0.0

    def __add__(self, other: AcceptanceCount) -> AcceptanceCount:
        """Sums counts of the same depth over batches."""
        if other.depth != self.depth:
            raise ValueError(f"AcceptanceCount: cannot add depth {other.depth} to depth {self.depth}")
        return AcceptanceCount(self.depth, self.accepted + other.accepted, self.total + other.total)


def mtp_acceptance(
    main_logits: torch.Tensor, draft_logits: Sequence[torch.Tensor], valid: torch.Tensor | None = None
) -> list[AcceptanceCount]:
    """Per depth k = 1, 2, ...: at each position t with t + k < S (and valid[t + k] when valid [B, S] bool is
    given), draft k is accepted when argmax(draft_logits[k - 1][t]) == argmax(main_logits[t + k]).

    main_logits [B, S, V] and each draft [B, S, V] as Step35ForCausalLM.draft_logits returns them; valid
    marks the positions whose main-head token counts (e.g. the completion's, not padding)."""
    B, S = main_logits.shape[:2]
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (B, S)):
        raise ValueError(
            f"mtp_acceptance: valid must be a bool tensor [B, S] = {(B, S)}, got {valid.dtype} {tuple(valid.shape)}"
        )
    main_tokens = main_logits.argmax(-1)  # [B, S]
    counts = []
    for k, draft in enumerate(draft_logits, start=1):
        if draft.shape != main_logits.shape:
            raise ValueError(
                f"mtp_acceptance: draft depth {k} has shape {tuple(draft.shape)}, main {tuple(main_logits.shape)}"
            )
        drafted = draft[:, : max(S - k, 0)].argmax(-1)  # [B, S - k]: the token drafted for t + k + 1
        wanted = main_tokens[:, k:]  # [B, S - k]: what the main head emits at t + k
        counted = valid[:, k:] if valid is not None else torch.ones_like(wanted, dtype=torch.bool)
        accepted = int(((drafted == wanted) & counted).sum())
        counts.append(AcceptanceCount(depth=k, accepted=accepted, total=int(counted.sum())))
    return counts
