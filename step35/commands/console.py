"""What `step35 fit|validate` prints besides its own lines.

Libraries' notices that say nothing the user can act on are dropped (each entry below says why), and
step35's own warnings print as `step35: warning: ...`: Python would show them under the file that
called the hook they came from (Lightning's `trainer/call.py`), which reads as a Lightning problem.
Everything else (other warnings, Lightning's info lines) is shown as usual.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

from step35 import job

# Regular expressions matched against the start of a warning's message.
IGNORED_WARNINGS = (
    # Lightning 2.6's own pytree helper on torch 2.13: internal to Lightning, nothing to change here.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # torchdata's StatefulDataLoader calls a torch API that torch has deprecated: internal to torchdata.
    r"'set_vital' is deprecated",
    # RunCheckpoint saves into the run folder across attempts by design; a fresh start in a folder that
    # holds checkpoints is reported by step35 itself (step35/run).
    r"Checkpoint directory .* exists and is not empty",
)

# Starts of Lightning's info lines that are dropped (Lightning prints them through its rank_zero loggers).
_RANK_ZERO_LINES = (
    # An advertisement for a cloud logger, printed by every Trainer.
    "💡 Tip:",
    # Said when a model summary is configured, as the CLI does (step35/callbacks/summary.py).
    "Trainer already configured with model summary",
)
# Logger name -> starts of its lines that are dropped.
IGNORED_LOG_LINES = {
    "lightning.pytorch.utilities.rank_zero": _RANK_ZERO_LINES,
    "lightning.fabric.utilities.rank_zero": _RANK_ZERO_LINES,
    # Printed at each save of a full checkpoint (optimizer included), which is what step35 saves.
    "lightning.pytorch.trainer.connectors.checkpoint_connector": ("`weights_only` was not set",),
}

# Frames of these modules sit between a warning's author and warnings.warn (Lightning's rank_zero_warn).
_RELAY_MODULES = (
    "warnings",
    "lightning_utilities.core.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.utilities.rank_zero",
)


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


def warning_author(frame=None) -> str | None:
    """The module that called warnings.warn (directly or through Lightning's rank_zero_warn), found on
    the live stack: the `filename` Python passes to showwarning is the frame `stacklevel` points at."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != "warnings" and not name.startswith(_RELAY_MODULES[1:]):
            return name
        frame = frame.f_back
    return None


def rank_prefix() -> str:
    """`[rank N] ` before a line printed by a rank other than the job's 0 (ranks share one terminal); the
    rank as the launcher set it (step35.job), before any process group exists."""
    place = job.this_process()
    return "" if place.is_rank_zero else f"[{place.describe()}] "


@contextlib.contextmanager
def step35_console() -> Iterator[None]:
    """Within it: the notices above are dropped and step35's warnings print as step35's. Warning filters,
    showwarning and the logging filters are restored on exit."""
    filters = []
    for name, starts in IGNORED_LOG_LINES.items():
        logger, drop = logging.getLogger(name), _DropLines(starts)
        logger.addFilter(drop)
        filters.append((logger, drop))
    with warnings.catch_warnings():
        for pattern in IGNORED_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        shown_by_python = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            author = warning_author(sys._getframe(1))
            if author is not None and author.split(".")[0] == "step35":
                stream = file if file is not None else sys.stderr
                text = str(message) if issubclass(category, UserWarning) else f"{category.__name__}: {message}"
                try:
                    print(f"{rank_prefix()}step35: warning: {text}", file=stream, flush=True)
                except OSError:  # as Python's own showwarning: a closed stream loses the warning
                    pass
            else:
                shown_by_python(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        try:
            yield
        finally:
            for logger, drop in filters:
                logger.removeFilter(drop)
