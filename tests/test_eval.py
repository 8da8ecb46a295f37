"""`step35 eval` on a run folder: its held-out loss equals the val/loss the fit logged; tasks scored by verifiers
with pass@k; the quality gate exits 1 naming the check; MTP acceptance before and after; results as JSON, a
table and a plot; and EvalCallback logging the same numbers during the fit."""

import json
import math

import pytest

from tests.helpers import metric_rows, steps_of
from tests.runner import cli, cli_fit

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  precision: 32-true
  max_steps: 4
  val_check_interval: 4
  check_val_every_n_epoch: null
  limit_val_batches: 2
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    - class_path: step35.loggers.CSVLogger
      init_args:
        name: csv
        flush_logs_every_n_steps: 1
  callbacks:
    - class_path: step35.callbacks.RunCheckpoint
      init_args:
        every_n_train_steps: 4
        keep_last: 1
    - class_path: step35.callbacks.evaluation.EvalCallback
      init_args:
        every_n_steps: 4
        prompts: {prompts}
        limit: 3
        reward_funcs: [regex_match]
        num_samples: 2
        k: [1, 2]
        temperature: 1.0
        max_new_tokens: 12
        mtp_batches: 2
model:
  config: tiny
  mtp_loss_weight: 0.3
  lr: 3.0e-3
  warmup_steps: 1
data:
  format: chat
  seq_len: 64
  micro_batch_size: 2
  val_batches: 2
  num_workers: 0
