"""Step-3.7-Flash end to end through the commands (issue 28): from a tiny Step-3.7 folder with the built-in
tokenizer and its chat template, `step35 fit` of a chat fine-tune and of DPO (from the release's names) and of LoRA
(from the NVFP4 export's `model.language_model.*` names, no MTP layers), `step35 export` of each (the LoRA run with
--merge) writing Step-3.7 folders that transformers' Step3p7ForConditionalGeneration loads, with every vision
tensor byte for byte the start folder's and the text tensors under the names they came with, and `step35
generate --chat` replying from the run and its export alike. Conversations with images stop a run, naming the
record; `step35 plan` counts the vision weights as carried on the host.

Every command runs in this process (the process boundary is not what is tested here); the runs and exports are
made once for the module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import STEP37_VISION, safetensors_in, step37_folder, write_jsonl
from tests.runner import ROOT, step35_in_process

pytestmark = pytest.mark.heavy  # transformers builds a vision tower; two short fits in this process

SFT = ROOT / "configs" / "tiny-sft.yaml"
DPO = ROOT / "configs" / "tiny-dpo.yaml"
SAVE_AT_2 = '[{"class_path": "step35.callbacks.RunCheckpoint", "init_args": {"every_n_train_steps": 2}}]'
SHORT = [  # two optimizer steps of short windows, a checkpoint at the end, nothing else
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=0",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    f"--trainer.callbacks={SAVE_AT_2}",
    "--data.seq_len=64",
    "--data.micro_batch_size=2",
]
TOLERANCE = 1e-5  # fp32 logits, step35 against transformers (tests/test_step37.py)
PROMPT = "What is the fnmatch module for?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, builtin_cache) -> dict[str, Path]:
    """{"flat": the tiny preset's language model (drawn with seed 1) in a Step-3.7 folder under the release's
    names, "nested": the same under model.language_model.* without MTP layers}, each with the built-in tokenizer
    and its chat template."""
    from step35.checkpoint.hf.materialize import checkpoint_state
    from step35.checkpoint.training.run_tokenizer import TOKENIZER_FILES
    from step35.config import preset
    from step35.data import builtin_tokenizer_dir
    from step35.model import Step35ForCausalLM

    start = Step35ForCausalLM(preset("tiny"))
    start.init_weights(1)
    initial = {n: t.detach().clone() for n, t in checkpoint_state(start).items()}
    root = tmp_path_factory.mktemp("step37-cli")
    tokenizer = builtin_tokenizer_dir(cache_dir=builtin_cache)
    out = {}
    for nested in (False, True):
        folder, _ = step37_folder(root, nested=nested, text=preset("tiny").to_dict(), language=initial)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copyfile(tokenizer / name, folder / name)
        out[folder.name] = folder
    assert (out["flat"] / "chat_template.jinja").is_file()
    return out


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory, builtin_cache) -> dict[str, Path]:
    """The chat fine-tune of the flat folder, the LoRA run of the nested one (2 steps each, built-in
    conversations) and DPO from the flat folder (2 steps, built-in preference pairs), and their exports:
    {"sft", "lora", "dpo": run folders, "full", "merged", "dpo-hf": HF folders}."""
    root = tmp_path_factory.mktemp("step37-runs")

    def step35(*args: str) -> None:
        step35_in_process(None, list(args), builtin_cache)

    flat, nested = folders["flat"], folders["nested"]
    step35("fit", "--config", str(SFT), f"--run_dir={root / 'sft'}", f"--model.checkpoint={flat}",
           f"--data.tokenizer={flat}", *SHORT)  # fmt: skip
    step35("fit", "--config", str(SFT), f"--run_dir={root / 'lora'}", f"--model.checkpoint={nested}",
           f"--data.tokenizer={nested}", "--model.num_mtp_layers=0", "--model.mtp_loss_weight=0",
           "--model.lora.rank=4", "--model.lr=1e-2", *SHORT)  # fmt: skip
    step35("fit", "--config", str(DPO), f"--run_dir={root / 'dpo'}", f"--model.checkpoint={flat}",
           f"--data.tokenizer={flat}", *SHORT[:-2], "--data.seq_len=320", "--data.micro_batch_size=1")  # fmt: skip
    step35("export", "--checkpoint", str(root / "sft"), "--out", str(root / "full"))
    step35("export", "--checkpoint", str(root / "lora"), "--out", str(root / "merged"), "--merge")
    step35("export", "--checkpoint", str(root / "dpo"), "--out", str(root / "dpo-hf"))
    return {name: root / name for name in ("sft", "lora", "dpo", "full", "merged", "dpo-hf")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("export, start", [("full", "flat"), ("merged", "nested"), ("dpo-hf", "flat")])
def test_exports_are_step37_folders_transformers_loads(runs, folders, export, start):
    """config.json is the start folder's with the trained text config; the vision tensors are the start folder's,
    byte for byte; the text tensors are the trained ones under the start folder's names; transformers loads the
    folder natively and computes step35's logits."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    from step35.checkpoint.hf.pretrained import load_pretrained

    out, source = runs[export], folders[start]
    written, released = (json.loads((p / "config.json").read_text()) for p in (out, source))
    assert written["model_type"] == "step3p7" and written["architectures"] == released["architectures"]
    assert written["vision_config"] == released["vision_config"]
    assert written["text_config"]["moe_num_experts"] == released["text_config"]["moe_num_experts"]
    stored, before = safetensors_in(out), safetensors_in(source)
    vision = {n for n in before if n.startswith(STEP37_VISION)}
    assert vision and vision <= set(stored)
    for name in vision:
        a, b = stored[name], before[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name
    text = set(stored) - vision
    prefix = "model.language_model." if start == "nested" else "model."
    assert {n for n in text if n.startswith("model.")} == {n for n in text if n.startswith(prefix)}, sorted(text)
    assert text == set(before) - vision  # the start folder's names, no more and no fewer
    assert any(not torch.equal(stored[n], before[n]) for n in text)  # trained (or merged) weights
    theirs, info = Step3p7ForConditionalGeneration.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_pretrained(out, num_mtp_layers=0 if start == "nested" else None).eval()
    ids = torch.randint(2, 1000, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = (ours(ids) - theirs.eval()(input_ids=ids, use_cache=False).logits).abs().max().item()
    assert err <= TOLERANCE, err


@pytest.mark.timeout(900)
def test_generate_chat_replies_from_the_run_and_its_step37_export(runs, step35_here):
    args = ["--chat", "--prompt", PROMPT, "--max_new_tokens", "8"]
    code, from_run, err = step35_here("generate", "--checkpoint", str(runs["sft"]), *args)
    assert code == 0 and from_run.strip(), err[-3000:]
    assert PROMPT not in from_run  # the reply alone
    code, from_export, err = step35_here("generate", "--checkpoint", str(runs["full"]), *args)
    assert code == 0 and from_export == from_run, err[-3000:]


@pytest.mark.timeout(600)
def test_images_in_conversations_stop_the_run_naming_the_record(folders, tmp_path, step35_here):
    """Line 1 gives its content as text parts (trained as before); line 2 holds an image part: the fit stops
    there, naming the file and the line, and saying that the run reads no images (not a bad record
    skipped and counted: the run would then train on other data than it was given)."""
    flat = folders["flat"]
    chats = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            {"messages": [
                {"role": "user", "content": [{"type": "text", "text": "Name a module."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "The fnmatch module."}]},
            ]},
            {"messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                ]},
                {"role": "assistant", "content": "A cat."},
            ]},
        ],
    )  # fmt: skip
    code, out, err = step35_here(
        "fit", "--config", str(SFT), f"--run_dir={tmp_path / 'run'}", f"--model.checkpoint={flat}",
        f"--data.tokenizer={flat}", f"--data.files={chats}", "--data.val_fraction=0", *SHORT,
    )  # fmt: skip
    assert code != 0
    assert (
        f"{chats}:2: message 0 (user): content part 1 is an image ('image_url'), and this run reads no images (no"
        " data.images" in err
    ), out[-2000:] + err[-4000:]
    assert "skipping bad record" not in err


@pytest.mark.timeout(600)
def test_plan_counts_the_vision_weights_on_the_host_not_on_devices(folders, step35_here):
    from step35.checkpoint.hf.folder import model_tensor_infos

    flat = folders["flat"]
    language, carried, _ = model_tensor_infos(flat)
    params = sum(torch.Size(info.shape).numel() for info in carried.values())
    size = sum(torch.Size(info.shape).numel() * info.dtype.itemsize for info in carried.values())
    args = ["plan", "--config", str(SFT), f"--model.checkpoint={flat}", f"--data.tokenizer={flat}"]
    code, out, err = step35_here(*args)
    assert code == 0, out[-2000:] + err[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("vision ")), "")
    assert f"{params:,} vision parameters (" in line and "carried on the host, not on devices" in line, out
    code, out, err = step35_here(*args, "--json")
    plan = json.loads(out)
    assert plan["carried"]["params"] == params and plan["carried"]["bytes"] == size
    assert plan["carried"]["tensors"] == len(carried) and plan["carried"]["dtypes"] == ["float32"]
    weights = [i for n, i in language.items() if not n.endswith("router_bias")]  # the biases are buffers
    assert plan["model"]["params_total"] == sum(torch.Size(i.shape).numel() for i in weights)  # no vision
