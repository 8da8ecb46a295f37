"""Parallelism: device meshes, expert-parallel token dispatch, the FSDP2 plan and the global grad norm.

Nothing here knows about data; the model knows nothing of this package (the expert dispatcher is
injected into each MoE module by `parallelize`)."""

from step35.parallel.grad import clip_grad_norm_, global_grad_norm
from step35.parallel.mesh import Meshes, ParallelConfigError, ParallelDims, valid_cp_sizes, valid_ep_sizes
from step35.parallel.parallelize import parallelize

__all__ = [
    "Meshes",
    "ParallelConfigError",
    "ParallelDims",
    "clip_grad_norm_",
    "global_grad_norm",
    "parallelize",
    "valid_cp_sizes",
    "valid_ep_sizes",
]
