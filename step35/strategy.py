"""Step35Strategy: Lightning's ModelParallelStrategy with the step35 plan: FSDP2 over all ranks
(or HSDP), routed experts over the same ranks as efsdp x ep, meta-device build in
`configure_model`, per-rank lazy loading, one grad norm across meshes, atomic checkpoints.

    --trainer.strategy step35.strategy.Step35Strategy --trainer.strategy.expert_parallel_size 8

Context parallelism (`context_parallel_size`, cp): every sequence is split over cp consecutive ranks
(step35/parallel/context.py); those ranks are one data-parallel rank and read the same batches.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

import step35.accelerators  # noqa: F401  (registers --trainer.accelerator npu)
from step35 import faults
from step35.parallel import Meshes, ParallelDims, parallelize
from step35.parallel.mesh import data_parallel_place

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_backend(device: torch.device) -> str:
    """hccl on NPU, nccl on CUDA, gloo on CPU."""
    return {"npu": "hccl", "cuda": "nccl"}.get(device.type, "gloo")


def _data_seq_len(module) -> int | None:
    """data.seq_len of the trainer's datamodule, when there is one (checked against the cp split)."""
    trainer = getattr(module, "_trainer", None) if module is not None else None
    return getattr(getattr(trainer, "datamodule", None), "seq_len", None)


def num_routed_experts(module) -> int | None:
    """The routed experts per MoE layer of the module's model, asked through the one call the strategy
    makes on its module: `module.num_routed_experts()` (step35's LightningModule has it). A module
    without that method (or whose model has no MoE layer, None) is not checked against
    expert_parallel_size beyond the world size."""
    ask = getattr(module, "num_routed_experts", None)
    return ask() if callable(ask) else None


