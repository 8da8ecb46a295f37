"""What `step35 eval` leaves behind: the results as JSON (`step=N.json` in the results folder, samples included),
a short table for the terminal, and `scores.png`: every scalar score of the folder's evaluations against the
checkpoint step, one panel per score (people read a curve faster than a column of numbers)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SCALARS = ("heldout", "tasks", "gate", "mtp", "mtp_baseline")  # the result sections whose numbers are plotted


def scalars(results: dict) -> dict[str, float]:
    """The plotted numbers of a result: `section/name` -> value (lists, samples and counts of tokens left out)."""
    found = {}
    for section in SCALARS:
        for name, value in (results.get(section) or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in ("tokens", "bytes"):
                found[f"{section}/{name}"] = float(value)
    return found


def write(results: dict, folder: Path, step: int | None) -> Path:
    """results as `folder/step=N.json` (`eval.json` for a checkpoint without a step); the plot refreshed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"step={step}.json" if step is not None else "eval.json")
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False, default=str) + "\n")
    plot(folder)
    return path


def plot(folder: Path) -> Path | None:
    """`folder/scores.png` from every `step=N.json` there (None when none has a score)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("step=*.json")):
        step = int(path.stem.split("=")[1])
        for name, value in scalars(json.loads(path.read_text())).items():
            if math.isfinite(value):
                series.setdefault(name, []).append((step, value))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(series))
    rows = math.ceil(len(series) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 2.6 * rows), squeeze=False)
    for axis, (name, points) in zip(axes.flat, sorted(series.items())):
        points.sort()
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o")
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=7)
    for axis in list(axes.flat)[len(series) :]:
        axis.axis("off")
    figure.tight_layout()
    out = folder / "scores.png"
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def table(results: dict[str, Any]) -> str:
    """A few lines for the terminal: each section's numbers."""
    step = results.get("step")
    lines = [f"{results['checkpoint']}" + (f" (step {step})" if step is not None else "")]
    for name, value in scalars(results).items():
        lines.append(f"  {name:<32} {value:.4g}")
    gate = results.get("gate") or {}
    for failure in gate.get("failed", []):
        lines.append(f"  gate FAILED: {failure}")
    agent = results.get("agent")
    if agent is not None:
        lines.append(f"  agent rendering: {agent['checked']} checked, {len(agent['failed'])} do not round-trip")
    lm_eval = results.get("lm_eval")
    if lm_eval:
        for task, metrics in (lm_eval.get("results") or {}).items():
            shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
            lines.append(f"  lm-eval {task}: {shown}")
    return "\n".join(lines)
