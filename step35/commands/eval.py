"""`step35 eval`: how good is the model I just trained?

    step35 eval --checkpoint runs/tiny-sft                                  # the run's own validation split
    step35 eval --checkpoint runs/tiny-sft --data held_out.jsonl            # held-out loss, bits per byte
    step35 eval --checkpoint runs/tiny-sft --tasks qa.jsonl --reward_funcs [exact_match] --num_samples 8 --k [1,4]
    step35 eval --checkpoint runs/tiny-sft --gate --max_missing_eos 0.2     # the SFT quality gate (exit 1 on fail)
    step35 eval --checkpoint runs/tiny-sft --mtp --baseline runs/tiny/hf    # MTP draft acceptance, before/after
    step35 eval --checkpoint runs/tiny-sft --agent_records agent.jsonl      # tool calls round-trip the template
    step35 eval --checkpoint runs/tiny-sft --lm_eval_tasks [my_task] --lm_eval_include_path tasks/

`--checkpoint` is what `step35 generate` reads (a run folder: its newest intact checkpoint; a .ckpt; an HF
folder, Step-3.5 or Step-3.7). Each part runs when asked (held-out loss always, on `--data` or, for a run
folder, its own validation split, exactly as the fit computed val/loss). Results go to `<run>/eval/step=N.json`
(or `--out`), a table to the terminal, and `<run>/eval/scores.png` plots every evaluation of the run against
its steps. A failed quality gate exits 1 naming the check.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from step35.checkpoint.training.trained import is_hf_folder
from step35.commands.function_cli import run_function
from step35.commands.generate import Generator, load_generator
from step35.data.chat_template import ChatTemplate
from step35.data.tokenizer import TextTokenizer
from step35.eval import generative, heldout, report
from step35.eval.drafts import draft_acceptance
from step35.eval.metrics import GateThresholds
from step35.run.resolution import checkpoint_of
from step35.training.rewards import load_reward_functions


def evaluate(
    checkpoint: str,
    data: list[str] | None = None,
    data_format: str = "auto",
    seq_len: int = 512,
    micro_batch_size: int = 4,
    batches: int = 8,
    tasks: str | None = None,
    reward_funcs: list[str] | None = None,
    reward_weights: list[float] | None = None,
    num_samples: int = 1,
    k: list[int] | None = None,
    pass_threshold: float = 1.0,
    gate: bool = False,
    gate_prompts: str | None = None,
    max_death_loop: float | None = None,
    max_missing_eos: float | None = None,
    max_empty: float | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    mtp: bool = False,
    baseline: str | None = None,
    agent_records: str | None = None,
    lm_eval_tasks: list[str] | None = None,
    lm_eval_include_path: str | None = None,
    lm_eval_limit: int | None = None,
    out: str | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str = "cpu",
) -> None:
    """Evaluate a checkpoint: held-out loss, generative tasks with pass@k, the quality gate, MTP draft acceptance,
    the agent rendering check, lm-evaluation-harness tasks.

    Args:
        checkpoint: a run folder (its newest intact checkpoint), a .ckpt file, a sharded checkpoint folder or an
            HF folder.
        data: held-out files in any format step35 trains on (text, chat, prompt/completion); chat counts the
            assistant's tokens only. None: a run folder's own validation split.
        data_format: `data.format` of those files (auto: detected).
        seq_len: window of the held-out batches (None of a run: the run's own).
        micro_batch_size: rows per held-out batch.
        batches: held-out batches at most.
        tasks: a jsonl of prompt records with references (`{"prompt", "answer", ...}`), answered and scored.
        reward_funcs: the verifiers of the tasks: built-ins (exact_match, regex_match, math_match,
            tool_call_valid, think_format, complete) or `package.module:function` (default exact_match).
        reward_weights: their weights (default 1 each).
        num_samples: answers per prompt (n of pass@k).
        k: the k of pass@k (default [1]).
        pass_threshold: a sample passes when its total reward reaches this.
        gate: run the quality gate (death loops, missing EOS, empty answers) on `gate_prompts`.
        gate_prompts: prompt records for the gate (default: `tasks`, else the built-in prompt records).
        max_death_loop: the most death-loop rate the gate passes (None: reported, not checked).
        max_missing_eos: the most missing-EOS rate the gate passes.
        max_empty: the most empty-answer rate the gate passes.
        max_new_tokens: the longest answer.
        temperature: 0: greedy; else sampling temperature.
        top_p: nucleus sampling.
        seed: seeds the sampling (per prompt).
        mtp: measure the MTP layers' draft acceptance on the held-out data (depth k's top-1 against the main
            head's greedy token k positions later).
        baseline: with mtp: another checkpoint measured the same way (e.g. the run's start folder).
        agent_records: chat records with tool calls: each rendered with the chat template and parsed back in the
            step3p5 form; the records that do not round-trip are reported.
        lm_eval_tasks: lm-evaluation-harness tasks to run on the checkpoint (needs `pip install 'step35[eval]'`).
        lm_eval_include_path: a folder of lm-eval task YAMLs (local tasks).
        lm_eval_limit: examples per lm-eval task at most.
        out: the results folder (default: <run>/eval for a run folder, else ./eval).
        dtype: dtype of the weights in memory.
        device: where the model runs (one device).
    """

    def say(line: str) -> None:
        print(f"step35 eval: {line}", file=sys.stderr)

    chosen, step, run = _resolve(Path(checkpoint), say)
    gen = load_generator(chosen, getattr(torch, dtype), device, say=say, num_mtp_layers=None if mtp else 0)
    results: dict[str, Any] = {"checkpoint": str(chosen), "step": step}
    with tempfile.TemporaryDirectory(prefix="step35-eval-tokenizer-") as folder:
        tokenizer = _tokenizer(gen, Path(folder))
        held = _heldout_batches(data, data_format, seq_len, micro_batch_size, batches, run, tokenizer)
        if held is not None:
            results["heldout"] = heldout.heldout_loss(gen.model, held, tokenizer.decode, limit=batches).as_dict()
        template = gen.chat_template(say)
        sampling = generative.Sampling(num_samples, max_new_tokens, temperature, top_p, seed)
        failures = _generative(results, gen, tokenizer, template, sampling, locals())
        if mtp:
            results["mtp"] = _acceptance(gen, held)
            if baseline is not None:
                results["mtp_baseline"] = _acceptance(load_generator(baseline, getattr(torch, dtype), device,
                                                                     say=say, num_mtp_layers=None), held)  # fmt: skip
        if agent_records is not None:
            results["agent"] = _agent_check(agent_records, template, tokenizer)
    if lm_eval_tasks:
        from step35.eval.lm_eval_model import run_lm_eval

        results["lm_eval"] = run_lm_eval(str(chosen), lm_eval_tasks, include_path=lm_eval_include_path,
                                         limit=lm_eval_limit, device=device, dtype=dtype)  # fmt: skip
    folder = Path(out) if out else (run / "eval" if run is not None else Path("eval"))
    written = report.write(results, folder, step)
    print(report.table(results), flush=True)
    say(f"results: {written}")
    if failures:
        raise SystemExit("step35 eval: quality gate failed: " + "; ".join(failures))


def _resolve(path: Path, say) -> tuple[Path, int | None, Path | None]:
    """(the checkpoint to read, its step, the run folder) of --checkpoint."""
    if is_hf_folder(path):
        return path, None, None
    chosen = checkpoint_of(path, say)
    found = re.search(r"step=(\d+)", chosen.name)
    run = path if path.is_dir() and chosen != path else None
    return chosen, int(found[1]) if found else None, run


def _tokenizer(gen: Generator, folder: Path) -> TextTokenizer:
    """The checkpoint's tokenizer as a folder (the data side reads tokenizers from folders)."""
    for name, data in gen.tokenizer_files.items():
        (folder / name).write_bytes(data)
    return TextTokenizer.from_folder(folder, gen.eos_id)


def _heldout_batches(data, data_format, seq_len, micro_batch_size, batches, run, tokenizer) -> list | None:
    """The held-out batches: of `data`, else of a run's own validation split (its data options as it ran)."""
    from step35.data.datamodule import Step35DataModule

    if data:
        module = Step35DataModule(files=data, val_files=data, format=data_format, seq_len=seq_len,
                                  micro_batch_size=micro_batch_size, val_batches=batches,
                                  tokenizer=str(tokenizer.path))  # fmt: skip
    elif run is not None and (run / "config.yaml").is_file():
        module = _run_datamodule(run, tokenizer)
    else:
        return None
    module.setup("validate")
    return [module.on_before_batch_transfer(batch, 0) for batch in module.val_dataloader()]


def _run_datamodule(run: Path, tokenizer: TextTokenizer):
    """The run's data module as config.yaml records it (its tokenizer from the checkpoint when the path it
    named is gone), with the validation batches the fit's trainer.limit_val_batches kept."""
    import yaml

    from step35.data.datamodule import Step35DataModule

    config = yaml.safe_load((run / "config.yaml").read_text())
    options = dict(config.get("data") or {})
    if not options.get("tokenizer") or not Path(options["tokenizer"]).exists():
        options["tokenizer"] = str(tokenizer.path)
    limit = (config.get("trainer") or {}).get("limit_val_batches")
    if isinstance(limit, int) and limit >= 0:
        options["val_batches"] = min(int(options.get("val_batches", 8)), limit)
    return Step35DataModule(**options)


def _generative(results: dict, gen: Generator, tokenizer, template: ChatTemplate, sampling, options: dict) -> list:
    """Tasks and the gate into `results`; the gate's failed checks."""
    tasks, gate = options["tasks"], options["gate"]
    answers = None
    if tasks is not None:
        functions = load_reward_functions(options["reward_funcs"] or ["exact_match"], options["reward_weights"],
                                          field="--reward_funcs")  # fmt: skip
        items = generative.read_prompt_items(tasks, tokenizer, template)
        answers = generative.sample_answers(gen.model, items, sampling, gen.stop_ids, gen.decode)
        results["tasks"] = generative.score_answers(answers, functions, options["k"] or [1], options["pass_threshold"])
    if not gate:
        return []
    prompts = options["gate_prompts"]
    if prompts is not None or answers is None:
        if prompts is None:
            from step35.data.prompts import builtin_prompt_path

            prompts = builtin_prompt_path()
        items = generative.read_prompt_items(prompts, tokenizer, template)
        answers = generative.sample_answers(gen.model, items, sampling, gen.stop_ids, gen.decode)
    thresholds = GateThresholds(options["max_death_loop"], options["max_missing_eos"], options["max_empty"])
    results["gate"], failures = generative.gate_answers(answers, thresholds)
    results["gate"]["failed"] = failures
    return failures


def _acceptance(gen: Generator, held: list | None) -> dict:
    """Draft acceptance per MTP depth on the held-out batches (eval/drafts.py)."""
    if held is None:
        raise SystemExit("step35 eval: --mtp needs held-out text: --data files, or a run folder's validation split")
    return draft_acceptance(gen.model, held)


def _agent_check(path: str, template: ChatTemplate, tokenizer: TextTokenizer) -> dict:
    from step35.data.agent_check import check_agent_rendering
    from step35.data.readers import reader_for

    records = [r for r in reader_for(Path(path), "text", whole_records=True).records()]
    found = check_agent_rendering(records, template, tokenizer)
    return {"checked": found.checked, "failed": found.failed}


def main(argv: list[str] | None = None) -> None:
    run_function(evaluate, "step35 eval", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
