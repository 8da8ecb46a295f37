"""`step35 plan`: its predictions against what really happens, and its verdicts on the recipes.

- activations: the per-module formula (step35/plan/activations.py) against the tensors a real forward
  keeps for backward, counted over unique storages with parameters excluded;
- state: the predicted per-rank parameter / gradient / AdamW bytes against a real 4-rank gloo run;
- the production recipes fit (numbers in docs/plan.md), a too-small world does not, a bad EP size is refused.
"""

import json
from pathlib import Path

import pytest
import torch

from step35.config import Step35Config, preset
from step35.model import Step35ForCausalLM
from step35.parallel.parallelize import apply_activation_checkpointing
from step35.plan.activations import Shape, model_activations
from tests.helpers import tiny_config_dict
from tests.runner import cli, run_plan, run_script

ROOT = Path(__file__).parent.parent


# ------------------------------------------------------------------------------ activations
def measure_activations(
    config: Step35Config, batch: int, seq: int, mode: str, dtype: torch.dtype, mtp_loss_weight: float
) -> tuple[int, int]:
    """(bytes packed for backward, bytes of forward-created storages still alive after the forward), both over
    unique storages without parameters or buffers, by benchmarks/activation_memory.py's counter. Activation
    checkpointing packs inside its own hooks and keeps its inputs and (selective) cached results outside them,
    so for selective and full only the second count sees what is kept; without checkpointing both agree."""
    from benchmarks.activation_memory import _PartTracker, count_saved

    torch.manual_seed(0)
    model = Step35ForCausalLM(config)
    model.init_weights(0)
    model.to(dtype).train()
    if mode != "none":
        for layer in model.model.layers:
            apply_activation_checkpointing(layer, mode)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))

    def forward():
        return model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=mtp_loss_weight)

    saved, retained, out = count_saved(forward, _PartTracker(), model)
    out.loss.backward()  # the counted graph is a complete training graph
    return sum(b for *_, b in saved.values()), sum(b for *_, b in retained.values())


def wider_config() -> Step35Config:
    """Wider than tiny, other ratios: hidden 256, 16 experts top-4, 2 MTP layers, no router renorm."""
    raw = tiny_config_dict(
        hidden_size=256,
        intermediate_size=640,
        num_attention_heads=8,
        moe_num_experts=16,
        moe_top_k=4,
        moe_intermediate_size=96,
        share_expert_dim=160,
        norm_expert_weight=False,
        sliding_window=48,
        num_nextn_predict_layers=2,
    )
    raw["layer_types"] = raw["layer_types"] + ["sliding_attention"]
    for key in ("rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared"):
        raw[key] = raw[key] + raw[key][-1:]
    return Step35Config.from_dict(raw)


