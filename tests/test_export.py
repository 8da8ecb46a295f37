"""`step35 export`: a training checkpoint becomes an HF folder that loads as it is, with the tokenizer the
run trained with, config ids that agree with it, and (for a run started from an HF folder) every other file
of that folder byte for byte."""

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file

from step35.checkpoint import run_tokenizer
from step35.checkpoint.export import export_checkpoint, resolve_checkpoint
from step35.checkpoint.pretrained import load_pretrained, save_pretrained
from step35.cli import main
from step35.data import Step35DataModule
from step35.data.builtin import builtin_tokenizer_dir
from step35.data.tokenizer import TextTokenizer
from step35.model import Step35ForCausalLM
from step35.module import Step35LightningModule


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    run, _ = tiny_run
    out = tmp_path_factory.mktemp("export") / "hf"
    main(["export", "--checkpoint", str(run), "--out", str(out), "--max_shard_size", "1MB"])
    return out


def exported_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(folder.glob("model-*.safetensors")):
        state.update(load_file(file))
    return state


def test_run_folder_resolves_to_its_newest_checkpoint(tiny_run):
    run, _ = tiny_run
    assert resolve_checkpoint(run).name == "step=000003.ckpt"


def test_export_round_trip_fp32(tiny_run, exported):
    _, model = tiny_run
    assert len(list(exported.glob("model-*.safetensors"))) > 1  # 1MB shards
    loaded = load_pretrained(exported)
    reference = model.state_dict()
    assert loaded.state_dict().keys() == reference.keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, reference[name]), name
    init = Step35ForCausalLM(model.config)
    init.init_weights(0)
    assert not torch.equal(loaded.lm_head.weight, init.lm_head.weight)  # the trained weights, not the init


