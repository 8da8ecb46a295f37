"""The Quick start's two commands (README.md): `make run` (the main job) and `make test` (the tests), each doing its
own set-up from the Makefile, and `.ci/run` calling the test command exactly as the README prints it.

Three levels, from the cheapest:
- what the commands run: `make -n` prints the README's by-hand main job and test command;
- the set-up's bookkeeping, offline, with a stand-in python3 that records each call: a fresh folder makes the venv
  and runs both installs once, a second command installs nothing and prints only the command it runs, a changed
  pyproject.toml or tests/oracles.txt redoes its install alone, a failed install is retried;
- both commands on a fresh `git clone` of this repository, finding the main job's validation loss and the tests'
  passed count. The clone's install would need the package index, which tests do not reach: by default the
  commands run in this test's own environment through STEP35_VENV (nothing installed; the clone's code comes
  first on PYTHONPATH), so what the fresh clone exercises is the Makefile's commands, the README's main job and
  pytest's collection in a tree with no .venv, .oracle or runs/. STEP35_TEST_INSTALL=1 makes the clone's commands
  install for real (.venv and .oracle from pip; network or a local index needed) and checks that a second
  `make test` installs nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from tests.helpers import metric_rows, steps_of
from tests.runner import ONE_PROCESS_THREADS, environment, run_process_group
from tests.test_readme import quick_start

ROOT = Path(__file__).parent.parent
# Variables of an outer make (a `make test` that runs this file) or pytest that would reach the nested commands:
# MAKEFLAGS carries the outer command line's variables (TESTS=..., STEP35_VENV=...) into every make below.
INHERITED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "STEP35_VENV", "PYTHONPATH")

pytestmark = pytest.mark.early(minutes=3.0)  # the main job in a fresh clone (~2 min on two cores), then pytest


def clean_environment(base: Mapping[str, str] = os.environ, **extra: str) -> dict[str, str]:
    """`base` without an outer make's or pytest's variables (INHERITED, PYTEST_*), with `extra` on top."""
    env = {k: v for k, v in base.items() if k not in INHERITED and not k.startswith("PYTEST_")}
    env.update(extra)
    return env


def make(folder: Path, *args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return run_process_group(["make", "--no-print-directory", *args], timeout=timeout, cwd=folder, env=env)


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


# ----------------------------------------------------------------------------------- what the commands run
def test_ci_runs_the_quick_starts_test_command_as_printed():
    two_commands, _ = quick_start()
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == two_commands[1] == "make test", commands


@needs_make
def test_the_two_commands_run_the_readmes_main_job_and_tests():
    """`make run` runs the by-hand block's main job and `make test` its test command, in the environment named."""
    two_commands, by_hand = quick_start()
    env = clean_environment(STEP35_VENV="/some/venv")
    run = make(ROOT, "-n", *two_commands[0].split()[1:], env=env)
    main_job = next(line for line in by_hand if line.startswith("step35 fit"))
    assert run.returncode == 0 and run.stdout.splitlines() == [f"/some/venv/bin/{main_job}"], run
    test = make(ROOT, "-n", *two_commands[1].split()[1:], "TESTS=tests/test_config.py -x", env=env)
    assert test.returncode == 0 and test.stdout.splitlines() == [
        f"/some/venv/bin/{by_hand[-1]} tests/test_config.py -x"
    ], test


# ----------------------------------------------------------------------------------- the set-up, offline
FAKE_PYTHON = """#!/bin/sh
# A stand-in for python3 and for the venv's python and step35: records its call, makes what the call would make.
echo "$(basename "$0") $*" >> "$FAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && cp "$0" "$3/bin/step35"; fi
if [ "$1 $2" = "-m pip" ]; then
    [ -n "$FAKE_PIP_FAILS" ] && echo "ERROR: no matching distribution" >&2 && exit 1
    previous=""
    for arg in "$@"; do [ "$previous" = "--target" ] && mkdir -p "$arg"; previous="$arg"; done
fi
exit 0
"""
VENV = "python3 -m venv .venv"
INSTALL = "python -m pip install -e .[dev]"
ORACLES = "python -m pip install --no-deps --upgrade --target .oracle -r tests/oracles.txt"
APART = "python -m pip install --no-deps --upgrade --target .oracle/_torchvision torchvision==0.28.0"
PYTEST = "python -m pytest tests/test_config.py"
MAIN_JOB = "step35 fit --config configs/tiny.yaml"


@pytest.fixture
def fake_checkout(tmp_path) -> tuple[Path, Callable[..., tuple[int, str, list[str]]]]:
    """A folder with the Makefile and the files its set-up is keyed on, and a function running `make ARGS` there
    with the stand-in python3; it returns (exit code, output, the calls the stand-in recorded)."""
    folder = tmp_path / "checkout"
    (folder / "tests").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "tests/oracles.txt"):
        shutil.copy(ROOT / name, folder / name)
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"

    def run(*args: str, **extra: str) -> tuple[int, str, list[str]]:
        log.write_text("")
        env = clean_environment(FAKE_LOG=str(log), **extra)
        proc = make(folder, f"PYTHON={fake}", *args, env=env)
        return proc.returncode, proc.stdout + proc.stderr, log.read_text().splitlines()

    return folder, run


