import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network from tests
os.environ.setdefault("WANDB_SILENT", "true")


# The quick tier, `python -m pytest -m quick` (README, "for people changing the code"): every test of the
# default run that runs in this one process and in seconds, which still covers each package. Left out,
# besides `slow` and `multiprocess` tests: the files and tests below, each for the reason given. CI runs
# the full default run (.ci/run).
NOT_QUICK_FILES = {
    # step35 started as a subprocess (the CLI, torchrun, launchers), signals, timeouts
    "test_cli.py", "test_chaos.py", "test_process_timeouts.py", "test_resume.py",
    "test_short_run.py", "test_wandb.py", "test_configs.py", "test_skipped_records.py",
    "test_data_long_documents.py", "test_strategy_save.py",
    # compiles FlexAttention for the CPU (tens of seconds)
    "test_flex_attention_cpu.py",
    # a fixture trains under several processes
    "test_distributed_equivalence.py",
}
NOT_QUICK_TESTS = {
    # the main job or early stopping through the CLI, as a subprocess
    "test_papercuts.py": ("test_main_job_first_screen", "test_early_stopping_says_why", "test_help_lists",
                          "test_the_checkpoint_interval_and_retention"),
    # the CLI as a subprocess, or a sharded run
    "test_validation.py": ("test_cli_",),
    # the `checkpoints` fixture trains and saves single-file and sharded checkpoints (2 minutes)
    "test_checkpoint_safety.py": ("test_crafted_checkpoint", "test_metadata_pointing_outside",
                                  "test_flipped_byte_refused_by_resume", "test_damaged_checkpoint_refused_by_resume",
                                  "test_nan_weights_refused_by_resume", "test_step35strategy_full_file",
                                  "test_payloads_are_live", "test_bytes_item_refused", "test_damaged_sharded",
                                  "test_manifest_records", "test_checkpoint_without_manifest"),
    # the 196B model sharded for many simulated ranks; the wider model's activations
    "test_plan.py": ("test_recipes_fit", "test_too_few_ranks", "test_invalid_expert_parallel_size",
                     "test_predicted_activations_match_saved_tensors[wider"),
    "test_module.py": ("test_precisions_train",),
    "test_data_module.py": ("test_builtin_cache_survives", "test_two_workers", "test_lightning_resume"),
    # the remaining ones take 10 s or more each (measured in a run of the tier)
    "test_run.py": ("test_a_second_run_is_refused", "test_auto_falls_back", "test_an_abbreviated_option",
                    "test_a_trainer_built_without_the_cli", "test_lock_refuses", "test_a_forked_child"),
    "test_callbacks.py": ("test_metrics_reach_csv_and_offline_wandb",),
    "test_schedule.py": ("test_resume_with_other_max_steps",),
    "test_model_imports.py": ("test_importing_the_model_loads_no_higher_layer",),  # a subprocess; test_layers stays
    "test_balancing.py": ("test_bias_update_evens_out_a_skewed_router",),
    "test_activation_memory.py": ("test_issue10_shape_within_budget",),
    "test_data_stream.py": ("test_resume_exact_for_arrow_save_to_disk",),
    # the CLI or a chaos supervisor as a subprocess; a short training run; the built-in conversation set
    "test_lora_checkpoint.py": ("test_lora_run_killed_twice",),
    "test_lora.py": ("test_cli_fit_with_lora",),
    "test_generate.py": ("test_generate_command", "test_sharded_run", "test_chat_renders"),
    "test_plan_cp.py": ("test_long_context_recipe_parses_for_fit",),
    "test_plan_lora.py": ("test_recipe_is_one_node_of_eight",),
    "test_context_parallel.py": ("test_fit_refuses",),
    "test_sft_training.py": ("test_assistant_only_loss",),
    "test_builtin_chat.py": ("test_conversations_are_well_formed",),
}


# Files of process-level tests of which only these are quick (so that the tier still covers step35.faults).
QUICK_ONLY = {"test_fail_fast.py": ("test_watchdog_names_the_phase_and_exits_76",)}


def is_quick(item) -> bool:
    if item.get_closest_marker("slow") or item.get_closest_marker("multiprocess"):
        return False
    file = item.path.name
    if file in QUICK_ONLY:
        return item.name.startswith(QUICK_ONLY[file])
    return file not in NOT_QUICK_FILES and not item.name.startswith(NOT_QUICK_TESTS.get(file, ()))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_quick(item):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    """A cache folder holding the built-in corpus and tokenizer, built once per test session."""
    from step35.data import builtin_corpus_path, builtin_tokenizer_dir

    path = tmp_path_factory.mktemp("step35-cache")
    builtin_corpus_path(cache_dir=path)
    builtin_tokenizer_dir(cache_dir=path)
    return path


@pytest.fixture
def step35_here(capfd, monkeypatch, builtin_cache):
    """`step35 <args>` in this process (tests/runner.cli), as a job started by tests/runner.step35 would see
    it: in the repository root, with the session's built-in cache. Returns a function of the arguments
    giving (exit code, stdout, stderr), captured at the file descriptors (step35.faults reports a failure
    with os.write to fd 2); an exception that would end the process is printed with its traceback and
    gives exit code 1, as Python does. For refusals and reports where the process boundary is not tested."""
    import traceback

    from tests.runner import ROOT, cli

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))

    def run(*args: str) -> tuple[int, str, str]:
        try:
            return cli(capfd, *args)
        except Exception:
            traceback.print_exc()
            out = capfd.readouterr()
            return 1, out.out, out.err

    return run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, builtin_cache):
    """A from-scratch tiny run of 3 steps on the built-in corpus, saved as a run folder would be
    (<run>/checkpoints/step=000003.ckpt with its manifest, last.ckpt). Returns (run folder, model)."""
    import lightning.pytorch as pl

    from step35.callbacks import RunCheckpoint
    from step35.checkpoint.training.trainer_io import Step35CheckpointIO
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
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "STEP35_JOB")


@pytest.fixture(autouse=True)
def _no_launch_variables_leak():
    before = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def cp_saved_bytes(tmp_path_factory):
    """Saved-tensor bytes per rank at cp 1 and cp 2 (tests/dist/cp_activation_bytes.py on 2 gloo ranks,
    the release's head ratio), measured once for the cp tests and the plan's cp test."""
    from pathlib import Path

    from tests.runner import run_dist_script

    script = Path(__file__).parent / "dist" / "cp_activation_bytes.py"
    return run_dist_script(script, tmp_path_factory.mktemp("cp-bytes") / "bytes.pt", 2, timeout=240)
