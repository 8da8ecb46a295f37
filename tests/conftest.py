import os
import sys
from pathlib import Path

import pytest

# The tests' outside references (transformers, PEFT, Huawei's NPU reference: tests/oracles.txt) live in .oracle,
# on this process's path only: a step35 process a test starts imports what a user's install has, not
# transformers through torchmetrics (~3 s of every rank's start). Appended: step35's own packages come first.
_ORACLE = Path(__file__).parent.parent / ".oracle"
if _ORACLE.is_dir() and str(_ORACLE) not in sys.path:
    sys.path.append(str(_ORACLE))

# Two OpenMP threads for the tests in this process on a two-core machine; one per worker when two
# pytest-xdist workers share it (pyproject.toml's addopts), as the jobs the tests start have one per rank.
# A worker sets it whatever it inherited: the controller's own setdefault ("2") reaches the workers through
# their environment, and two workers of two OpenMP threads on two cores ran in-process training 10x slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
# Bytecode of step35 and of the tests, written once per run: a machine with PYTHONDONTWRITEBYTECODE=1 (CI's image)
# otherwise recompiles step35's ~70 modules from source in each of the ~200 processes the suite starts (0.4 s each).
# Stale files are recompiled here; nothing else changes (imports read __pycache__ whatever that variable says).
if not os.environ.get("PYTEST_XDIST_WORKER"):
    import compileall

    for _folder in ("step35", "tests"):
        compileall.compile_dir(Path(__file__).parent.parent / _folder, quiet=1)
os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network from tests
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_report_header(config):
    """The machine in the run's header: the suite's time has differed 2.5x between the machines CI ran on."""
    import platform

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"machine: {model}, {os.cpu_count()} CPUs"


# The quick tier, `python -m pytest -m quick` (README, "for people changing the code"): every test of the
# default run that runs in this one process and in seconds, which still covers each package. A test is left
# out of it by a marker where it is written: `slow`, `multiprocess`, or `heavy` (a process of its own, a
# compile, a training run of 10 s or more; the marker's comment says which). CI runs the full default run.
TIER_MARKERS = ("slow", "multiprocess", "heavy")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(name) for name in TIER_MARKERS):
            item.add_marker(pytest.mark.quick)

    # Files marked `early(minutes)` first, the longest first, each in its written order, the rest as collected:
    # the workers of a parallel run take files in this order, so a long file never starts last, alone.
    def minutes(item) -> float:
        early = item.get_closest_marker("early")
        return -early.kwargs["minutes"] if early is not None else 0.0

    items.sort(key=minutes)


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    """A cache folder holding the built-in corpus and tokenizer, built once per test session."""
    from step35.data import builtin_corpus_path, builtin_tokenizer_dir

    path = tmp_path_factory.mktemp("step35-cache")
    builtin_corpus_path(cache_dir=path)
    builtin_tokenizer_dir(cache_dir=path)
    return path


# The word-level chat tokenizer with its template (tests/helpers/chat.py make_chat_tokenizer), for the conversation
# and preference data tests; a module that defines its own `tok` uses that one.
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tests.helpers import make_chat_tokenizer

    return make_chat_tokenizer(tmp_path_factory.mktemp("word_tokenizer"), template=True)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from step35.data.tokenizer import TextTokenizer

    return TextTokenizer.from_folder(tok_dir)


@pytest.fixture(scope="module")
def template(tok_dir):
    from step35.data.chat_template import ChatTemplate

    return ChatTemplate.from_folder(tok_dir)


@pytest.fixture
def step35_here(capfd, monkeypatch, builtin_cache):
    """`step35 <args>` in this process (tests/runner.cli), as a job started by tests/runner.step35 would see
    it: in the repository root, with the session's built-in cache. Returns a function of the arguments
    giving (exit code, stdout, stderr), captured at the file descriptors (step35.faults reports a failure
    with os.write to fd 2); an exception that would end the process is printed with its traceback and
    gives exit code 1, as Python does. For refusals and reports where the process boundary is not tested."""
    import traceback

    from tests.runner import ROOT, cli

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))

    def run(*args: str) -> tuple[int, str, str]:
        try:
            return cli(capfd, *args)
        except Exception:
            traceback.print_exc()
            out = capfd.readouterr()
            return 1, out.out, out.err

    return run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, builtin_cache):
    """A from-scratch tiny run of 3 steps on the built-in corpus, saved as a run folder would be
    (<run>/checkpoints/step=000003.ckpt with its manifest, last.ckpt). Returns (run folder, model)."""
    from step35.module import Step35LightningModule
    from tests.helpers import checkpointed_fit

    run = tmp_path_factory.mktemp("tiny-run")
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1)
    checkpointed_fit(module, run, builtin_cache, steps=3, every=3)
    return run, module.model


# Set by in-process runs of Lightning's distributed strategies (e.g. MASTER_PORT, picked once per
# process): left in os.environ they would be inherited by every later subprocess test, which would
# then all try to listen on that one port.
_LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "STEP35_JOB",
)


@pytest.fixture(autouse=True)
def _no_launch_variables_leak():
    before = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
