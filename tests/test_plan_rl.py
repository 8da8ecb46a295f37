"""`step35 plan` for online RL (`model.objective: grpo`, an objective whose Needs declares `generates`): it counts
one prompt's rollout on the device (the KV cache at the prefill and at the end of decoding, a layer's
concatenation copy, the prefill's layer work, the recorded routes), the routes kept on the host, and the
training forward on B x G packed rows of up to the packer's capacity (S + 1 + n rounded up to 64).

Checked against hand computations for the tiny preset and for flash-196b on the recipe's layout (8 H200, EP 8,
bf16 compute), against the storage a real rollout of the tiny model holds, and by its consequences: beta 0
has no reference; beta > 0 counts the reference as DPO's is counted; the fit decision follows max_new_tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from step35.config import preset
from step35.plan.activations import Shape, model_activations
from step35.plan.devices import DEVICES
from step35.plan.planner import make_plan, sharded_state
from step35.plan.report import text
from step35.plan.settings import read_settings

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
RECIPE = str(ROOT / "configs" / "flash-196b-grpo-lora-h200.yaml")
GiB = 1024**3

# tiny: G 3 completions of up to n 70 tokens, prompt window S 32, B 2 prompts per micro-batch, fp32 (32-true)
G, N, S, B = 3, 70, 32, 2


def tiny_settings(*extra: str, rl: str = f"{{num_generations: {G}, max_new_tokens: {N}}}", objective: str = "grpo"):
    args = ["--config", TINY, "--model.objective", objective, "--model.mtp_loss_weight", "0"]
    args += ["--data.seq_len", str(S), "--data.micro_batch_size", str(B)]
    if objective == "grpo":
        args += ["--model.rl", rl]
    return read_settings(args + list(extra))


def plan_of(s, device: str = "h100"):
    return make_plan(s, DEVICES[device], allocator_margin=0.05)


def test_tiny_rollout_terms_equal_a_hand_count():
    """tiny: 5 layers (full, 3 sliding of window 64, full), 2 KV heads of dim 32; MoE layers 1-4, top-2; fp32."""
    cfg = preset("tiny")
    assert [cfg.layer(i).sliding for i in range(5)] == [False, True, True, True, False] and cfg.sliding_window == 64
    assert {(cfg.layer(i).num_kv_heads, cfg.layer(i).head_dim) for i in range(5)} == {(2, 32)}
    assert [cfg.layer(i).is_moe for i in range(5)] == [False, True, True, True, True] and cfg.moe_top_k == 2
    p = plan_of(tiny_settings())
    r, s = p.rollout, p.settings
    kv = G * 2 * 2 * 32 * 4  # a token's keys and values in one layer, G rows, fp32
    fed = S + N  # the prompt's S + 1 ids, then each sampled token but the last
    assert r.prefill_cache == 5 * (S + 1) * kv
    assert r.decode_cache == (2 * fed + 3 * 64) * kv  # sliding layers: the window's storage
    assert r.decode_copy == fed * kv
    routes = G * 4 * 2 * 2  # a token's routes: G rows x 4 MoE layers x top-2, int16
    assert (r.prefill_routes, r.decode_routes) == ((S + 1) * routes, 2 * fed * routes)
    rows, row = B * G, 128  # S + 1 + N = 103 ids of the longest sequence, rounded up to 64
    assert (s.rows_per_micro_batch, s.row_tokens, s.tokens_per_rank) == (rows, row, rows * row)
    assert r.host_routes == B * fed * routes + rows * row * 4 * 2 * 2
    assert r.prefill_work == model_activations(cfg, Shape(G, S + 1, 4, "cpu")).largest_layer
    # The training forward's activations: those of the language model on B G rows of 128 tokens, as documents.
    lm = tiny_settings("--data.micro_batch_size", str(rows), "--data.seq_len", str(row), objective="lm")
    lm.document_masking = True
    assert p.activations.total == plan_of(lm).activations.total
    phases = {ph.name: ph.rows for ph in p.phases}
    assert phases["rollout prefill"]["KV cache"] == r.prefill_cache
    assert phases["rollout decode"]["KV cache"] == r.decode_cache
    assert phases["rollout decode"]["routes"] == r.decode_routes
    assert p.verdict.peak == max(sum(rows.values()) for rows in phases.values())


@pytest.mark.parametrize("max_new_tokens", [1, N])
def test_the_counted_cache_and_routes_are_what_a_real_rollout_holds(monkeypatch, max_new_tokens):
    """generate_group on the tiny model with a prompt filling the window and no stop: the storage of its KV cache
    and the routes its recorder holds (chunks and joined copy) equal the plan's, at the prefill alone (n = 1)
    and at the end of decoding."""
    from step35.model import Step35ForCausalLM
    from step35.training import rollout

    made = {}

    class Cache(rollout.KVCache):
        def __init__(self):
            super().__init__()
            made["cache"] = self

    class Recorder(rollout.RouteRecorder):
        def __init__(self):
            super().__init__()
            made["recorder"] = self

    monkeypatch.setattr(rollout, "KVCache", Cache)
    monkeypatch.setattr(rollout, "RouteRecorder", Recorder)
    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(0)
    model.eval()
    group = rollout.generate_group(
        model, list(range(5, 5 + S + 1)), G, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0,
        stop_ids=set(), generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert all(len(c) == max_new_tokens for c in group.completions)
    storages = {}
    for layer in made["cache"].layers.values():
        for t in (layer.keys, layer.values):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    recorded = sum(c.numel() * c.element_size() for chunks in made["recorder"].chunks.values() for c in chunks)
    r = plan_of(tiny_settings(rl=f"{{num_generations: {G}, max_new_tokens: {max_new_tokens}}}")).rollout
    if max_new_tokens == 1:
        assert sum(storages.values()) == r.prefill_cache and recorded == r.prefill_routes
    else:
        assert sum(storages.values()) == r.decode_cache and 2 * recorded == r.decode_routes


def recipe_plan(*extra: str):
    return plan_of(read_settings(["--config", RECIPE, *extra]), "h200")


def test_flash_196b_on_the_recipes_layout_equals_a_hand_count():
    """flash-196b, 8 H200, EP 8, bf16 compute, G 8, n 4096, S 1024, B 1, 4 micro-batches per step: 12 full
    layers and 33 sliding ones (window 512), 8 KV heads of dim 128; 42 MoE layers, top-8."""
    cfg = preset("flash-196b")
    specs = [cfg.layer(i) for i in range(cfg.num_hidden_layers)]
    assert (sum(not x.sliding for x in specs), sum(x.sliding for x in specs), cfg.sliding_window) == (12, 33, 512)
    assert {(x.num_kv_heads, x.head_dim) for x in specs} == {(8, 128)}
    assert (sum(x.is_moe for x in specs), cfg.moe_top_k) == (42, 8)
    p = recipe_plan()
    r, s = p.rollout, p.settings
    kv = 8 * 2 * 8 * 128 * 2  # G rows x (K and V) x 8 heads x 128 x bf16
    assert r.decode_cache == kv * (12 * 5120 + 33 * 512) == 2_566_914_048
    assert r.prefill_cache == kv * 45 * 1025 and r.decode_copy == kv * 5120
    routes = 8 * 42 * 8 * 2
    assert r.decode_routes == 2 * routes * 5120 == 55_050_240
    assert (s.rows_per_micro_batch, s.row_tokens, s.tokens_per_rank) == (8, 5184, 41_472)  # 1025 + 4096 -> 5184
    assert r.host_routes == 4 * routes * 5120 + 8 * 5184 * 42 * 8 * 2
    assert p.speed.tokens_per_rank_step == 4 * 41_472
    assert p.verdict.fits and p.verdict.required / GiB == pytest.approx(88.42, abs=0.01)  # the recipe's comment
    report = text(p)
    for line in ("KV cache                2.39 GiB", "recorded routes", "8 rows x 5184 tokens", "routes per rank"):
        assert line in report, line
    assert "reference" not in report  # beta 0


def test_the_fit_decision_follows_max_new_tokens():
    """The recipe fits with n 4096 and 12288, not with 16384: the KV cache and the training rows grow with n."""
    plans = {n: recipe_plan("--model.rl.max_new_tokens", str(n)) for n in (4096, 12288, 16384)}
    assert [plans[n].verdict.fits for n in (4096, 12288, 16384)] == [True, True, False]
    full, sliding = 8 * 2 * 8 * 128 * 2 * 12, 8 * 2 * 8 * 128 * 2 * 33 * 512
    for n, p in plans.items():
        assert p.rollout.decode_cache == full * (1024 + n) + sliding
        assert p.settings.tokens_per_rank == 8 * -(-(1025 + n) // 64) * 64
    assert plans[16384].activations.total > 3 * plans[4096].activations.total


def test_beta_zero_has_no_reference_and_beta_counts_it_as_dpo_does():
    """beta 0: no reference forward, no copy, no reference line. beta > 0 under LoRA: one forward without
    gradients (adapters off), no bytes; in a full fine-tune: the frozen copy, the bytes DPO's is counted with."""
    none = tiny_settings()
    assert none.objective_needs.reference is None and none.objective_needs.extra_forwards == 0
    assert sharded_state(none).state.reference == 0 and "reference" not in text(plan_of(none))
    beta = f"{{num_generations: {G}, max_new_tokens: {N}, beta: 0.04}}"
    lora = tiny_settings("--model.lora", "{rank: 4}", rl=beta)
    assert lora.objective_needs.extra_forwards == 1 and sharded_state(lora).state.reference == 0
    assert "the policy with its adapters off" in text(plan_of(lora))
    full, dpo = tiny_settings(rl=beta), tiny_settings(objective="dpo")
    held = sharded_state(full).state.reference
    assert held == sharded_state(dpo).state.reference > 0
    p = plan_of(full)
    assert p.state.total == sharded_state(none).state.total + held
    assert "reference copy" in text(p) and "its frozen copy" in text(p)
    assert p.speed.hardware_flops_per_token > plan_of(none).speed.hardware_flops_per_token


def test_the_196b_grpo_recipe_is_the_fewest_h200_nodes_that_fit(step35_here):
    """configs/flash-196b-grpo-lora-h200.yaml: one node of 8 H200 fits (4 devices do not); it is a valid
    `step35 fit` config (objective grpo, prompt data, the rollout options)."""
    code, out, err = step35_here("plan", "--config", RECIPE, "--json")
    assert code == 0, err[-3000:]
    plan = json.loads(out)
    assert plan["verdict"]["fits"] and plan["device"]["name"].startswith("NVIDIA H200"), plan["verdict"]
    assert plan["layout"]["world_size"] == 8 and plan["rollout"]["decode_cache"] == 2_566_914_048
    four = ["--trainer.devices", "4", "--trainer.strategy.expert_parallel_size", "4", "--no-suggestions"]
    code, out, _ = step35_here("plan", "--config", RECIPE, "--json", *four)
    assert code == 1 and not json.loads(out)["verdict"]["fits"]
    code, out, err = step35_here("fit", "--config", RECIPE, "--print_config")
    assert code == 0, err[-3000:]
    for said in ("objective: grpo", "format: prompt", "num_generations: 8", "max_new_tokens: 4096", "devices: 8"):
        assert said in out, said
