"""Subcommands that are one documented function (`step35 export`, `step35 generate`): the function's
signature and docstring are the options and their help, parsed by jsonargparse like every other
step35 option (underscore names, `--config` YAML), and a CheckpointError ends the command with its
one-line message instead of a traceback."""

from __future__ import annotations

from typing import Callable

from step35.checkpoint.errors import CheckpointError


def run_function(function: Callable, prog: str, argv: list[str] | None = None) -> None:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog=prog, description=(function.__doc__ or "").split("\n\n")[0], default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with any of these options")
    parser.add_function_arguments(function, as_group=False)
    args = parser.parse_args(argv)
    args.pop("config", None)
    try:
        function(**args.as_dict())
    except CheckpointError as e:
        raise SystemExit(f"{prog}: {e}") from None
