"""The one check of the module's numeric options: each value against its rule, refused with the option named;
and the one reader of an objective's options dataclass from what the config gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")

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


def options_of(cls: type[T], value: Any, option: str, what: str) -> T:
    """`cls` (an options dataclass) from an instance, a dict of its fields (a jsonargparse Namespace too) or None
    (the defaults); anything else, and unknown fields, refused naming `model.<option>`."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if not isinstance(value, dict):
        raise ValueError(f"model.{option} must be a mapping of {what} options or null, got {type(value).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"model.{option}: unknown field(s) {unknown} for {what}; valid: {sorted(names)}")
    return cls(**value)
