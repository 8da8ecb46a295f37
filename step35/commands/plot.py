"""`step35 plot RUN`: a run's training curves as one PNG, from the metrics its CSV logger wrote.

    step35 plot runs/tiny                      # -> runs/tiny/plots/training.png
    step35 plot runs/tiny --out curves.png

`step35 fit` writes the same picture at the end of every fit (rank 0; `Step35CLI.after_fit`), so a run folder
holds its curves beside its checkpoints; this command draws them again, e.g. while a run is going or after one
that was stopped.

What is drawn: one panel per group of metrics, and only the groups the run logged (PANELS): the losses
(training `train/loss` and `train/lm_loss`, validation `val/loss`), a preference objective's loss (DPO, KTO),
the learning rate of each parameter group, the gradient norm, tokens/s, a preference objective's rewards
(DPO's chosen and rejected, KTO's desirable and undesirable) and DPO's reward accuracy, online RL's rewards
(`train/reward`, `val/reward` and each reward function's). Steps are the CSV's (Lightning's 0-based step
index: the validation after 300 optimizer steps sits at 299).

A run folder holds one `csv/version_N/` per attempt; they are read in order, and an attempt that resumed
replaces what the earlier ones logged from its first step on (the steps it trained again), so a resumed run
draws as one curve. Rendering uses matplotlib's object API (no pyplot, no global backend), and the file is
written beside its final name and renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from step35.checkpoint.publish import partial_path, publish

PLOT_FILE = Path("plots") / "training.png"  # inside the run folder
CSV_NAME = "csv"  # the CSV logger's folder in the run folder (step35.loggers.CSVLogger's default name)
FEW_POINTS = 30  # a series with fewer points (validations, a short run) is drawn with a marker at each


@dataclass(frozen=True)
class Panel:
    """One panel: its title, its y-axis label, and the metrics it draws (fnmatch patterns, in legend order)."""

    title: str
    ylabel: str
    patterns: tuple[str, ...]


PANELS = (
    Panel("loss", "loss", ("train/loss", "train/lm_loss", "val/loss")),
    Panel("preference loss", "loss", ("train/dpo_loss", "val/dpo_loss", "train/kto_loss", "val/kto_loss")),
    Panel("learning rate", "lr", ("lr/*",)),
    Panel("gradient norm", "global L2 norm", ("train/grad_norm",)),
    Panel("throughput", "tokens/s (all ranks)", ("throughput/tokens_per_s",)),
    Panel(
        "preference rewards",
        "beta * log-ratio",
        (
            "train/chosen_reward",
            "train/rejected_reward",
            "val/chosen_reward",
            "val/rejected_reward",
            "train/desirable_reward",
            "train/undesirable_reward",
            "val/desirable_reward",
            "val/undesirable_reward",
        ),
    ),
    Panel("reward accuracy", "chosen > rejected", ("train/reward_accuracy", "val/reward_accuracy")),
    Panel("RL reward", "mean reward", ("train/reward", "val/reward", "train/reward/*", "val/reward/*")),
)

Series = dict[str, dict[int, float]]  # metric -> {step: value}


class NoMetrics(ValueError):
    """The folder holds no CSV metrics to draw."""


def metric_files(run: Path) -> list[Path]:
    """The metrics.csv files of `run`, attempts in order: a run folder (its csv/version_N/), a CSV logger's
    folder (version_N/ below it), a version folder, or a metrics.csv itself."""
    run = Path(run)
    if run.is_file():
        return [run]
    if (run / "metrics.csv").is_file():
        return [run / "metrics.csv"]
    root = run / CSV_NAME if (run / CSV_NAME).is_dir() else run
    versions = [p for p in root.glob("version_*/metrics.csv") if re.fullmatch(r"version_\d+", p.parent.name)]
    return sorted(versions, key=lambda p: int(p.parent.name.split("_")[1]))


def read_metrics(files: list[Path]) -> Series:
    """{metric: {step: value}} of the CSV files `files` (attempts, in order). A later attempt replaces the
    earlier ones' values from its own first step on. Empty cells and non-numeric columns are skipped."""
    series: Series = {}
    for file in files:
        attempt = _read_one(file)
        steps = [step for values in attempt.values() for step in values]
        if not steps:
            continue
        first = min(steps)
        for values in series.values():
            for step in [s for s in values if s >= first]:
                del values[step]
        for name, values in attempt.items():
            series.setdefault(name, {}).update(values)
    return {name: values for name, values in series.items() if values}


