"""Step35Strategy through the real CLI under torchrun (gloo, 2 processes, EP 2): training runs, the
sharded (DCP) checkpoint resumes exactly, and bad parallel sizes fail before any collective."""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator

from step35.checkpoint.hf.pretrained import load_pretrained
from step35.module import Step35LightningModule
from step35.parallel import ParallelConfigError, ParallelDims, valid_ep_sizes
from step35.strategy import Step35Strategy, num_routed_experts
from tests.runner import step35


def fit_args(run: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--trainer.strategy=step35.strategy.Step35Strategy",
        "--trainer.strategy.expert_parallel_size=2",
        "--trainer.devices=2",
        "--trainer.val_check_interval=1000",
        "--trainer.log_every_n_steps=1",
        "--data.seq_len=64",
        "--data.micro_batch_size=2",
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.save_dir={run}",
        *extra,
    ]


def losses(run: Path) -> dict[int, float]:
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/lm_loss"]) for r in csv.DictReader(f) if r.get("train/lm_loss")}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_fsdp_ep_run_resumes_exactly_from_sharded_checkpoint(tmp_path, builtin_cache):
    ckpt_dir = tmp_path / "ckpt"
    checkpointing = [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=4",
        "--trainer.callbacks.save_top_k=-1",
        f"--trainer.callbacks.dirpath={ckpt_dir}",
    ]
    step35(fit_args(tmp_path / "full", "--trainer.max_steps=8", *checkpointing), builtin_cache, nproc=2)
    step4 = sorted(ckpt_dir.glob("*step=4*"))
    assert step4 and step4[0].is_dir(), list(ckpt_dir.iterdir())  # a DCP folder: shards + meta.pt
    assert (step4[0] / "meta.pt").exists() and list(step4[0].glob("*.distcp"))
    assert not list(ckpt_dir.glob(".*partial*"))  # the atomic save left no temporary folder
    step35(fit_args(tmp_path / "resumed", "--trainer.max_steps=8", f"--ckpt_path={step4[0]}"), builtin_cache, nproc=2)
    a, b = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    # metrics are logged at 0-based global steps: the step-4 checkpoint is followed by steps 4..7
    assert set(range(4, 8)) <= set(a) and set(range(4, 8)) <= set(b), (sorted(a), sorted(b))
    for step in range(4, 8):
        assert b[step] == pytest.approx(a[step], rel=1e-6), (step, a[step], b[step])

    # The sharded checkpoint exports to an HF folder equal to torch's own DCP consolidation.
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from step35.checkpoint.training.export import export_checkpoint

    export_checkpoint(step4[0], tmp_path / "hf", max_shard_size="2MB")
    dcp_to_torch_save(step4[0], tmp_path / "consolidated.pt")
    consolidated = torch.load(tmp_path / "consolidated.pt", weights_only=False)["state_dict"]
    exported = load_pretrained(tmp_path / "hf").state_dict()
    assert len(exported) == len([k for k in consolidated if k.startswith("model.")]) > 0
    for name, value in exported.items():
        assert torch.equal(value, consolidated["model." + name]), name


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_expert_parallel_size_that_does_not_divide_experts_fails_fast(tmp_path, builtin_cache):
    # tiny has 8 experts; 2 ranks with ep=2 is fine, so ask for ep=3 (divides neither).
    proc = step35(
        fit_args(tmp_path / "bad", "--trainer.max_steps=1", "--trainer.strategy.expert_parallel_size=3"),
        builtin_cache,
        nproc=2,
        timeout=240,
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "expert_parallel_size=3 must divide the world size 2 (sizes that divide the world size and the experts: "
        "[1, 2])" in proc.stderr + proc.stdout
    )


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
    import lightning.pytorch as pl

    from step35.accelerators import NPUUnavailableError

    with pytest.raises(NPUUnavailableError, match="torch_npu"):
        pl.Trainer(accelerator="npu", devices=1, logger=False)


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
