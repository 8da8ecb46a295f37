"""Online RL (`model.objective: grpo`) resumes exactly, and says what is wrong with its reward functions.

A tiny from-scratch run (the built-in tokenizer and prompt records; 6 steps, a checkpoint every 2, mu = 2 so a
checkpoint falls between rollout batches, a KL term against the frozen start model) is held after its third
optimizer step (tests.dist.hooks.Gate), one step past its step-2 checkpoint, SIGKILLed there, and resumed with
`--ckpt_path last`: its step-6 checkpoint (weights and optimizer state) is bitwise the one of an uninterrupted run
started beside it, and every step's logged train/reward and train/loss, in either attempt, is the uninterrupted
run's to the bit (the rollouts' seeds are the step's and the prompt's: a resumed run draws what the uninterrupted
one drew). The reward (`even_ids`, beside the built-in regex_match, which a random model never satisfies) has a
spread, so advantages and the loss are not zero.

A reward path that cannot be imported is refused as `step35 fit` starts, in one line without a traceback; a reward
function that raises stops the run at the first rollout, naming the function (reported as a failure of the step,
with the traceback that leads into the function)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_bitwise, metric_rows
from tests.runner import command, fit, kill_job, start_at_gate

HERE = "tests.test_grpo_resume"  # this module as the runs import it (pytest may name it otherwise)
STEPS, EVERY, KILLED_AT = 6, 2, 3
LOGGED = ("train/reward", "train/loss")
CONFIG = f"""
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  precision: 32-true
  max_steps: {STEPS}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    - class_path: step35.loggers.CSVLogger
      init_args:
        name: csv
        flush_logs_every_n_steps: 1
  callbacks:
    - class_path: step35.callbacks.RunCheckpoint
      init_args:
        every_n_train_steps: {EVERY}
        keep_last: 5
model:
  checkpoint: null
  objective: grpo
  rl:
    reward_funcs: [regex_match, {HERE}:even_ids]
    num_generations: 4
    max_new_tokens: 8
    num_iterations: 2
    beta: 0.05
    sample_every: 2
  mtp_loss_weight: 0.0
  lr: 1.0e-3
  warmup_steps: 2
  weight_decay: 0.0
data:
  tokenizer: null
  format: prompt
  seq_len: 128
  micro_batch_size: 2
  num_workers: 0
"""


def even_ids(prompts, completions, completion_ids, **fields) -> list[float]:
    """The number of even ids in the completion: a reward with a spread over a random model's samples."""
    return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]


def raising_reward(prompts, completions, **fields) -> list[float]:
    raise ZeroDivisionError("the checker divided by zero")


def config_file(folder: Path, **replaced: str) -> Path:
    text = CONFIG
    for old, new in replaced.items():
        text = text.replace(old, new)
    path = folder / "grpo.yaml"
    path.write_text(text)
    return path


def final_state(run: Path) -> dict:
    state = torch.load(run / "checkpoints" / f"step={STEPS:06d}.ckpt", map_location="cpu", weights_only=True)
    return {"params": state["state_dict"], "optimizer": state["optimizer_states"], "step": state["global_step"]}


def logged(attempt: Path) -> dict[str, dict[int, str]]:
    """{column: {step: the value as the CSV holds it}} of one attempt's metrics.csv (text: equal text is equal bits,
    the CSV writes a float's shortest round-trip form)."""
    rows = metric_rows(attempt)
    return {column: {int(r["step"]): r[column] for r in rows if r.get(column)} for column in LOGGED}


@pytest.mark.heavy  # step35 started as a subprocess, three runs
@pytest.mark.timeout(600)
def test_sigkill_mid_run_then_resume_is_bitwise_the_uninterrupted_run(tmp_path, builtin_cache):
    config = config_file(tmp_path)
    args = ["fit", "--config", str(config)]
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run beside the killed one (one OpenMP thread each)
        reference = pool.submit(fit, config, tmp_path / "reference", builtin_cache, threads=1, timeout=500)
        gate = tmp_path / "never"  # the killed run is held after step KILLED_AT until the kill
        gated = [*args, f"--run_dir={tmp_path / 'run'}", "--trainer.callbacks+=tests.dist.hooks.Gate",
                 f"--trainer.callbacks.file={gate}", f"--trainer.callbacks.at_step={KILLED_AT}"]  # fmt: skip
        kill_job(start_at_gate(command(gated), builtin_cache, gate))
        folder = tmp_path / "run" / "checkpoints"
        assert sorted(p.name for p in folder.glob("step=*.ckpt")) == ["step=000002.ckpt"]  # one step past it
        resumed = fit(config, tmp_path / "run", builtin_cache, "--ckpt_path=last", threads=1, timeout=500)
        reference.result()
    assert f"--ckpt_path last: resuming from {folder / 'step=000002.ckpt'} (global step 2" in resumed.stderr

    assert_bitwise(final_state(tmp_path / "run"), final_state(tmp_path / "reference"))
    expected = logged(tmp_path / "reference" / "csv" / "version_0")
    assert all(sorted(expected[c]) == list(range(STEPS)) for c in LOGGED), expected
    assert len(set(expected["train/loss"].values())) > 1 and float(expected["train/reward"][0]) > 0
    killed, again = (logged(tmp_path / "run" / "csv" / v) for v in ("version_0", "version_1"))
    assert min(again["train/loss"]) == 2 and max(again["train/loss"]) == STEPS - 1
    assert {0, 1} <= set(killed["train/loss"])  # the steps before the checkpoint, from the killed attempt
    for attempt in (killed, again):
        for column in LOGGED:
            assert attempt[column] == {step: expected[column][step] for step in attempt[column]}, column
    # The sample tables (completions, rewards, advantages at steps 0, 2, 4): the last attempt's rows of a step are
    # the uninterrupted run's (a step both attempts sampled holds both attempts' rows: the table is appended to).
    samples = sorted((tmp_path / "reference" / "rl_samples").iterdir())
    assert [p.name for p in samples] == ["step=0.jsonl", "step=2.jsonl", "step=4.jsonl"]
    for table in samples:
        assert (tmp_path / "run" / "rl_samples" / table.name).read_bytes().endswith(table.read_bytes()), table.name


def test_an_unimportable_reward_path_is_refused_at_start_in_one_line(tmp_path, step35_here):
    config = config_file(tmp_path, **{f"{HERE}:even_ids": "nowhere_pkg.rewards:score"})
    code, _, err = step35_here("fit", "--config", str(config), f"--run_dir={tmp_path / 'run'}")
    assert code != 0 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if "nowhere_pkg" in line]
    assert line.startswith("step35: ") and "model.rl.reward_funcs[1]" in line, err[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_reward_function_that_raises_stops_the_run_naming_it(tmp_path, step35_here):
    config = config_file(tmp_path, **{f"{HERE}:even_ids": f"{HERE}:raising_reward"})
    code, _, err = step35_here("fit", "--config", str(config), f"--run_dir={tmp_path / 'run'}")
    assert code != 0, err[-3000:]
    said = f"reward function {HERE}:raising_reward raised ZeroDivisionError: the checker divided by zero"
    assert said in err, err[-3000:]