def _read_one(file: Path) -> Series:
    attempt: Series = {}
    with open(file, newline="") as f:
        for row in csv.DictReader(f):
            step = _number(row.get("step"))
            if step is None:
                continue
            for name, cell in row.items():
                value = _number(cell)
                if name not in ("step", "epoch") and value is not None:
                    attempt.setdefault(name, {})[int(step)] = value
    return attempt


def _number(cell: str | None) -> float | None:
    try:
        return float(cell) if cell not in (None, "") else None
    except ValueError:
        return None


def panel_metrics(panel: Panel, names: list[str]) -> list[str]:
    """The metrics of `names` the panel draws, in its patterns' order (each pattern's matches sorted)."""
    chosen: list[str] = []
    for pattern in panel.patterns:
        chosen += [n for n in sorted(fnmatch.filter(names, pattern)) if n not in chosen]
    return chosen


def draw(series: Series, title: str):
    """A matplotlib Figure of `series`: one panel per PANELS entry that has a metric, two panels a row; each
    metric one line (validation ones, and any of few points, with a marker at each). None when no panel has data."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend change

    names = sorted(series)
    panels = [(panel, panel_metrics(panel, names)) for panel in PANELS]
    panels = [(panel, metrics) for panel, metrics in panels if metrics]
    if not panels:
        return None
    columns = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.0 * columns, 3.2 * rows), layout="constrained")
    figure.suptitle(title, fontsize=10)
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for axis, (panel, metrics) in zip(axes, panels):
        for name in metrics:
            steps = sorted(series[name])
            marker = "o" if name.startswith("val/") or len(steps) < FEW_POINTS else None
            axis.plot(steps, [series[name][s] for s in steps], label=name, marker=marker, markersize=3, linewidth=1)
        axis.set_title(panel.title, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.set_ylabel(panel.ylabel, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    for axis in axes[len(panels) :]:  # the empty cell of an odd count
        axis.set_visible(False)
    return figure


def write_plot(run: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Draw the metrics of `run` (see metric_files) into the PNG `out` (default `<run>/plots/training.png`)
    and return its path. Raises NoMetrics when there is nothing to draw."""
    run = Path(run)
    files = metric_files(run)
    if not files:
        raise NoMetrics(f"{run}: no metrics.csv (looked for {run / CSV_NAME / 'version_N' / 'metrics.csv'})")
    figure = draw(read_metrics(files), title or str(run))
    if figure is None:
        raise NoMetrics(f"{run}: {', '.join(map(str, files))} hold none of the metrics step35 plots")
    out = Path(out) if out is not None else run / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(out)
    try:
        figure.savefig(partial, dpi=100, format="png")
        publish(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def plot_after_fit(run_dir: str | Path, csv_root: str | Path) -> str:
    """The end-of-fit picture: `<run_dir>/plots/training.png` from the CSV logger's folder `csv_root` (its
    version_N/ folders). Returns the one line to print; never raises (a picture must not fail a finished run)."""
    try:
        out = write_plot(csv_root, Path(run_dir) / PLOT_FILE, title=str(run_dir))
    except Exception as error:  # noqa: BLE001 (reported in one line: the run itself succeeded)
        return f"no training plot: {type(error).__name__}: {error}"
    return f"training curves: {out}"


def main(argv: list[str] | None = None) -> None:
    """`step35 plot RUN [--out PNG]`."""
    parser = argparse.ArgumentParser(
        prog="step35 plot",
        description="Draw a run's training curves (loss, learning rate, grad norm, tokens/s, rewards) from its CSV "
        "metrics into a PNG.",
    )
    parser.add_argument("run", help="a run folder (its csv/version_N/metrics.csv), a version folder or a metrics.csv")
    parser.add_argument("--out", default=None, help="the PNG to write (default: RUN/plots/training.png)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out
    if out is None and Path(args.run).is_file():
        raise SystemExit(f"step35 plot: {args.run} is a file: give --out for the PNG")
    try:
        print(write_plot(args.run, out))
    except NoMetrics as error:
        raise SystemExit(f"step35 plot: {error}") from None


if __name__ == "__main__":
    main()
