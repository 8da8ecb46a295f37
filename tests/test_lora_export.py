"""A LoRA run's checkpoint out of the trainer: `step35 export --merge` writes W + (alpha/r)·BA as a full HF
folder that loads like every other export and computes the LoRA model's logits and losses (MTP included);
`step35 generate` runs on the LoRA run and on the merged export alike; without --merge the export is a PEFT
adapter folder (PEFT 0.21.2's layout, expert adapters stacked per expert) that gives the merged export's
logits on its base and refuses another base; merging a run without adapters is refused (docs/lora.md)."""

from __future__ import annotations

import copy
import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.materialize import materialize
from step35.checkpoint.hf.peft import CONFIG_FILE, WEIGHTS_FILE, apply_peft_folder
from step35.checkpoint.hf.pretrained import load_pretrained, save_pretrained
from step35.cli import main
from step35.commands.generate import load_generator
from step35.model import build_model
from step35.model.lora import LoraError, merged_weight
from tests.helpers import checkpointed_fit

TARGETS = ["attention", "mlp", "shared_expert", "experts", "mtp", "router"]
MTP_WEIGHT = 0.3


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, builtin_cache):
    """A tiny LoRA run of 3 steps (every adapter kind, MTP and a full-trained router; alpha != rank and
    an expert rank of its own, so each scale differs), saved as a run folder. Returns (run, model)."""
    from step35.module import Step35LightningModule

    run = tmp_path_factory.mktemp("lora-run")
    module = Step35LightningModule(
        config="tiny",
        lora={"rank": 4, "alpha": 6.0, "expert_rank": 3, "targets": TARGETS},
        mtp_loss_weight=MTP_WEIGHT,
        lr=2e-2,
        warmup_steps=1,
    )
    checkpointed_fit(module, run, builtin_cache, steps=3, every=3)
    return run, module.model.eval()


@pytest.fixture(scope="module")
def merged(lora_run, tmp_path_factory):
    run, _ = lora_run
    out = tmp_path_factory.mktemp("lora-export") / "hf"
    main(["export", "--checkpoint", str(run), "--out", str(out), "--merge", "true", "--max_shard_size", "1MB"])
    return out


def batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 24), generator=g), torch.randint(0, vocab, (2, 24), generator=g)


