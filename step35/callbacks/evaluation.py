"""EvalCallback: `step35 eval`'s generative measurements during training, on a small prompt set, every N optimizer
steps: the tasks' rewards and pass@k, the quality gate, and the MTP drafts' acceptance on the first validation
batches. It generates with the training model itself (eval mode, no gradients, the KV cache, at most
`max_new_tokens` per answer), so it stays inside training's memory plan; every rank answers the same prompts in
lockstep (the sharded model needs every rank's calls) and logs the same numbers, which rank 0 also writes to
`<run>/eval/step=N.json` as `step35 eval` does (the same sampling gives the same numbers on the same weights).

A failed gate warns, or stops the run (`on_fail: stop`) with a one-line message naming the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from step35.data.chat_template import ChatTemplate
from step35.eval import generative, report
from step35.eval.drafts import draft_acceptance
from step35.eval.metrics import GateThresholds
from step35.faults import RunStopped
from step35.parallel.collectives import all_reduce_, any_rank
from step35.training.rewards import load_reward_functions


class QualityGateFailed(RunStopped):
    """The quality gate failed with `on_fail: stop`."""


class EvalCallback(pl.Callback):
    def __init__(
        self,
        every_n_steps: int = 100,
        prompts: str | None = None,
        limit: int = 8,
        reward_funcs: list[str] | None = None,
        num_samples: int = 1,
        k: list[int] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
        max_death_loop: float | None = None,
        max_missing_eos: float | None = None,
        max_empty: float | None = None,
        on_fail: Literal["warn", "stop"] = "warn",
        mtp_batches: int = 1,
    ):
        """
        Args:
            every_n_steps: evaluate after every N optimizer steps.
            prompts: prompt records (`{"prompt", "answer", ...}` jsonl) to answer; default the built-in ones.
            limit: the first `limit` records of them.
            reward_funcs: verifiers of the answers (None: none; the gate still runs).
            num_samples: answers per prompt.
            k: the k of pass@k (default [1]).
            max_new_tokens: the longest answer.
            temperature: 0: greedy.
            seed: seeds the sampling.
            max_death_loop, max_missing_eos, max_empty: the gate's thresholds (None: reported, not checked).
            on_fail: a failed gate warns, or stops the run.
            mtp_batches: validation batches the MTP acceptance is measured on (0: not measured).
        """
        if every_n_steps < 1 or limit < 1 or num_samples < 1 or max_new_tokens < 1:
            raise ValueError("EvalCallback: every_n_steps, limit, num_samples and max_new_tokens must be >= 1")
        self.every_n_steps, self.prompts, self.limit = every_n_steps, prompts, limit
        self.functions = (
            load_reward_functions(reward_funcs, None, field="EvalCallback.reward_funcs") if reward_funcs else []
        )
        self.k = k or [1]
        self.sampling = generative.Sampling(num_samples, max_new_tokens, temperature, 1.0, seed)
        self.thresholds = GateThresholds(max_death_loop, max_missing_eos, max_empty)
        self.on_fail, self.mtp_batches = on_fail, mtp_batches
        self._items: list | None = None
        self._last = -1  # the step evaluated last (micro-batches after it see the same global_step)
        self._folder: Path | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._folder = Path(trainer.default_root_dir) / "eval"

    def _prepare(self, trainer: pl.Trainer) -> None:
        datamodule = trainer.datamodule
        template = datamodule._stream_options.get("template") or ChatTemplate.default()
        path = self.prompts
        if path is None:
            from step35.data.prompts import builtin_prompt_path

            path = builtin_prompt_path(datamodule.cache_dir)
        self._items = generative.read_prompt_items(path, datamodule.tokenizer, template, limit=self.limit)
        self._stop_ids = datamodule.generation_stop_ids()
        self._decode = datamodule.tokenizer.decode

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # counted once the step's last micro-batch stepped the optimizer
        if step == 0 or step % self.every_n_steps or step == self._last:
            return
        self._last = step
        results = self.evaluate(trainer, pl_module.model, step)
        for name, value in report.scalars(results).items():
            pl_module.log(f"eval/{name}", value, rank_zero_only=True)
        if trainer.is_global_zero:
            report.write(results, self._folder, step)
        failures = (results.get("gate") or {}).get("failed") or []
        if failures and self.on_fail == "stop":
            raise QualityGateFailed(f"step {step}: quality gate failed: " + "; ".join(failures))
        for failure in failures:
            rank_zero_warn(f"step {step}: quality gate: {failure}")

    def evaluate(self, trainer: pl.Trainer, model, step: int) -> dict:
        """This step's results (the same dict `step35 eval` writes)."""
        if self._items is None:
            self._prepare(trainer)
        device = trainer.strategy.root_device
        answers = generative.sample_answers(
            model, self._items, self.sampling, self._stop_ids, self._decode,
            keep_going=lambda mine: any_rank(mine, device),
        )  # fmt: skip
        results: dict = {"checkpoint": f"training step {step}", "step": step}
        if self.functions:
            results["tasks"] = generative.score_answers(answers, self.functions, self.k)
        results["gate"], failures = generative.gate_answers(answers, self.thresholds)
        results["gate"]["failed"] = failures
        if self.mtp_batches and model.num_mtp_layers:
            datamodule = trainer.datamodule
            batches = (datamodule.on_before_batch_transfer(b, 0) for b in datamodule.val_dataloader())
            # each rank measures its own validation batches; the counts are summed over the ranks
            results["mtp"] = draft_acceptance(model, batches, limit=self.mtp_batches, sum_counts=all_reduce_)
        return results
