"""The README's own commands, as written: the main job, what it learned (generate), the second main job
(export, fine-tune on conversations, generate --chat) and the LoRA lines (fit, merged export), in that
order, in a fresh folder (so `runs/...` are the README's relative paths), each line run by bash exactly as
the README prints it. The commands are read from the README, so the test follows it when it changes.

Also checked, loosely, what the README says of the results: the main job's validation loss ends below 5
(README: 4.4 at step 400, from 5.5 at step 100; ln 1024 = 6.9 at the start), the fine-tune's held-out
assistant loss falls (README: 4.13 -> 3.07), and the merged export is an HF folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_resume import metric_rows, steps_of

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def bash_blocks(text: str) -> list[list[str]]:
    """The README's ```bash blocks, each as its commands (comments dropped, `\\` continuations joined)."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = body.replace("\\\n", " ")
        lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
        blocks.append([line for line in lines if line and not line.startswith("#")])
    return blocks


def readme_job_commands() -> list[str]:
    """The step35 lines of the quick start, the generate lines, the second main job and the LoRA block:
    every README command that runs on this machine (the install and the test lines are what CI runs;
    the other blocks name clusters and 196B checkpoints)."""
    blocks = bash_blocks(README)
    quick_start = blocks[0]
    assert quick_start[0].startswith("python3 -m venv") and quick_start[-1] == "python -m pytest", quick_start
    commands = [line for line in quick_start if line.startswith("step35 ")]
    for block in blocks[1:]:
        if all(line.startswith("step35 ") and ("runs/tiny" in line or "configs/tiny" in line) for line in block):
            commands += block
    return commands


def test_the_readme_commands_are_found():
    commands = readme_job_commands()
    assert commands[0] == "step35 fit --config configs/tiny.yaml"
    names = [c.split()[1] for c in commands]
    assert names.count("fit") == 3 and names.count("export") == 2 and names.count("generate") >= 4, commands
    assert any("--chat" in c for c in commands) and any("--merge" in c for c in commands), commands


@pytest.mark.multiprocess
@pytest.mark.timeout(3000)
def test_the_readme_commands_run_as_written(tmp_path, builtin_cache):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    bin_dir = Path(sys.executable).parent  # the venv's `step35` entry point
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "STEP35_CACHE": str(builtin_cache),
           "PYTHONPATH": str(ROOT)}
    for command in readme_job_commands():
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-4000:])
        if " generate " in f" {command} ":
            assert proc.stdout.strip(), (command, proc.stderr[-2000:])
        print(f"ok: {command}")
    runs = tmp_path / "runs"
    main_val = steps_of(metric_rows(runs / "tiny" / "csv" / "version_0"), "val/loss")
    assert max(main_val) == 399 and main_val[399] < 5.0, main_val  # (Lightning logs step 400's validation at 399)
    sft_val = steps_of(metric_rows(runs / "tiny-sft" / "csv" / "version_0"), "val/loss")
    assert sft_val[max(sft_val)] < sft_val[min(sft_val)], sft_val
    assert (runs / "tiny-lora" / "merged" / "config.json").is_file()
    assert (runs / "tiny" / "hf" / "config.json").is_file()
