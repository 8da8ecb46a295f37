"""The step progress bar after a resume: step/max_steps from the resumed step on, the next-token loss
(lm_loss, not the MTP-weighted total), tokens/s and memory; no epoch counter, no logger version."""

from step35.callbacks import Step35ProgressBar
from step35.checkpoint.training.plugin import Step35CheckpointIO
from step35.data import Step35DataModule
from step35.loggers import CSVLogger
from step35.module import Step35LightningModule
from step35.run import checkpoint_of
from tests.helpers import make_trainer


def test_bar_after_a_resume_counts_steps_and_shows_loss_rate_memory(tiny_run, builtin_cache, tmp_path, capsys):
    run, _ = tiny_run  # 3 steps, saved at step 3
    bar = Step35ProgressBar()
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1)
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    trainer = make_trainer(
        max_steps=5,
        logger=CSVLogger(tmp_path),
        callbacks=[bar],
        enable_progress_bar=True,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        plugins=[Step35CheckpointIO()],
    )
    trainer.fit(module, datamodule=data, ckpt_path=str(checkpoint_of(run)))
    shown = bar.train_progress_bar
    assert shown.initial == 3 and shown.n == 5 and shown.total == 5  # from the resumed step to max_steps
    rendered = str(shown)
    assert rendered.startswith("step: ") and "5/5" in rendered, rendered
    for item in ("lm_loss=", "tok/s=", "mem="):
        assert item in rendered, rendered
    assert "v_num" not in rendered and "Epoch" not in capsys.readouterr().out
    metrics = bar.get_metrics(trainer, module)
    assert set(metrics) == {"lm_loss", "tok/s", "mem"}  # no monitors configured: the bar's own rate and memory
    assert abs(float(metrics["lm_loss"]) - trainer.callback_metrics["train/lm_loss"]) <= 5e-4  # printed with 3 decimals
    assert float(metrics["tok/s"].replace(",", "")) > 0 and float(metrics["mem"].split()[0]) > 0
