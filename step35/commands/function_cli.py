"""Subcommands that are one documented function (`step35 export`, `step35 generate`): the function's
signature and docstring are the options and their help, parsed by jsonargparse like every other
step35 option (underscore names, `--config` YAML; a bool option given alone, `--chat`, means true), and a
CheckpointError ends the command with its one-line message instead of a traceback."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

from step35.checkpoint.errors import CheckpointError


def run_function(function: Callable, prog: str, argv: list[str] | None = None) -> None:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog=prog, description=(function.__doc__ or "").split("\n\n")[0], default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with any of these options")
    parser.add_function_arguments(function, as_group=False)
    args = parser.parse_args(bare_flags_as_true(function, sys.argv[1:] if argv is None else argv))
    args.pop("config", None)
    try:
        function(**args.as_dict())
    except CheckpointError as e:
        raise SystemExit(f"{prog}: {e}") from None


def bare_flags_as_true(function: Callable, argv: list[str]) -> list[str]:
    """`--chat` alone (the last word, or followed by another option) means `--chat true` for a bool
    parameter of `function`; jsonargparse would otherwise ask for the value."""
    flags = {
        f"--{name}" for name, p in inspect.signature(function).parameters.items() if p.annotation in (bool, "bool")
    }
    out = []
    for i, word in enumerate(argv):
        out.append(word)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if word in flags and (following is None or following.startswith("--")):
            out.append("true")
    return out
