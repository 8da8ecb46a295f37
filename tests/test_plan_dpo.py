"""`step35 plan` for DPO runs (issue 26): a full-fine-tuning DPO run holds, beside the policy, a frozen reference copy
of the start model (no MTP layers) in the compute dtype, sharded as the policy; its bytes on every simulated rank equal
that copy built here by hand (build_model, the real `parallelize` on 3 and 4 simulated ranks), and they are added to
what the rank holds. LoRA DPO (the reference is the policy with its adapters off) and reference_free hold nothing more.
"""

from pathlib import Path

import pytest
import torch

from step35.model import build_model
from step35.plan.settings import read_settings
from tests.helpers import tiny_config

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def settings(*extra: str, world: int = 1, ep: int = 1, objective: str = "dpo"):
    args = ["--config", TINY, "--model.objective", objective]
    if world > 1:
        args += [
            "--trainer.devices",
            str(world),
            "--trainer.strategy",
            "step35.strategy.Step35Strategy",
            "--trainer.strategy.expert_parallel_size",
            str(ep),
        ]
    return read_settings(args + list(extra))


@pytest.mark.parametrize("world,ep,param_dtype", [(3, 1, None), (4, 2, "bfloat16")])
def test_full_dpo_counts_the_sharded_reference_copy(world, ep, param_dtype):
    from step35.parallel import ParallelDims, parallelize
    from step35.plan.planner import sharded_state
    from step35.plan.world import close_world, simulated_world

    extra = ["--trainer.strategy.param_dtype", param_dtype] if param_dtype else []
    s = settings(*extra, world=world, ep=ep)
    lm = settings(*extra, world=world, ep=ep, objective="lm")
    assert s.objective == "dpo" and s.reference_copy
    config = tiny_config()
    dtype = getattr(torch, param_dtype) if param_dtype else torch.float32
    for rank in range(world):
        simulated_world(world, rank)
        try:
            model = build_model(config, 0, device="meta", dtype=dtype)  # the start model, MTP layers left out
            parallelize(model, ParallelDims(world, ep, num_experts=config.moe_num_experts).build("cpu"))
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        finally:
            close_world()
        want = sum(t.numel() * t.element_size() for t in local)
        state, policy = sharded_state(s, rank=rank).state, sharded_state(lm, rank=rank).state
        assert state.reference == want > 0, rank
        assert state.total == policy.total + want  # nothing else changes: no gradient, no optimizer state
        assert (state.params, state.grads, state.optimizer) == (policy.params, policy.grads, policy.optimizer)


def test_lora_and_reference_free_dpo_hold_no_reference():
    from step35.plan.planner import sharded_state

    assert sharded_state(settings("--model.lora", "{rank: 4}")).state.reference == 0
    assert sharded_state(settings("--model.dpo", "{reference_free: true}")).state.reference == 0
    full = sharded_state(settings()).state
    n = sum(p.numel() for p in build_model(tiny_config(), 0, device="meta").parameters())
    assert full.reference == n * 4  # unsharded, 32-true: fp32


DPO_RECIPE = str(ROOT / "configs" / "flash-196b-lora-dpo-h200.yaml")


def test_the_196b_lora_dpo_recipe_is_the_fewest_h200_that_fit(step35_here):
    """configs/flash-196b-lora-dpo-h200.yaml: 4 H200 fit (the LoRA reference costs no bytes), 3 do not; the
    recipe is a valid `step35 fit` config (objective dpo, preference data)."""
    import json

    code, out, err = step35_here("plan", "--config", DPO_RECIPE, "--json")
    assert code == 0, err[-3000:]
    plan = json.loads(out)
    assert plan["verdict"]["fits"] and plan["device"]["name"].startswith("NVIDIA H200"), plan["verdict"]
    assert plan["state"].get("reference", 0) == 0  # the policy with adapters off: no copy
    three = ["--trainer.devices", "3", "--trainer.strategy.expert_parallel_size", "3"]
    code, out, _ = step35_here("plan", "--config", DPO_RECIPE, "--json", *three)
    assert code != 0 and not json.loads(out)["verdict"]["fits"]
    code, out, err = step35_here("fit", "--config", DPO_RECIPE, "--print_config")
    assert code == 0, err[-3000:]
    assert "objective: dpo" in out and "format: preference" in out and "devices: 4" in out


def test_the_reference_forward_is_in_the_step_time_not_in_the_model_flops():
    """The objective's forward without gradients (Objective.needs: DPO's reference, 1 per micro-batch) costs a
    forward's FLOPs (2 x parameters per token + attention's third), all-to-all calls (2 per MoE layer) and an
    all-gather of every group; reference_free runs none."""
    from step35.plan.devices import DEVICES
    from step35.plan.planner import make_plan

    def plan(*extra, objective="dpo"):
        args = ("--model.mtp_loss_weight", "0", *extra)
        s = settings(*args, world=2, ep=2, objective=objective)
        return s, make_plan(s, DEVICES["h100"], allocator_margin=0.1).speed

    (s, lm), (_, dpo), (_, free) = plan(objective="lm"), plan(), plan("--model.dpo", "{reference_free: true}")
    assert s.objective_needs.extra_forwards == 0 and free == lm
    assert dpo.flops_per_token == lm.flops_per_token  # the MFU numerator: the policy's training only
    assert dpo.hardware_flops_per_token == pytest.approx(lm.hardware_flops_per_token * 4 / 3, rel=1e-12)
    assert dpo.all_to_all_bytes == pytest.approx(lm.all_to_all_bytes * 6 / 4, rel=1e-12)
    assert dpo.fsdp_gather_bytes > lm.fsdp_gather_bytes and dpo.fsdp_reduce_bytes == lm.fsdp_reduce_bytes