def test_transformers_oracle_holds_the_trained_parameters(tiny_run, exported):
    """The exported files, read by safetensors and loaded strictly into transformers' Step3p7TextModel
    (tests/hf_oracle.py), hold the trained parameters and compute our logits."""
    from tests.hf_oracle import hf_forward_logits, hf_name_to_ours, hf_reference_model

    _, model = tiny_run
    config = json.loads((exported / "config.json").read_text())
    hf_model, lm_head = hf_reference_model(config, exported_state(exported))
    trained = model.state_dict()
    checked = 0
    for hf_name, value in hf_model.state_dict().items():
        for ours, selector in hf_name_to_ours(hf_name):
            part = value if selector is None else value.chunk(2, dim=1)[0 if selector == "gate" else 1]
            assert torch.equal(part, trained[ours]), (hf_name, ours)
            checked += 1
    assert torch.equal(lm_head.detach(), trained["lm_head.weight"])
    main_layer_tensors = [n for n in trained if not n.startswith(f"model.layers.{config['num_hidden_layers']}.")]
    assert checked == len(main_layer_tensors) - 1  # every main-model tensor but lm_head, which is checked above
    ids = torch.randint(0, config["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_forward_logits(hf_model, lm_head, ids), model(ids), atol=1e-4, rtol=1e-4)


def test_exported_tokenizer_is_the_runs_and_agrees_with_config(tiny_run, exported, builtin_cache):
    from transformers import AutoTokenizer

    builtin = builtin_tokenizer_dir(cache_dir=builtin_cache)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (exported / name).read_bytes() == (builtin / name).read_bytes(), name
    config = json.loads((exported / "config.json").read_text())
    assert "auto_map" not in config  # no remote code in the folder, so nothing may point at it
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.eos_token_id == 0 and config["eos_token_id"] == [0]  # the preset said [1]
    assert tokenizer.bos_token_id is None and config["bos_token_id"] is None  # the preset said 0
    assert tokenizer.pad_token_id is None and "pad_token_id" not in config
    text = "for x in range(3): print(x)"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == TextTokenizer.from_folder(builtin).encode(text)


def test_tokenizer_travels_inside_the_checkpoint(tiny_run, builtin_cache):
    """The recorded files are what export uses: the built-in cache may be gone on the export machine."""
    from step35.checkpoint.trainer_io import load_file as load_ckpt

    run, _ = tiny_run
    saved = load_ckpt(resolve_checkpoint(run))[run_tokenizer.RECORD_KEY]
    builtin = builtin_tokenizer_dir(cache_dir=builtin_cache)
    assert saved["source"] == str(builtin.resolve()) and saved["eos_token_id"] == 0
    assert saved["files"]["tokenizer.json"] == (builtin / "tokenizer.json").read_bytes()


def test_export_to_bf16_keeps_router_bias_fp32(tiny_run, tmp_path):
    run, model = tiny_run
    main(["export", "--checkpoint", str(run / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "hf"),
          "--dtype", "bfloat16"])
    loaded = load_pretrained(tmp_path / "hf")
    assert loaded.config.torch_dtype == "bfloat16"
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[1].moe.router_bias.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_checkpoint_carries_the_model_config(tiny_run):
    from step35.config import preset

    run, _ = tiny_run
    meta = torch.load(resolve_checkpoint(run), map_location="cpu", weights_only=False)
    assert meta["step35_config"] == preset("tiny").to_dict()


def release_like_folder(path: Path, builtin: Path) -> dict[str, bytes]:
    """A start checkpoint as a release ships it: weights + config.json with auto_map, remote code,
    tokenizer, generation config, chat template, licence, readme, a docs subfolder. Returns the extra files."""
    model = Step35ForCausalLM(Step35LightningModule(config="tiny").model_config)
    model.init_weights(1)
    save_pretrained(model, path)
    extra = {name: (builtin / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json",
                                                               "special_tokens_map.json")}
    extra.update({
        "configuration_step3p5.py": b"# remote code: the config class\nclass Step3p5Config: ...\n",
        "modeling_step3p5.py": b"# remote code: the model class\nclass Step3p5ForCausalLM: ...\n",
        "generation_config.json": b'{"bos_token_id": 0, "eos_token_id": [0], "do_sample": true}\n',
        "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
        "LICENSE": b"Apache License 2.0 \xc2\xa9 someone\n",
        "README.md": b"---\nlicense: apache-2.0\n---\n# a model\n",
        "docs/figure.svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>\x00\xff",
    })
    for name, content in extra.items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(content)
    (path / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # hidden: not copied
    return extra


def test_run_from_an_hf_folder_exports_its_files_byte_for_byte(tmp_path, builtin_cache):
    source = tmp_path / "release"
    extra = release_like_folder(source, builtin_tokenizer_dir(cache_dir=builtin_cache))
    module = Step35LightningModule(checkpoint=str(source), lr=1e-2, warmup_steps=1)
    data = Step35DataModule(tokenizer=str(source), seq_len=16, micro_batch_size=1, cache_dir=str(builtin_cache))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path / "run",
                         enable_checkpointing=False)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    report = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "hf")
    out = tmp_path / "hf"
    for name, content in extra.items():
        assert (out / name).read_bytes() == content, name
    assert not (out / ".gitattributes").exists()
    config, released = (json.loads((p / "config.json").read_text()) for p in (out, source))
    assert config["auto_map"] == released["auto_map"] and config["architectures"] == released["architectures"]
    assert {k: v for k, v in config.items() if k not in ("eos_token_id", "bos_token_id")} == \
           {k: v for k, v in released.items() if k not in ("eos_token_id", "bos_token_id")}
    # The folder's tokenizer says EOS 0 and no BOS, its config [1] and 0: fixed, and said so.
    assert config["eos_token_id"] == [0] and config["bos_token_id"] is None
    assert any(note.startswith("eos_token_id [1] -> [0]") for note in report.notes), report.notes
    trained = load_pretrained(out).state_dict()
    for name, value in module.model.state_dict().items():
        assert torch.equal(trained[name], value), name
    # The source folder moved: the error names it and the option that points at its new place.
    source.rename(tmp_path / "moved")
    with pytest.raises(SystemExit, match=r"release: the run started from this HF folder .* pass --source"):
        main(["export", "--checkpoint", str(tmp_path / "run.ckpt"), "--out", str(tmp_path / "hf2")])
    main(["export", "--checkpoint", str(tmp_path / "run.ckpt"), "--out", str(tmp_path / "hf2"),
          "--source", str(tmp_path / "moved")])
    assert (tmp_path / "hf2" / "modeling_step3p5.py").read_bytes() == extra["modeling_step3p5.py"]
