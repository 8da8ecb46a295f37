"""The mistakes a newcomer makes, each answered by one line that says what to do, without a traceback (issue 47):
a chat template that does not parse, a run folder as model.checkpoint, a misspelt YAML key or option, the SFT
config with prompt/completion files, conversations that do not fit the window, two devices without a strategy,
the --checkpoint.async_save shortcut and the A100 in the plan; and what a fit from a Step-3.7 FP8 folder did with
the vision tensors and the block scales.

Every command runs in this process (tests/runner.cli) but the two-device job, whose second process Lightning
starts; a refusal's exit code and its one line on stderr are what the tests read."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, not first inside a test: its log handler keeps the real stderr)
import pytest
import torch
import yaml

from tests.helpers import write_jsonl
from tests.runner import ROOT, run_plan, step35

TINY = str(ROOT / "configs" / "tiny.yaml")
SFT = str(ROOT / "configs" / "tiny-sft.yaml")
QUICK = [  # one optimizer step of short windows, no validation, no progress bar
    "--trainer.max_steps=1",
    "--data.seq_len=32",
    "--data.micro_batch_size=2",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
]


def step35_lines(err: str) -> list[str]:
    """The lines step35 said (`step35: ...`, `step35 fit: ...`)."""
    return [line for line in err.splitlines() if line.startswith(("step35:", "step35 fit:"))]


def refused(result: tuple[int, str, str]) -> str:
    """The one line of a refusal, given step35_here's (code, out, err): exit code 1, no traceback, one `step35:`
    line on stderr."""
    code, _, err = result
    lines = step35_lines(err)
    assert code == 1 and "Traceback" not in err and len(lines) == 1, (code, err[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def builtin_tokenizer(builtin_cache) -> Path:
    from step35.data import builtin_tokenizer_dir

    return builtin_tokenizer_dir(cache_dir=builtin_cache)


# ------------------------------------------------------------------------------ a chat template that does not parse
def test_a_chat_template_that_does_not_parse_stops_the_run_at_setup(tmp_path, step35_here, builtin_tokenizer):
    """Before: every record failed to render, each skipped as a bad record, and the run ended at its first batch
    with "fix the data, or use fewer ranks x workers" and a traceback."""
    folder = shutil.copytree(builtin_tokenizer, tmp_path / "tokenizer")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    args = ["fit", "--config", TINY, f"--run_dir={tmp_path / 'run'}", "--data.format=chat", *QUICK]
    line = refused(step35_here(*args, f"--data.tokenizer={folder}"))
    assert line == (
        f"step35: {folder / 'chat_template.jinja'}: chat template from chat_template.jinja does not parse (line 1):"
        " unexpected '}'; fix it, or set data.chat_template to a .jinja file"
    )
    (tmp_path / "bad.jinja").write_text("{% if %}")  # the same for data.chat_template, named by its path
    line = refused(step35_here(*args, f"--data.chat_template={tmp_path / 'bad.jinja'}"))
    assert line.startswith(f"step35: chat template from {tmp_path / 'bad.jinja'} does not parse (line 1): ")


# ------------------------------------------------------------------------------ a run folder as model.checkpoint
def test_a_run_folder_as_model_checkpoint_says_to_export_it_first(tmp_path, tiny_run, step35_here):
    run, _ = tiny_run
    args = ["fit", "--config", TINY, f"--run_dir={tmp_path / 'run'}", *QUICK]
    line = refused(step35_here(*args, f"--model.checkpoint={run}"))
    assert line == (
        f"step35: model.checkpoint={run} is a step35 run folder (newest checkpoint: step=000003.ckpt), not an HF"
        f" folder (config.json + safetensors): export it first, `step35 export --checkpoint {run} --out {run / 'hf'}`,"
        f" then start from --model.checkpoint {run / 'hf'}"
    )
    ckpt = run / "checkpoints" / "step=000003.ckpt"  # one checkpoint of it: the same answer
    line = refused(step35_here(*args, f"--model.checkpoint={ckpt}"))
    assert line.startswith(f"step35: model.checkpoint={ckpt} is a step35 training checkpoint, not an HF folder")
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------------------ a misspelt key or option
@pytest.mark.parametrize(
    ("config", "option", "answer"),
    [
        ("trainer:\n  max_step: 3\n", [], "'trainer.max_step'; trainer.max_step: did you mean trainer.max_steps"),
        ("model:\n  lrr: 0.1\n", [], "'model.lrr'; model.lrr: did you mean model.lr "),
        ("traner:\n  max_steps: 3\n", [], "'traner.max_steps'; traner.max_steps: did you mean trainer.max_steps "),
        ("", ["--trainer.max_step", "3"], "--trainer.max_step 3; --trainer.max_step: did you mean --trainer.max_steps"),
        (
            "trainer:\n  callbacks:\n    - class_path: step35.callbacks.RunCheckpoint\n"
            "      init_args:\n        every_n_train_step: 5\n",
            [],
            "trainer.callbacks: step35.callbacks.RunCheckpoint takes no option 'every_n_train_step': did you mean"
            " every_n_train_steps?",
        ),
        (
            "",
            ["--model.lora.rnk", "4"],
            "model.lora: step35.model.lora.LoraConfig takes no option 'rnk': did you mean rank?",
        ),
    ],
)
def test_a_misspelt_key_or_option_is_answered_alone_with_a_did_you_mean(tmp_path, step35_here, config, option, answer):
    """The error alone, on one line (before: after ~90 lines of usage; a YAML key had no did-you-mean)."""
    (tmp_path / "mine.yaml").write_text(config or "seed_everything: 0\n")
    code, out, err = step35_here("fit", "--config", TINY, "--config", str(tmp_path / "mine.yaml"), *option)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, err[-3000:])
    assert err.startswith("step35 fit: error: ") and answer in err, err
    assert err.rstrip().endswith("(`step35 fit --help` lists the options)")


# ------------------------------------------------------------------------------ tiny-sft with prompt/completion files
def test_the_sft_config_trains_on_prompt_completion_files_and_on_built_in_conversations_without(
    tmp_path, step35_here, builtin_cache
):
    """configs/tiny-sft.yaml with `data.files` of prompt/completion records, as the README suggests (before: its
    `data.format: chat` refused them at the first batch); without files it still trains on the built-in
    conversations."""
    from step35.data import Step35DataModule

    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": f"What is {i}?", "completion": f"It is {i}."} for i in range(50)]
    )
    start_here = ["--model.checkpoint=null", "--model.config=tiny", "--data.tokenizer=null"]  # no runs/tiny/hf needed
    run = tmp_path / "run"
    code, out, err = step35_here(
        "fit", "--config", SFT, f"--run_dir={run}", *start_here, f"--data.files={pairs}", *QUICK
    )
    assert code == 0, err[-3000:]
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        losses = [float(r["train/lm_loss"]) for r in csv.DictReader(f) if r.get("train/lm_loss")]
    assert len(losses) == 1 and 0 < losses[0] < 10, losses

    # the config's data section as the run reads it: the files' format detected; no files, the built-in conversations
    data = {k: v for k, v in yaml.safe_load(Path(SFT).read_text())["data"].items() if k != "tokenizer"}
    with_files = Step35DataModule(**data, files=str(pairs), cache_dir=str(builtin_cache))
    with_files.setup("fit")
    assert [s.format for s in with_files._train_sources] == ["prompt_completion"]
    without = Step35DataModule(**data, cache_dir=str(builtin_cache))
    without.setup("fit")
    assert [(s.name, s.format) for s in without._train_sources] == [("builtin-chat", "chat")]


# ------------------------------------------------------------------------------ conversations that do not fit
def agent_records(count: int, with_tools: int) -> list[dict]:
    """`count` short agent conversations, the first `with_tools` of them with two long tool schemas."""
    description = "Looks the weather up for a city and returns the forecast for the next days. " * 6
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": description,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
        for i in range(2)
    ]
    records = []
    for i in range(count):
        messages = [
            {"role": "user", "content": f"Weather in Paris, day {i}?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "tool_0", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "Sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ]  # fmt: skip
        records.append({"messages": messages, **({"tools": tools} if i < with_tools else {})})
    return records


def test_conversations_that_do_not_fit_the_window_are_said_at_start_and_stop_the_run_above_a_share(
    tmp_path, step35_here, builtin_tokenizer
):
    """30 of 40 agent conversations carry tool schemas longer than the window: truncated, none of their trained
    tokens would be left, so the packer drops them (before: each reported as training met it, validation off,
    exit 0). At setup: a refusal above data.max_dropped_share (0.5 by default), a warning at or below it; both
    name the count and the seq_len that holds every conversation, computed here by rendering each record whole."""
    from step35.data.chat_template import ChatTemplate
    from step35.data.tokenizer import TextTokenizer

    records = agent_records(40, with_tools=30)
    path = write_jsonl(tmp_path / "agent.jsonl", records)
    seq_len = 96
    tokenizer, template = TextTokenizer.from_folder(builtin_tokenizer), ChatTemplate.from_folder(builtin_tokenizer)
    encoded = [template.encode(tokenizer, r["messages"], tools=r.get("tools")) for r in records]
    window = seq_len + 1
    dropped = sum(len(ids) > window and not any(trained[1:window]) for ids, trained in encoded)
    longest = max(len(ids) for ids, _ in encoded)
    assert dropped == 30 and longest > 2 * window, (dropped, longest)  # the fixture does what it says

    args = ["fit", "--config", TINY, f"--data.files={path}", "--data.val_fraction=0", *QUICK]
    args += [f"--data.seq_len={seq_len}", f"--data.tokenizer={builtin_tokenizer}"]
    said = (
        f"source '{path}': 30 of the first 40 conversations (75%) do not fit a window of {window} tokens (data.seq_len"
        f" {seq_len}) and would be dropped (cut to the window, they would keep none of their trained tokens: what"
        f" comes first (a system prompt, tool schemas) fills it); data.seq_len {longest - 1} holds them all."
    )
    line = refused(step35_here(*args, f"--run_dir={tmp_path / 'stopped'}"))
    assert line == (
        f"step35: {said} That is above data.max_dropped_share=0.5: raise data.seq_len, or set"
        " data.max_dropped_share 0.75 to train on the rest"
    )
    code, _, err = step35_here(*args, f"--run_dir={tmp_path / 'run'}", "--data.max_dropped_share=0.8")
    assert code == 0, err[-3000:]
    warned = [line for line in step35_lines(err) if said in line]
    assert warned == [f"step35: warning: {said} Training goes on without them (data.max_dropped_share=0.8)"], err
    # within the window: nothing said
    code, _, err = step35_here(*args[:-2], f"--data.seq_len={longest}", f"--data.tokenizer={builtin_tokenizer}",
                               f"--run_dir={tmp_path / 'fits'}")  # fmt: skip
    assert code == 0 and "do not fit a window" not in err, err[-3000:]


# ------------------------------------------------------------------------------ two devices, no strategy
@pytest.mark.multiprocess  # two ranks, started by Lightning's launcher
@pytest.mark.timeout(600)
def test_two_devices_without_a_strategy_train_with_step35_strategy_and_say_so(tmp_path, builtin_cache):
    """Before: Lightning's DDP, chosen without a word (a whole copy of the model and optimizer on every rank)."""
    run = tmp_path / "run"
    proc = step35(
        ["fit", "--config", TINY, f"--run_dir={run}", "--trainer.devices=2", *QUICK],
        builtin_cache,
        timeout=540,
    )
    said = [line for line in step35_lines(proc.stderr) if "trainer.strategy" in line]
    assert said == [
        "step35: trainer.strategy is not set for 2 processes (trainer.devices=2 x trainer.num_nodes=1): training with"
        " step35.strategy.Step35Strategy (FSDP2 over the ranks, experts not split: --trainer.strategy"
        ".expert_parallel_size N splits them), not Lightning's default DDP, which keeps a whole copy of the model and"
        " its optimizer state on every rank; --trainer.strategy ddp asks for DDP"
    ], proc.stderr[-3000:]
    assert (run / "checkpoints" / "step=000001.ckpt").is_dir()  # Step35Strategy's sharded checkpoint, not a file


