"""Exports load in transformers as a causal LM (step35/checkpoint/hf/modeling/modeling_step35.py): no missing or
unexpected keys, the logits of step35.model within 1e-5 (fp32), and `generate` gives `step35 generate`'s tokens."""

import json
import shutil

import pytest
import torch

from step35.checkpoint.hf.modeling import AUTO_MAP, MODELING_FILE
from step35.checkpoint.hf.pretrained import save_pretrained
from step35.checkpoint.training.export import export_checkpoint
from step35.commands.generate import load_generator
from step35.config import preset
from step35.model import build_model
from step35.run import checkpoint_of
from tests.hf_oracle import random_state_dict

transformers = pytest.importorskip("transformers")


def load_hf(folder):
    """The folder through AutoModelForCausalLM with remote code, checked to fill every tensor."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True
    )
    assert type(model).__name__ == "Step3p5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model.eval()


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    run, _ = tiny_run
    out = tmp_path_factory.mktemp("hf-modeling") / "hf"
    export_checkpoint(checkpoint_of(run), out)
    return out


def test_a_from_scratch_export_loads_as_a_causal_lm_with_step35s_logits_and_greedy_tokens(tiny_run, exported):
    run, model = tiny_run
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["Step3p5ForCausalLM"]
    hf = load_hf(exported)
    # Every tensor of the folder, MTP layer included, has its place: save and load agree on the names.
    assert hf.config.to_dict()["layer_types"] == config["layer_types"]
    assert len(hf.model.layers) == config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    # 80 tokens: longer than the tiny preset's 64-key sliding window.
    ids = torch.randint(0, config["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), atol=1e-5, rtol=0)
    generator = load_generator(run)
    prompt = generator.encode("The for statement")
    ours = generator.generate_ids(prompt, max_new_tokens=16)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    assert theirs == ours and len(ours) >= 2


def random_folder(path, sliding_window=16):
    """A tiny random model (tests/hf_oracle.py: router biases that change the top-k, clamps that bite),
    saved with save_pretrained and given the modeling file and auto_map as `step35 export` writes them.
    Returns the step35 model."""
    config = preset("tiny").with_overrides({"sliding_window": sliding_window})
    model = build_model(config, device="cpu")
    model.load_state_dict(random_state_dict(config.to_dict(), seed=1))  # O(1) activations: every part counts
    save_pretrained(model, path)
    shutil.copy(MODELING_FILE, path / MODELING_FILE.name)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "auto_map": AUTO_MAP}))
    return model.eval()


def test_moe_routing_sliding_windows_and_the_cache_match_step35_model(tmp_path):
    model = random_folder(tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    assert any(t.abs().max() > 0.1 for n, t in hf.state_dict().items() if n.endswith("router_bias"))
    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=0)
        # Token by token through the cache: the sliding layers' cache holds 15 keys once full.
        cache, logits = None, []
        for t in range(ids.shape[1]):
            out = hf(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits)
        # logits up to ~5: one token at a time sums in another order than the whole sequence
        torch.testing.assert_close(torch.cat(logits, dim=1), model(ids), atol=3e-5, rtol=0)
    generated = hf.generate(
        ids[:1, :10], max_new_tokens=30, do_sample=False, eos_token_id=None, return_dict_in_generate=True
    )
    layers = generated.cache.layers
    assert [type(layer).__name__ for layer in layers][:2] == ["DynamicLayer", "DynamicSlidingWindowLayer"]
    assert layers[1].keys.shape[-2] == 15  # the window minus the token to come: the cache is cropped
    expected = ids[:1, :10]
    with torch.no_grad():
        for _ in range(30):
            expected = torch.cat([expected, model(expected)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated.sequences, expected)


def test_bf16_load_keeps_the_router_bias_in_fp32(tmp_path):
    random_folder(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", trust_remote_code=True, dtype=torch.bfloat16
    )
    assert hf.lm_head.weight.dtype == torch.bfloat16
    assert hf.model.layers[1].moe.router_bias.dtype == torch.float32
    with torch.no_grad():
        assert torch.isfinite(hf(torch.tensor([[0, 5, 7, 9]])).logits).all()


def test_the_modeling_file_imports_only_torch_and_transformers():
    import ast

    roots = set()
    for node in ast.walk(ast.parse(MODELING_FILE.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "dataclasses", "math", "torch", "transformers"}, roots


def test_export_writes_our_file_unless_the_source_brings_its_own_modeling_code(tiny_run, exported, tmp_path):
    """The tiny preset's config names the release's remote code in auto_map, as the release does."""
    run, _ = tiny_run
    release_map = {
        "AutoConfig": "configuration_step3p5.Step3p5Config",
        "AutoModelForCausalLM": "modeling_step3p5.Step3p5ForCausalLM",
    }
    # A start folder without that code (here an earlier export, holding an outdated copy of ours): our file.
    source = tmp_path / "source"
    shutil.copytree(exported, source)
    (source / MODELING_FILE.name).write_text("# an older step35's file\n")
    report = export_checkpoint(checkpoint_of(run), tmp_path / "a", source=source)
    assert (tmp_path / "a" / MODELING_FILE.name).read_bytes() == MODELING_FILE.read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert (
        f"{MODELING_FILE.name} written ({source} brings no modeling code; transformers loads it with "
        f"trust_remote_code); auto_map {release_map} -> {AUTO_MAP}" in report.notes
    )
    load_hf(tmp_path / "a")
    # A start folder that brings the code auto_map names keeps it (as tests/test_export.py's release-like folder).
    (source / "configuration_step3p5.py").write_text("")
    (source / "modeling_step3p5.py").write_text("")
    export_checkpoint(checkpoint_of(run), tmp_path / "b", source=source)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["auto_map"] == release_map
    assert (tmp_path / "b" / "modeling_step3p5.py").is_file() and not (tmp_path / "b" / MODELING_FILE.name).exists()


def test_left_padded_rows_give_each_rows_own_logits_and_greedy_tokens(exported):
    """A batch of two prompts, the shorter one left-padded: the logits at each row's real tokens equal the row's
    alone (within 1e-5, fp32, sliding-window layers included), all finite, and `generate` on the batch (with the
    attention mask, positions from it) continues each row with the tokens it gets alone."""
    hf = load_hf(exported)
    window = hf.config.sliding_window
    g = torch.Generator().manual_seed(1)
    long, short = (torch.randint(3, hf.config.vocab_size, (1, n), generator=g) for n in (window + 9, 6))
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.no_grad():
        both = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        assert torch.isfinite(both[mask.bool()]).all()
        torch.testing.assert_close(both[0], hf(long).logits[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(both[1, pad:], hf(short).logits[0], rtol=0, atol=1e-5)
        new = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
        batched = hf.generate(ids, attention_mask=mask, **new)[:, ids.shape[1] :]
        alone = [hf.generate(row, **new)[0, row.shape[1] :] for row in (long, short)]
    assert batched[0].tolist() == alone[0].tolist() and batched[1].tolist() == alone[1].tolist()
