"""Objectives and optimizers answer for themselves (issue 43): outside their rooms (step35/training/) no file
of step35/ asks one by its name. Every `step35/**/*.py` outside training/ is parsed with `ast` and the test
fails listing file:line of each comparison (==, !=, in, not in, a `match` case) with a string that names a
built-in objective or optimizer. The names come from the registries (training/objective.py OBJECTIVES,
training/optimizer.py OPTIMIZERS), so a new one is covered the day it is registered."""

from __future__ import annotations

import ast
from pathlib import Path

from step35.training.objective import OBJECTIVES
from step35.training.optimizer import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1]
ROOMS = "step35/training/"


def _strings(node: ast.AST) -> list[str]:
    """The string constants a comparison operand is: "x", or the members of ("x", "y") / ["x"] / {"x"}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def name_checks(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every comparison in `source` with a string constant that is one of `names`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        found += [(node.lineno, s) for operand in operands for s in _strings(operand) if s in names]
    return found


def test_no_objective_or_optimizer_is_asked_by_name_outside_its_room():
    names = set(OBJECTIVES) | set(OPTIMIZERS)
    found = []
    for path in sorted((ROOT / "step35").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith(ROOMS):
            found += [f"{relative}:{line}: {name!r}" for line, name in name_checks(path.read_text(), names)]
    assert not found, (
        "objectives and optimizers are asked what they are (training/objective.py Objective, "
        "training/optimizer.py OptimizerKind), never compared by name outside step35/training/:\n  "
        + "\n  ".join(found)
    )


def test_the_checker_finds_each_way_of_comparing_a_name():
    source = (
        'if s.optimizer == "muon":\n'  # 1
        "    pass\n"
        'ok = "dpo" != objective.name\n'  # 3
        'many = kind in ("lm", "other")\n'  # 4
        "match name:\n"
        '    case "adamw":\n'  # 6
        "        pass\n"
        'fine = {"dpo": 1}["dpo"]; default = "lm"\n'  # a key, a value: not comparisons
        'other = s.optimizer == "sgd"\n'  # not a registered name
    )
    assert name_checks(source, {"muon", "dpo", "lm", "adamw"}) == [(1, "muon"), (3, "dpo"), (4, "lm"), (6, "adamw")]


def test_the_registries_name_the_built_ins():
    # What the grep above is made of: if a registry moved or emptied, the test would pass on nothing.
    assert {"lm", "dpo"} <= set(OBJECTIVES) and {"adamw", "muon"} <= set(OPTIMIZERS)