# ------------------------------------------------------------------------------ --checkpoint.async_save
def test_the_async_save_shortcut_sets_run_checkpoint(tmp_path):
    """Before: `--checkpoint.async_save true` was refused as unrecognized."""
    from step35.plan.settings import parse_fit_args

    config = parse_fit_args(["--config", TINY, "--checkpoint.async_save", "true", "--checkpoint.keep_last", "2"])
    (entry,) = [c for c in config.trainer.callbacks if c.class_path == "step35.callbacks.RunCheckpoint"]
    assert entry.init_args.async_save is True and entry.init_args.keep_last == 2
    assert entry.init_args.every_n_train_steps == 150  # the config's own, kept


# ------------------------------------------------------------------------------ the A100 in the plan
@pytest.mark.parametrize(("device", "name", "memory"), [("a100", "NVIDIA A100 SXM4 80GB", 80), ("a100-40gb", "NVIDIA A100 SXM4 40GB", 40)])  # fmt: skip
def test_the_plan_knows_the_a100(capsys, device, name, memory):
    """Before: `--device a100` was refused (choose from 910b, a3, b200, cpu, h100, h200)."""
    code, out, _ = run_plan(capsys, "--config", TINY, "--device", device, "--json", "--no-suggestions")
    planned = json.loads(out)
    assert code == 0 and planned["verdict"]["fits"]
    assert planned["device"] == {
        "name": name,
        "memory_gib": memory,
        "peak_tflops": 312,  # the A100 datasheet's dense BF16
        "intra_node_gbps": 300,  # NVLink 3: 600 GB/s both directions
        "inter_node_gbps": 25,  # one 200 Gb/s HDR port per GPU
        "runtime_reserve_gib": 2.0,
    }


