"""`step35 plan` with an EvalCallback in trainer.callbacks: one prompt record's generation after the optimizer
step (num_samples rows, prompt counted at data.seq_len + 1 ids, up to max_new_tokens new ones; no routes) is two
phases, `eval prefill` and `eval decode`, holding the run's state, its gradients and the KV cache; its MTP draft
scoring on one validation micro-batch is a third, `eval MTP drafts` (plan/drafts.py).

Checked against a hand count for the tiny preset, against the storage of the KV cache the callback's own
sampler (eval/generative.py sample_answers) leaves on the real tiny model, against the peak of the storages alive
while eval/drafts.py draft_acceptance runs on the real tiny model, in the JSON, and by absence: no callback (or
no draft scoring), no phase.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from step35.config import preset
from step35.plan.activations import Shape, decoder_layer
from step35.plan.devices import DEVICES
from step35.plan.drafts import eval_draft_memory
from step35.plan.planner import activation_shape, make_plan
from step35.plan.report import as_dict, text
from step35.plan.settings import read_settings

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
EVAL_CALLBACK = "step35.callbacks.evaluation.EvalCallback"

# tiny: num_samples G 3 of up to n 40 new tokens, prompt window S 32, fp32 (32-true)
G, N, S = 3, 40, 32


def callbacks(num_samples: int = G, max_new_tokens: int = N, mtp_batches: int | None = None) -> str:
    init = {"num_samples": num_samples, "max_new_tokens": max_new_tokens, "limit": 2}
    if mtp_batches is not None:
        init["mtp_batches"] = mtp_batches
    return json.dumps([{"class_path": EVAL_CALLBACK, "init_args": init}])


def tiny_settings(
    *extra: str, num_samples: int = G, max_new_tokens: int = N, with_callback: bool = True, mtp_batches=None
):
    args = ["--config", TINY, "--data.seq_len", str(S)]
    if with_callback:
        args += ["--trainer.callbacks", callbacks(num_samples, max_new_tokens, mtp_batches)]
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
    assert list(phases)[-4:] == ["optimizer step", "eval prefill", "eval decode", "eval MTP drafts"]  # after it
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
    assert p.settings.eval_generation is None and p.eval_generation is None and p.eval_drafts is None
    assert not [ph for ph in p.phases if ph.name.startswith("eval")]
    assert "eval generation" not in text(p) and as_dict(p)["eval_generation"] is None
    assert as_dict(p)["eval_drafts"] is None


# tiny's draft scoring: micro_batch_size 8 rows of S tokens, 1 MTP layer, vocab 1024, hidden 128
B, D, V, H = 8, 1, 1024, 128
ROPE = 2 * S * (32 + 16) * 4  # cos and sin [S, rotary dim] fp32 of tiny's two RoPE kinds (dims 32 and 16)


def test_tiny_draft_phase_equals_a_hand_count():
    """The callback's default mtp_batches (1): one validation micro-batch's main and depth-1 logits, in the eval
    dtype (fp32 here, bf16 under bf16-true: no upcast), beside the state and the gradients; unsharded (one CPU
    device), nothing gathered. At the last head 3 [B, S, H] hidden states, the ids and the RoPE tables lie beside
    every logits tensor; in the last MTP block 2 of them and its layer's work beside the main head's: on tiny
    (vocab 1024 beside an MLP of 352) the block is the peak."""
    cfg = preset("tiny")
    assert (cfg.num_nextn_predict_layers, cfg.vocab_size, cfg.hidden_size) == (D, V, H)
    for precision, a in (("32-true", 4), ("bf16-true", 2)):
        p = plan_of(tiny_settings("--trainer.precision", precision))
        d, st = p.eval_drafts, p.state
        work = decoder_layer(cfg, cfg.layer(5), Shape(B, S, a, "cpu")).total
        assert (d.depths, d.tokens, d.head_logits) == (D, B * S, B * S * V * a)  # fp32: 256 tokens x 1024 x 4
        assert d.at_head == 3 * B * S * H * a + B * S * 8 + ROPE
        assert d.at_block == 2 * B * S * H * a + B * S * 8 + ROPE + work
        assert not d.peak_at_head and d.logits == D * d.head_logits and d.beside == d.at_block
        assert d.block_gather == 0
        phase = next(ph.rows for ph in p.phases if ph.name == "eval MTP drafts")
        assert phase == {
            "parameters": st.params, "optimizer states": st.optimizer, "buffers": st.buffers, "gradients": st.grads,
            "root gathered": 0, "block all-gather": 0, "draft logits": d.logits, "draft hidden states + work": d.beside,
        }  # fmt: skip
        assert p.verdict.peak >= sum(phase.values())
    p = plan_of(tiny_settings())
    d = json.loads(json.dumps(as_dict(p)))
    assert d["eval_drafts"]["head_logits"] == B * S * V * 4 and d["eval_drafts"]["peak_at_head"] is False
    assert d["phases"]["eval MTP drafts"]["draft logits"] == B * S * V * 4
    assert "MTP draft logits" in text(p) and "(last MTP block)" in text(p)


def test_no_draft_phase_without_draft_scoring():
    """mtp_batches 0, or a model built without MTP layers (model.num_mtp_layers 0): the callback scores none."""
    for p in (plan_of(tiny_settings(mtp_batches=0)), plan_of(tiny_settings("--model.num_mtp_layers", "0"))):
        assert p.eval_generation is not None and p.eval_drafts is None
        assert [ph.name for ph in p.phases if ph.name.startswith("eval")] == ["eval prefill", "eval decode"]
        assert "MTP draft" not in text(p)
    with pytest.raises(ValueError, match="mtp_batches"):
        tiny_settings(mtp_batches=-1)


class LivePeak(TorchDispatchMode):
    """The most bytes of storages created under it and alive at once, taken after each op (its inputs still
    alive); storages in `ignored` (the model's parameters and buffers) are not counted."""

    def __init__(self, ignored: set):
        super().__init__()
        self.ignored, self.live, self.peak = ignored, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.ignored:
                    self.live.setdefault(ref, t.untyped_storage().nbytes())
        self.live = {ref: n for ref, n in self.live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize("precision,dtype", [("32-true", torch.float32), ("bf16-true", torch.bfloat16)])
@pytest.mark.parametrize("vocab", [V, 8 * V])
def test_the_draft_phase_is_what_draft_acceptance_holds(precision, dtype, vocab):
    """draft_acceptance (what EvalCallback.evaluate scores the drafts with) on the real tiny model, and on tiny with
    an 8x vocabulary (the last head is then the peak, as on Step-3.5), one batch of B rows of S + 1 ids with
    labels: the peak of the storages alive during it, parameters excluded, against the plan's logits + what lies
    beside them. At the last head that is exact (within 0.1 %: the ids, a device copy in the plan, are the
    batch's own [B, S + 1] storage on the CPU); in the last MTP block the layer's no-grad work is taken as the
    plan's training count of one layer: within 20 %."""
    from step35.eval.drafts import draft_acceptance
    from step35.model import Step35ForCausalLM

    cfg = dataclasses.replace(preset("tiny"), vocab_size=vocab)
    torch.manual_seed(0)
    model = Step35ForCausalLM(cfg)
    model.init_weights(0)
    model.to(dtype).train()
    ids = torch.randint(0, vocab, (B, S + 1))
    batch = {"input_ids": ids, "labels": ids[:, 1:].clone()}
    owned = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    live = LivePeak(owned)
    with live:
        result = draft_acceptance(model, [batch], limit=1)
    assert result["depths"] == D and model.training
    s = tiny_settings("--trainer.precision", precision)
    s = dataclasses.replace(s, model_config=cfg)
    d = eval_draft_memory(s, activation_shape(s), [])
    assert d.peak_at_head == (vocab > V)
    planned = d.logits + d.beside
    assert live.peak == pytest.approx(planned, rel=0.001 if d.peak_at_head else 0.2), (live.peak, planned)
