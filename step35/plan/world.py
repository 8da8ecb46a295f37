"""The simulated world: one process plays rank `rank` of `world_size` through torch's fake process
group (collectives do nothing, meshes and DTensors shard as on the real world), and the real model
is built on the meta device and sharded by the real `parallelize`, so nothing is allocated."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from step35.model import Step35ForCausalLM
from step35.parallel import ParallelDims, parallelize
from step35.training.setup import TrainedModel, training_model


def simulated_world(world_size: int, rank: int = 0) -> None:
    """(Re)start the fake process group as `rank` of `world_size`.

    torch 2.13 exposes it through the public `init_process_group(backend="fake")` (the backend is
    registered by torch itself; its store is created internally)."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("step35 plan simulates its own world; it cannot run inside a real process group")
        dist.destroy_process_group()
    try:
        dist.init_process_group(backend="fake", rank=rank, world_size=world_size)
    except (ValueError, RuntimeError, ImportError) as err:
        raise RuntimeError(
            f"torch {torch.__version__} did not start its fake process group "
            f"(init_process_group(backend='fake')): {err}. step35 plan needs it to simulate "
            f"{world_size} ranks"
        ) from err


def sharded_meta_model(
    spec: TrainedModel,
    dims: ParallelDims,
    *,
    rank: int = 0,
    stored_dtype: torch.dtype = torch.float32,
    activation_checkpointing: str = "none",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> Step35ForCausalLM:
    """The model exactly as Step35LightningModule.configure_model makes it on `rank` (meta tensors): the
    one training setup (training/setup.py) in the stored dtype, sharded by the real `parallelize`."""
    simulated_world(dims.world_size, rank)
    meshes = dims.build("cpu")
    return training_model(
        spec,
        dtype=stored_dtype,
        shard=functools.partial(
            parallelize,
            meshes=meshes,
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        ),
    )


def close_world() -> None:
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
