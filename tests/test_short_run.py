"""A short run as a user starts it: `step35 fit --config configs/tiny.yaml --trainer.max_steps 6`
with TensorBoard as the logger, from the default install. Its intervals (validation and heatmap
every 100 steps) are beyond the run, yet it validates and draws a heatmap at its end, and TensorBoard
gets the metrics and the heatmap image."""

from __future__ import annotations

import pytest

from tests.helpers import tensorboard_events
from tests.runner import step35

pytestmark = pytest.mark.heavy  # a short training run as a subprocess


@pytest.mark.timeout(900)
def test_short_run_validates_and_draws_a_heatmap_into_tensorboard(tmp_path, builtin_cache):
    step35(
        [
            "fit",
            "--config",
            "configs/tiny.yaml",
            "--trainer.max_steps",
            "6",
            "--trainer.logger",
            "lightning.pytorch.loggers.TensorBoardLogger",
            "--trainer.logger.save_dir",
            str(tmp_path / "tb"),
            f"--trainer.default_root_dir={tmp_path}",
            "--data.seq_len=32",
            "--data.micro_batch_size=2",
            "--data.val_batches=2",
            "--trainer.limit_val_batches=2",
        ],
        builtin_cache,
        timeout=840,
    )
    version = tmp_path / "tb" / "lightning_logs" / "version_0"
    assert sorted(p.name for p in (version / "expert_load").glob("heatmap_*.png")) == ["heatmap_step0000006.png"]
    values = [(e.step, v) for e in tensorboard_events(version) for v in e.summary.value]
    val_steps = {step for step, v in values if v.tag == "val/loss"}
    train_steps = {step for step, v in values if v.tag == "train/loss"}
    # One validation (the sanity check logs nothing), after the last step: Lightning writes it at the
    # index of the last training step's metrics (0-based: 5).
    assert val_steps == {5} and max(train_steps) == 5, (val_steps, train_steps)
    heatmaps = [v.image for _, v in values if v.tag == "expert_load/heatmap"]
    assert len(heatmaps) == 1 and heatmaps[0].encoded_image_string[:4] == b"\x89PNG"
