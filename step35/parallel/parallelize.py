"""Apply parallelism to a Step35ForCausalLM built on the meta device, in a fixed order:
expert parallelism, activation checkpointing, per-block compile, then FSDP2 (innermost first).
Activation checkpointing wraps each decoder layer and, in a vision-language model, each vision encoder block.

Parameter names stay the HF names throughout (no wrapper modules), so checkpoints keep them.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from step35.model import Step35ForCausalLM
from step35.model.lora import is_adapter
from step35.model.moe import MoE
from step35.parallel.context import ContextParallel
from step35.parallel.expert_parallel import shard_experts
from step35.parallel.mesh import Meshes

ActivationCheckpointing = Literal["none", "selective", "full"]


def parallelize(
    model: Step35ForCausalLM,
    meshes: Meshes,
    *,
    activation_checkpointing: ActivationCheckpointing = "none",
    compile: bool = False,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> None:
    layers = list(model.model.layers)
    if meshes.context is not None:  # the model computes its share of each sequence (parallel/context.py)
        model.context_parallel = ContextParallel(meshes.context["cp"].get_group())
    if meshes.experts is not None:
        for layer in layers:
            if layer.spec.is_moe:
                shard_experts(layer.moe, meshes.experts["ep"])
    if activation_checkpointing != "none":
        checkpoint_blocks(model, activation_checkpointing)
    if compile:
        for layer in layers:
            layer.compile(fullgraph=False)
    apply_fsdp(
        model, meshes, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype, reduce_dtype=reduce_dtype
    )


def apply_fsdp(
    model: Step35ForCausalLM,
    meshes: Meshes,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    dense_mesh = meshes.dense
    # LoRA (model/lora.py): the frozen base and the fp32 adapters share units (FSDP2 checks dtypes of
    # trainable parameters only, at the first forward). A rank whose adapters get no gradient in a
    # step (a frozen MTP path, experts no token reached) must still join the reduce-scatters.
    lora = any(is_adapter(name) for name, _ in model.named_parameters())
    units = []
    for layer in model.model.layers:
        if layer.spec.is_moe and meshes.experts is not None:
            experts = [layer.moe.gate_proj, layer.moe.up_proj, layer.moe.down_proj]
            # Dim 0 is already split over ep; FSDP shards the per-expert rows (dim 1) over efsdp, evenly only:
            # a size that would not split is refused here, naming it, on every rank alike.
            names = ("gate_proj", "up_proj", "down_proj")
            meshes.dims.check_expert_rows(
                {f"{k}.{n}": p.shape[1] for k, m in zip(names, experts) for n, p in m.named_parameters()}
            )
            fully_shard(
                experts,
                mesh=meshes.experts["efsdp"],
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp,
                shard_placement_fn=lambda p: Shard(1),
            )
            # An expert's gradient already sums the tokens of its whole ep group (the all-to-all
            # backward); reduce-scatter over efsdp then sums over every rank. Divide by the world,
            # as the dense parameters are, so both are a mean over data-parallel ranks.
            experts[0].set_gradient_divide_factor(float(meshes.dims.world_size))
            units.append(experts[0])
            # gloo has no PREMUL_SUM: sum, then divide. (With efsdp == 1 the forced sum skipped the
            # division in a probe on torch 2.13, so only where a reduce-scatter really happens.)
            if dense_mesh.device_type == "cpu" and meshes.dims.efsdp > 1:
                experts[0].set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        if layer.spec.is_mtp:  # its head outside forward: the drafts of `draft_logits` (EvalCallback's MTP check)
            register_fsdp_forward_method(layer, "logits")
        units.append(layer)
    units += _shard_vision(model, dense_mesh, reshard_after_forward, mp)
    # Root: embedding, final norm, lm_head. Not resharded after forward: backward needs them at once.
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=False, mp_policy=mp)
    if lora:
        for unit in units + [model]:
            unit.set_reduce_scatter_unused_params(True)
    # The training losses are `model.loss` and `model.sequence_logprobs`, not `forward`: give them the root's
    # gather and input casting.
    register_fsdp_forward_method(model, "loss")
    register_fsdp_forward_method(model, "sequence_logprobs")  # the preference objective's (training/dpo.py)
    register_fsdp_forward_method(model, "token_logprobs")  # online RL's (training/grpo.py)
    register_fsdp_forward_method(model, "step")  # its rollouts: decoding under the sharding
    register_fsdp_forward_method(model, "draft_logits")  # EvalCallback's MTP acceptance


def _shard_vision(model: nn.Module, mesh, reshard_after_forward: bool, mp) -> list[nn.Module]:
    """Step-3.7's vision encoder (model/vision.py), when the model has one: each block a unit, then the encoder's
    other parameters (patch embedding, positions, downsamplers); the projector stays with the root. Each is
    called once per forward on every rank, with or without images (an empty batch of views)."""
    from torch.distributed.fsdp import fully_shard

    encoder = getattr(model, "vision_model", None)
    if encoder is None:
        return []
    units = vision_blocks(model) + [encoder]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return units


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The encoder blocks of Step-3.7's vision side (model/vision.py VisionBlock), none without a vision encoder."""
    encoder = getattr(model, "vision_model", None)
    return [] if encoder is None else list(encoder.transformer.resblocks)


def checkpoint_blocks(model: Step35ForCausalLM, mode: ActivationCheckpointing) -> None:
    """Checkpoint every decoder layer and every vision encoder block in `mode`. A block whose inputs and
    parameters ask for no gradient (a frozen encoder) keeps nothing either way."""
    for block in list(model.model.layers) + vision_blocks(model):
        apply_activation_checkpointing(block, mode)


def apply_activation_checkpointing(layer: nn.Module, mode: ActivationCheckpointing) -> None:
    """Recompute the layer's activations in backward: all of them ("full"), or all but the matmul
    outputs ("selective": saves GEMM and attention results and the expert-parallel all-to-all
    outputs, recomputes norms, activations and elementwise ops; the replay communicates nothing).

    The forward is wrapped in place, so parameter names do not change."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing must be 'none', 'selective' or 'full', got {mode!r}")
    if mode == "selective":
        _ignore_profiler_ops_in_selective_checkpointing()
    for module in layer.modules():  # the checkpoint keeps none of the expert rows: no saved-tensor hooks inside it
        if isinstance(module, MoE):
            module.regather_rows = False
    forward = layer.forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if mode == "selective" else None

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    layer.forward = checkpointed


def _ignore_profiler_ops_in_selective_checkpointing() -> None:
    # FSDP2 unshards the expert group inside the block (its modules run there), and its hooks emit
    # record_function markers whose count differs between the forward and the recompute; selective
    # checkpointing then reports a mismatch. The markers carry no data: let SAC pass them through.
    from torch.utils import checkpoint

    profiler = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit._RecordFunction,
        }
    )


@functools.lru_cache(maxsize=1)
def _all_to_all_ops() -> frozenset:
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is None:
        return frozenset()
    return frozenset({functional.all_to_all_single.default, functional.wait_tensor.default})


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
    }
    if hasattr(torch.ops.aten, "_grouped_mm"):
        saved.add(torch.ops.aten._grouped_mm.default)
    # Expert parallelism (expert_parallel.all_to_all): keep the count exchange and the row
    # all-to-alls, so the replay in backward communicates nothing (and reuses the split sizes).
    saved |= _all_to_all_ops()
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
