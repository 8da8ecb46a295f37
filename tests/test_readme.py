"""The README's own commands, as written: the main job, what it learned (generate), the second main job
(export, fine-tune on conversations, generate --chat), the third (export, DPO), KTO and the LoRA lines (fit, merged export), in that
order, in a fresh folder (so `runs/...` are the README's relative paths), each line run by bash exactly as
the README prints it. The commands are read from the README, so the test follows it when it changes.

Also checked, loosely, what the README says of the results: the main job's validation loss ends below 5
(README: 4.6 at step 300, from 5.5 at step 100; ln 1024 = 6.9 at the start), the fine-tune's held-out
assistant loss falls (README: 3.95 at step 50 -> 3.59), and the merged export is an HF folder.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import metric_rows, steps_of
from tests.runner import ONE_PROCESS_THREADS, environment, run_process_group

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.early(minutes=3.5)  # minutes of processes: started first in the parallel run (conftest.py)


def bash_blocks(text: str) -> list[list[str]]:
    """The README's ```bash blocks, each as its commands (comments dropped, `\\` continuations joined)."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = body.replace("\\\n", " ")
        lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
        blocks.append([line for line in lines if line and not line.startswith("#")])
    return blocks


def quick_start() -> tuple[list[str], list[str]]:
    """The Quick start's two commands (the main job, the tests: the Makefile's, tests/test_quick_start.py) and the
    block below them with the same steps by hand (install, the tests' outside references, the main job, the tests)."""
    blocks = bash_blocks(README)
    two_commands, by_hand = blocks[0], blocks[1]
    assert two_commands == ["make run", "make test"], two_commands
    assert by_hand[0].startswith("python3 -m venv") and by_hand[-1] == "python -m pytest", by_hand
    return two_commands, by_hand


def readme_job_commands() -> list[str]:
    """The step35 lines of the quick start's by-hand block (the main job, which `make run` runs), the generate
    lines, the second main job and the LoRA block: every README command that runs on this machine (the install and
    the test lines are what CI runs, through `make test`; the other blocks name clusters and 196B checkpoints)."""
    blocks = bash_blocks(README)
    commands = [line for line in quick_start()[1] if line.startswith("step35 ")]
    for block in blocks[2:]:
        if all(line.startswith("step35 ") and ("runs/tiny" in line or "configs/tiny" in line) for line in block):
            commands += block
    return commands