"""


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Three prompt records: one every answer passes (`.*`), one none can (a word outside the vocabulary)."""
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    records = [
        {"prompt": [{"role": "user", "content": "What is the for statement?"}], "answer_regex": "(?s).*"},
        {"prompt": [{"role": "user", "content": "Tell me about lists."}], "answer_regex": "(?s).*zzqqxx.*"},
        {"prompt": "The while statement", "answer_regex": "(?s).*"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, builtin_cache, prompts):
    """A 4-step chat fine-tune from scratch with validation and EvalCallback at step 4, and its checkpoint."""
    folder = tmp_path_factory.mktemp("eval-run")
    config = folder / "sft.yaml"
    config.write_text(CONFIG.format(prompts=prompts))
    run = folder / "run"
    cli_fit(None, config, run, builtin_cache)
    return run


def evaluate(capfd, *args):
    return cli(capfd, "eval", *args)


def test_heldout_loss_equals_the_logged_validation_loss(sft_run, capfd, builtin_cache, monkeypatch):
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    code, out, err = evaluate(capfd, "--checkpoint", str(sft_run))
    assert code == 0, err[-3000:]
    results = json.loads((sft_run / "eval" / "step=4.json").read_text())
    logged = steps_of(metric_rows(sft_run / "csv" / "version_0"), "val/loss")
    assert results["heldout"]["loss"] == pytest.approx(logged[3], rel=1e-6, abs=1e-6)  # (step 4 logs at 3)
    assert 0 < results["heldout"]["bits_per_byte"] < results["heldout"]["loss"] / math.log(2)  # > 1 byte a token
    assert "heldout/loss" in out and (sft_run / "eval" / "scores.png").is_file()


def test_tasks_pass_at_k_and_the_gate(sft_run, prompts, capfd, builtin_cache, monkeypatch):
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    out_dir = sft_run.parent / "tasks-eval"
    args = ["--checkpoint", str(sft_run), "--tasks", str(prompts), "--reward_funcs", "[regex_match]",
            "--num_samples", "2", "--k", "[1, 2]", "--temperature", "1.0", "--max_new_tokens", "12",
            "--out", str(out_dir)]  # fmt: skip
    code, _, err = evaluate(capfd, *args, "--gate", "--max_empty", "1.0")
    assert code == 0, err[-3000:]
    tasks = json.loads((out_dir / "step=4.json").read_text())["tasks"]
    assert tasks["pass@1"] == pytest.approx(2 / 3) and tasks["pass@2"] == pytest.approx(2 / 3)
    assert tasks["reward"] == pytest.approx(2 / 3) and len(tasks["samples"]) == 6
    # A 4-step model never stops within 12 tokens: a gate on missing EOS fails, naming it, with exit 1.
    code, _, err = evaluate(capfd, *args, "--gate", "--max_missing_eos", "0.5")
    assert code == 1 and "quality gate failed: missing_eos" in err, err[-2000:]
    assert "Traceback" not in err


def test_mtp_acceptance_is_measured_on_the_validation_split(sft_run, capfd, builtin_cache, monkeypatch):
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    out_dir = sft_run.parent / "mtp-eval"
    code, _, err = evaluate(capfd, "--checkpoint", str(sft_run), "--mtp", "--out", str(out_dir))
    assert code == 0, err[-3000:]
    mtp = json.loads((out_dir / "step=4.json").read_text())["mtp"]
    assert mtp["depths"] == 1 and 0.0 <= mtp["depth1"] <= 1.0


def test_the_callback_logged_what_eval_computes_on_the_same_checkpoint(sft_run, prompts, capfd, builtin_cache,
                                                                       monkeypatch):  # fmt: skip
    """EvalCallback at step 4 and `step35 eval` of the step-4 checkpoint with the same options: the same answers
    and batches, so the same numbers."""
    from step35.eval.report import scalars

    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    rows = metric_rows(sft_run / "csv" / "version_0")
    logged = {name[len("eval/") :]: values[3] for name in rows[0] if name.startswith("eval/")
              for values in [steps_of(rows, name)] if 3 in values}  # fmt: skip
    out_dir = sft_run.parent / "callback-eval"
    code, _, err = evaluate(
        capfd, "--checkpoint", str(sft_run), "--tasks", str(prompts), "--reward_funcs", "[regex_match]",
        "--num_samples", "2", "--k", "[1, 2]", "--temperature", "1.0", "--max_new_tokens", "12", "--gate",
        "--mtp", "--batches", "2", "--out", str(out_dir),
    )  # fmt: skip
    assert code == 0, err[-3000:]
    computed = {k: v for k, v in scalars(json.loads((out_dir / "step=4.json").read_text())).items()
                if not k.startswith("heldout/")}  # fmt: skip
    assert logged.keys() == computed.keys() and "tasks/pass@1" in logged and "mtp/depth1" in logged, logged
    for name, value in computed.items():
        assert logged[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_the_callback_under_ep2_on_two_ranks_logs_what_eval_computes(tmp_path, prompts, capfd, builtin_cache,
                                                                     monkeypatch):  # fmt: skip
    """EvalCallback inside a 2-rank FSDP + EP 2 fit (every rank answers the same prompts in lockstep; a hang fails
    by the timeout): its step-4 numbers equal `step35 eval`'s in one process on the step-4 checkpoint, the MTP
    drafts too (scored through the sharded MTP layer's head; each rank's validation batch, the counts summed, as
    one process's two batches)."""
    from step35.eval.report import scalars
    from tests.runner import fit

    config = tmp_path / "sft.yaml"
    config.write_text(CONFIG.format(prompts=prompts).replace("mtp_batches: 2", "mtp_batches: 1"))
    run = tmp_path / "run"
    strategy = ["--trainer.strategy=step35.strategy.Step35Strategy", "--trainer.strategy.expert_parallel_size=2",
                "--trainer.devices=2"]  # fmt: skip
    fit(config, run, builtin_cache, *strategy, nproc=2, timeout=600)
    rows = metric_rows(run / "csv" / "version_0")
    logged = {name[len("eval/") :]: values[3] for name in rows[0] if name.startswith("eval/")
              for values in [steps_of(rows, name)] if 3 in values}  # fmt: skip
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    out_dir = tmp_path / "eval"
    code, _, err = evaluate(
        capfd, "--checkpoint", str(run), "--tasks", str(prompts), "--reward_funcs", "[regex_match]",
        "--num_samples", "2", "--k", "[1, 2]", "--temperature", "1.0", "--max_new_tokens", "12", "--gate",
        "--mtp", "--batches", "2", "--out", str(out_dir),
    )  # fmt: skip
    assert code == 0, err[-3000:]
    computed = {k: v for k, v in scalars(json.loads((out_dir / "step=4.json").read_text())).items()
                if not k.startswith("heldout/")}  # fmt: skip
    assert logged.keys() == computed.keys() and "tasks/pass@1" in logged and "mtp/depth1" in logged, logged
    for name, value in computed.items():
        assert logged[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
