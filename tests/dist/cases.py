"""Several runs of a tests/dist script in one job: `--case NAME=OPTIONS` (repeated) runs the script's `run` once per
case, in one process group, and rank 0 writes {NAME: result} to --out; without --case, the options on the command
line are one run and --out gets its result. Starting a job (Python, torch and a gloo group on every rank) costs more
than a tiny-model case, so the tests start one job per world size and compare every case against it.

  torchrun --standalone --nproc-per-node 4 tests/dist/train_steps.py --out r.pt --case ep2="--ep 2" --case ep4="--ep 4"
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import shlex
from collections.abc import Callable

import torch
import torch.distributed as dist


def main(options: argparse.ArgumentParser, run: Callable[[argparse.Namespace, bool], dict | None],
         argv: list[str] | None = None, save: Callable[[object, str], None] = torch.save) -> None:
    """Parse --out and --case from `argv`, the rest by `options`; call run(args, distributed) per case (torchrun
    sets WORLD_SIZE: then one gloo process group for all of them); rank 0 saves the result(s) with `save`."""
    atexit.register(gc.freeze)  # as step35.cli.main: the exit's final collections skip torch's objects
    top = argparse.ArgumentParser(add_help=False)
    top.add_argument("--out", required=True)
    top.add_argument("--case", action="append", default=[], metavar="NAME=OPTIONS")
    known, rest = top.parse_known_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    if known.case:
        assert not rest, f"options outside a --case: {rest}"
        result = {}
        for case in known.case:
            name, _, opts = case.partition("=")
            result[name] = run(options.parse_args(shlex.split(opts)), distributed)
    else:
        result = run(options.parse_args(rest), distributed)
    if not distributed or dist.get_rank() == 0:
        save(result, known.out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def case_args(cases: dict[str, list[str]]) -> list[str]:
    """The command-line arguments that run `cases` ({name: options}) in one job."""
    return [f"--case={name}={shlex.join(opts)}" for name, opts in cases.items()]
