"""Generative evaluation: sample answers to prompt records, score them with reward functions (the verifiers of
online RL, training/rewards.py: exact, regex, math, tool-call validity, or a function given by import path),
and report the mean scores, the unbiased pass@k, and the quality gate's rates (death loops, missing EOS, empty).

Records are `data.format: prompt` records (data/prompts.py): `{"prompt": text or messages, <fields>}`, the
fields reaching the verifiers (`answer`, `answer_regex`, `tools`). Each prompt gets `num_samples` answers from
the KV-cache sampler of the rollouts (training/rollout.py), seeded per prompt, so a run of the same model draws
the same answers. Thinking is stripped before scoring and before the gate (`answer_text`: `<think>...</think>`
and a message's `reasoning_content`): reasoning models think at length and loop in their thoughts. A sample
passes when its total reward reaches `pass_threshold`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from step35.data.prompts import PromptEncoder
from step35.data.readers import BadRecord, reader_for
from step35.eval.metrics import GateThresholds, Sample, gate_failures, mean_pass_at_k, quality_report
from step35.model import Step35ForCausalLM
from step35.training.rewards import RewardFunction, answer_text, reward_names, score_completions
from step35.training.rollout import Group, generate_group, prompt_seed


@dataclass
class PromptItem:
    ids: list[int]
    record: dict
    where: str


@dataclass
class Sampling:
    num_samples: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Answers:
    """The sampled answers of a prompt set: per prompt its Group, and the answers as text (thinking stripped)."""

    items: list[PromptItem]
    groups: list[Group]
    texts: list[list[str]] = field(default_factory=list)


def read_prompt_items(path: str | Path, tokenizer, template, limit: int | None = None) -> list[PromptItem]:
    """The prompt records of a jsonl/json/parquet file, encoded as the prompt format encodes them; a bad record
    stops the evaluation naming its file:line (an evaluation set with holes would report a wrong mean)."""
    encoder = PromptEncoder(tokenizer, template, template_missing="the checkpoint has no chat template")
    items = []
    for record in reader_for(Path(path), "text", whole_records=True).records():
        if limit is not None and len(items) >= limit:
            break
        try:
            prompt = encoder(record)
        except BadRecord as error:
            raise ValueError(f"{record.where()}: {error}") from None
        if prompt is not None:
            items.append(PromptItem(prompt.ids, record.value(), prompt.where))
    if not items:
        raise ValueError(f"{path}: no prompt records")
    return items


@torch.no_grad()
def sample_answers(
    model: Step35ForCausalLM,
    items: Sequence[PromptItem],
    sampling: Sampling,
    stop_ids: set[int],
    decode: Callable[[list[int]], str],
    keep_going: Callable[[bool], bool] = lambda mine: mine,
) -> Answers:
    """`num_samples` answers per prompt, in eval mode (the model's mode is restored)."""
    training = model.training
    model.eval()
    try:
        groups = []
        for item in items:
            seed = prompt_seed(sampling.seed, -1, item.ids, 0)
            generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
            groups.append(
                generate_group(
                    model, item.ids, sampling.num_samples, max_new_tokens=sampling.max_new_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, stop_ids=stop_ids, generator=generator,
                    keep_going=keep_going, record_routes=False,
                )
            )  # fmt: skip
    finally:
        model.train(training)
    texts = [[answer_text(decode([t for t in ids if t not in stop_ids])) for ids in g.completions] for g in groups]
    return Answers(list(items), groups, texts)


def score_answers(
    answers: Answers, functions: list[RewardFunction], ks: Sequence[int], pass_threshold: float = 1.0
) -> dict:
    """Mean reward (and per function), pass@k for each k <= num_samples, and the samples with their scores."""
    prompts, completions, columns = [], [], {}
    for item, texts, group in zip(answers.items, answers.texts, answers.groups):
        conversational = isinstance(item.record["prompt"], list)
        for text, ids, cut in zip(texts, group.completions, group.truncated):
            prompts.append(item.record["prompt"])
            completions.append([{"role": "assistant", "content": text}] if conversational else text)
            for key in {k for i in answers.items for k in i.record if k != "prompt"}:
                columns.setdefault(key, []).append(item.record.get(key))
            columns.setdefault("completion_ids", []).append(ids)
            columns.setdefault("truncated", []).append(cut)
    scores = score_completions(functions, prompts, completions, columns)
    n = len(answers.groups[0].completions)
    passed = (scores.total >= pass_threshold).view(len(answers.items), n).sum(1).tolist()
    names = reward_names(functions)
    result = {"reward": float(scores.total.mean()), "samples_per_prompt": n, "prompts": len(answers.items)}
    for f, name in enumerate(names):
        applicable = scores.applicable[f]
        if bool(applicable.any()):
            result[f"reward/{name}"] = float(scores.per_function[f][applicable].mean())
    for k in ks:
        if k <= n:
            result[f"pass@{k}"] = mean_pass_at_k([(n, c) for c in passed], k)
    result["samples"] = [
        {"where": answers.items[i // n].where, "completion": completions[i], "reward": float(scores.total[i])}
        for i in range(len(completions))
    ]
    return result


def gate_answers(answers: Answers, thresholds: GateThresholds) -> tuple[dict, list[str]]:
    """The quality gate on the answers: (the report as a dict, the failed checks as lines)."""
    samples = [
        Sample(text, not cut) for texts, group in zip(answers.texts, answers.groups)
        for text, cut in zip(texts, group.truncated)
    ]  # fmt: skip
    report = quality_report(samples)
    return report.as_dict(), gate_failures(report, thresholds)
