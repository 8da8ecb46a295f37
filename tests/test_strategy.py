"""Step35Strategy in this process: bad parallel sizes fail before any process group, naming both values; the
strategy asks the module for its experts and keeps its meshes to itself. Its real jobs (torchrun, Lightning's
launcher, srun) are tests/test_launchers.py's and tests/test_fail_fast.py's: a sharded (DCP) EP 2 checkpoint
resumes bitwise and exports like torch's consolidation there; a bad EP size ends a Lightning-launched job."""

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator

from step35.module import Step35LightningModule
from step35.parallel import ParallelConfigError, ParallelDims, valid_ep_sizes
from step35.strategy import Step35Strategy, num_routed_experts
from tests.helpers import make_trainer


def test_parallel_dims_errors_name_both_values():
    with pytest.raises(ParallelConfigError, match="expert_parallel_size=64 must divide num_experts=288"):
        ParallelDims(world_size=192, expert_parallel_size=64, num_experts=288)
    with pytest.raises(
        ParallelConfigError,
        match=r"expert_parallel_size=5 must divide the world size 8 \(sizes that "
        r"divide the world size and the experts: \[1, 2, 4, 8\]\)",
    ):
        ParallelDims(world_size=8, expert_parallel_size=5, num_experts=288)
    with pytest.raises(ParallelConfigError, match=r"divide the world size: \[1, 2, 3, 6\]\)"):
        ParallelDims(world_size=6, expert_parallel_size=4)
    with pytest.raises(ParallelConfigError, match="replicate_size=3 must divide the world size 8"):
        ParallelDims(world_size=8, replicate_size=3)
    with pytest.raises(ParallelConfigError, match=r"must divide num_experts=24 .*world size 16: \[1, 2, 4, 8\]"):
        ParallelDims(world_size=16, expert_parallel_size=16, num_experts=24)
    assert valid_ep_sizes(192, 288) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert valid_ep_sizes(8) == [1, 2, 4, 8] and valid_ep_sizes(6, 4) == [1, 2]
    dims = ParallelDims(world_size=192, expert_parallel_size=96, num_experts=288)
    assert (dims.efsdp, dims.shard_size) == (2, 192)


def test_npu_without_torch_npu_is_a_clear_error():

    from step35.accelerators import NPUUnavailableError

    with pytest.raises(NPUUnavailableError, match="torch_npu"):
        make_trainer(accelerator="npu")


class ThreeExperts(pl.LightningModule):
    """Not step35's module: only the declared call, and no model_config to read."""

    def num_routed_experts(self) -> int:
        return 3


def _strategy(module, world: int, **kwargs) -> Step35Strategy:
    strategy = Step35Strategy(**kwargs)
    strategy.parallel_devices = [torch.device("cpu")] * world
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = CPUAccelerator()
    strategy.connect(module)
    return strategy


@pytest.mark.timeout(120)
def test_strategy_asks_the_module_for_its_experts_before_any_process_group():
    # Two simulated ranks, ep=2, a module with 3 experts: refused in setup_environment through the
    # module's num_routed_experts(), before a process group is started (unchecked, this test would
    # hang in the process group's start, waiting for a second rank).
    strategy = _strategy(ThreeExperts(), world=2, expert_parallel_size=2)
    with pytest.raises(ParallelConfigError, match="expert_parallel_size=2 must divide num_experts=3"):
        strategy.setup_environment()
    assert not dist.is_initialized()
    module = Step35LightningModule(config="tiny", config_overrides={"moe_num_experts": 3})
    assert num_routed_experts(module) == 3 and num_routed_experts(torch.nn.Linear(1, 1)) is None
    assert Step35LightningModule(config="tiny", config_overrides={"use_moe": False}).num_routed_experts() is None


def test_strategy_keeps_its_meshes_to_itself():
    # One process, world 1 (LightningEnvironment picks a free port; conftest drops it afterwards): the
    # strategy's device_mesh is its dense mesh; the module's stays unset.
    module = Step35LightningModule(config="tiny")
    strategy = _strategy(module, world=1)
    try:
        strategy.setup_environment()
        assert strategy.device_mesh is strategy.meshes.dense and strategy.meshes.dense.size() == 1
        assert module.device_mesh is None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
