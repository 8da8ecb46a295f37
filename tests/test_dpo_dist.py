"""DPO and KTO on real gloo processes give what one process gives (tests/dist/dpo_steps.py): one 2-rank torchrun job
for every case. KTO: full fine-tuning and LoRA at EP 2 over 2 data-parallel ranks against one process taking the
same global batch as 2 micro-batches (its reference point is each micro-batch's own). DPO: full fine-tuning (the frozen reference copy sharded like the policy) and LoRA (the adapters off) at EP 2
over 2 data-parallel ranks, whose rows hold 3 and 2 pairs (the loss is the mean over the step's 5 pairs, not the mean
of the ranks' means), and context parallelism 2 (each rank its share of every sequence, the log-probabilities summed
over the cp group) against cp 1. Compared: the logged loss, rewards and log-probabilities, and every trained
parameter's gradient (relative 1e-5; the rewards, differences of log-probability sums, within 1e-5 of those sums)."""

from pathlib import Path

import pytest
import torch

from tests.dist.cases import case_args
from tests.runner import run_dist_script

SCRIPT = Path(__file__).parent / "dist" / "dpo_steps.py"
REL = 1e-5
DPO_CASES = {
    "full_ep2": ["--ep", "2"],
    "lora_ep2": ["--ep", "2", "--lora"],
    "full_cp2": ["--cp", "2"],
    "lora_cp2_ipo": ["--cp", "2", "--lora", "--loss-type", "ipo"],
}
KTO_CASES = {
    "kto_full_ep2": ["--objective", "kto", "--ep", "2", "--micro-batches", "2"],
    "kto_lora_ep2": ["--objective", "kto", "--ep", "2", "--micro-batches", "2", "--lora"],
}
CASES = {**DPO_CASES, **KTO_CASES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return run_dist_script(SCRIPT, tmp_path_factory.mktemp("dpo") / "r.pt", 2, *case_args(CASES), timeout=900)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # the first case waits for the job
@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_on_two_ranks_equals_one_process(two_ranks, case):
    plain, got = two_ranks[case]["plain"], two_ranks[case]["parallel"]
    assert plain["pairs"] == got["pairs"] == 5
    # The rewards and their margin are differences of sequence log-probabilities (sums over ~100 tokens, each
    # summed over the cp group in another order): their error is relative to those sums, not to the difference.
    logged = plain["logged"]
    scale = abs(logged["train/chosen_logp"]) + abs(logged["train/rejected_logp"])
    for name, value in logged.items():
        differences = name.endswith(("reward", "reward_margin"))
        assert got["logged"][name] == pytest.approx(value, rel=REL, abs=REL * scale if differences else 1e-7), name
    assert plain["logged"]["train/reward_margin"] != 0  # the policy is not its reference: a real comparison
    assert plain["grads"].keys() == got["grads"].keys() and plain["grads"]
    for name, g in plain["grads"].items():
        assert rel_err(got["grads"][name], g) < REL, name


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", list(KTO_CASES))
def test_kto_on_two_ranks_equals_one_process_accumulating_their_micro_batches(two_ranks, case):
    plain, got = two_ranks[case]["plain"], two_ranks[case]["parallel"]
    assert plain["pairs"] == got["pairs"] == 5  # the step's records
    for name, value in plain["logged"].items():
        assert got["logged"][name] == pytest.approx(value, rel=REL, abs=1e-6), (name, got["logged"][name], value)
    assert plain["logged"]["train/desirable_reward"] != 0 and plain["logged"]["train/kl"] > 0  # a real comparison
    assert plain["grads"].keys() == got["grads"].keys() and plain["grads"]
    for name, g in plain["grads"].items():
        assert rel_err(got["grads"][name], g) < REL, name
