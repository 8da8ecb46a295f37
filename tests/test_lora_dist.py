"""LoRA under FSDP2 + expert parallelism on real gloo processes gives what one plain process gives:
4 ranks at EP 1, 2 and 4 (and EP 2 with selective activation checkpointing) against one process, same init and global batches, 3 SGD-momentum steps with
adapters on every target kind (routed experts sharded over EP like the experts), MTP on. Compared:
per-step losses and every adapter / full-target gradient at every step (relative 1e-5), the
trained parameters after the steps; and in every run the frozen base is bitwise unchanged, has no
gradient and no optimizer state (tests/dist/lora_steps.py)."""

from pathlib import Path

import pytest
import torch

from tests.dist import lora_steps
from tests.dist.cases import case_args
from tests.runner import run_dist_script

SCRIPT = Path(__file__).parent / "dist" / "lora_steps.py"
REL = 1e-5
EP_CASES = [(1, "none"), (2, "none"), (4, "none"), (2, "selective")]  # on 4 ranks, one job for all
# Muon on every adapter (parallel/whole_matrices.py: dense adapters split over 4 ranks, expert adapters over efsdp 4
# or whole per rank at ep 4), AdamW on the full-trained router, in the same job
MUON_CASES = [1, 4]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / a.double().norm().clamp(min=1e-12)).item()


@pytest.fixture(scope="module")
def plain() -> dict:
    return lora_steps.plain()  # one plain process: this one


@pytest.fixture(scope="module")
def plain_muon() -> dict:
    return lora_steps.plain("--optimizer", "muon")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    """{f"ep{ep}_{ac}": result} of every EP_CASES case (and the Muon and bf16-base cases), one torchrun job on 4
    ranks."""
    cases = {f"ep{ep}_{ac}": ["--ep", str(ep), "--ac", ac] for ep, ac in EP_CASES}
    cases |= {f"ep{ep}_muon": ["--ep", str(ep), "--optimizer", "muon"] for ep in MUON_CASES}
    cases["bf16_base"] = ["--ep", "2", "--base-dtype", "bfloat16"]
    return run_dist_script(SCRIPT, tmp_path_factory.mktemp("four") / "results.pt", 4, *case_args(cases), timeout=900)


def check_frozen(run_: dict) -> None:
    assert run_["frozen"] > 0 and run_["base_unchanged"] and run_["no_base_grads"] and run_["no_base_state"]


def test_plain_run_trains_only_adapters(plain):
    check_frozen(plain)
    assert any(n.endswith("moe.down_proj.lora_B") for n in plain["grads"][0])
    # B starts at 0, so the first step's A gradients are 0; later steps exercise both.
    last = plain["grads"][-1]
    assert all(g.abs().sum() > 0 for n, g in last.items()), [n for n, g in last.items() if g.abs().sum() == 0]


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # the first case waits for the job
@pytest.mark.parametrize("ep,ac", EP_CASES)
def test_lora_matches_one_process_at_every_ep_size(four_ranks, plain, ep, ac):
    got = four_ranks[f"ep{ep}_{ac}"]
    check_frozen(got)
    a, b = torch.tensor(plain["losses"]), torch.tensor(got["losses"])
    assert torch.allclose(a, b, rtol=REL, atol=0), f"losses {a.tolist()} vs {b.tolist()}"
    for step, (ref, grads) in enumerate(zip(plain["grads"], got["grads"])):
        assert ref.keys() == grads.keys()
        for name, g in ref.items():
            if g.abs().sum() == 0:  # step 0's A gradients: exactly zero in both
                assert grads[name].abs().sum() == 0, (step, name)
                continue
            assert rel_err(g, grads[name]) <= REL, (step, name, rel_err(g, grads[name]))
    for name, p in plain["params"].items():
        assert rel_err(p, got["params"][name]) <= REL, (name, rel_err(p, got["params"][name]))


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ep", MUON_CASES)
def test_lora_with_muon_matches_one_process(four_ranks, plain_muon, ep):
    """LoRA-Muon: each adapter matrix (each expert's apart) orthogonalised whole across its shards; the
    adapters after 3 steps within 1e-5 of one process, the base untouched."""
    got = four_ranks[f"ep{ep}_muon"]
    check_frozen(got)
    a, b = torch.tensor(plain_muon["losses"]), torch.tensor(got["losses"])
    assert torch.allclose(a, b, rtol=REL, atol=0), f"losses {a.tolist()} vs {b.tolist()}"
    moved = [n for n, p in plain_muon["params"].items() if n.endswith("lora_A") and p.abs().sum() > 0]
    assert any(".moe." in n for n in moved)
    for name, p in plain_muon["params"].items():
        assert rel_err(p, got["params"][name]) <= REL, (name, rel_err(p, got["params"][name]))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bf16_base_with_fp32_adapters_shards_and_trains(four_ranks, plain):
    """A bf16 frozen base and fp32 adapters in the same FSDP2 units (EP 2 x FSDP 2 on 4 ranks, in the 4-rank job):
    the base stays bf16 and bitwise unchanged, adapters and their gradients stay fp32, losses within 2 % of fp32."""
    got = four_ranks["bf16_base"]
    check_frozen(got)
    assert got["base_dtypes"] == ["torch.bfloat16"] and plain["base_dtypes"] == ["torch.float32"]
    assert all(p.dtype == torch.float32 for p in got["params"].values())
    assert all(g.dtype == torch.float32 for step in got["grads"] for g in step.values())
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(plain["losses"]), rtol=2e-2, atol=0)