def test_the_readme_commands_are_found():
    commands = readme_job_commands()
    assert commands[0] == "step35 fit --config configs/tiny.yaml"
    names = [c.split()[1] for c in commands]
    assert names.count("fit") == 6 and names.count("export") == 3 and names.count("generate") >= 4, commands
    assert any("--chat" in c for c in commands) and any("--merge" in c for c in commands), commands


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory, builtin_cache) -> Path:
    """The README's job commands run once, each by bash as printed, in a fresh folder (with configs/ linked in);
    its runs/ folder. A command that fails, or a generate line that prints nothing, fails every test using it."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "configs").symlink_to(ROOT / "configs")
    bin_dir = Path(sys.executable).parent  # the venv's `step35` entry point
    env = environment(
        builtin_cache, threads=ONE_PROCESS_THREADS, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    for command in readme_job_commands():
        proc = run_process_group(["bash", "-c", command], timeout=1200, cwd=folder, env=env)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-4000:])
        if " generate " in f" {command} ":
            assert proc.stdout.strip(), (command, proc.stderr[-2000:])
        print(f"ok: {command}")
    return folder / "runs"


@pytest.mark.multiprocess
@pytest.mark.timeout(3000)
def test_the_readme_commands_run_as_written(readme_runs):
    runs = readme_runs
    main_val = steps_of(metric_rows(runs / "tiny" / "csv" / "version_0"), "val/loss")
    assert max(main_val) == 299 and main_val[299] < 5.0, main_val  # (Lightning logs step 300's validation at 299)
    sft_val = steps_of(metric_rows(runs / "tiny-sft" / "csv" / "version_0"), "val/loss")
    assert sft_val[max(sft_val)] < sft_val[min(sft_val)], sft_val
    assert (runs / "tiny-lora" / "merged" / "config.json").is_file()
    assert (runs / "tiny" / "hf" / "config.json").is_file()
    # DPO (README: val/reward_accuracy 0.79 -> 0.88, val/dpo_loss 0.41 -> 0.20; ln 2 = 0.69 at the start)
    dpo_rows = metric_rows(runs / "tiny-dpo" / "csv" / "version_0")
    accuracy, dpo_loss = steps_of(dpo_rows, "val/reward_accuracy"), steps_of(dpo_rows, "val/dpo_loss")
    assert max(accuracy) == 99 and accuracy[99] >= 0.6 and dpo_loss[99] < 0.69, (accuracy, dpo_loss)
    assert steps_of(dpo_rows, "train/chosen_logp") and steps_of(dpo_rows, "train/reward_margin")
    # KTO (README: held-out rewards desirable -1.75, undesirable -3.87 at step 100; every reward 0 at the start)
    kto_rows = metric_rows(runs / "tiny-kto" / "csv" / "version_0")
    good, bad = steps_of(kto_rows, "val/desirable_reward"), steps_of(kto_rows, "val/undesirable_reward")
    assert max(good) == 99 and good[99] > bad[99] + 0.5, (good, bad)
    # GRPO (README: train/reward 0.40 over the first 5 steps -> 0.99 over the last 5; val/reward 1.00 at 20 and 60)
    grpo_rows = metric_rows(runs / "tiny-grpo" / "csv" / "version_0")
    reward = steps_of(grpo_rows, "train/reward")
    start, end = sum(reward[s] for s in range(5)) / 5, sum(reward[s] for s in range(55, 60)) / 5
    assert start < 0.7 and end > 0.9, reward
    assert max(steps_of(grpo_rows, "rl/logprob_diff_max").values()) < 1e-4
    # eval (README: held-out 3.586 = the fit's val/loss, MTP acceptance 0.655 after vs 0.644 before)
    results = json.loads((runs / "tiny-sft" / "eval" / "step=150.json").read_text())
    assert results["heldout"]["loss"] == pytest.approx(sft_val[max(sft_val)], rel=1e-5), (results, sft_val)
    assert 0 < results["mtp"]["depth1"] <= 1 and 0 < results["mtp_baseline"]["depth1"] <= 1
    assert results["gate"]["num_samples"] > 100 and (runs / "tiny-sft" / "eval" / "scores.png").is_file()
    # README (--chat): the fine-tuned model's replies end by themselves, but for at most a tenth of the gate's prompts
    assert results["gate"]["missing_eos_rate"] <= 0.10, results["gate"]


@pytest.mark.multiprocess
@pytest.mark.timeout(3000)
def test_the_main_job_trains_logs_and_saves_its_run_folder(readme_runs):
    """`step35 fit --config configs/tiny.yaml` as a user runs it (the README's first command): the loss falls from
    about ln(1024) at the start, the CSV has the training, learning-rate and validation columns, the run folder
    (not the attempt's folder) has the checkpoints, and the resolved config is saved with the command line's
    overrides applied (the LoRA line's --trainer.max_steps 50)."""
    folder = readme_runs / "tiny" / "csv" / "version_0"
    rows = metric_rows(folder)
    losses = steps_of(rows, "train/lm_loss")
    steps = sorted(losses)
    assert len(steps) >= 20, steps
    assert losses[steps[0]] > 6.0  # ~ln(1024) at init
    first = sum(losses[s] for s in steps[:3]) / 3
    last = sum(losses[s] for s in steps[-3:]) / 3
    assert first - last > 1.0, f"loss fell from {first:.3f} to {last:.3f} only"
    assert {"step", "train/loss", "train/grad_norm", "lr/decay"} <= set(rows[0])
    assert steps_of(rows, "val/loss") and steps_of(rows, "val/ppl")
    assert (readme_runs / "tiny" / "checkpoints" / "last.ckpt").exists()  # the run folder's, not the attempt's
    assert (readme_runs / "tiny" / "plots" / "training.png").is_file()  # its curves (tests/test_plots.py: their lines)
    saved = (readme_runs / "tiny" / "config.yaml").read_text()
    assert "mtp_loss_weight: 0.3" in saved and "max_steps: 300" in saved  # the resolved config
    lora = (readme_runs / "tiny-lora" / "config.yaml").read_text()
    assert re.search(r"max_steps: 50\n", lora) and "rank: 4" in lora  # the command line's overrides applied
