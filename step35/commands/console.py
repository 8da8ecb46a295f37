"""What `step35 fit|validate` prints besides its own lines.

Libraries' notices that say nothing the user can act on are dropped (each entry below says why), and
step35's own warnings print as `step35: warning: ...`: Python would show them under the file that
called the hook they came from (Lightning's `trainer/call.py`), which reads as a Lightning problem.
Everything else (other warnings, Lightning's info lines) is shown as usual.

While a progress bar is drawn, its line is open (the cursor sits at its end): warnings and Lightning's
lines are written through tqdm (`tqdm.write` clears the bars, prints the line, draws them again below),
so that none is spliced into the bar (``mem=0.52 GiB]`Trainer.fit` stopped``). Lines step35 writes on
fd 2 itself (a received signal, a failure) start with a newline then (`faults.write_stderr`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

from step35 import faults, job

# Regular expressions matched against the start of a warning's message.
IGNORED_WARNINGS = (
    # Lightning 2.6's own pytree helper on torch 2.13: internal to Lightning, nothing to change here.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # torchdata's StatefulDataLoader calls a torch API that torch has deprecated: internal to torchdata.
    r"'set_vital' is deprecated",
    # RunCheckpoint saves into the run folder across attempts by design; a fresh start in a folder that
    # holds checkpoints is reported by step35 itself (step35/run).
    r"Checkpoint directory .* exists and is not empty",
    # On every multi-rank run: the epoch-level values step35 logs without sync_dist (val/ppl, the objectives'
    # val/ summaries) are computed from values already reduced over the set and the ranks
    # (Step35LightningModule.on_validation_epoch_end); syncing them again would change nothing.
    r"It is recommended to use `self\.log\('val/[^']*', \.\.\., sync_dist=True\)`",
)

# Starts of Lightning's info lines that are dropped (Lightning prints them through its rank_zero loggers).
_RANK_ZERO_LINES = (
    # An advertisement for a cloud logger, printed by every Trainer.
    "💡 Tip:",
    # Said when a model summary is configured, as the CLI does (step35/callbacks/summary.py).
    "Trainer already configured with model summary",
    # Printed by every Trainer: whether a GPU / TPU exists. The device used is the one configured
    # (trainer.accelerator); one present and unused is still said, as a warning ("GPU available but not used").
    "GPU available: ",
    "TPU available: ",
)
# Logger name -> starts of its lines that are dropped.
IGNORED_LOG_LINES = {
    "lightning.pytorch.utilities.rank_zero": _RANK_ZERO_LINES,
    "lightning.fabric.utilities.rank_zero": _RANK_ZERO_LINES,
    # Printed at each save of a full checkpoint (optimizer included), which is what step35 saves.
    "lightning.pytorch.trainer.connectors.checkpoint_connector": ("`weights_only` was not set",),
}

# Loggers with a handler of their own that prints Lightning's lines (and step35's rank_zero_info) on stderr.
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")

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


class _AroundBars:
    """The text stream of a logging handler, written through tqdm while a progress bar is drawn."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        if faults.bar_on_screen():
            from tqdm import tqdm

            tqdm.write(text, file=self.stream, end="")
        else:
            self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # encoding, isatty, name, ...: the stream's own
        return getattr(self.stream, name)


def write_line(text: str, stream=None) -> None:
    """`text` and a newline on `stream` (default: sys.stderr as it is at the call), through tqdm while a
    progress bar is drawn, so that the line is not spliced into the bar's."""
    stream = stream if stream is not None else sys.stderr
    if faults.bar_on_screen():
        from tqdm import tqdm

        tqdm.write(text, file=stream)
    else:
        stream.write(text + "\n")
    stream.flush()


def _route_log_lines() -> list[tuple[logging.StreamHandler, object]]:
    """Lightning's console handlers made to write around the progress bars; (handler, its stream) to restore.
    The stream is swapped, not set (`setStream` flushes the old one, which may be closed: a test's capture)."""
    swapped = []
    for name in _LIGHTNING_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler and not isinstance(handler.stream, _AroundBars):
                swapped.append((handler, handler.stream))
                handler.stream = _AroundBars(handler.stream)
    return swapped


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
    """Within it: the notices above are dropped, step35's warnings print as step35's, and warnings and
    Lightning's lines are written around the progress bars. Warning filters, showwarning, the logging filters
    and the handlers' streams are restored on exit."""
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
                    write_line(f"{rank_prefix()}step35: warning: {text}", stream)
                except OSError:  # as Python's own showwarning: a closed stream loses the warning
                    pass
            elif faults.bar_on_screen():
                try:
                    write_line(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file)
                except OSError:
                    pass
            else:
                shown_by_python(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        swapped = _route_log_lines()
        try:
            yield
        finally:
            for handler, stream in swapped:
                handler.stream = stream
            for logger, drop in filters:
                logger.removeFilter(drop)
