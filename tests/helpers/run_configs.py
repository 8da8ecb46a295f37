"""The run configs of the run-folder and chaos tests, as YAML text for `step35 fit --config`: RUN_CONFIG (10
steps, RunCheckpoint every 5 keeping 3), CHAOS_CONFIG (no max_steps, RunCheckpoint every 5 keeping 2), a file
of one of them, the same turned into a LoRA run, and the command line of a quick run of configs/tiny.yaml."""

from __future__ import annotations

from pathlib import Path

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

# The tiny run both configs share; the fields in braces are where they differ.
_TINY_RUN = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  precision: 32-true
{max_steps}  val_check_interval: 1000
  check_val_every_n_epoch: null
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    - class_path: step35.loggers.CSVLogger
      init_args:
        name: csv
{flush}  callbacks:
{callbacks}model:
  config: tiny
  mtp_loss_weight: 0.3
  lr: 3.0e-3
  warmup_steps: {warmup_steps}
  moe_bias_update_rate: 1.0e-3
data:
  seq_len: 32
  micro_batch_size: 2
  num_workers: 0
"""

# The tiny run of the run-folder tests (10 steps, RunCheckpoint every 5 steps keeping 3, the CSV flushed every
# step); `--trainer.callbacks.<option>` sets RunCheckpoint's options (it is the list's last callback).
RUN_CONFIG = _TINY_RUN.format(
    max_steps="  max_steps: 10\n",
    flush="        flush_logs_every_n_steps: 1\n",
    callbacks="""    - class_path: lightning.pytorch.callbacks.LearningRateMonitor
      init_args:
        logging_interval: step
    - class_path: step35.callbacks.RunCheckpoint   # last in the list: --trainer.callbacks.keep_last=N sets it
      init_args:
        every_n_train_steps: 5
        keep_last: 3
""",
    warmup_steps=4,
)

# The chaos runs' config (tests/test_chaos.py): no max_steps (the command line gives it), RunCheckpoint every
# 5 steps keeping 2, warmup 10.
CHAOS_CONFIG = _TINY_RUN.format(
    max_steps="",
    flush="",
    callbacks="""    - class_path: step35.callbacks.RunCheckpoint
      init_args:
        every_n_train_steps: 5
        keep_last: 2
""",
    warmup_steps=10,
)


def tiny_run_args(command: str, run: Path, *extra: str) -> list[str]:
    """The arguments of `step35 <command>` for a quick run of configs/tiny.yaml in the run folder `run` (seq_len 32,
    micro-batch 2, no progress bar, validation every 1000 steps), then `extra`."""
    return [
        command,
        "--config",
        str(TINY_YAML),
        "--trainer.val_check_interval=1000",
        "--trainer.limit_val_batches=1",
        "--data.seq_len=32",
        "--data.micro_batch_size=2",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.save_dir={run}",
        *extra,
    ]


def write_run_config(folder: Path, text: str = RUN_CONFIG, name: str = "resume.yaml") -> Path:
    """`text` (RUN_CONFIG unless given) written as `folder`/`name`; the path."""
    path = Path(folder) / name
    path.write_text(text)
    return path


def lora_config(text: str = CHAOS_CONFIG) -> str:
    """A run config (CHAOS_CONFIG unless given) turned into a LoRA run: rank 4 on every target, decay over 20 steps."""
    assert "  config: tiny\n" in text and "mtp_loss_weight: 0.3" in text
    return text.replace(
        "  config: tiny\n",
        "  config: tiny\n  decay_steps: 20\n  lora:\n    rank: 4\n"
        "    targets: [attention, mlp, shared_expert, experts, mtp, router]\n",
    )
