import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network from tests
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    """A cache folder holding the built-in corpus and tokenizer, built once per test session."""
    from step35.data import builtin_corpus_path, builtin_tokenizer_dir

    path = tmp_path_factory.mktemp("step35-cache")
    builtin_corpus_path(cache_dir=path)
    builtin_tokenizer_dir(cache_dir=path)
    return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, builtin_cache):
    """A from-scratch tiny run of 3 steps on the built-in corpus, saved as a run folder would be
    (<run>/checkpoints/step=000003.ckpt with its manifest, last.ckpt). Returns (run folder, model)."""
    import lightning.pytorch as pl

    from step35.callbacks import RunCheckpoint
    from step35.checkpoint.trainer_io import Step35CheckpointIO
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    run = tmp_path_factory.mktemp("tiny-run")
    module = Step35LightningModule(config="tiny", lr=1e-2, warmup_steps=1)
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=run,
                         plugins=[Step35CheckpointIO()], callbacks=[RunCheckpoint(every_n_train_steps=3)])
    trainer.fit(module, datamodule=data)
    return run, module.model


# Set by in-process runs of Lightning's distributed strategies (e.g. MASTER_PORT, picked once per
# process): left in os.environ they would be inherited by every later subprocess test, which would
# then all try to listen on that one port.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _no_launch_variables_leak():
    before = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
