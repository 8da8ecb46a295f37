"""`step35 plan` for LoRA runs and its suggestions (LoRA, context parallelism) for layouts that do not fit.

- the adapter tensors the plan counts (read from the model training/setup.py builds) equal adapters
  attached by hand to every targeted layer of a plain model;
- the plan's per-rank bytes of a LoRA run equal the bytes of the real adapted model, sharded by the real
  parallelize on 3 and 4 simulated ranks, counted here;
- the per-rank bytes of the LoRA recipe equal a hand computation from the model's shape;
- the recipe configs/flash-196b-lora-h200.yaml FITS on an H200 (and on 8 H100 / 16 NPUs of 64 GB);
- a fine-tuning config that does not fit is offered a LoRA fine-tune and, for a long sequence, a
  context-parallel size, each with its verdict;
- bad `model.lora` values are refused with a message naming the field.
"""

import inspect
import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from step35.config import Step35Config, preset
from step35.model import build_model
from step35.model.lora import DEFAULT_TARGETS, LoraConfig, apply_lora
from step35.plan.lora import parse_lora, trained_tensors
from step35.plan.settings import read_settings
from tests.helpers import tiny_config
from tests.runner import run_plan

ROOT = Path(__file__).parent.parent
RECIPE = str(ROOT / "configs" / "flash-196b-lora-h200.yaml")
GiB = 1024**3


# ------------------------------------------------------------------------------ adapter counts
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "g_proj"}


def adapters_built_on(model, config: Step35Config, targets: set[str], rank: int, expert_rank: int) -> dict[str, int]:
    """Attach real adapter parameters to every targeted module of `model` (meta) and count them by
    base weight name: [r, in] + [out, r] per nn.Linear, [E, in, r] + [E, r, out] per stacked expert
    projection. Full targets count their weight."""
    attention = ATTENTION if "attention" in targets else ATTENTION & targets
    counts = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        layer = int(parts[2]) if name.startswith("model.layers.") and len(parts) > 2 else None
        mtp = layer is not None and layer >= config.num_hidden_layers
        if mtp and "mtp" not in targets:
            continue
        leaf, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
        if isinstance(module, nn.Linear):
            out_f, in_f = module.weight.shape
            adapted = (
                (parent == "self_attn" and leaf in attention)
                or (parent == "mlp" and "mlp" in targets)
                or (parent == "share_expert" and "shared_expert" in targets)
                or leaf == "eh_proj"
            )  # MTP layers only, which are skipped unless targeted
            if parent == "moe" and leaf == "gate":  # the router: trained whole when named
                if "router" in targets:
                    counts[f"{name}.weight"] = module.weight.numel()
                continue
            if adapted:
                a = nn.Parameter(torch.empty(rank, in_f, device="meta"))
                b = nn.Parameter(torch.empty(out_f, rank, device="meta"))
                counts[f"{name}.weight"] = a.numel() + b.numel()
        elif parent == "moe" and leaf in ("gate_proj", "up_proj", "down_proj") and "experts" in targets:
            E, out_f, in_f = module.weight.shape
            a = nn.Parameter(torch.empty(E, in_f, expert_rank, device="meta"))
            b = nn.Parameter(torch.empty(E, expert_rank, out_f, device="meta"))
            counts[f"{name}.weight"] = a.numel() + b.numel()
    if "embed" in targets:
        counts["model.embed_tokens.weight"] = model.model.embed_tokens.weight.numel()
    if "lm_head" in targets:
        counts["lm_head.weight"] = model.lm_head.weight.numel()
    return counts


def adapted_model(config: Step35Config, options: dict, mtp_loss_weight: float = 1.0):
    from step35.training.setup import TrainedModel, training_model

    return training_model(TrainedModel(config, None, mtp_loss_weight, LoraConfig.of(options)))