@needs_make
def test_the_set_up_runs_once_and_again_only_for_what_changed(fake_checkout):
    folder, make_here = fake_checkout
    code, out, calls = make_here("test", "TESTS=tests/test_config.py")
    assert code == 0 and calls == [VENV, INSTALL, ORACLES, APART, PYTEST], (out, calls)
    assert "make: installing step35 into .venv (pyproject.toml is new or changed)" in out
    assert "make: installing the tests' outside references into .oracle (tests/oracles.txt is new or changed)" in out

    # Done: the second time installs nothing and says only what it runs.
    code, out, calls = make_here("test", "TESTS=tests/test_config.py")
    assert code == 0 and calls == [PYTEST] and out == f".venv/bin/{PYTEST}\n", (out, calls)
    code, out, calls = make_here("run")
    assert code == 0 and calls == [MAIN_JOB] and out == f".venv/bin/{MAIN_JOB}\n", (out, calls)

    # A changed tests/oracles.txt redoes the oracles alone; a changed pyproject.toml the install alone.
    with open(folder / "tests" / "oracles.txt", "a") as f:
        f.write("# one more line\n")
    assert make_here("test", "TESTS=tests/test_config.py")[2] == [ORACLES, APART, PYTEST]
    with open(folder / "pyproject.toml", "a") as f:
        f.write("# one more line\n")
    assert make_here("run")[2] == [INSTALL, MAIN_JOB]
    assert make_here("test", "TESTS=tests/test_config.py")[2] == [PYTEST]


@needs_make
def test_a_failed_install_stops_the_command_and_is_retried_by_the_next(fake_checkout):
    folder, make_here = fake_checkout
    code, out, calls = make_here("run", FAKE_PIP_FAILS="1")
    assert code != 0 and calls == [VENV, INSTALL], (out, calls)  # the main job does not start
    assert "ERROR: no matching distribution" in out
    code, out, calls = make_here("run")
    assert code == 0 and calls == [INSTALL, MAIN_JOB], (out, calls)


@needs_make
def test_step35_venv_runs_in_that_environment_and_installs_nothing(fake_checkout):
    folder, make_here = fake_checkout
    make_here("run")  # a venv to name (its stand-in python and step35)
    (folder / "pyproject.toml").write_text("changed\n")
    code, out, calls = make_here("test", "TESTS=tests/test_config.py", STEP35_VENV=str(folder / ".venv"))
    assert code == 0 and calls == [PYTEST], (out, calls)
    assert not (folder / ".oracle").exists()


# ----------------------------------------------------------------------------------- a fresh clone
@needs_make
@pytest.mark.heavy  # the main job (300 steps) and a pytest run, in processes of their own
@pytest.mark.timeout(3000)
def test_the_two_commands_on_a_fresh_clone_train_the_main_job_and_pass_tests(tmp_path, builtin_cache):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    install = os.environ.get("STEP35_TEST_INSTALL") == "1"
    env = clean_environment(environment(builtin_cache, threads=ONE_PROCESS_THREADS))
    if not install:  # this environment, the clone's code first (the venv's editable install is this checkout)
        env.update(STEP35_VENV=sys.prefix, PYTHONPATH=str(clone))
        assert Path(sys.prefix, "bin", "step35").is_file(), f"{sys.prefix} is not a venv with step35 installed"
    two_commands, _ = quick_start()

    run = make(clone, *two_commands[0].split()[1:], env=env, timeout=2400)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    val = steps_of(metric_rows(clone / "runs" / "tiny" / "csv" / "version_0"), "val/loss")
    # README: validation 5.5 at step 100, 4.6 at step 300 (Lightning logs step 300's at 299)
    assert max(val) == 299 and val[99] == pytest.approx(5.54, abs=0.2) and val[299] == pytest.approx(4.64, abs=0.2)

    selection = "TESTS=tests/test_config.py"
    test = make(clone, *two_commands[1].split()[1:], selection, env=env, timeout=1200)
    assert test.returncode == 0, (test.stdout[-4000:], test.stderr[-2000:])
    passed = re.search(r"=+ (\d+) passed[ ,]", test.stdout)
    written = len(re.findall(r"^def test_", (clone / "tests" / "test_config.py").read_text(), flags=re.M))
    assert passed and int(passed.group(1)) >= written > 0 and " failed" not in test.stdout, test.stdout[-2000:]
    if install:  # done: the second time installs nothing
        again = make(clone, *two_commands[1].split()[1:], selection, env=env, timeout=1200)
        assert again.returncode == 0 and "make: installing" not in again.stdout + again.stderr, again.stdout[-2000:]
