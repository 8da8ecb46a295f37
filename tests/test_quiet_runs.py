"""The README's jobs speak only when there is something to do (issue 47).

What a user sees is the terminal: stdout (the progress bars) and stderr (warnings, Lightning's lines, step35's
own) on one screen. Each job here runs as a process with both streams in one pipe, unbuffered, and
`screen` replays that output as a terminal would show it (`\\r` back to the line's start, `\\n` to the next line,
tqdm's cursor-up for its second bar). On that screen:

- No warning that asks for nothing (`NOISE`, each pattern with why it asks for nothing): Lightning's GPU / TPU
  availability lines, its sync_dist advice (step35's epoch-level values are reduced already), the validation
  repeat said as a warning or more than once, truncated or dropped built-in conversations and pairs. The README's
  jobs print no warning at all (`warning_lines`): one that asked for an action would ask it of the README's own
  configuration, which is what would need the change.
- The end-of-fit line and the SIGTERM line start their own lines: neither is spliced into the progress bar.
- The built-in conversations, pairs and unpaired records fit the tiny recipes' windows: none truncated, dropped
  or skipped over a whole epoch, training and held-out alike.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest
import yaml

from tests.runner import ROOT, Job, wait_for

CONFIGS = ROOT / "configs"

# Warnings and lines that ask nothing of the user (name -> regular expression searched in each screen line).
NOISE = {
    # Lightning's notice on every Trainer: the device used is the configured one.
    "GPU/TPU availability": r"^(GPU|TPU) available: ",
    # Lightning's advice on every multi-rank run: step35's epoch-level values are reduced over the ranks already.
    "sync_dist advice": r"It is recommended to use `self\.log\(",
    # Each rank's copy of the validation-repeat notice, or the notice as a warning: said once, on rank 0.
    "validation repeat as a warning": r"warning: the validation data holds|^\[rank \d+\].*repeated to fill",
    # Built-in data cut to the recipe's window: the recipe's own choice, nothing a user could fix.
    "built-in records cut": r"truncating the |dropping the |overlong records (truncated|dropped)",
}
# A warning of any kind: step35's own, or one Python shows at its source line (`file.py:123: ...`).
WARNING = r"step35: warning: |^\S+\.py:\d+: "
# The README's jobs, shortened: (config, overrides): a few steps, two validations.
SHORT = ["--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=5"]


def screen(output: str) -> list[str]:
    """The lines a terminal shows after receiving `output`: `\\r` returns to the line's start and later text
    overwrites, `\\n` goes to the start of the next line, ESC[nA moves n lines up (tqdm's bars below the first);
    other escape sequences are dropped."""
    lines, row, col = [""], 0, 0
    for token in re.split(r"(\r|\n|\x1b\[[0-9;]*[A-Za-z])", output):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            lines.extend("" for _ in range(row + 1 - len(lines)))
        elif token.startswith("\x1b["):
            if token.endswith("A"):
                row = max(row - int(token[2:-1] or 1), 0)
        elif token:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    return [line.rstrip() for line in lines]


def test_screen_replays_carriage_returns_newlines_and_cursor_moves():
    assert screen("step 1\rstep 2\n") == ["step 2", ""]
    assert screen("bar 50%]\r        \rnote\nbar 60%]") == ["note", "bar 60%]"]  # tqdm.write clears, prints, redraws
    assert screen("main\n val 1\x1b[A\rmain 2") == ["main 2", " val 1"]  # a second bar, then back up
    assert screen("mem=0.52 GiB]`Trainer.fit` stopped\n") == ["mem=0.52 GiB]`Trainer.fit` stopped", ""]


def noise_lines(lines: list[str]) -> dict[str, list[str]]:
    """The screen lines matching each NOISE pattern, for the patterns some line matches."""
    found = {name: [line for line in lines if re.search(pattern, line)] for name, pattern in NOISE.items()}
    return {name: hits for name, hits in found.items() if hits}


def warning_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if re.search(WARNING, line)]


def raw_output(job: Job) -> str:
    """The job's output as written: `\r` kept (Job.output reads the log as text, with `\r` turned into `\n`)."""
    job.output()  # flushed
    return job.log.read_bytes().decode(errors="replace")


def fit_on_screen(tmp_path: Path, cache: Path, config: str, *overrides: str, devices: int = 1) -> list[str]:
    """`step35 fit --config configs/<config> <overrides>` as a process (Lightning's launcher for `devices` > 1),
    stdout and stderr in one unbuffered pipe as on a terminal; the screen it leaves. It must succeed."""
    cmd = [sys.executable, "-m", "step35", "fit", "--config", str(CONFIGS / config), f"--run_dir={tmp_path / 'run'}"]
    if devices > 1:
        cmd += [f"--trainer.devices={devices}", "--trainer.strategy=step35.strategy.Step35Strategy"]
    with Job([*cmd, *overrides], tmp_path / "log.txt", cache, env={"PYTHONUNBUFFERED": "1"}) as job:
        assert job.wait(900) == 0, job.output()[-6000:]
        return screen(raw_output(job))


def assert_quiet(lines: list[str]) -> None:
    """No NOISE, no warning at all, and Lightning's end-of-fit line at the start of its own line."""
    assert noise_lines(lines) == {}, "\n".join(lines[-60:])
    assert warning_lines(lines) == [], "\n".join(lines[-60:])
    stopped = [line for line in lines if "`Trainer.fit` stopped" in line]
    assert stopped and all(line.startswith("`Trainer.fit` stopped: `max_steps=") for line in stopped), stopped


@pytest.mark.heavy  # the main job as a process, shortened
def test_the_main_job_prints_no_warning_and_ends_on_its_own_line(tmp_path, builtin_cache):
    lines = fit_on_screen(tmp_path, builtin_cache, "tiny.yaml", *SHORT, "--trainer.limit_val_batches=2")
    assert_quiet(lines)
    assert any(line.startswith("step: 100%") and "6/6" in line for line in lines), lines[-30:]  # the bar is kept


@pytest.mark.heavy  # the second main job as a process, shortened, on a tiny HF start folder
def test_the_sft_job_says_the_validation_repeat_once_and_nothing_else(tmp_path, builtin_cache):
    from step35.data import builtin_tokenizer_dir
    from tests.helpers import hf_base

    start = hf_base(tmp_path / "start", seed=1)
    tokenizer = builtin_tokenizer_dir(cache_dir=builtin_cache)  # the main job's, with step35's chat template
    lines = fit_on_screen(
        tmp_path, builtin_cache, "tiny-sft.yaml", *SHORT, f"--model.checkpoint={start}", f"--data.tokenizer={tokenizer}"
    )
    assert_quiet(lines)
    repeats = [line for line in lines if "repeated to fill the validation batches" in line]
    # The held-out conversations fill fewer windows than the 8 validation batches of 4 take: said once, a fact.
    assert len(repeats) == 1 and repeats[0].startswith("the validation data holds "), repeats


@pytest.mark.heavy
@pytest.mark.multiprocess  # two ranks, started by Lightning's launcher
def test_a_two_rank_run_says_the_validation_repeat_once_without_sync_dist_advice(tmp_path, builtin_cache):
    # 8 validation batches of 8 windows on each of 2 ranks: 128 windows, more than the built-in held-out corpus's.
    lines = fit_on_screen(tmp_path, builtin_cache, "tiny.yaml", *SHORT, devices=2)
    assert_quiet(lines)
    repeats = [line for line in lines if "repeated to fill the validation batches" in line]
    assert len(repeats) == 1 and repeats[0].startswith("the validation data holds "), repeats


@pytest.mark.heavy  # the main job as a process, stopped by SIGTERM
def test_the_sigterm_line_starts_its_own_line(tmp_path, builtin_cache):
    cmd = [sys.executable, "-m", "step35", "fit", "--config", str(CONFIGS / "tiny.yaml"), f"--run_dir={tmp_path}"]
    cmd += ["--trainer.max_steps=200", "--trainer.val_check_interval=100", "--trainer.limit_val_batches=2"]
    with Job(cmd, tmp_path / "log.txt", builtin_cache, env={"PYTHONUNBUFFERED": "1"}) as job:
        wait_for(lambda: re.search(r"\| [2-9]/200 ", job.output()), 300, job, "the second step on the bar")
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(300) == 75, job.output()[-4000:]  # faults.EXIT_PREEMPTED: stopped after a checkpoint
        lines = screen(raw_output(job))
    received = [line for line in lines if "step35: received SIGTERM" in line]
    assert received and all(line.startswith("[rank 0] step35: received SIGTERM") for line in received), received
    assert any(line.startswith("step: ") for line in lines[: lines.index(received[0])]), lines  # the bar was drawn


# ------------------------------------------------------------------------------- the built-in data, the windows
def recipe_data(config: str) -> dict:
    return yaml.safe_load((CONFIGS / config).read_text())["data"]


@pytest.mark.heavy  # one epoch of each built-in set, tokenized with the template (about 20 s)
@pytest.mark.parametrize("config", ["tiny-sft.yaml", "tiny-dpo.yaml", "tiny-kto.yaml"])
def test_the_builtin_records_fit_the_recipes_windows(config, builtin_cache):
    """Every built-in record of the recipe's format, training and held-out, fits its window whole: the README's
    jobs report nothing truncated, dropped or skipped (before: tiny-sft cut 4 conversations; tiny-dpo cut 65
    pairs and dropped 47 of 464; tiny-kto cut 30 and dropped 46 unpaired records)."""
    from step35.data import Step35DataModule, builtin_tokenizer_dir
    from step35.data.stream import TokenWindows

    data = recipe_data(config)
    dm = Step35DataModule(
        tokenizer=str(builtin_tokenizer_dir(cache_dir=builtin_cache)), format=data.get("builtin") or data["format"],
        seq_len=data["seq_len"],
        micro_batch_size=data["micro_batch_size"], cache_dir=str(builtin_cache), overlong=data["overlong"],
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    counts = {}
    for part, sources in (("train", dm._train_sources), ("val", dm._val_sources)):
        stream = TokenWindows(sources, dm.tokenizer, data["seq_len"], endless=False, **dm._stream_options)
        windows = sum(1 for _ in stream)
        state = stream.state_dict()["sources"][0]
        counts[part] = {kind: state[kind] for kind in ("truncated", "dropped", "skipped")}
        assert windows > 0, part
    assert counts == {part: {"truncated": 0, "dropped": 0, "skipped": 0} for part in ("train", "val")}, counts
