"""Expert load: tokens routed to each expert of each MoE layer, summed over micro-batches and ranks
over a window of optimizer steps, logged per layer and overall, and every so often a layers x
experts heatmap and the router-bias distribution.

Metrics (i = the checkpoint's layer index; "load" = tokens routed to an expert in the window):
  expert_load/layer{i}/max_over_mean   busiest expert / mean      (1 = perfectly balanced)
  expert_load/layer{i}/min_over_mean   idlest expert / mean
  expert_load/layer{i}/cv              std / mean of the loads (population std)
  expert_load/layer{i}/dead            experts that got no token in the window
  expert_load/layer{i}/entropy         entropy of the load distribution / ln(E)   (1 = uniform)
  expert_load/layer{i}/routed          routed rows in the window (= tokens x top-k)
  expert_load/{max_over_mean, min_over_mean, cv, dead, entropy}   worst max, worst min, mean cv,
                                       total dead, mean entropy over layers
  router_bias/layer{i}/{min, max, mean, std}   (at the heatmap interval; a histogram too on wandb)
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from step35.balancing import ExpertCounter
from step35.callbacks.reporting import StepEnds, every, log_metrics, metric_step


def load_stats(load: torch.Tensor) -> dict[str, float]:
    """Balance statistics of one layer's loads [E] (tokens per expert); empty if nothing was routed."""
    load = load.double()
    total = float(load.sum())
    if total <= 0:
        return {}
    mean = load.mean()
    p = load / total
    entropy = -(p[p > 0] * p[p > 0].log()).sum() / math.log(load.numel()) if load.numel() > 1 else torch.ones(())
    return {
        "max_over_mean": float(load.max() / mean),
        "min_over_mean": float(load.min() / mean),
        "cv": float(load.std(unbiased=False) / mean),
        "dead": float((load == 0).sum()),
        "entropy": float(entropy),
        "routed": total,
    }


def overall_stats(per_layer: list[dict[str, float]]) -> dict[str, float]:
    per_layer = [s for s in per_layer if s]
    if not per_layer:
        return {}
    n = len(per_layer)
    return {
        "max_over_mean": max(s["max_over_mean"] for s in per_layer),
        "min_over_mean": min(s["min_over_mean"] for s in per_layer),
        "cv": sum(s["cv"] for s in per_layer) / n,
        "dead": sum(s["dead"] for s in per_layer),
        "entropy": sum(s["entropy"] for s in per_layer) / n,
    }