def test_merged_weight_is_w_plus_scaled_ba_per_expert():
    """Against plain per-expert loops in float64: dense W + (alpha/r) B A, experts W_e + (alpha/r) (A_e B_e)^T."""
    g = torch.Generator().manual_seed(0)
    W, A, B = torch.randn(6, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    want = W.double() + 3.0 / 2 * B.double() @ A.double()
    torch.testing.assert_close(merged_weight("w", W, A, B, 3.0).double(), want, rtol=1e-6, atol=1e-6)
    We, Ae, Be = torch.randn(4, 6, 5, generator=g), torch.randn(4, 5, 3, generator=g), torch.randn(4, 3, 6, generator=g)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    merged = merged_weight("experts", We, Ae, Be, 6.0).double()
    for e in range(4):  # what the forward computes for expert e: x W_e^T + (x A_e B_e) * alpha / r
        forward = x @ We[e].double().T + (x @ Ae[e].double() @ Be[e].double()) * 6.0 / 3
        torch.testing.assert_close(x @ merged[e].T, forward, rtol=1e-6, atol=1e-6)
    with pytest.raises(LoraError, match=r"experts: adapter shapes A \[4, 5, 3\], B \[4, 6, 3\] do not fit weight"):
        merged_weight("experts", We, Ae, Be.transpose(1, 2), 6.0)


def test_merged_export_computes_the_lora_models_logits_and_losses(lora_run, merged):
    _, model = lora_run
    B = [p for n, p in model.named_parameters() if n.endswith("lora_B")]
    assert B and all(p.abs().sum() > 0 for p in B)  # every adapter trained: merging matters
    loaded = load_pretrained(merged).eval()
    assert not any("lora" in n for n in loaded.state_dict())
    assert loaded.num_mtp_layers == model.num_mtp_layers > 0
    ids, labels = batch(model.config.vocab_size)
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(loaded(ids), want, rtol=0, atol=1e-5)
        got_loss = loaded.loss(ids, labels, mtp_loss_weight=MTP_WEIGHT)
        want_loss = model.loss(ids, labels, mtp_loss_weight=MTP_WEIGHT)
        torch.testing.assert_close(got_loss.lm_loss, want_loss.lm_loss, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            torch.stack(got_loss.mtp_losses), torch.stack(want_loss.mtp_losses), rtol=0, atol=1e-5
        )
        base = copy.deepcopy(model)
        for n, p in base.named_parameters():
            if n.endswith("lora_B"):
                p.zero_()
        assert (base(ids) - want).abs().max() > 1e-3  # the adapters move the logits: the check can fail


def test_an_fp8_export_of_a_lora_run_is_merged_first(lora_run, merged, tmp_path):
    """`--dtype float8_e4m3fn` without --merge is refused (a PEFT folder's adapters are not quantised), writing
    nothing; with --merge the merged weights are written block-quantised ([32, 32]: the largest block up to the
    releases' 128 x 128 that cuts the tiny MLP's 352 columns whole, as transformers reads blocks), and step35
    reads them back within e4m3's rounding of the bf16 merged export (2^-4 relative, plus bf16's own 2^-8)."""
    run, _ = lora_run
    with pytest.raises(SystemExit, match=r"--dtype float8_e4m3fn: .*PEFT adapter folder.*add --merge"):
        main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "a"), "--dtype", "float8_e4m3fn"])
    assert not (tmp_path / "a").exists()
    out = tmp_path / "fp8"
    main(["export", "--checkpoint", str(run), "--out", str(out), "--merge", "true", "--dtype", "float8_e4m3fn"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]
    fp8 = load_pretrained(out, dtype=torch.float32).state_dict()
    plain = load_pretrained(merged, dtype=torch.float32).state_dict()
    stored = load_file(next(out.glob("*.safetensors")))
    quantised = [n for n in fp8 if n + "_scale_inv" in stored]
    assert "model.layers.0.self_attn.q_proj.weight" in quantised and "model.layers.1.moe.up_proj.weight" in quantised
    for name, value in fp8.items():
        slack = 2**-4 + 2**-8 if name in quantised else 2**-8
        assert ((value - plain[name]).abs() <= plain[name].abs() * slack + 1e-6).all(), name


def test_a_merge_into_non_finite_weights_is_refused_writing_nothing(lora_run, tmp_path, monkeypatch):
    """A run with an alpha that overflows float32 when merged (the probe's lora_alpha 1e38 wrote Inf weights with
    exit code 0): refused in one line naming the weight and the option, no folder written."""
    from step35.model.lora import LoraConfig

    monkeypatch.setattr(LoraConfig, "scale_alpha", property(lambda self: 1e300))
    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as refusal:
        main(["export", "--checkpoint", str(lora_run[0]), "--out", str(out), "--merge", "true"])
    message = str(refusal.value)
    assert "merging its LoRA adapter into model." in message and "gives NaN/Inf" in message, message
    assert "model.lora.alpha=1e+300" in message and "\n" not in message
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_merge_needs_a_lora_run(tiny_run, tmp_path):
    with pytest.raises(SystemExit, match=r"--merge: .*step=000003.ckpt is not a LoRA run's checkpoint"):
        main(["export", "--checkpoint", str(tiny_run[0]), "--out", str(tmp_path / "b"), "--merge", "true"])
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def peft_folder(lora_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-peft") / "adapter"
    main(["export", "--checkpoint", str(lora_run[0]), "--out", str(out)])  # a LoRA run without --merge
    return out


def test_peft_folder_has_peft_names_and_expert_layout(lora_run, peft_folder):
    _, model = lora_run
    config = json.loads((peft_folder / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 6.0
    assert config["rank_pattern"] == {f"moe.{p}.weight": 3 for p in ("gate_proj", "up_proj", "down_proj")}
    assert config["alpha_pattern"] == {f"moe.{p}.weight": 6.0 for p in ("gate_proj", "up_proj", "down_proj")}
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"]
    assert "model.layers.1.moe.up_proj.weight" in config["target_parameters"]
    assert "model.layers.1.moe.gate" in config["modules_to_save"]  # the router, trained in full
    tensors = load_file(peft_folder / WEIGHTS_FILE)
    assert not [k for k in tensors if not k.startswith("base_model.model.model.layers.")]
    E, out_f, in_f = model.get_parameter("model.layers.1.moe.up_proj.weight").shape
    A, B = (tensors[f"base_model.model.model.layers.1.moe.up_proj.lora_{x}.weight"] for x in "AB")
    assert A.shape == (E * 3, in_f) and B.shape == (out_f, 3 * E)
    # PEFT 0.21.2's ParamWrapper.get_delta_weight for (experts, out, in) parameters, on the stacked tensors:
    peft_delta = torch.einsum("o r e, e r i -> e o i", B.reshape(out_f, 3, E), A.reshape(E, 3, in_f)) * 6.0 / 3
    ours_A, ours_B = (model.get_parameter(f"model.layers.1.moe.up_proj.lora_{x}") for x in "AB")
    torch.testing.assert_close(peft_delta, torch.bmm(ours_A, ours_B).transpose(1, 2) * 6.0 / 3, rtol=1e-6, atol=1e-7)
    q_A = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(q_A, model.get_parameter("model.layers.0.self_attn.q_proj.lora_A"))


def test_peft_folder_on_its_base_gives_the_merged_exports_logits(lora_run, merged, peft_folder, tmp_path):
    _, model = lora_run
    base = build_model(model.config)
    materialize(base, "cpu", seed=0)  # the run's base: the init of model.init_seed 0
    save_pretrained(base, tmp_path / "base")
    adapted = load_pretrained(tmp_path / "base")
    apply_peft_folder(adapted, peft_folder, tmp_path / "base")
    ids, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids), load_pretrained(merged)(ids), rtol=0, atol=1e-5)


def test_peft_itself_attaches_the_folder_to_the_transformers_model_and_gives_the_merged_logits(
    lora_run, merged, peft_folder, tmp_path
):
    """The PEFT library (0.21.2) loads the folder onto the base loaded by transformers with the exported remote code:
    every adapter kind lands (expert adapters at their own rank, the router as modules_to_save), and the model
    computes the transformers-loaded merged export's logits within 1e-5 (fp32); the adapters move them by > 1e-3."""
    import transformers
    from peft import PeftModel

    _, model = lora_run
    base = build_model(model.config)
    materialize(base, "cpu", seed=0)  # the run's base
    save_pretrained(base, tmp_path / "base")
    for name in ("config.json", "modeling_step35.py"):  # the export's remote code, pointed at by its auto_map
        shutil.copy(merged / name, tmp_path / "base" / name)
    load = functools.partial(
        transformers.AutoModelForCausalLM.from_pretrained, trust_remote_code=True, dtype=torch.float32
    )
    hf_base, hf_merged = load(tmp_path / "base").eval(), load(merged).eval()
    ids, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        want, before = hf_merged(ids).logits, hf_base(ids).logits
    adapted = PeftModel.from_pretrained(hf_base, peft_folder).eval()
    layer = adapted.base_model.model.model.layers[1]
    assert layer.moe.gate_proj.lora_A["default"].weight.shape == (
        3 * model.config.moe_num_experts,
        model.config.hidden_size,
    )
    assert layer.self_attn.q_proj.lora_A["default"].weight.shape[0] == 4
    assert type(layer.moe.gate).__name__ == "ModulesToSaveWrapper"
    with torch.no_grad():
        got = adapted(ids).logits
    assert (before - want).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_peft_folder_refuses_another_base(tmp_path, builtin_cache):
    from tests.helpers import hf_base, lora_fit

    base = hf_base(tmp_path / "base", seed=1)
    lora_fit(tmp_path / "run", builtin_cache, 2, base=base)
    main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")])
    model = load_pretrained(base)
    apply_peft_folder(model, tmp_path / "adapter", base)
    other = hf_base(tmp_path / "other", seed=2)
    with pytest.raises(
        CheckpointError,
        match=r"adapter: a LoRA checkpoint of another base: .*other \(model.checkpoint\) "
        r"is not the base .*base the run trained on: .* has crc32",
    ):
        apply_peft_folder(load_pretrained(other), tmp_path / "adapter", other)


def test_generate_on_the_lora_run_and_its_merged_export(lora_run, merged):
    run, model = lora_run
    said = []
    from_run, from_hf = load_generator(run, say=said.append), load_generator(merged)
    assert any(line.startswith("LoRA run: its adapters merged into the weights (alpha=6)") for line in said), said
    prompt = from_run.encode("The for statement")
    greedy = from_run.generate_ids(prompt, max_new_tokens=8)
    assert greedy == from_hf.generate_ids(prompt, max_new_tokens=8)
    ids = torch.tensor([prompt])
    with torch.no_grad():  # the LoRA model's own argmax, step by step
        torch.testing.assert_close(from_run.model(ids), model(ids), rtol=0, atol=1e-5)
        for token in greedy:
            assert token == int(model(ids)[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def test_generate_on_the_peft_folder_gives_the_runs_tokens(lora_run, peft_folder, builtin_cache):
    from step35.data.builtin import builtin_tokenizer_dir

    run, _ = lora_run
    with pytest.raises(CheckpointError, match=r"adapter folder over a base drawn from the init.*--tokenizer"):
        load_generator(peft_folder)
    from_run = load_generator(run)
    from_peft = load_generator(peft_folder, tokenizer=builtin_tokenizer_dir(cache_dir=builtin_cache))
    prompt = from_run.encode("The for statement")
    assert from_peft.encode("The for statement") == prompt
    assert from_peft.generate_ids(prompt, max_new_tokens=8) == from_run.generate_ids(prompt, max_new_tokens=8)
