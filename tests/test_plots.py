"""The training curves (step35/commands/plot.py): `step35 fit` writes `<run>/plots/training.png` at its end, and
`step35 plot RUN` draws it again, from the run's CSV metrics.

What a picture holds is checked on the Figure that was saved (its panels, and each line's points against the
CSV read here with tests/helpers' own reader), and the PNG file against that figure rendered again, pixel for
pixel: the file holds those curves, not just some image. The objectives' panels (DPO's rewards and accuracy,
GRPO's reward) are checked on metrics files written here, so each panel is asked for by its metric names alone.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from step35.commands import plot
from tests.helpers import metric_rows, steps_of, tiny_run_args
from tests.runner import step35_in_process


def lines_of(figure) -> dict[str, dict[str, dict[int, float]]]:
    """{panel title: {line label: {step: value}}} of a figure's visible panels."""
    out = {}
    for axis in figure.axes:
        if axis.get_visible():
            out[axis.get_title()] = {
                line.get_label(): dict(zip(map(int, line.get_xdata()), map(float, line.get_ydata())))
                for line in axis.get_lines()
            }
    return out


def write_metrics(folder: Path, rows: list[dict[str, float]]) -> Path:
    """A CSVLogger-like metrics.csv in `folder` (every row has `step`; absent metrics are empty cells)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted({name for row in rows for name in row} - {"step"})
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["epoch", "step", *names])
        writer.writeheader()
        for row in rows:
            writer.writerow({"epoch": 0, **row})
    return folder / "metrics.csv"


def rendered(figure) -> np.ndarray:
    """The figure as RGBA floats in [0, 1], drawn as savefig draws it (Agg, dpi 100)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure.set_dpi(100)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba(), dtype=np.float32) / 255.0


@pytest.mark.heavy  # a Lightning fit of 6 steps (about 10 s on two cores)
def test_a_fit_ends_by_drawing_its_curves(tmp_path, capfd, builtin_cache):
    """Before: the run folder had no picture but the expert-load heatmaps. Now a fit (6 steps, logging every
    step, validating after steps 3 and 6) ends with one line naming the PNG; its figure has the loss (training
    and validation), learning-rate, grad-norm and tokens/s panels with exactly the CSV's points, and the file is
    that figure."""
    from matplotlib.image import imread

    run = tmp_path / "run"
    args = tiny_run_args(
        "fit", run, "--trainer.max_steps=6", "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=3"
    )
    done = step35_in_process(capfd, args, builtin_cache)
    png = run / "plots" / "training.png"
    assert f"step35: training curves: {png}" in done.stderr.splitlines(), done.stderr[-2000:]
    assert png.is_file()
    rows = metric_rows(run / "csv" / "version_0")
    figure = plot.draw(plot.read_metrics(plot.metric_files(run)), str(run))
    drawn = lines_of(figure)
    assert list(drawn) == ["loss", "learning rate", "gradient norm", "throughput"]
    assert list(drawn["loss"]) == ["train/loss", "train/lm_loss", "val/loss"]
    assert list(drawn["learning rate"]) == ["lr/decay", "lr/no_decay"]
    for panel in drawn.values():
        for name, points in panel.items():
            assert points == steps_of(rows, name), name
    assert sorted(drawn["loss"]["train/lm_loss"]) == [0, 1, 2, 3, 4, 5]
    assert sorted(drawn["loss"]["val/loss"]) == [2, 5]  # validations after steps 3 and 6, logged at 2 and 5
    stored = imread(png)
    assert stored.shape == rendered(figure).shape == (640, 1200, 4)
    assert np.abs(stored - rendered(figure)).max() < 1.5 / 255  # PNG stores 8 bits a channel: equal pixels


