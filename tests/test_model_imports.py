"""The model package is the layer below checkpoints, parallelism and Lightning (docs/architecture.md):
nothing in step35/model imports step35.checkpoint, torch.distributed or Lightning, and importing it
loads none of them."""

import ast
from pathlib import Path

import pytest

import step35.model
from tests.runner import python

MODEL_DIR = Path(step35.model.__file__).parent
FORBIDDEN = (
    "step35.checkpoint",
    "step35.parallel",
    "step35.module",
    "step35.strategy",
    "step35.callbacks",
    "torch.distributed",
    "lightning",
    "pytorch_lightning",
)


def _imports(path: Path) -> list[str]:
    """Every module name an import statement in `path` names (function-local imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]  # `from torch import distributed`
    return names


def test_model_sources_import_no_higher_layer():
    found = [
        f"{path.name}: {name}"
        for path in sorted(MODEL_DIR.glob("*.py"))
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert found == []


def loaded_by(imports: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with one of `prefixes` that `import <imports>` loads in a fresh interpreter (this
    test process has long imported everything)."""
    proc = python(f"import sys, {imports}; print('\\n'.join(m for m in sys.modules if m.startswith({prefixes!r})))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


@pytest.mark.heavy  # a subprocess (tests/test_layers.py stays quick)
def test_importing_the_model_loads_no_higher_layer():
    prefixes = ("step35.checkpoint", "step35.parallel", "step35.module", "lightning", "pytorch_lightning")
    assert loaded_by("step35.model", prefixes) == []


@pytest.mark.heavy  # a subprocess
def test_export_and_generate_start_without_lightning():
    # Lightning (with torchmetrics and, where installed, transformers) is ~2/3 of a process's start-up: the
    # commands that only read checkpoints must not pay it (step35/checkpoint/training/plugin.py holds its side).
    prefixes = ("lightning", "pytorch_lightning", "torchmetrics")
    assert loaded_by("step35.commands.export, step35.commands.generate", prefixes) == []


@pytest.mark.heavy  # a subprocess
def test_a_job_the_tests_start_imports_no_test_oracle():
    # A rank of `step35 fit` imports Lightning, whose torchmetrics imports transformers whenever it can (~3 s of
    # every start on CI's two cores): the tests' references live in .oracle (tests/oracles.txt), off the path of
    # the jobs they start, so those jobs start as a user's install does. Fails when an oracle is installed into
    # step35's environment again (e.g. back in the dev extra).
    assert loaded_by("step35.commands.fit", ("transformers", "peft", "accelerate", "msprobe")) == []