def save_heatmap(counts: torch.Tensor, layer_ids: list[int], path: Path, title: str) -> None:
    """Layers x experts image of load / layer mean (1 = balanced) as a PNG."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend change

    counts = counts.double()
    relative = counts / counts.mean(1, keepdim=True).clamp(min=1e-12)
    L, E = counts.shape
    fig = Figure(figsize=(min(24.0, 3.0 + E / 12), min(16.0, 1.5 + L / 3)))
    ax = fig.subplots()
    image = ax.imshow(relative.numpy(), aspect="auto", interpolation="nearest", cmap="magma")
    ax.set_yticks(range(L), [str(i) for i in layer_ids])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="tokens / layer mean")
    fig.savefig(path, dpi=100, bbox_inches="tight")


def save_counts_csv(counts: torch.Tensor, layer_ids: list[int], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", *[f"expert{e}" for e in range(counts.shape[1])]])
        for layer, row in zip(layer_ids, counts.tolist()):
            writer.writerow([layer, *row])


class ExpertLoadMonitor(pl.Callback):
    def __init__(self, every_n_steps: int = 10, heatmap_every_n_steps: int = 50, per_layer: bool = True):
        """
        Args:
            every_n_steps: optimizer steps per window: the window's counts (every micro-batch of every
                rank) are summed with one all_reduce and logged; 0 turns the callback off.
            heatmap_every_n_steps: every so many steps, at the end of a window, a layers x experts
                heatmap (PNG) and the raw counts (CSV) go into `<run folder>/expert_load/`, the PNG
                as an image to wandb and TensorBoard when such a logger is attached, and the
                router-bias distribution is logged. A run that ends between two heatmaps gets one
                more at its end (of its last steps). Must be a multiple of every_n_steps; 0 = never.
            per_layer: log the per-layer metrics too, not only the overall ones.
        """
        if every_n_steps < 0 or heatmap_every_n_steps < 0:
            raise ValueError("every_n_steps and heatmap_every_n_steps must be >= 0")
        if heatmap_every_n_steps and (not every_n_steps or heatmap_every_n_steps % every_n_steps):
            raise ValueError(
                f"heatmap_every_n_steps={heatmap_every_n_steps} must be a multiple of every_n_steps={every_n_steps}"
            )
        self.every_n_steps = every_n_steps
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.per_layer = per_layer
        self.counter: ExpertCounter | None = None
        self.out_dir: Path | None = None
        self.last_counts: torch.Tensor | None = None  # the last window's global counts [L, E] (CPU)
        self._step_ends = StepEnds()
        self._window_start = 0  # first step (1-based) of the current window
        self._last_window: tuple[int, int] | None = None  # steps of last_counts
        self._heatmap_step: int | None = None  # step of the last heatmap written

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The module's counter when it has one (it also feeds the bias update), else our own.
        counter = getattr(pl_module, "expert_counter", None)
        self.counter = counter if counter is not None else ExpertCounter(pl_module)
        self._step_ends.reset(trainer)
        self._window_start = trainer.global_step + 1
        # trainer.log_dir is a broadcast (a collective): every rank asks, once, here.
        self.out_dir = Path(trainer.log_dir or trainer.default_root_dir) / "expert_load"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._step_ends(trainer) or not every(trainer.global_step, self.every_n_steps):
            return
        window = self.counter.pop_window() if self.counter is not None else None  # collective: all ranks
        if window is None:
            return
        counts = window.cpu()  # host sync (once per window)
        self.last_counts = counts
        self._last_window = (self._window_start, trainer.global_step)
        self._window_start = trainer.global_step + 1
        ids = self.counter.layer_ids
        stats = [load_stats(row) for row in counts]
        metrics = {f"expert_load/{k}": v for k, v in overall_stats(stats).items()}
        if self.per_layer:
            for i, s in zip(ids, stats):
                metrics.update({f"expert_load/layer{i}/{k}": v for k, v in s.items()})
        if every(trainer.global_step, self.heatmap_every_n_steps):
            metrics.update(self._router_bias_stats())
            self._write_heatmap(trainer, counts, self._last_window)
            self._heatmap_step = trainer.global_step
        log_metrics(trainer, metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A run that ends between heatmap intervals (a short run: max_steps below the interval, or an
        end that is not a multiple of it) still gets a heatmap of its last steps: those since the last
        window when there are any, else the last window. Runs on every rank (one collective)."""
        step = trainer.global_step
        if not self.heatmap_every_n_steps or self.counter is None or not self.counter.layers:
            return
        if self._heatmap_step == step or step < self._window_start and self.last_counts is None:
            return  # written at this very step already, or no step was trained
        window = self.counter.pop_window()  # collective: all ranks
        counts, steps = window.cpu(), (self._window_start, step)
        if counts.sum() == 0 and self.last_counts is not None:  # nothing routed since the last window
            counts, steps = self.last_counts, self._last_window
        self._window_start = step + 1
        if counts.sum() == 0:
            return
        log_metrics(trainer, self._router_bias_stats())
        self._write_heatmap(trainer, counts, steps)
        self._heatmap_step = step

    def _router_bias_stats(self) -> dict[str, float]:
        # router_bias is a plain (unsharded) buffer, identical on every rank: no collective needed.
        metrics = {}
        for i, moe in zip(self.counter.layer_ids, self.counter.layers):
            if moe.router_bias is None:
                continue
            b = moe.router_bias.detach().float().cpu()  # host sync (heatmap interval only)
            metrics.update(
                {
                    f"router_bias/layer{i}/min": float(b.min()),
                    f"router_bias/layer{i}/max": float(b.max()),
                    f"router_bias/layer{i}/mean": float(b.mean()),
                    f"router_bias/layer{i}/std": float(b.std(unbiased=False)),
                }
            )
        return metrics

    @rank_zero_only
    def _write_heatmap(self, trainer: pl.Trainer, counts: torch.Tensor, steps: tuple[int, int]) -> None:
        step = trainer.global_step
        self.out_dir.mkdir(parents=True, exist_ok=True)
        png = self.out_dir / f"heatmap_step{step:07d}.png"
        save_heatmap(
            counts, self.counter.layer_ids, png, f"expert load, steps {steps[0]}-{steps[1]} (tokens / layer mean)"
        )
        save_counts_csv(counts, self.counter.layer_ids, self.out_dir / f"counts_step{step:07d}.csv")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                from matplotlib.image import imread

                image = imread(png)[..., :3]  # [H, W, RGBA] floats in [0, 1]; TensorBoard takes RGB
                logger.experiment.add_image(
                    "expert_load/heatmap", image, global_step=metric_step(trainer), dataformats="HWC"
                )
                for i, moe in zip(self.counter.layer_ids, self.counter.layers):
                    if moe.router_bias is not None:
                        logger.experiment.add_histogram(
                            f"router_bias/layer{i}/hist",
                            moe.router_bias.detach().float().cpu().numpy(),
                            global_step=metric_step(trainer),
                        )
            if isinstance(logger, WandbLogger):
                import wandb

                logger.log_image("expert_load/heatmap", [str(png)], step=metric_step(trainer))
                hists = {
                    f"router_bias/layer{i}/hist": wandb.Histogram(moe.router_bias.detach().float().cpu().numpy())
                    for i, moe in zip(self.counter.layer_ids, self.counter.layers)
                    if moe.router_bias is not None
                }
                logger.log_metrics(hists, step=metric_step(trainer))
