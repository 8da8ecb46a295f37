"""Objectives and optimizers answer for themselves (issue 43): outside their rooms (step35/training/) no file
of step35/ asks one by its name. Every `step35/**/*.py` outside training/ is parsed with `ast` and the test
fails listing file:line of each comparison (==, !=, in, not in, a `match` case) with a string that names a
built-in objective or optimizer. The names come from the registries (training/objective.py OBJECTIVES,
training/optimizer.py OPTIMIZERS), so a new one is covered the day it is registered."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from step35.training.objective import (
    OBJECTIVES,
    LanguageModelObjective,
    Needs,
    ObjectiveInputs,
    build_objective,
)
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


class TwiceTheActivations(LanguageModelObjective):
    """An objective from outside step35, named by its class path: the language model keeping twice the
    activations per token (what the plan must read from it, not from a name)."""

    name = "tests.test_rooms.TwiceTheActivations"

    @classmethod
    def needs(cls, inputs: ObjectiveInputs) -> Needs:
        return Needs(activation_factor=2.0)


def test_a_class_path_objective_is_built_and_planned_by_what_it_declares():
    from step35.plan.devices import DEVICES
    from step35.plan.planner import make_plan
    from step35.plan.settings import read_settings

    path = "tests.test_rooms.TwiceTheActivations"
    built = build_objective(path)  # imported by its path (pytest may hold this file under another module name)
    assert type(built).__name__ == "TwiceTheActivations" and isinstance(built, LanguageModelObjective)
    with pytest.raises(
        ValueError, match=r"model.dpo is set but model.objective=tests.test_rooms.Twice.*drop model.dpo"
    ):
        build_objective(path, {"beta": 0.1})
    with pytest.raises(ValueError, match=r"model.objective='nowhere.Objective': cannot import it"):
        build_objective("nowhere.Objective")

    def activations(*objective: str) -> int:
        s = read_settings(["--config", str(ROOT / "configs" / "tiny.yaml"), *objective])
        return make_plan(s, DEVICES["h100"], allocator_margin=0.1).activations.total

    assert activations("--model.objective", path) == pytest.approx(2 * activations(), abs=2)
