"""`step35 export`: a training checkpoint becomes an HF folder that loads as it is, with the tokenizer the
run trained with, config ids that agree with it, and (for a run started from an HF folder) every other file
of that folder byte for byte."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from step35.checkpoint.hf.modeling import AUTO_MAP, MODELING_FILE
from step35.checkpoint.hf.pretrained import load_pretrained, save_pretrained
from step35.checkpoint.training import keys
from step35.checkpoint.training.export import export_checkpoint
from step35.cli import main
from step35.data.builtin import builtin_tokenizer_dir
from step35.data.tokenizer import TextTokenizer
from step35.model import Step35ForCausalLM
from step35.module import Step35LightningModule
from step35.run import checkpoint_of
from tests.helpers import one_step_from


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
    assert checkpoint_of(run).name == "step=000003.ckpt"


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
    # no start folder: our own modeling file, which auto_map points at (tests/test_hf_modeling.py loads it)
    assert config["auto_map"] == AUTO_MAP and (exported / MODELING_FILE.name).read_bytes() == MODELING_FILE.read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.eos_token_id == 0 and config["eos_token_id"] == [0]  # the preset said [1]
    assert tokenizer.bos_token_id is None and config["bos_token_id"] is None  # the preset said 0
    assert tokenizer.pad_token_id is None and "pad_token_id" not in config
    text = "for x in range(3): print(x)"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == TextTokenizer.from_folder(builtin).encode(text)


def test_tokenizer_travels_inside_the_checkpoint(tiny_run, builtin_cache):
    """The recorded files are what export uses: the built-in cache may be gone on the export machine."""
    from step35.checkpoint.training.trainer_io import load_file as load_ckpt

    run, _ = tiny_run
    saved = load_ckpt(checkpoint_of(run))[keys.TOKENIZER]
    builtin = builtin_tokenizer_dir(cache_dir=builtin_cache)
    assert saved["source"] == str(builtin.resolve()) and saved["eos_token_id"] == 0
    assert saved["files"]["tokenizer.json"] == (builtin / "tokenizer.json").read_bytes()


def test_export_to_bf16_keeps_router_bias_fp32(tiny_run, tmp_path):
    run, model = tiny_run
    main(
        [
            "export",
            "--checkpoint",
            str(run / "checkpoints" / "last.ckpt"),
            "--out",
            str(tmp_path / "hf"),
            "--dtype",
            "bfloat16",
        ]
    )
    loaded = load_pretrained(tmp_path / "hf")
    assert loaded.config.torch_dtype == "bfloat16"
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[1].moe.router_bias.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_checkpoint_carries_the_model_config(tiny_run):
    from step35.config import preset

    run, _ = tiny_run
    meta = torch.load(checkpoint_of(run), map_location="cpu", weights_only=False)
    assert meta["step35_config"] == preset("tiny").to_dict()


def release_like_folder(path: Path, builtin: Path) -> dict[str, bytes]:
    """A start checkpoint as a release ships it: weights + config.json with auto_map, remote code (the
    modeling file imports a helper module relatively), tokenizer, generation config, chat template,
    licence, readme, and things an export leaves behind: a docs subfolder, a hidden file, a script no
    auto_map names. Returns the files an export copies."""
    model = Step35ForCausalLM(Step35LightningModule(config="tiny").model_config)
    model.init_weights(1)
    save_pretrained(model, path)
    extra = {
        name: (builtin / name).read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    }
    extra.update(
        {
            "configuration_step3p5.py": b"# remote code: the config class\nclass Step3p5Config: ...\n",
            "modeling_step3p5.py": b"# remote code: the model class\nfrom .moe_utils_step3p5 import route\n"
            b"class Step3p5ForCausalLM: ...\n",
            "moe_utils_step3p5.py": b"def route(): ...\n",
            "generation_config.json": b'{"bos_token_id": 0, "eos_token_id": [0], "do_sample": true}\n',
            "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
            "LICENSE": b"Apache License 2.0 \xc2\xa9 someone\n",
            "README.md": b"---\nlicense: apache-2.0\n---\n# a model\n",
        }
    )
    for name, content in extra.items():
        (path / name).write_bytes(content)
    (path / "docs").mkdir()
    (path / "docs" / "figure.svg").write_bytes(b"<svg xmlns='http://www.w3.org/2000/svg'/>\x00\xff")
    (path / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (path / "convert_weights.py").write_text("# a script of the release, not code the model loads\n")
    return extra


def test_run_from_an_hf_folder_exports_its_files_byte_for_byte(tmp_path, builtin_cache):
    source = tmp_path / "release"
    extra = release_like_folder(source, builtin_tokenizer_dir(cache_dir=builtin_cache))
    module, _ = one_step_from(source, tmp_path, builtin_cache)
    report = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "hf")
    out = tmp_path / "hf"
    for name, content in extra.items():
        assert (out / name).read_bytes() == content, name
    assert sorted(report.copied) == sorted(extra)  # nothing else: docs/, .gitattributes, convert_weights.py stay
    assert not {"docs", ".gitattributes", "convert_weights.py"} & {p.name for p in out.iterdir()}
    config, released = (json.loads((p / "config.json").read_text()) for p in (out, source))
    assert config["auto_map"] == released["auto_map"] and config["architectures"] == released["architectures"]
    assert {k: v for k, v in config.items() if k not in ("eos_token_id", "bos_token_id")} == {
        k: v for k, v in released.items() if k not in ("eos_token_id", "bos_token_id")
    }
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
    main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "run.ckpt"),
            "--out",
            str(tmp_path / "hf2"),
            "--source",
            str(tmp_path / "moved"),
        ]
    )
    assert (tmp_path / "hf2" / "modeling_step3p5.py").read_bytes() == extra["modeling_step3p5.py"]


# ------------------------------------------------------------------------------- paths inside a checkpoint
def planted_checkpoint(tiny_run, path: Path, drop: tuple[str, ...] = (), **hparams) -> Path:
    """tiny_run's checkpoint with its hyper-parameters saying what a checkpoint from elsewhere may say
    (and without the `drop` keys): a plain .ckpt with no manifest, as an older step35 wrote."""
    run, _ = tiny_run
    meta = torch.load(checkpoint_of(run), map_location="cpu", weights_only=False)
    meta["hyper_parameters"] = {**meta["hyper_parameters"], **hparams}
    for key in drop:
        meta.pop(key)
    torch.save(meta, path)
    return path


def home_like_folder(path: Path, builtin: Path) -> dict[str, bytes]:
    """An HF folder (config.json, tokenizer, readme, remote code) that also holds what must never be
    published: a key, cloud credentials, a subfolder. Returns the files an export may take from it."""
    from step35.config import preset

    public = {
        name: (builtin / name).read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    }
    public.update(
        {
            "README.md": b"# my model\n",
            "LICENSE": b"MIT\n",
            "generation_config.json": b'{"eos_token_id": 0}\n',
            "configuration_step3p5.py": b"class Step3p5Config: ...\n",
            "modeling_step3p5.py": b"class Step3p5ForCausalLM: ...\n",
        }
    )
    private = {
        "id_rsa": b"-----BEGIN OPENSSH PRIVATE KEY-----\n",
        ".aws/credentials": b"[default]\naws_secret=x\n",
        "projects/README.md": b"# another project\n",
        "notes.txt": b"passwords\n",
    }
    for name, content in {**public, **private}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(content)
    preset("tiny").save(path / "config.json")
    return public


def copied_lines(stdout: str) -> dict[str, str]:
    """`step35 export: copied NAME from ORIGIN` lines, as {NAME: ORIGIN}."""
    lines = [line.removeprefix("step35 export: copied ") for line in stdout.splitlines() if " copied " in line]
    return dict(line.split(" from ", 1) for line in lines)


def written_files(out: Path) -> set[str]:
    """Every file of an HF folder but its weights, index, config.json and manifest, recursively."""
    return (
        {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
        - {"config.json", "model.safetensors.index.json", "step35.manifest.json"}
        - {p.name for p in out.glob("model-*.safetensors")}
    )


def test_export_copies_only_known_file_kinds_of_the_folder_a_checkpoint_names(
    tiny_run, tmp_path, builtin_cache, capsys
):
    home = tmp_path / "home"
    public = home_like_folder(home, builtin_tokenizer_dir(cache_dir=builtin_cache))
    ckpt = planted_checkpoint(tiny_run, tmp_path / "planted.ckpt", checkpoint=str(home))
    main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")])
    out = tmp_path / "hf"
    assert written_files(out) == set(public)  # no id_rsa, .aws/, projects/, notes.txt
    for name, content in public.items():
        assert (out / name).read_bytes() == content, name
    said = capsys.readouterr()
    copied = copied_lines(said.out)
    assert sorted(copied) == sorted(public)  # one line per file written besides the weights
    assert copied["README.md"] == str(home / "README.md")
    assert copied["modeling_step3p5.py"] == str(home / "modeling_step3p5.py")  # named by auto_map
    assert f"files besides the weights taken from {home}, the HF folder the run started from" in said.err
    assert f"left out of {home}: .aws, id_rsa, notes.txt, projects (only known HF file kinds" in said.err
    assert (
        json.loads((out / "config.json").read_text())["auto_map"]["AutoConfig"] == "configuration_step3p5.Step3p5Config"
    )


def test_source_option_wins_over_the_folder_the_checkpoint_names(tiny_run, tmp_path, builtin_cache, capsys):
    builtin = builtin_tokenizer_dir(cache_dir=builtin_cache)
    home, release = tmp_path / "home", tmp_path / "release"
    home_like_folder(home, builtin)
    public = home_like_folder(release, builtin)
    (release / "README.md").write_bytes(b"# the release's own card\n")
    ckpt = planted_checkpoint(tiny_run, tmp_path / "planted.ckpt", checkpoint=str(home))
    main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--source", str(release)])
    assert (tmp_path / "hf" / "README.md").read_bytes() == b"# the release's own card\n"
    copied = copied_lines(capsys.readouterr().out)
    assert sorted(copied) == sorted(public)
    assert not [origin for origin in copied.values() if str(home) in origin], copied


def test_an_old_checkpoint_names_its_config_and_tokenizer_folders_known_files_only(
    tiny_run, tmp_path, builtin_cache, capsys
):
    """Without a saved model config or tokenizer, export reads the ones the hyper-parameters name:
    only a config.json (any other file is refused) and the tokenizer files, each said aloud."""
    home = tmp_path / "home"
    public = home_like_folder(home, builtin_tokenizer_dir(cache_dir=builtin_cache))
    old = (keys.MODEL_CONFIG, keys.TOKENIZER)
    ckpt = planted_checkpoint(tiny_run, tmp_path / "key.ckpt", drop=old, checkpoint=None, config=str(home / "id_rsa"))
    with pytest.raises(SystemExit, match=r"names '.*id_rsa' as its model config, .* pass --model_config"):
        main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()
    ckpt = planted_checkpoint(tiny_run, tmp_path / "old.ckpt", drop=old, checkpoint=str(home))
    main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")])
    assert written_files(tmp_path / "hf") == set(public)
    said = capsys.readouterr()
    assert f"model config read from {home} (named in {ckpt}, which records no model config)" in said.err
    assert f"(tokenizer: {home} (named in {ckpt}, which records no tokenizer files))" in said.out


def test_libraries_import_no_command():
    """Commands sit on top: nothing outside step35/commands (but the dispatcher, cli.py, and plan/, a
    command that parses fit's options) imports them, and the checkpoint library imports no command
    module at all (cli.py included)."""
    import ast

    package = Path(__file__).parent.parent / "step35"
    commands = ("step35.commands", "step35.cli", "step35.function_cli", "step35.generate", "step35.plan")
    offenders = []
    for file in package.rglob("*.py"):
        if (
            file.is_relative_to(package / "commands")
            or file.is_relative_to(package / "plan")
            or file.name in ("cli.py", "__main__.py")
        ):
            continue
        forbidden = commands if file.is_relative_to(package / "checkpoint") else commands[:1]
        for node in ast.walk(ast.parse(file.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{file.relative_to(package)}: {n}" for n in names if n.startswith(forbidden)]
    assert not offenders


def test_remote_code_is_what_auto_map_names_in_this_repository():
    from step35.checkpoint.training.export import remote_code_modules

    config = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    tokenizer = {"AutoTokenizer": ["tokenization_x.XTokenizer", None], "AutoProcessor": "other/repo--proc_x.P"}
    assert remote_code_modules([config, tokenizer, None]) == ["configuration_x", "modeling_x", "tokenization_x"]
