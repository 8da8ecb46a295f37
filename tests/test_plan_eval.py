"""`step35 plan` with an EvalCallback in trainer.callbacks: one prompt record's generation after the optimizer
step (num_samples rows, prompt counted at data.seq_len + 1 ids, up to max_new_tokens new ones; no routes) is two
phases, `eval prefill` and `eval decode`, holding the run's state, its gradients and the KV cache.

Checked against a hand count for the tiny preset, against the storage of the KV cache the callback's own
sampler (eval/generative.py sample_answers) leaves on the real tiny model, in the JSON, and by absence: no
callback, no phase.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from step35.config import preset
from step35.plan.devices import DEVICES
from step35.plan.planner import make_plan
from step35.plan.report import as_dict, text
from step35.plan.settings import read_settings

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
EVAL_CALLBACK = "step35.callbacks.evaluation.EvalCallback"

# tiny: num_samples G 3 of up to n 40 new tokens, prompt window S 32, fp32 (32-true)
G, N, S = 3, 40, 32


def callbacks(num_samples: int = G, max_new_tokens: int = N) -> str:
    init = {"num_samples": num_samples, "max_new_tokens": max_new_tokens, "limit": 2}
    return json.dumps([{"class_path": EVAL_CALLBACK, "init_args": init}])


def tiny_settings(*extra: str, num_samples: int = G, max_new_tokens: int = N, with_callback: bool = True):
    args = ["--config", TINY, "--data.seq_len", str(S)]
    if with_callback:
        args += ["--trainer.callbacks", callbacks(num_samples, max_new_tokens)]
    return read_settings(args + list(extra))


def plan_of(s):
    return make_plan(s, DEVICES["h100"], allocator_margin=0.05)


def test_tiny_eval_generation_equals_a_hand_count():
    """tiny: 5 layers (full, 3 sliding of window 64, full), 2 KV heads of dim 32, fp32: the KV cache of G rows
    is layers x (K and V) x kv heads x head dim x 4 bytes x G x tokens, sliding layers' storage capped at the
    window; the phases hold the state and the gradients, and the run's peak takes them into account."""
    cfg = preset("tiny")
    assert [cfg.layer(i).sliding for i in range(5)] == [False, True, True, True, False] and cfg.sliding_window == 64
    assert {(cfg.layer(i).num_kv_heads, cfg.layer(i).head_dim) for i in range(5)} == {(2, 32)}
    p = plan_of(tiny_settings())
    e, st = p.eval_generation, p.state
    kv = G * 2 * 2 * 32 * 4  # a token's keys and values in one layer, G rows, fp32
    fed = S + N  # the prompt's S + 1 ids, then each sampled token but the last
    assert (e.rows, e.max_new_tokens, e.window_tokens) == (G, N, fed)
    assert e.prefill_cache == 5 * (S + 1) * kv == 253_440
    assert e.decode_cache == (2 * fed + 3 * 64) * kv == 516_096
    assert e.decode_copy == fed * kv
    phases = {ph.name: ph.rows for ph in p.phases}
    assert list(phases)[-3:] == ["optimizer step", "eval prefill", "eval decode"]  # after the step
    held = {"parameters": st.params, "optimizer states": st.optimizer, "buffers": st.buffers, "gradients": st.grads}
    assert phases["eval prefill"] == {
        **held, "root gathered": 0, "block all-gather": 0, "KV cache": e.prefill_cache,
        "prefill layer work": e.prefill_work,
    }  # fmt: skip
    assert phases["eval decode"] == {
        **held, "root gathered": 0, "block all-gather": 0, "KV cache": e.decode_cache,
        "KV concatenation": e.decode_copy,
    }  # fmt: skip
    assert p.verdict.peak == max(sum(rows.values()) for rows in phases.values())
    # A generation large enough to be the peak is the peak.
    big = plan_of(tiny_settings(num_samples=64, max_new_tokens=4000))
    assert big.verdict.peak_phase == "eval decode"
    assert big.verdict.peak == sum(dict((ph.name, ph.rows) for ph in big.phases)["eval decode"].values())


def test_the_report_and_json_show_it():
    p = plan_of(tiny_settings())
    report = text(p)
    for said in ("eval generation", f"{G} row(s) of <= {N} new tokens", "2 full layers x 72 tokens, 3 sliding x 64",
                 f"data.seq_len + 1 = {S + 1} ids", "eval prefill", "eval decode"):  # fmt: skip
        assert said in report, said
    d = json.loads(json.dumps(as_dict(p)))
    assert d["eval_generation"]["decode_cache"] == 516_096 and d["eval_generation"]["num_samples"] == G
    assert d["eval_generation"]["prompt_tokens"] == S + 1 and d["eval_generation"]["dtype"] == "float32"
    assert d["phases"]["eval decode"]["KV cache"] == 516_096


def test_the_eval_dtype_is_the_weights_not_the_autocast():
    """The callback runs after the optimizer step, outside the training step's autocast: under bf16-mixed its
    keys and values are fp32 (the weights'), under bf16-true bf16 (half the bytes)."""
    mixed = plan_of(tiny_settings("--trainer.precision", "bf16-mixed"))
    true = plan_of(tiny_settings("--trainer.precision", "bf16-true"))
    assert mixed.settings.eval_dtype == torch.float32 and true.settings.eval_dtype == torch.bfloat16
    assert mixed.eval_generation.decode_cache == 516_096 == 2 * true.eval_generation.decode_cache


@pytest.mark.parametrize("max_new_tokens", [1, N])
def test_the_counted_cache_is_what_the_callbacks_sampler_holds(monkeypatch, max_new_tokens):
    """sample_answers (what EvalCallback.evaluate generates with) on the tiny model, a prompt filling the window
    and no stop id: the storage of its KV cache equals the plan's, at the prefill alone (n = 1) and at the end
    of decoding."""
    from step35.eval import generative
    from step35.model import Step35ForCausalLM
    from step35.training import rollout

    made = []

    class Cache(rollout.KVCache):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(rollout, "KVCache", Cache)
    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(0)
    item = generative.PromptItem(list(range(5, 5 + S + 1)), {"prompt": "p"}, "test:1")
    sampling = generative.Sampling(G, max_new_tokens, temperature=1.0)
    answers = generative.sample_answers(model, [item], sampling, stop_ids=set(), decode=lambda ids: "x")
    assert [len(c) for c in answers.groups[0].completions] == [max_new_tokens] * G
    (cache,) = made
    storages = {}
    for layer in cache.layers.values():
        for t in (layer.keys, layer.values):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    e = plan_of(tiny_settings(max_new_tokens=max_new_tokens)).eval_generation
    assert sum(storages.values()) == (e.prefill_cache if max_new_tokens == 1 else e.decode_cache)


def test_without_the_callback_there_is_no_eval_phase():
    p = plan_of(tiny_settings(with_callback=False))
    assert p.settings.eval_generation is None and p.eval_generation is None
    assert not [ph for ph in p.phases if ph.name.startswith("eval")]
    assert "eval generation" not in text(p) and as_dict(p)["eval_generation"] is None