def test_dpo_runs_get_their_rewards_and_accuracy_and_no_empty_panel(tmp_path):
    """The metric names a DPO run logs (training/dpo.py) give the preference loss, rewards and accuracy panels;
    a run without throughput or RL metrics gets no such panel."""
    rows = [
        {"step": s, "train/loss": 0.69 - s / 100, "train/dpo_loss": 0.69 - s / 90, "lr/decay": 1e-4}
        | {"train/chosen_reward": s / 10, "train/rejected_reward": -s / 10, "train/reward_accuracy": s / 10}
        for s in range(10)
    ] + [{"step": 9, "val/dpo_loss": 0.3, "val/reward_accuracy": 0.9, "val/chosen_reward": 0.5}]
    write_metrics(tmp_path / "csv" / "version_0", rows)
    drawn = lines_of(plot.draw(plot.read_metrics(plot.metric_files(tmp_path)), "dpo"))
    assert list(drawn) == ["loss", "preference loss", "learning rate", "preference rewards", "reward accuracy"]
    assert list(drawn["preference rewards"]) == ["train/chosen_reward", "train/rejected_reward", "val/chosen_reward"]
    assert drawn["reward accuracy"]["val/reward_accuracy"] == {9: 0.9}
    assert drawn["reward accuracy"]["train/reward_accuracy"] == {s: s / 10 for s in range(10)}


def test_grpo_runs_get_their_reward_panel(tmp_path):
    """`train/reward`, `val/reward` and each reward function's curve (`train/reward/<name>`) in one panel;
    the reward's spread (`train/reward_std`) and the `rl/` checks are not rewards."""
    rows = [
        {"step": s, "train/loss": 0.1, "train/reward": s / 5, "train/reward/complete": s / 5}
        | {"train/reward_std": 0.3, "rl/logprob_diff_max": 1e-6, "train/grad_norm": 0.5}
        for s in range(6)
    ] + [{"step": 5, "val/reward": 1.0}]
    write_metrics(tmp_path / "csv" / "version_0", rows)
    drawn = lines_of(plot.draw(plot.read_metrics(plot.metric_files(tmp_path)), "grpo"))
    assert list(drawn) == ["loss", "gradient norm", "RL reward"]
    assert list(drawn["RL reward"]) == ["train/reward", "val/reward", "train/reward/complete"]
    assert drawn["RL reward"]["train/reward"] == {s: s / 5 for s in range(6)}


def test_a_resumed_run_draws_as_one_curve(tmp_path):
    """Attempt 1 resumed from step 5 after attempt 0 had logged up to step 7: steps 5 to 7 are attempt 1's (the
    steps it trained again), the rest attempt 0's; version_10 comes after version_2 (numeric order)."""
    write_metrics(tmp_path / "csv" / "version_0", [{"step": s, "train/loss": 10.0 + s} for s in range(8)])
    write_metrics(tmp_path / "csv" / "version_2", [{"step": s, "train/loss": 20.0 + s} for s in range(5, 9)])
    write_metrics(tmp_path / "csv" / "version_10", [{"step": s, "train/loss": 30.0 + s} for s in range(8, 10)])
    series = plot.read_metrics(plot.metric_files(tmp_path))
    assert series["train/loss"] == {0: 10, 1: 11, 2: 12, 3: 13, 4: 14, 5: 25, 6: 26, 7: 27, 8: 38, 9: 39}


def test_step35_plot_draws_a_run_and_refuses_a_folder_without_metrics(tmp_path, capfd):
    """`step35 plot RUN` writes RUN/plots/training.png and prints its path; `--out` puts it elsewhere; a folder
    without metrics is one line and exit code 1, no traceback."""
    from tests.runner import cli

    write_metrics(tmp_path / "run" / "csv" / "version_0", [{"step": s, "train/loss": 5.0 - s} for s in range(4)])
    code, out, err = cli(capfd, "plot", str(tmp_path / "run"))
    assert code == 0 and out.strip() == str(tmp_path / "run" / "plots" / "training.png"), (out, err)
    assert (tmp_path / "run" / "plots" / "training.png").is_file()
    code, out, _ = cli(capfd, "plot", str(tmp_path / "run"), "--out", str(tmp_path / "elsewhere.png"))
    assert code == 0 and (tmp_path / "elsewhere.png").is_file()

    (tmp_path / "empty").mkdir()
    code, out, err = cli(capfd, "plot", str(tmp_path / "empty"))
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"step35 plot: {tmp_path / 'empty'}: no metrics.csv (looked for {tmp_path / 'empty' / 'csv'}"
        "/version_N/metrics.csv)"
    ]
    code, out, _ = cli(capfd, "--help")
    assert "plot      a run's training curves" in out