class Step35Strategy(ModelParallelStrategy):
    writes_in_background = True  # its save_checkpoint takes RunCheckpoint's BackgroundWriter (async_save)

    def __init__(
        self,
        expert_parallel_size: int = 1,
        replicate_size: int = 1,
        reshard_after_forward: bool = True,
        param_dtype: Literal["bfloat16", "float16", "float32"] | None = None,
        reduce_dtype: Literal["bfloat16", "float32"] = "float32",
        activation_checkpointing: Literal["none", "selective", "full"] = "none",
        compile: bool = False,
        process_group_backend: Literal["auto", "nccl", "hccl", "gloo"] = "auto",
        timeout_minutes: float = 10.0,
        save_distributed_checkpoint: bool = True,
        context_parallel_size: int = 1,
    ):
        """
        Args:
            expert_parallel_size: ranks that split the routed experts (ep); must divide the number of
                experts and the world size. 1 = plain FSDP for the experts too.
            replicate_size: HSDP: replicas of the dense part (each FSDP-sharded over world/replicate ranks).
            reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3);
                False keeps them until backward (faster, more memory).
            param_dtype: FSDP mixed precision: dtype of gathered parameters for compute (e.g. bfloat16);
                None keeps the stored dtype. Use with trainer.precision 32-true.
            reduce_dtype: dtype of gradient reduce-scatter.
            activation_checkpointing: none, selective (recompute all but matmul outputs) or full, per block.
            compile: torch.compile each decoder block.
            process_group_backend: auto picks hccl on NPU, nccl on CUDA, gloo on CPU.
            timeout_minutes: how long a rank may wait without progress (default 10): the watchdog of
                `step35.callbacks.FaultTolerance` ends a rank stuck this long (exit code 76), naming the
                phase it waited in (the process group's own timeout is 30 s longer, a backstop). Must
                exceed the slowest single phase (first-step compile, a checkpoint save or load).
            save_distributed_checkpoint: each rank writes its shards (DCP); False gathers on rank 0.
            context_parallel_size: ranks that split every sequence (cp); must divide the world size,
                and data.seq_len must divide into 2 x cp chunks. 1 = each rank holds whole sequences.
        """
        if timeout_minutes <= 0:
            raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
        backend = None if process_group_backend == "auto" else process_group_backend
        # The backend's own collective timeout is a backstop 30 s behind the watchdog (FaultTolerance),
        # which names the phase; subgroups of the device meshes keep torch's default timeout anyway.
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=backend,
            timeout=timedelta(minutes=timeout_minutes, seconds=30),
        )
        if activation_checkpointing not in ("none", "selective", "full"):
            raise ValueError(
                f"activation_checkpointing must be none, selective or full, got {activation_checkpointing!r}"
            )
        self.expert_parallel_size = expert_parallel_size
        self.replicate_size = replicate_size
        self.context_parallel_size = context_parallel_size
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = _DTYPES[param_dtype] if param_dtype else None
        self.reduce_dtype = _DTYPES[reduce_dtype] if reduce_dtype else None
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.meshes: Meshes | None = None
        self.timeout_minutes = timeout_minutes
        self._failed = False  # set by on_exception: no collective may run after a failure

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or default_backend(self.root_device)

    def setup_environment(self) -> None:
        """Check the parallel sizes, start the process group, build the meshes. The sizes are checked
        before the process group exists: a bad size must fail on every rank at once, never leave some
        ranks waiting in a collective. That is why the strategy asks the module for its expert count
        (`num_routed_experts` above) here rather than being told later: no hook of the module runs
        before this one. The dense mesh is this strategy's `device_mesh`; the module's `device_mesh`
        stays None (nothing in Lightning reads it, and step35's module shards through
        `parallelize_model`, which gets both meshes)."""
        # A rank whose launcher dies ends itself (faults.watch_launcher), from here on: the process
        # group init below can wait for peers, and the model build and checkpoint load take long.
        faults.begin_run()
        faults.watch_launcher()  # (the rank is known after _setup_distributed)
        world = self.num_nodes * self.num_processes
        dims = ParallelDims(
            world,
            self.expert_parallel_size,
            self.replicate_size,
            num_experts=num_routed_experts(self.lightning_module),
            context_parallel_size=self.context_parallel_size,
        )
        seq_len = _data_seq_len(self.lightning_module)
        if seq_len is not None:
            dims.check_seq_len(seq_len)
        self._init_process_group_of_restart()
        self._setup_distributed()  # (Lightning's init is skipped when the group exists)
        faults.watch_launcher(self.global_rank)
        assert dims.world_size == self.world_size, (dims.world_size, self.world_size)
        self.meshes = dims.build(self.root_device.type)
        self._device_mesh = self.meshes.dense  # the strategy's own (ModelParallelStrategy.device_mesh)

    def _init_process_group_of_restart(self) -> None:
        """After a torchrun restart (--max-restarts), init the process group on a store prefixed by
        the attempt. torch 2.13's env:// init reuses the torchrun agent's store as it is, assuming a
        fresh one per attempt, but the agent keeps it: the subgroups of the device meshes then read the
        previous attempt's addresses and fail ("Gloo connectFullMesh failed ... Connection refused",
        reproduced with plain torch). TORCHELASTIC_RESTART_COUNT is the same on every rank of a
        single-node job, and on all nodes when every node's ranks failed (the usual case: a
        collective fails when a peer dies)."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
            return
        env = self.cluster_environment
        store = dist.TCPStore(env.main_address, env.main_port, is_master=False, timeout=self._timeout)
        device = self.root_device
        dist.init_process_group(
            self._get_process_group_backend(),
            store=dist.PrefixStore(f"step35/attempt_{attempt}", store),
            rank=env.global_rank(),
            world_size=env.world_size(),
            timeout=self._timeout,
            device_id=device if device.type != "cpu" else None,
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # dp2ep: every rank is a data-parallel rank, except that the cp consecutive ranks of a
        # context-parallel group share one (each reads the whole window and keeps its share).
        rank, replicas = data_parallel_place(self.global_rank, self.world_size, self.context_parallel_size)
        return {"num_replicas": replicas, "rank": rank}

    @property
    def data_parallel_group(self):
        """The process group of the ranks that read different data and whose gradients are averaged
        (None: the world). The loss over the global batch sums its trained-token counts over it: every
        rank (dp2ep), but only one rank per context-parallel group, whose ranks share their data (and
        whose loss sums are already those of the whole rows)."""
        return self.meshes.data_parallel_group() if self.meshes is not None else None

    def parallelize_model(self, model) -> None:
        """Called by the LightningModule's configure_model on the meta-device model."""
        assert self.meshes is not None, "parallelize_model runs after setup_environment"
        parallelize(
            model,
            self.meshes,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
        )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write into a temporary sibling, hash (each rank its own shards), manifest last, then publish:
        a kill at any moment leaves the previous checkpoint or the new one, never a mix. A failed
        sharded save (a full disk: OSError ENOSPC naming the path) fails on every rank together, and
        its partial folder is removed at once. `storage_options`: a BackgroundWriter (RunCheckpoint's
        async_save) stages the state in host memory and writes it on its thread, the same files."""
        from step35.checkpoint.publish import partial_path
        from step35.checkpoint.training.background import writer_of
        from step35.checkpoint.training.keys import GLOBAL_STEP, manifest_extra
        from step35.checkpoint.training.trainer_io import save_file, save_file_in_background, save_sharded

        writer = writer_of(storage_options, type(self).__name__)
        path = Path(self.broadcast(str(filepath)))
        if not self._save_distributed_checkpoint:  # full state dicts, gathered on rank 0 by Lightning
            if self.global_rank == 0:
                if writer is None or not save_file_in_background(writer, checkpoint, path):
                    save_file(checkpoint, path)
            self.barrier()
            return
        extra = manifest_extra(checkpoint, "dcp", self.world_size)
        optimizers = checkpoint.pop("optimizer_states", [])
        state = {"state_dict": checkpoint.pop("state_dict"), **{f"optimizer_{i}": s for i, s in enumerate(optimizers)}}
        tmp = Path(self.broadcast(str(partial_path(path))))
        if self.global_rank == 0:
            tmp.mkdir(parents=True)
        self.barrier()
        rank, world = self.global_rank, self.world_size
        if writer is not None:
            staged = writer.stage({"state": state, "meta": checkpoint})
            if self.reduce_boolean_decision(staged is not None, all=True):  # every rank staged, or none goes on
                step = checkpoint.get(GLOBAL_STEP, 0)
                state, meta, group = staged["state"], staged["meta"], writer.group
                writer.start(path, step, lambda: save_sharded(state, meta, tmp, path, extra, rank, world, group))
                return
        save_sharded(state, checkpoint, tmp, path, extra, rank, world)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the manifest (checksums split over the ranks), read with no unpickling of code, and
        refuse NaN/Inf weights; every rank raises the same one-line error naming the file or tensor.
        A sharded folder is read by DCP (any world size); a single file (full state, e.g. from a
        one-process run) is spread over this run's ranks, each keeping its slice."""
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        from step35.checkpoint.errors import raise_together
        from step35.checkpoint.integrity import verify_on_all_ranks
        from step35.checkpoint.safe_load import lightning_types, load_torch
        from step35.checkpoint.training import keys
        from step35.checkpoint.training.trainer_io import (
            check_loadable,
            finite_modules,
            load_full_optimizers,
            load_sharded,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        raise_together(lambda: check_loadable(path))
        verify_on_all_ranks(path)
        assert self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        if path.is_dir():
            meta = raise_together(lambda: load_sharded(path, self.model, self.optimizers, strict))
        else:
            raise_together(lambda: load_torch(path, mmap=True))  # refuses a crafted file before Lightning reads it
            with lightning_types():  # Lightning's model loader, with weights_only=True and our allowlist
                meta = _load_checkpoint(path, {keys.STATE_DICT: self.model}, strict=strict, weights_only=True)
            # The optimizers ourselves: Lightning re-keys a full optimizer state by module order,
            # wrong for one saved by a one-process run (optimizer order, grouped by weight decay).
            load_full_optimizers(meta, path, self.model, self.optimizers, strict)
        raise_together(lambda: finite_modules(self.model, self.optimizers, path))
        return meta

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            from step35.checkpoint.training.trainer_io import remove

            remove(filepath)

    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this on every rank that raised, before teardown. A failure is printed with
        the rank at once and the process groups are aborted: the other ranks see the failure (a
        closed connection, an aborted communicator, or torchrun ending them) instead of waiting in
        a collective this rank will never join. A pre-emption stop (`faults.Preempted`, raised by
        all ranks after the same step) is not a failure."""
        super().on_exception(exception)
        if isinstance(exception, faults.Preempted):
            return
        self._failed = True
        faults.check_launcher()  # a dead launcher (exit 77) is the cause of a peer's closed connection
        faults.mark_failure()
        if not faults.was_reported(exception):  # (FaultTolerance.on_exception, called first, may have)
            faults.report_failure(exception, self.global_rank)
        faults.abort_process_groups()

    def teardown(self) -> None:
        # On success only: a barrier before the process group goes (without it gloo ranks can abort
        # at exit, "terminate called without an active exception", after all work succeeded). After a
        # failure the other ranks are elsewhere (or gone): a barrier would wait for them forever.
        if not self._failed:
            faults.stop_watching_launcher()  # a launcher that is rank 0 (Lightning's) may now end first
        if not self._failed and dist.is_available() and dist.is_initialized():
            dist.barrier()
        super().teardown()
        if dist.is_available() and dist.is_initialized() and os.environ.get("STEP35_KEEP_PROCESS_GROUP") != "1":
            dist.destroy_process_group()