@pytest.mark.parametrize(
    "targets",
    [
        list(DEFAULT_TARGETS),
        ["q_proj", "o_proj", "experts"],
        ["attention", "mlp", "shared_expert", "experts", "mtp", "router", "lm_head", "embed"],
    ],
)
def test_adapter_tensors_match_adapters_built_on_the_model(targets):
    config = tiny_config()
    lora = parse_lora({"rank": 4, "targets": targets}, config)
    assert lora.expert_rank == max(1, 4 // config.moe_top_k)
    built = adapters_built_on(build_model(config, device="meta"), config, set(targets), lora.rank, lora.expert_rank)
    planned: dict[str, int] = {}
    for t in trained_tensors(adapted_model(config, {"rank": 4, "targets": targets})):
        base = t.name.removesuffix(".lora_A").removesuffix(".lora_B")
        base = base if base.endswith(".weight") else f"{base}.weight"
        planned[base] = planned.get(base, 0) + t.numel
    assert planned == built
    assert sum(built.values()) > 0


def test_unsharded_tiny_plan_counts_the_base_in_its_base_dtype_and_adapters_in_fp32():
    from step35.plan.planner import sharded_state

    base = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--model.lora", "{rank: 4}"]
    config = tiny_config()
    lora = parse_lora({"rank": 4}, config)
    n_adapters = sum(
        adapters_built_on(
            build_model(config, device="meta"), config, set(DEFAULT_TARGETS), 4, lora.expert_rank
        ).values()
    )
    n_base = sum(p.numel() for p in build_model(config, device="meta").parameters())
    # As apply_lora: the base in model.lora.base_dtype, default the config's torch_dtype, whatever the precision.
    stored = torch.empty((), dtype=getattr(torch, config.torch_dtype)).element_size()
    for precision, base_dtype, base_bytes in (
        ("32-true", None, stored),
        ("bf16-mixed", None, stored),
        ("bf16-mixed", "bfloat16", 2),
        ("32-true", "float16", 2),
    ):
        args = [*base, "--trainer.precision", precision]
        if base_dtype:
            args[3] = f"{{rank: 4, base_dtype: {base_dtype}}}"
        s = read_settings(args)
        assert s.lora.rank == lora.rank and s.lora.targets == lora.targets
        state = sharded_state(s).state
        assert state.frozen == n_base * base_bytes, precision  # the frozen base in its base dtype
        assert state.adapter_params == state.grads == n_adapters * 4, precision  # fp32 master + fp32 grads
        assert state.optimizer == 2 * n_adapters * 4
        assert state.params == state.frozen + state.adapter_params
    # The override of one key changes the count like the fit parser would.
    s = read_settings([*base, "--model.lora.rank", "2"])
    assert s.lora.rank == 2 and s.lora.targets == tuple(DEFAULT_TARGETS)
    # MTP adapters without an MTP loss would never learn: the plan says so.
    s = read_settings([*base, "--model.lora.targets", "[attention, mtp]", "--model.mtp_loss_weight", "0"])
    assert any("names mtp but no MTP loss is trained" in n for n in s.notes)


@pytest.mark.parametrize("world,ep", [(3, 1), (4, 1), (4, 2)])
def test_plan_bytes_equal_the_real_adapted_sharded_model(world, ep):
    """The tiny model adapted by apply_lora and sharded by the real `parallelize` (FSDP2; EP 2 on 4 ranks)
    for `world` simulated ranks, counted here tensor by tensor on every rank: local shards in their dtype,
    a gradient like each trainable shard, two AdamW states like it. The plan's numbers are those, exactly
    (3 ranks make FSDP's chunks uneven)."""
    from step35.parallel import ParallelDims, parallelize
    from step35.plan.planner import sharded_state
    from step35.plan.world import close_world, simulated_world

    options = {"rank": 4, "targets": ["attention", "mlp", "shared_expert", "experts", "router"]}
    yaml_lora = "{rank: 4, targets: [attention, mlp, shared_expert, experts, router]}"
    s = read_settings(
        [
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--model.lora",
            yaml_lora,
            "--trainer.devices",
            str(world),
            "--trainer.strategy",
            "step35.strategy.Step35Strategy",
            "--trainer.strategy.expert_parallel_size",
            str(ep),
        ]
    )
    config = tiny_config()
    for rank in range(world):
        simulated_world(world, rank)
        try:
            model = build_model(config, device="meta")
            apply_lora(model, LoraConfig.of(options))
            parallelize(model, ParallelDims(world, ep, num_experts=config.moe_num_experts).build("cpu"))
            for layer in model.model.mtp_layers:  # mtp_loss_weight 0 in tiny.yaml
                layer.requires_grad_(False)
            local = {
                n: (p.to_local() if hasattr(p, "to_local") else p, p.requires_grad) for n, p in model.named_parameters()
            }
        finally:
            close_world()
        params = sum(t.numel() * t.element_size() for t, _ in local.values())
        grads = sum(t.numel() * t.element_size() for t, trained in local.values() if trained)
        adapters = sum(t.numel() * t.element_size() for n, (t, _) in local.items() if ".lora_" in n)
        state = sharded_state(s, rank=rank).state
        assert (state.params, state.grads, state.optimizer, state.adapter_params) == (
            params,
            grads,
            2 * grads,
            adapters,
        )
        assert 0 < adapters < grads < params  # the router trains in full; the base is frozen


# ------------------------------------------------------------------------------ the 196B recipe
def hand_lora(rank: int, expert_rank: int, tokens: int) -> dict[str, float]:
    """Global adapter elements and the adapter activations (bf16, no checkpointing) of the default
    targets on Step-3.5-Flash, from the release's shape: 45 layers, 3 dense then 42 MoE; full attention
    (64 heads) on every fourth layer from 0, sliding (96 heads) otherwise; 8 KV heads of 128."""
    H, d, nkv, E, K, I, S, Id = 4096, 128, 8, 288, 8, 1280, 1280, 11264
    r, re = rank, expert_rank
    dense = experts = act = 0
    for i in range(45):
        nq = 64 if i % 4 == 0 else 96
        dense += r * (H + nq * d) * 2 + r * (H + nkv * d) * 2 + r * (H + nq)  # q, o; k, v; head gate
        act += 5 * r * 2
        if i < 3:
            dense += 3 * r * (H + Id)
            act += 3 * r * 2
        else:
            experts += 3 * E * re * (H + I)
            dense += 3 * r * (H + S)
            act += 3 * K * re * 2 + 3 * r * 2
    return {
        "adapters": dense + experts,
        "activations": act * tokens,
        "per_token": dense + experts * K / E,
    }  # adapter parameters a token passes through


@pytest.mark.timeout(300)
def test_recipe_lora_bytes_equal_a_hand_computation(capsys):
    code, out, err = run_plan(
        capsys, "--config", RECIPE, "--device", "h200", "--json", "--trainer.strategy.activation_checkpointing", "none"
    )
    assert code == 0, err[-3000:]
    plan = json.loads(out)
    assert plan["lora"]["rank"] == 32 and plan["lora"]["expert_rank"] == 4 and plan["lora"]["base_dtype"] == "bfloat16"
    hand = hand_lora(32, 4, tokens=4096)
    assert plan["lora"]["adapter_params"] == pytest.approx(hand["adapters"], rel=1e-9)
    # Per rank of 8: the release's 196.96 B parameters (router biases are buffers) and the three MTP layers
    # (test_plan.test_recipes_fit_with_margin spells them out) in bf16; adapters fp32 with fp32 grads and 2 AdamW states.
    H, V, q, kv = 4096, 128896, 96 * 128, 8 * 128
    mtp_layer = 2 * H * q + 2 * H * kv + H * 96 + 2 * 128 + 3 * H * 11264 + 2 * H + 2 * H + 2 * H * H + H + V * H
    base = 196_956_130_368 - 42 * 288 + 3 * mtp_layer
    state = plan["state"]
    assert state["frozen"] == pytest.approx(base * 2 / 8, rel=0.01)
    assert state["adapter_params"] == pytest.approx(hand["adapters"] * 4 / 8, rel=0.01)
    assert state["grads"] == pytest.approx(hand["adapters"] * 4 / 8, rel=0.01)
    assert state["optimizer"] == pytest.approx(2 * hand["adapters"] * 4 / 8, rel=0.01)
    lora_act = sum(v for k, v in plan["activations"]["parts"].items() if k.startswith("lora "))
    assert lora_act == pytest.approx(hand["activations"], rel=0.01)
    # FLOPs: the frozen base keeps 4 of its 6 FLOPs per parameter, attention is unchanged, adapters cost 6.
    from step35.flops import attention_flops_per_token

    attention = attention_flops_per_token(preset("flash-196b"), 4096)
    flops = attention + (73.506e9 - attention) * 4 / 6 + 6 * hand["per_token"]
    assert plan["speed"]["flops_per_token"] == pytest.approx(flops, rel=1e-4)
    # No base gradient anywhere: only adapters are reduce-scattered, and the lm_head is not trained.
    assert plan["transients"]["lm_head_grad"] == 0 and plan["transients"]["root_grads"] == 0
    assert plan["speed"]["fsdp_reduce_bytes"] < 0.05 * plan["speed"]["fsdp_gather_bytes"]  # full: 2x the gather


def test_recipe_is_one_node_of_eight_with_valid_ep_and_parses_for_fit(tmp_path, step35_here):
    from step35.module import Step35LightningModule
    from step35.parallel import ParallelDims
    from step35.plan.settings import parse_fit_args, split_lora_args

    cfg = yaml.safe_load(Path(RECIPE).read_text())
    trainer, model = cfg["trainer"], cfg["model"]
    assert (trainer["num_nodes"], trainer["devices"], trainer["accelerator"]) == (1, 8, "gpu")
    ep = trainer["strategy"]["init_args"]["expert_parallel_size"]
    ParallelDims(8, ep, num_experts=preset("flash-196b").moe_num_experts)  # raises if inconsistent
    assert cfg["data"]["seq_len"] == 4096 and model["checkpoint"] == "/data/Step-3.5-Flash"
    assert parse_lora(model["lora"], preset("flash-196b")).rank == 32
    # Everything but model.lora is a valid `step35 fit` config today ...
    args, lora = split_lora_args(["--config", RECIPE], str(tmp_path))
    assert lora == model["lora"] and parse_fit_args(args).model.checkpoint == "/data/Step-3.5-Flash"
    # ... and all of it once the trainer has the option.
    if "lora" in inspect.signature(Step35LightningModule.__init__).parameters:
        code, out, err = step35_here("fit", "--config", RECIPE, "--print_config")
        assert code == 0, err[-3000:]
        assert yaml.safe_load(out)["model"]["lora"]["rank"] == 32


@pytest.mark.timeout(300)
def test_recipe_fits_h200_and_the_smaller_setups(capsys):
    code, out, err = run_plan(capsys, "--config", RECIPE, "--device", "h200")
    assert code == 0, err[-3000:]
    assert "FITS:" in out and "margin" in out and "LoRA adapters" in out and "frozen base" in out
    margin = float(out.split("margin ")[-1].split("%")[0])
    assert margin >= 30
    # 8 x H100 80 GB, and one node of 16 NPUs of 64 GB (EP 16), with the same recipe.
    code, out, err = run_plan(capsys, "--config", RECIPE, "--device", "h100", "--json")
    assert code == 0 and json.loads(out)["verdict"]["fits"], err[-2000:]
    code, out, err = run_plan(
        capsys,
        "--config",
        RECIPE,
        "--device",
        "910b",
        "--trainer.accelerator",
        "npu",
        "--trainer.devices",
        "16",
        "--trainer.strategy.expert_parallel_size",
        "16",
        "--json",
    )
    assert code == 0 and json.loads(out)["verdict"]["fits"], err[-2000:]


# ------------------------------------------------------------------------------ suggestions
FINETUNE_YAML = """\
trainer:
  accelerator: cpu
  devices: 4
  precision: 32-true
  strategy:
    class_path: step35.strategy.Step35Strategy
    init_args:
      expert_parallel_size: 2
      param_dtype: bfloat16
      activation_checkpointing: none
model:
  checkpoint: {checkpoint}
  mtp_loss_weight: 0.0
data:
  seq_len: 8192
  micro_batch_size: 1
"""


@pytest.mark.timeout(300)
def test_a_fine_tune_that_does_not_fit_is_offered_lora_and_context_parallelism(capsys, tmp_path):
    tiny_config().save(tmp_path)  # a fine-tuning config: model.checkpoint with a config.json
    config = tmp_path / "run.yaml"
    config.write_text(FINETUNE_YAML.format(checkpoint=tmp_path))
    common = ["--config", str(config), "--no-suggestions", "--json", "--runtime-reserve-gib", "0"]
    full = json.loads(run_plan(capsys, *common, "--device-memory-gib", "1000")[1])
    lora = json.loads(run_plan(capsys, *common, "--device-memory-gib", "1000", "--model.lora", "{rank: 4}")[1])
    # A device between the two: the full fine-tune does not fit, its LoRA fine-tune does.
    full_gib, lora_gib = full["verdict"]["required"] / GiB, lora["verdict"]["required"] / GiB
    assert lora_gib < full_gib
    memory = f"{(full_gib + lora_gib) / 2:.6f}"
    code, out, err = run_plan(
        capsys, "--config", str(config), "--device-memory-gib", memory, "--runtime-reserve-gib", "0"
    )
    assert code == 1, err[-3000:]
    ways = out.split("Other ways on the same devices:")[1]
    assert "LoRA fine-tune (model.lora: {rank: 4}" in ways and "FITS" in ways.split("\n")[1]
    assert "context parallel size" in ways and "ESTIMATE" not in ways
    code, out, _ = run_plan(
        capsys, "--config", str(config), "--device-memory-gib", memory, "--runtime-reserve-gib", "0", "--json"
    )
    plan = json.loads(out)
    (lora_way,) = [w for w in plan["other_ways"] if w["what"].startswith("LoRA")]
    assert lora_way["fits"]
    assert lora_way["required_bytes"] == pytest.approx(lora["verdict"]["required"], rel=1e-9)
    (cp_way,) = [w for w in plan["other_ways"] if w["what"].startswith("context parallel")]
    assert "context_parallel_size" in cp_way["what"]
    # No LoRA offer for a run from scratch, no context parallelism for a short sequence.
    scratch = tmp_path / "scratch.yaml"
    scratch.write_text(
        FINETUNE_YAML.format(checkpoint="null")
        .replace("model:\n", "model:\n  config: tiny\n")
        .replace("seq_len: 8192", "seq_len: 256")
    )
    code, out, _ = run_plan(capsys, "--config", str(scratch), "--device-memory-gib", "0.001")
    assert code == 1 and "Other ways" not in out


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "lora,message",
    [
        ("{rank: 0}", "model.lora.rank=0: must be an integer >= 1"),
        ("{rank: -8}", "model.lora.rank=-8: must be an integer >= 1"),
        ("{rank: eight}", "model.lora.rank='eight': must be an integer >= 1"),
        ("{alpha: 16}", "model.lora: `rank` is required"),
        ("{rank: 4, ranks: 8}", "model.lora: unknown field(s) ['ranks']"),
        ("{rank: 4, targets: [attention, ffn]}", "model.lora.targets: unknown target(s) ['ffn']"),
        ("{rank: 4, targets: attention}", "model.lora.targets='attention': must be a non-empty list"),
        ("{rank: 4, targets: []}", "model.lora.targets=[]: must be a non-empty list"),
        ("{rank: 4, dropout: 1.5}", "model.lora.dropout=1.5: must be in [0, 1)"),
        ("{rank: 4, alpha: 0}", "model.lora.alpha=0: must be > 0"),
        ("{rank: 4, expert_rank: 0}", "model.lora.expert_rank=0: must be an integer >= 1"),
        (
            "{rank: 64}",
            "model.lora.rank=64 is larger than layer model.layers.0.self_attn.g_proj (128 -> 4) can use (at most 4)",
        ),
        (
            "{rank: 4, expert_rank: 100, targets: [experts]}",
            "model.lora.expert_rank=100 is larger than layer "
            "model.layers.1.moe.gate_proj (128 -> 64) can use (at most 64)",
        ),
        ("{rank: 4, targets: [lm_head], lora: 1}", "model.lora: unknown field(s) ['lora']"),
        ("[4]", "model.lora must be a mapping of LoRA options or null"),
    ],
)
def test_bad_lora_values_are_refused_naming_the_field(capsys, tmp_path, lora, message):
    config = tmp_path / "run.yaml"
    config.write_text(
        (ROOT / "configs" / "tiny.yaml").read_text().replace("  config: tiny\n", f"  config: tiny\n  lora: {lora}\n")
    )
    code, _, err = run_plan(capsys, "--config", str(config))
    assert code == 2, err[-2000:]
    assert err.startswith("step35 plan: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_lora_on_only_a_flash_layer_kind_counts_that_kind():
    config = preset("flash-196b")
    lora = parse_lora({"rank": 16, "targets": ["experts"]}, config)
    assert lora.expert_rank == 2
    from step35.training.setup import TrainedModel, training_model

    model = training_model(TrainedModel(config, 0, 0.0, lora.options))
    kinds = {t.kind for t in trained_tensors(model)}
    assert kinds == {"experts"}
    assert sum(t.numel for t in trained_tensors(model)) == 42 * 3 * 288 * 2 * (4096 + 1280)
