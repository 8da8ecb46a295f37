"""The one check of the module's numeric options: each value against its rule, refused with the option named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Rule = tuple[Any, Callable[[Any], bool], str]  # (value, test, what it must be)


def check_rules(rules: dict[str, Rule]) -> None:
    """Raise ValueError `model.<name>=<value>: must be <requirement>` for the first value whose test fails
    (NaN fails every comparison, so it is refused too; a value of the wrong type as well)."""
    for name, (value, ok, requirement) in rules.items():
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            shown = list(value) if isinstance(value, tuple) else value
            raise ValueError(f"model.{name}={shown}: must be {requirement}")
