"""Training in this process: `make_trainer`, the one builder of the tests' Lightning Trainers (one CPU
device, no logger, no progress bar, no model summary, no validation; a test passes what differs); the
Trainer arguments that save as the CLI does (a file or a sharded folder); and the runs several test files share:
a run saved as a run folder, a LoRA run on an HF base, one step from an HF folder."""

from __future__ import annotations

from pathlib import Path

import torch


def make_trainer(**overrides):
    """A Lightning Trainer for a test in this process: one CPU device, no logger, no progress bar, no model summary,
    no validation batches; `overrides` replace or add Trainer arguments. Checkpointing stays Lightning's default (a
    ModelCheckpoint at the end of fit unless a test passes its own or enable_checkpointing=False)."""
    import lightning.pytorch as pl

    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    return pl.Trainer(**(defaults | overrides))


def checkpoint_io(sharded: bool) -> dict:
    """The Trainer arguments that save as the CLI does: Step35Strategy for a sharded folder, Step35CheckpointIO for
    one file (with its manifest)."""
    from step35.checkpoint.training.plugin import Step35CheckpointIO
    from step35.strategy import Step35Strategy

    return {"strategy": Step35Strategy()} if sharded else {"plugins": [Step35CheckpointIO()]}


def checkpointed_fit(module, root: Path, cache: Path, steps: int, every: int, ckpt_path: Path | None = None):
    """`module` trained `steps` steps on the built-in corpus in `cache` (seq_len 32, micro-batch 2), saved as a run
    folder under `root` would be (Step35CheckpointIO, RunCheckpoint every `every` steps), resumed from `ckpt_path`
    when given; the trainer."""
    from step35.callbacks import RunCheckpoint
    from step35.data import Step35DataModule

    trainer = make_trainer(
        max_steps=steps,
        default_root_dir=root,
        callbacks=[RunCheckpoint(every_n_train_steps=every)],
        **checkpoint_io(sharded=False),
    )
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(cache))
    trainer.fit(module, datamodule=data, ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trainer


LORA = {"rank": 4, "targets": ["attention", "mlp", "shared_expert", "experts", "router"]}


def hf_base(folder: Path, seed: int) -> Path:
    """A tiny model drawn with `seed`, saved as an HF folder at `folder` (a LoRA run's frozen base)."""
    from step35.checkpoint.hf.materialize import materialize
    from step35.checkpoint.hf.pretrained import save_pretrained
    from step35.config import preset
    from step35.model import build_model

    model = build_model(preset("tiny"))
    materialize(model, "cpu", seed=seed)
    save_pretrained(model, folder)
    return folder


def lora_fit(
    root: Path, cache: Path, steps: int, base: Path | None = None, ckpt_path: Path | None = None, init_seed: int = 0
) -> torch.nn.Module:
    """A tiny LoRA run (LORA) of `steps` steps in this process, RunCheckpoint every 2 steps under `root`, on the base
    HF folder `base` (else the init drawn with `init_seed`), resumed from `ckpt_path` when given; its model."""
    from step35.module import Step35LightningModule

    module = Step35LightningModule(
        config="tiny",
        checkpoint=str(base) if base else None,
        lora=dict(LORA),
        lr=1e-2,
        warmup_steps=1,
        decay_steps=4,
        init_seed=init_seed,
        moe_bias_update_rate=1e-3,
    )
    checkpointed_fit(module, root, cache, steps, every=2, ckpt_path=ckpt_path)
    return module.model


def one_step_from(source: Path, folder: Path, cache: Path):
    """One training step (in this process, lr 1e-2) from the HF folder `source` with its own tokenizer, saved as
    `folder`/run.ckpt: (the trained LightningModule, the checkpoint's path)."""
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    module = Step35LightningModule(checkpoint=str(source), lr=1e-2, warmup_steps=1)
    data = Step35DataModule(tokenizer=str(source), seq_len=16, micro_batch_size=1, cache_dir=str(cache))
    trainer = make_trainer(max_steps=1, default_root_dir=folder / "run", enable_checkpointing=False)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(folder / "run.ckpt")
    return module, folder / "run.ckpt"
