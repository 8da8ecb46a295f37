"""The house style, as CI runs it: `ruff check` (the rules of [tool.ruff.lint] in pyproject.toml) and
`ruff format --check` over the whole tree. A failure lists the files and rules to fix; `ruff check --fix`
and `ruff format` fix most of them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.quick


def ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is in the dev extra (pip install -e '.[dev]')")
    return [found]


@pytest.mark.parametrize(
    "command", [["check", "--output-format", "concise"], ["format", "--check"]], ids=["lint", "format"]
)
def test_the_tree_keeps_the_ruff_rules(command):
    proc = subprocess.run([*ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