# ------------------------------------------------------------------------------ what a fit did with the parts
def step37_fp8_folder(checkpoint: Path, out: Path, tokenizer: Path) -> tuple[Path, int]:
    """The run's checkpoint exported in FP8, then wrapped as a Step-3.7 folder (config.json's text_config, the
    quantization_config at its top level, two bf16 vision tensors in a file of their own): (the folder, how many
    of its tensors have block scales)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from step35.checkpoint.training.export import export_checkpoint

    export_checkpoint(checkpoint, out, dtype=torch.float8_e4m3fn, tokenizer=tokenizer)
    (out / "step35.manifest.json").unlink(missing_ok=True)  # edited below: no longer what the manifest lists
    text = json.loads((out / "config.json").read_text())
    quantization = text.pop("quantization_config")
    wrapper = {
        "model_type": "step3p7",
        "quantization_config": quantization,
        "text_config": {**text, "model_type": "step3p5"},
    }
    (out / "config.json").write_text(json.dumps(wrapper))
    vision = {"vision_model.patch_embed.weight": torch.ones(8, 4), "vit_large_projector.weight": torch.ones(4, 8)}
    save_file({n: t.to(torch.bfloat16) for n, t in vision.items()}, out / "vision.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(vision, "vision.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    scaled = 0
    for file in out.glob("model-*.safetensors"):
        with safe_open(file, "pt") as f:
            scaled += sum(name.endswith("_scale_inv") for name in f.keys())
    return out, scaled


def test_a_fit_from_a_step37_fp8_folder_says_what_it_did_with_the_vision_tensors_and_the_block_scales(
    tmp_path, tiny_run, step35_here, builtin_tokenizer
):
    run, _ = tiny_run
    folder, scaled = step37_fp8_folder(run / "checkpoints" / "step=000003.ckpt", tmp_path / "start", builtin_tokenizer)
    block = json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"]
    assert scaled > 20
    code, _, err = step35_here(
        "fit", "--config", TINY, f"--run_dir={tmp_path / 'run'}", f"--model.checkpoint={folder}", *QUICK
    )
    assert code == 0, err[-3000:]
    notes = [line for line in step35_lines(err) if line.startswith(f"step35: model.checkpoint {folder} ")]
    assert notes == [
        f"step35: model.checkpoint {folder} is a Step-3.7 folder: its vision encoder and projector (64 parameters, 2"
        " tensors, 0.1 KiB bfloat16) are not trained and stay in the folder, never loaded on a device nor saved in this"
        " run's checkpoints; `step35 export` copies them from there as they are",
        f"step35: model.checkpoint {folder} is stored in FP8 (float8_e4m3fn, scale blocks {block}): its {scaled} FP8"
        " tensors are read dequantised (each block times its inverse scale <name>_scale_inv, in float32) into the"
        " model's weights, which this run trains and saves unquantised; `step35 export` writes them without"
        " quantization_config, or in the release's FP8 layout with --dtype float8_e4m3fn",
    ], err[-3000:]