CASES = {"tiny": (lambda: preset("tiny"), 2, 96), "wider": (wider_config, 1, 128)}


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize(
    "case,dtype",
    [
        pytest.param("tiny", torch.float32, id="tiny-fp32"),
        pytest.param("tiny", torch.bfloat16, id="tiny-bf16"),
        pytest.param(
            "wider", torch.bfloat16, id="wider-bf16", marks=pytest.mark.heavy
        ),  # the wider model's activations
    ],
)
def test_predicted_activations_match_saved_tensors(case, dtype, mode):
    make, batch, seq = CASES[case]
    config = make()
    packed, kept = measure_activations(config, batch, seq, mode, dtype, mtp_loss_weight=0.3)
    shape = Shape(batch, seq, torch.empty((), dtype=dtype).element_size(), device_type="cpu")
    predicted = model_activations(config, shape, mode=mode, num_mtp_layers=config.num_nextn_predict_layers).total
    if mode == "none":
        assert packed == pytest.approx(kept, rel=0.01)  # both counts see the same tensors
        assert predicted == pytest.approx(packed, rel=0.10)
    assert predicted == pytest.approx(kept, rel=0.10)
    assert predicted == pytest.approx(kept, rel=0.01)  # measured: equal up to a few hundred bytes of scalars


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_predicted_activations_match_under_expert_parallelism(tmp_path):
    """2 gloo ranks, EP 2 (the real all-to-all dispatcher), bf16: the rows a rank receives differ from
    what it sends with the routing, so the plan (balanced routing) is compared on the sum over ranks."""
    config = preset("tiny")
    config.save(tmp_path / "config.json")
    run_script(
        ROOT / "tests" / "dist" / "plan_ep_activations.py",
        2,
        "--config",
        str(tmp_path / "config.json"),
        "--out",
        str(tmp_path),
        timeout=540,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    shape = Shape(2, 64, 2, device_type="cpu", expert_parallel_size=2)  # the script's micro-batch, bf16
    for mode in ("none", "selective", "full"):
        predicted = 2 * model_activations(config, shape, mode=mode, num_mtp_layers=1).total
        assert predicted == pytest.approx(sum(r[mode] for r in ranks), rel=0.01), mode


def test_checkpointing_orders_activations_and_mtp_only_counts_when_trained():
    config = preset("flash-196b")
    shape = Shape(1, 4096, 2, "cuda", expert_parallel_size=96)
    none, sel, full = (
        model_activations(config, shape, mode=m, num_mtp_layers=0).total for m in ("none", "selective", "full")
    )
    # Selective keeps every matmul result, the experts' down projections and the returned all-to-all rows
    # included, which no checkpointing no longer keeps (issue 30): for this MoE-heavy model it keeps more
    assert full < none < sel
    # full keeps one [S, H] bf16 block input per layer plus the final norm's work
    assert full == pytest.approx(45 * 4096 * 4096 * 2, rel=0.15)
    assert model_activations(config, shape, mode="full", num_mtp_layers=3).total > full


# ------------------------------------------------------------------------------ state on 4 real ranks
RUN_YAML = """\
trainer:
  accelerator: cpu
  devices: 4
  precision: 32-true
  strategy:
    class_path: step35.strategy.Step35Strategy
    init_args:
      expert_parallel_size: 2
      param_dtype: bfloat16
      reduce_dtype: float32
      activation_checkpointing: full
model:
  config: tiny
  mtp_loss_weight: 0.0   # the MTP layer is held but frozen: no gradient, no AdamW state
data:
  seq_len: 32
  micro_batch_size: 2
"""


LORA_RUN_YAML = RUN_YAML.replace(
    "  mtp_loss_weight: 0.0   # the MTP layer is held but frozen: no gradient, no AdamW state\n",
    "  mtp_loss_weight: 0.0\n  lora:\n    rank: 4\n    base_dtype: bfloat16\n",
)
assert "lora:" in LORA_RUN_YAML  # the replacement above matched
# Full fine-tuning with Muon: one fp32 momentum per matrix value (Newton–Schulz over the shards, EP 2 x
# efsdp 2), AdamW's two moments for the embeddings, norms and router: the plan counts each group's own.
MUON_RUN_YAML = RUN_YAML.replace(
    "  config: tiny\n", "  config: tiny\n  optimizer: muon\n  optimizer_options: {preset: stepfun}\n"
)
assert "optimizer: muon" in MUON_RUN_YAML


RUNS = {"full-muon": MUON_RUN_YAML, "lora-adamw": LORA_RUN_YAML}


@pytest.fixture(scope="module")
def four_rank_states(tmp_path_factory) -> Path:
    """Both runs' per-rank bytes (<name>-rank<R>.json) and configs (<name>.yaml): one 4-rank job, a fit per config."""
    folder = tmp_path_factory.mktemp("four_ranks")
    configs = []
    for name, text in RUNS.items():
        (folder / f"{name}.yaml").write_text(text)
        configs += ["--config", str(folder / f"{name}.yaml")]
    run_script(ROOT / "tests" / "dist" / "plan_state_run.py", 4, *configs, "--out", str(folder), timeout=540)
    return folder


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", RUNS)
def test_predicted_state_matches_four_rank_run(four_rank_states, name):
    """Per-rank parameter, gradient and optimizer-state bytes of a real 4-rank step equal the plan's, for a
    full fine-tune with Muon (its momentum for the matrices, AdamW's moments for the rest) and for LoRA with
    AdamW (a frozen bf16 base, fp32 adapters sharded like their layers)."""
    config = four_rank_states / f"{name}.yaml"
    real = [json.loads((four_rank_states / f"{name}-rank{r}.json").read_text()) for r in range(4)]

    from step35.plan.planner import sharded_state
    from step35.plan.settings import read_settings

    settings = read_settings(["--config", str(config)])
    for rank, got in enumerate(real):
        state = sharded_state(settings, rank=rank).state
        assert state.params == pytest.approx(got["params"], rel=0.01), rank
        assert state.grads == pytest.approx(got["grads"], rel=0.01), rank
        assert state.optimizer == pytest.approx(got["optimizer"], rel=0.01), rank
        assert got["frozen"] > 0 and state.grads < state.params  # the frozen MTP layer was left out
    assert max(r["params"] for r in real) == real[0]["params"]  # rank 0 holds the largest shards


@pytest.mark.parametrize("written,meant", [(None, "32-true"), ("bf16", "bf16-mixed")])
def test_precision_as_lightning_reads_it(tmp_path, capsys, written, meant):
    """A config that leaves trainer.precision unset trains at Lightning's default (32-true), and "bf16" is
    Lightning's bf16-mixed: the plan reads them so (it used to refuse the unset one, which `fit` accepts)."""
    plans = {}
    for name, value in (("written", written), ("meant", meant)):
        text = RUN_YAML.replace("  precision: 32-true\n", "" if value is None else f"  precision: {value}\n")
        assert text.count("precision") == (0 if value is None else 1)
        (tmp_path / f"{name}.yaml").write_text(text)
        code, out, err = run_plan(capsys, "--config", str(tmp_path / f"{name}.yaml"), "--no-suggestions", "--json")
        assert code in (0, 1), err[-3000:]
        plans[name] = json.loads(out)
        plans[name].pop("seconds")
    assert plans["written"] == plans["meant"]


# ------------------------------------------------------------------------------ the CLI on real recipes


@pytest.mark.heavy  # the 196B model sharded for many simulated ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe,device,min_margin", [("npu", "Ascend 910B", 20), ("gpu", "NVIDIA H100 SXM", 10)])
def test_recipes_fit_with_margin(capsys, recipe, device, min_margin):
    code, out, err = run_plan(capsys, "--config", f"configs/flash-196b-4k-{recipe}.yaml", "--json")
    assert code == 0, err[-3000:]
    plan = json.loads(out)
    assert plan["verdict"]["fits"] and plan["verdict"]["margin_pct"] >= min_margin
    assert plan["device"]["name"] == device
    assert plan["seconds"] < 30
    # The 3 MTP layers are held (frozen: mtp_loss_weight 0); the total is the release's parameters
    # (router biases are buffers) plus the three MTP layers.
    H, V, q, kv = 4096, 128896, 96 * 128, 8 * 128  # MTP layers are sliding: 96 heads (docs/architecture.md §2.10)
    mtp_layer = (
        2 * H * q
        + 2 * H * kv
        + H * 96
        + 2 * 128  # q, o, k, v, head gate, q/k norms
        + 3 * H * 11264
        + 2 * H  # dense MLP, its two norms
        + 2 * H
        + 2 * H * H
        + H
        + V * H
    )  # enorm, hnorm, eh_proj, head norm, head
    assert plan["model"]["num_mtp_layers"] == 3 and not plan["model"]["mtp_trained"]
    assert plan["model"]["params_total"] == 196_956_130_368 - 42 * 288 + 3 * mtp_layer
    assert plan["speed"]["flops_per_token"] == pytest.approx(73.506e9, rel=1e-4)  # docs/architecture.md §5; MTP not run
    if recipe == "npu":
        # 288 experts / ep 96 = 3 per rank; FSDP over efsdp=2 splits each expert's rows (dim 1).
        assert plan["layout"]["efsdp"] == 2
        assert plan["state"]["expert_shapes"] == {
            "gate_proj.weight": [3, 640, 4096],
            "up_proj.weight": [3, 640, 4096],
            "down_proj.weight": [3, 2048, 1280],
        }
        code, out, _ = run_plan(capsys, "--config", f"configs/flash-196b-4k-{recipe}.yaml")
        assert code == 0 and "FITS:" in out and "MFU <=" in out


@pytest.mark.heavy  # the 196B model sharded for many simulated ranks
@pytest.mark.timeout(600)
def test_too_few_ranks_does_not_fit_and_suggests_more_nodes(capsys):
    code, out, err = run_plan(
        capsys,
        "--config",
        "configs/flash-196b-4k-gpu.yaml",
        "--trainer.num_nodes",
        "1",
        "--trainer.strategy.expert_parallel_size",
        "8",
        "--json",
    )
    assert code == 1, err[-3000:]
    plan = json.loads(out)
    assert not plan["verdict"]["fits"] and plan["layout"]["world_size"] == 8
    assert plan["suggestions"] and all(s["fits"] for s in plan["suggestions"])
    assert plan["suggestions"][0]["world_size"] > 8


@pytest.mark.heavy  # the 196B model sharded for many simulated ranks
def test_invalid_expert_parallel_size_is_refused_with_valid_sizes(capsys):
    code, _, err = run_plan(
        capsys, "--config", "configs/flash-196b-4k-gpu.yaml", "--trainer.strategy.expert_parallel_size", "64"
    )
    assert code == 2
    assert "expert_parallel_size=64 is invalid" in err and "Valid sizes: 1, 2, 4, 8, 16, 32" in err
    # 0 is refused the same way (it used to divide by zero in the check).
    code, _, err = run_plan(
        capsys,
        "--config",
        "configs/flash-196b-4k-gpu.yaml",
        "--no-suggestions",
        "--trainer.strategy.expert_parallel_size",
        "0",
    )
    assert code == 2 and "expert_parallel_size=0 is invalid" in err, err[-2000:]


def test_step35_help_lists_plan_and_export(capsys):
    code, out, _ = cli(capsys, "--help")  # in this process; test_cli.py runs `python -m step35 --help`
    assert code == 0
    for sub in ("fit", "validate", "export", "plan"):
        assert f"  {sub} " in out


def test_unreadable_inputs_name_the_field(capsys, tmp_path):
    code, _, err = run_plan(capsys, "--model.checkpoint", str(tmp_path / "missing"), "--trainer.devices", "1")
    assert code == 2 and "model.checkpoint" in err and "--model.config" in err
    code, _, err = run_plan(capsys, "--model.config", "tiny")  # trainer.devices defaults to "auto"
    assert code == 2 and "trainer.devices='auto'" in err
