"""A pruned release (issue 28): an HF folder whose MoE layers keep 6 of the tiny model's 8 experts, as expert-pruned
variants of Step-3.5/3.7-Flash keep fewer than the release's 288. Nothing in step35 assumes an expert count: the
folder loads with its kept experts in order; under FSDP2 + expert parallelism of sizes 2 and 3 (gloo jobs of 2
and 3 ranks, tests/dist/train_steps.py) it trains as one plain process does; and an EP size that does not divide its
experts (4), or leaves too few ranks to split each expert's rows (EP 2 of 6 ranks), is refused by `step35 fit`
and `step35 plan`, which name the sizes that work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dist import train_steps
from tests.runner import run_dist_script

SCRIPT = Path(__file__).parent / "dist" / "train_steps.py"
KEPT = [0, 1, 3, 4, 6, 7]  # experts 2 and 5 pruned
REL = 1e-5  # as tests/test_distributed_equivalence.py: fp32 reduction order only
# A tensor that starts at zero (the zero-centred norms' weights) is all update after two steps (norm ~8e-3), and
# Adam's normalised update magnifies fp32 reduction-order noise on its near-zero gradients (measured: k_norm 6.3e-5
# relative at EP 3, 5.2e-7 absolute): such a tensor is compared to a thousandth of a step instead (lr 1e-3).
STEP_NOISE = 1e-6
STEPS, BATCH = ("--steps", "2"), ("--batch", "6")  # 6 sequences a step: 3 per rank at EP 2, 2 at EP 3
SHARDED = ["--trainer.strategy=step35.strategy.Step35Strategy"]


def prune(source: Path, out: Path, kept: list[int]) -> Path:
    """The HF folder `source` with only the experts `kept` in every MoE layer (the router's rows, the router bias,
    the stacked expert weights: every `.moe.` tensor, experts first), config.json's moe_num_experts said so."""
    config = json.loads((source / "config.json").read_text())
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors |= load_file(file)
    index = torch.tensor(kept)
    for name, tensor in tensors.items():
        if ".moe." in name:
            assert tensor.shape[0] == config["moe_num_experts"], (name, tensor.shape)
            tensors[name] = tensor.index_select(0, index).contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "moe_num_experts": len(kept)}, indent=2))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model drawn with seed 3 as an HF folder, the same with experts 2 and 5 pruned)."""
    from tests.helpers import hf_base

    root = tmp_path_factory.mktemp("pruned")
    eight = hf_base(root / "eight", seed=3)
    return eight, prune(eight, root / "six", KEPT)


def test_the_pruned_folder_loads_its_kept_experts(folders):
    from step35.checkpoint.hf.pretrained import load_pretrained

    eight, six = folders
    model = load_pretrained(six)
    assert model.config.moe_num_experts == 6
    full = {}
    for file in eight.glob("*.safetensors"):
        full |= load_file(file)
    state = model.state_dict()
    moe = [n for n in state if ".moe." in n]
    assert moe and all(state[n].shape[0] == 6 for n in moe)
    for name in moe:
        assert torch.equal(state[name], full[name][KEPT]), name
    with torch.no_grad():
        logits = model(torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0)))
    assert logits.isfinite().all()


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_expert_parallel_2_and_3_train_the_pruned_folder_as_one_process_does(folders, tmp_path):
    """EP 3 on 3 ranks (2 experts per rank) and EP 2 on 2 ranks (3 per rank), each rank loading its slices of the
    pruned folder: per-step losses, grad norms and every final parameter as one plain process computes them from
    the same folder. Two jobs: no world size gives EP 2 and EP 3 both an efsdp that splits the tiny experts' 64
    rows (6 ranks would leave efsdp 3 to EP 2: refused, test below)."""
    _, six = folders
    options = ["--checkpoint", str(six), *STEPS, *BATCH]
    plain = train_steps.plain(*options)
    for ep in (3, 2):
        result = run_dist_script(SCRIPT, tmp_path / f"ep{ep}.pt", ep, "--ep", str(ep), *options, timeout=540)
        for what in ("losses", "norms"):
            a, b = torch.tensor(plain[what]), torch.tensor(result[what])
            assert torch.allclose(a, b, rtol=REL, atol=0), f"ep {ep} {what}: {a.tolist()} vs {b.tolist()}"
        assert plain["params"].keys() == result["params"].keys()
        for key, a in plain["params"].items():
            b = result["params"][key]
            assert b.shape == a.shape, (ep, key)
            err = ((a.double() - b.double()).norm() / a.double().norm().clamp(min=1e-12)).item()
            worst = (a - b).abs().max().item()
            assert err <= REL or worst <= STEP_NOISE, f"ep {ep} {key}: relative error {err:.2e}, at most {worst:.1e}"
    experts = [k for k in plain["params"] if k.endswith("moe.up_proj.weight")]
    assert experts and all(plain["params"][k].shape[0] == 6 for k in experts)


def test_an_efsdp_that_does_not_split_the_expert_rows_is_refused_naming_the_sizes_that_work(folders):
    """6 ranks, EP 2: efsdp 3 cannot split the experts' 64 rows evenly (FSDP2 refuses uneven dim-1 shards deep in
    its setup); parallelize refuses it first, on every rank alike, listing the EP sizes that work (1, 3, 6)."""
    from step35.config import load_config
    from step35.parallel import ParallelConfigError, ParallelDims, valid_ep_sizes
    from step35.plan.world import close_world, sharded_meta_model
    from step35.training.setup import TrainedModel

    _, six = folders
    config = load_config(six)
    assert valid_ep_sizes(6, 6, (config.moe_intermediate_size, config.hidden_size)) == [1, 3, 6]
    try:
        with pytest.raises(
            ParallelConfigError,
            match=r"expert_parallel_size=2 on 6 ranks shards each expert's rows over efsdp = 6 / 2 = 3 ranks, .*"
            r"not a multiple of 3: gate_proj.weight 64, up_proj.weight 64, down_proj.weight 128\. Sizes that work on "
            r"this world size: \[1, 3, 6\]",
        ):
            sharded_meta_model(TrainedModel(config), ParallelDims(6, 2, num_experts=6))
    finally:
        close_world()
    sharded_meta_model(TrainedModel(config), ParallelDims(6, 3, num_experts=6))  # efsdp 2: accepted
    close_world()


def test_expert_parallel_4_is_refused_naming_the_sizes_that_divide_the_experts(folders, tmp_path, step35_here):
    """4 nodes of one device, EP 4: `step35 fit` refuses it before any process group (Step35Strategy's
    setup_environment), and `step35 plan` before planning; both name the sizes that divide the 6 experts."""
    _, six = folders
    fit = [
        "fit",
        "--config",
        "configs/tiny.yaml",
        f"--run_dir={tmp_path / 'run'}",
        f"--model.checkpoint={six}",
        *SHARDED,
        "--trainer.strategy.expert_parallel_size=4",
        "--trainer.num_nodes=4",
        "--trainer.devices=1",
        "--trainer.logger=false",
    ]
    code, out, err = step35_here(*fit)
    assert code != 0
    assert (
        "expert_parallel_size=4 must divide num_experts=6 (the routed experts per MoE layer of the model; its "
        "divisors: [1, 2, 3, 6]; sizes that divide both the experts and the world size 4: [1, 2])" in err
    ), out[-2000:] + err[-4000:]
    plan = ["plan", "--config", "configs/tiny.yaml", f"--model.checkpoint={six}", *SHARDED, "--no-suggestions"]
    code, out, err = step35_here(*plan, "--trainer.devices=4", "--trainer.strategy.expert_parallel_size=4")
    assert code == 2, out[-2000:] + err[-3000:]
    assert (
        "trainer.strategy.expert_parallel_size=4 is invalid: it must divide the 6 experts and the world size 4 "
        "(1 x 4), and world / ep (efsdp) must divide each expert's rows (moe_intermediate_size 64, hidden_size 128). "
        "Valid sizes: 1, 2 (the 6 experts' divisors: 1, 2, 3, 6)" in err
    ), err[-3000:]
    code, out, err = step35_here(*plan, "--trainer.devices=6", "--trainer.strategy.expert_parallel_size=2")
    assert code == 2 and "expert_parallel_size=2 is invalid" in err and "Valid sizes: 1, 3, 6 (" in err, err[-3000:]
    code, out, err = step35_here(*plan, "--trainer.devices=3", "--trainer.strategy.expert_parallel_size=3")
    assert code in (0, 1) and "6 experts top-2" in out and "EP 3 (efsdp 1)" in out, out[-3000:] + err[-3000:]
