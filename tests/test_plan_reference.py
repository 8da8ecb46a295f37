"""The frozen reference copy of a full-fine-tuning DPO run (issue 43): `step35 plan` counts the bytes the real
module holds, because both ask training/reference.py's one rule (FSDP's param_dtype, else the stored dtype;
sharded as the policy). Checked on 2 simulated ranks (the fake process group of step35/plan/world.py) at
32-true, bf16-mixed and bf16-mixed with param_dtype bfloat16: the module is built by its own configure_model
under Lightning's precision plugin (as Lightning's _call_configure_model runs it) and the sharded strategy's
parallelize, its reference's local shards summed, and compared with the plan's count for the same config.

And why the rule keeps fp32 under bf16-mixed: under Lightning's autocast the reference then gives the policy's
start log-probabilities bit for bit (a bf16 copy would not: its embeddings and residual stream are bf16).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from step35.module import Step35LightningModule
from step35.parallel import ParallelDims, parallelize
from step35.plan.planner import sharded_state
from step35.plan.settings import read_settings
from step35.plan.world import close_world, simulated_world
from step35.training.dpo import sequence_logprobs
from tests.dist.dpo_steps import pack, sample_rows
from tests.helpers import make_trainer

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
WORLD, EP = 2, 2


def _local_bytes(model) -> int:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


def _trainer(precision: str, strategy) -> SimpleNamespace:
    """What configure_model reads of a Trainer, with Lightning's own precision plugin for `precision`."""
    plugin = make_trainer(precision=precision).precision_plugin
    return SimpleNamespace(strategy=strategy, precision_plugin=plugin, is_global_zero=True, ckpt_path=None)


def held_reference(precision: str, param_dtype: torch.dtype | None, rank: int) -> tuple[int, set[torch.dtype]]:
    """(bytes, dtypes) of the reference copy the module holds on `rank` of the simulated world."""
    module = Step35LightningModule(config="tiny", objective="dpo", num_mtp_layers=0)
    simulated_world(WORLD, rank)
    try:
        meshes = ParallelDims(WORLD, EP, num_experts=module.model_config.moe_num_experts).build("cpu")
        strategy = SimpleNamespace(
            parallelize_model=functools.partial(parallelize, meshes=meshes, param_dtype=param_dtype),
            param_dtype=param_dtype,
            root_device=torch.device("cpu"),
        )
        module.trainer = _trainer(precision, strategy)
        with module.trainer.precision_plugin.module_init_context():  # as Lightning runs configure_model
            module.configure_model()
        reference = module.objective.reference_model
        return _local_bytes(reference), {p.dtype for p in reference.parameters()}
    finally:
        close_world()


def planned_reference(precision: str, param_dtype: str | None, rank: int) -> int:
    args = ["--config", TINY, "--model.objective", "dpo", "--model.mtp_loss_weight", "0"]
    args += ["--trainer.precision", precision, "--trainer.devices", str(WORLD)]
    args += ["--trainer.strategy", "step35.strategy.Step35Strategy", "--trainer.strategy.expert_parallel_size", str(EP)]
    if param_dtype:
        args += ["--trainer.strategy.param_dtype", param_dtype]
    return sharded_state(read_settings(args), rank=rank).state.reference


@pytest.mark.parametrize(
    "precision, param_dtype, dtype",
    [("32-true", None, torch.float32), ("bf16-mixed", None, torch.float32), ("bf16-mixed", "bfloat16", torch.bfloat16)],
)
def test_the_plan_counts_the_reference_the_module_holds(precision, param_dtype, dtype):
    for rank in range(WORLD):
        held, dtypes = held_reference(precision, getattr(torch, param_dtype) if param_dtype else None, rank)
        planned = planned_reference(precision, param_dtype, rank)
        assert held > 0 and abs(planned - held) <= 0.01 * held, (rank, planned, held)
        assert dtypes == {dtype}, dtypes


def test_under_autocast_the_reference_gives_the_start_logprobs_bit_for_bit():
    """bf16-mixed without param_dtype, one device: the fp32 copy computes what the fp32 policy computes
    under autocast; a bf16 copy of the same weights does not (why reference_dtype keeps the stored dtype)."""
    module = Step35LightningModule(config="tiny", objective="dpo", num_mtp_layers=0)
    module.trainer = _trainer("bf16-mixed", SimpleNamespace(root_device=torch.device("cpu")))
    precision = module.trainer.precision_plugin
    with precision.module_init_context():
        module.configure_model()
    batch = pack(sample_rows(7))
    with torch.no_grad(), precision.forward_context():
        policy = sequence_logprobs(module.model, batch, 64)[0]
        reference = sequence_logprobs(module.objective.reference_model, batch, 64)[0]
        assert torch.equal(policy, reference)
        bf16_copy = copy.deepcopy(module.objective.reference_model).to(torch.bfloat16)
        assert not torch.equal(policy, sequence_logprobs(bf16_copy, batch, 64)[0])
