"""`step35 generate`: text from a run checkpoint and from its exported HF folder, the same tokens greedily;
top-p sampling draws from the nucleus with the renormalised probabilities."""

import pytest
import torch

from step35.checkpoint.training.export import export_checkpoint
from step35.commands.generate import load_generator, next_token
from step35.data.chat_template import ChatTemplate
from step35.run import checkpoint_of
from tests.runner import ROOT, cli, step35

PROMPT = "The for statement"


@pytest.fixture(scope="module")
def folders(tiny_run, tmp_path_factory):
    run, _ = tiny_run
    out = tmp_path_factory.mktemp("generate") / "hf"
    export_checkpoint(checkpoint_of(run), out)
    return run, out


def test_checkpoint_and_exported_folder_generate_the_same_tokens(folders, tiny_run):
    run, hf = folders
    said = []
    from_run, from_hf = load_generator(run, say=said.append), load_generator(hf)
    ckpt = run / "checkpoints" / "step=000003.ckpt"  # where the model and tokenizer came from, said once
    assert len(said) == 1 and said[0].startswith(f"model: {ckpt}; tokenizer: the run's tokenizer ("), said
    assert said[0].endswith(f"saved in {ckpt})"), said
    prompt = from_run.encode(PROMPT)
    assert prompt == from_hf.encode(PROMPT) and prompt[0] == 0  # starts a document: EOS, the tokenizer has no BOS
    greedy = from_run.generate_ids(prompt, max_new_tokens=12)
    assert len(greedy) >= 1 and greedy == from_hf.generate_ids(prompt, max_new_tokens=12)
    # Greedy is the argmax of the trained model's logits, step by step (independent recomputation).
    _, model = tiny_run
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for token in greedy:
            assert token == int(model(ids)[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    sampled = from_run.generate_ids(prompt, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    assert sampled == from_hf.generate_ids(prompt, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)


def test_non_finite_logits_end_generation_in_one_line(folders, monkeypatch, capfd):
    """A model whose logits overflow (the probe: an adapter merged with lora_alpha 1e38 printed an empty reply with
    exit code 0): refused, naming the cause, instead of printing the argmax of NaN."""
    from step35.commands import generate

    _, hf = folders
    generator = load_generator(hf)
    with torch.no_grad():
        generator.model.lm_head.weight.fill_(3e38)  # finite weights, logits past float32's range
    with pytest.raises(generate.NonFiniteLogits, match="logits hold NaN/Inf after 0 new tokens"):
        generator.generate_ids(generator.encode(PROMPT), max_new_tokens=4)
    monkeypatch.setattr(generate, "load_generator", lambda *args, **kwargs: generator)
    code, out, err = cli(capfd, "generate", "--checkpoint", str(hf), "--prompt", PROMPT)
    assert code == 1 and out == "" and "step35 generate: the model's next-token logits hold NaN/Inf" in err, err
    assert "Traceback" not in err


def test_top_p_samples_the_nucleus_with_renormalised_probabilities():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    rng = torch.Generator().manual_seed(0)
    # top_p=0.8: 0.4 + 0.3 = 0.7 < 0.8, so the nucleus is {1, 3, 4} (0.85); 0 and 2 never come.
    draws = torch.tensor([next_token(logits, 1.0, 0.8, rng) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=5).float() / len(draws)
    assert counts[0] == 0 and counts[2] == 0
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    assert torch.allclose(counts, expected, atol=0.03), counts  # 4000 draws: std <= 0.008
    assert next_token(logits, 0.0, 0.5, rng) == 1  # greedy
    assert {next_token(logits, 1.0, 0.3, rng) for _ in range(50)} == {1}  # the top token alone reaches 0.3


def in_process(capfd, *args: str) -> tuple[str, str]:
    """`step35 <args>` in this process (where what is compared is the output, not the process): stdout, stderr."""
    code, out, err = cli(capfd, *args)
    assert code == 0, err[-3000:]
    return out, err


@pytest.mark.heavy  # the CLI as a subprocess, or a short training run
@pytest.mark.timeout(600)
def test_generate_command_prints_text_from_run_and_export(folders, builtin_cache, capfd):
    run, hf = folders
    args = ["--prompt", PROMPT, "--max_new_tokens", "16"]
    from_run = step35(["generate", "--checkpoint", str(run), *args], builtin_cache, timeout=300).stdout  # as users do
    assert from_run.startswith(PROMPT) and len(from_run.strip()) > len(PROMPT), from_run
    assert in_process(capfd, "generate", "--checkpoint", str(hf), *args)[0] == from_run


@pytest.mark.heavy  # the CLI as a subprocess, or a short training run
@pytest.mark.timeout(900)
def test_sharded_run_exports_and_generates_like_its_export(tmp_path, builtin_cache, capfd, monkeypatch):
    """A sharded (DCP) checkpoint of Step35Strategy: `step35 generate` reads it through the same readers
    as `step35 export`, and the exported folder gives the same text (each command in this process)."""
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    run = tmp_path / "run"
    saves = '[{"class_path": "step35.callbacks.RunCheckpoint", "init_args": {"every_n_train_steps": 2}}]'
    in_process(
        capfd,
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        f"--run_dir={run}",
        "--trainer.max_steps=2",
        "--trainer.strategy=step35.strategy.Step35Strategy",
        "--trainer.strategy.expert_parallel_size=1",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--data.seq_len=16",
        "--data.micro_batch_size=1",
        f"--trainer.callbacks={saves}",
    )
    assert (run / "checkpoints" / "step=000002.ckpt" / "meta.pt").is_file()  # a sharded folder
    in_process(capfd, "export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"))
    args = ["--prompt", PROMPT, "--max_new_tokens", "8", "--temperature", "0.8", "--top_p", "0.9", "--seed", "1"]
    from_run, _ = in_process(capfd, "generate", "--checkpoint", str(run), *args)
    from_export, _ = in_process(capfd, "generate", "--checkpoint", str(tmp_path / "hf"), *args)
    assert from_run.startswith(PROMPT) and from_run == from_export


@pytest.mark.heavy  # the CLI as a subprocess, or a short training run
@pytest.mark.timeout(600)
def test_chat_renders_the_user_turn_with_the_template_and_prints_only_the_reply(folders, builtin_cache, capfd):
    run, hf = folders
    args = ["--chat", "true", "--prompt", "How do loops work?", "--system", "Be brief.", "--max_new_tokens", "12"]
    proc = step35(["generate", "--checkpoint", str(run), *args], builtin_cache, timeout=300)
    # The template recorded with the run's tokenizer (the built-in one carries step35's default as
    # chat_template.jinja), said on stderr with the checkpoint read.
    assert "step35 generate: chat template: chat_template.jinja of the run's tokenizer (" in proc.stderr, proc.stderr
    assert f"model: {run / 'checkpoints' / 'step=000003.ckpt'}" in proc.stderr
    generator = load_generator(run)
    template = generator.chat_template()
    assert template.source == ChatTemplate.default().source
    ids = generator.chat_ids(template, "How do loops work?", "Be brief.")
    assert generator.eos_id in generator.stop_ids  # the default template ends a reply with EOS
    rendered = generator.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|system|>\nBe brief.\n<|user|>\nHow do loops work?\n<|assistant|>\n" in rendered, rendered
    reply_ids = generator.generate_ids(ids, max_new_tokens=12)
    assert len(reply_ids) >= 2
    assert proc.stdout == generator.decode(reply_ids) + "\n"  # the reply alone: no prompt, no headers
    assert "How do loops work?" not in proc.stdout and "<|assistant|>" not in proc.stdout
    # The export carries the same tokenizer files, so its chat gives the same reply.
    from_hf, err = in_process(capfd, "generate", "--checkpoint", str(hf), *args)
    assert from_hf == proc.stdout, err[-3000:]


def test_system_without_chat_is_refused_before_anything_loads(tmp_path):
    from step35.commands.generate import generate

    with pytest.raises(SystemExit, match="--system needs --chat true"):
        generate(str(tmp_path / "nothing-here"), "Hi", system="Be brief.")


def test_chat_template_kwargs_reach_the_template_and_a_misspelt_one_is_refused(folders, tmp_path, capfd):
    """--chat_template_kwargs are variables of the chat rendering (as data.chat_template_kwargs in training):
    the export's template, given one that raises on `reasoning_effort: boom`, raises with it; a name the
    template does not read is refused naming the option; without --chat they are refused before loading."""
    import shutil

    from step35.commands.generate import generate

    _, hf = folders
    folder = shutil.copytree(hf, tmp_path / "hf")
    guard = "{% if reasoning_effort is defined and reasoning_effort == 'boom' %}{{ raise_exception('boom read') }}"
    ChatTemplate(guard + "{% endif %}" + ChatTemplate.default().source, "t").save(folder)
    args = ["generate", "--checkpoint", str(folder), "--chat", "--prompt", "Hi", "--max_new_tokens", "2"]
    code, _, err = cli(capfd, *args, "--chat_template_kwargs", '{"reasoning_effort": "boom"}')
    assert code == 1 and "boom read" in err, err[-2000:]
    code, _, err = cli(capfd, *args, "--chat_template_kwargs", '{"reasoning_efort": "low"}')
    assert code == 1 and "--chat_template_kwargs.reasoning_efort: the chat template from chat_template.jinja" in err
    assert cli(capfd, *args, "--chat_template_kwargs", '{"reasoning_effort": "low"}')[0] == 0
    with pytest.raises(SystemExit, match="--chat_template_kwargs needs --chat true"):
        generate(str(tmp_path / "nothing-here"), "Hi", chat_template_kwargs={"reasoning_effort": "low"})


def test_a_tokenizer_without_a_chat_template_gets_step35s_default(folders):
    run, _ = folders
    generator = load_generator(run)
    generator.tokenizer_files = {
        name: content for name, content in generator.tokenizer_files.items() if name != "chat_template.jinja"
    }
    said = []
    assert generator.chat_template(said.append).origin == "default"
    assert said == [f"chat template: step35's default ({generator.tokenizer_origin} has none)"]


def test_a_bool_option_given_alone_means_true():
    from step35.commands.function_cli import bare_flags_as_true
    from step35.commands.generate import generate

    argv = ["--checkpoint", "run", "--chat", "--prompt", "hi", "--cache"]
    assert bare_flags_as_true(generate, argv) == [
        "--checkpoint",
        "run",
        "--chat",
        "true",
        "--prompt",
        "hi",
        "--cache",
        "true",
    ]
    assert bare_flags_as_true(generate, ["--chat", "false", "--prompt", "--x"]) == [
        "--chat",
        "false",
        "--prompt",
        "--x",
    ]
