"""The LightningModule: the Lightning side of training Step-3.5-Flash. It builds the model in
`configure_model` through the one training setup (step35/training/setup.py: meta device, LoRA, sharded by
the strategy, frozen, filled from an HF checkpoint or the init), backpropagates what the objective
(step35/training/objective.py) says a micro-batch's loss is, turns the step's summed gradient into the
one of the step's mean before the optimizer (step35/training/optimizer.py) steps, checks and records
what a checkpoint holds, and balances expert load with the aux-loss-free router-bias update after
each optimizer step."""

from __future__ import annotations

import functools
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from step35.balancing import ExpertCounter, update_router_bias
from step35.checkpoint.hf import lora_base
from step35.checkpoint.training import keys, run_tokenizer
from step35.checkpoint.training.trainer_io import check_lora_state, frozen_state_keys
from step35.config import Step35Config
from step35.loggers import SampleTables
from step35.model import Step35ForCausalLM
from step35.model.lora import LoraConfig
from step35.parallel.collectives import any_rank, distributed
from step35.parallel.grad import clip_grad_norm_, global_grad_norm
from step35.run import SavedRun, check_resume, checkpoint_to_load
from step35.training.objective import (
    OPTION_FIELDS,
    ObjectiveContext,
    ObjectiveInputs,
    add_micro_batch,
    objective_class,
)
from step35.training.optimizer import OptimizerOptions, apply_resumed_settings, build_optimizer, lr_schedule
from step35.training.options import check_rules
from step35.training.reference import FROZEN_COPY, build_reference_copy
from step35.training.setup import TrainedModel, model_config_of, training_model
from step35.training.vision import VisionOptions, check_image_data, vision_config_of


def _ignore(*args) -> None:
    return None


class Step35LightningModule(pl.LightningModule):
    """Step-3.5-Flash trained by Lightning (this module's docstring).

    Args:
        config: model shape: a preset (`tiny`, `flash-196b`) or a config.json / folder holding one.
            Ignored when `checkpoint` is given (the checkpoint's own config.json is used).
        checkpoint: an HF checkpoint folder (config.json + safetensors) to start from; each rank
            reads only the slices it holds. None: the deterministic from-scratch init.
        config_overrides: config.json fields to change for this run, validated like the file, e.g.
            `{rope_scaling: null}` (no llama3 scaling, as StepFun's own trainer at 4K) or
            `{sliding_window: 513}` (the 513-key window of Steptron/Megatron instead of HF's 512).
            Shape fields that the checkpoint fixes make loading fail with the tensor named.
        num_mtp_layers: MTP layers to build (default: all of the config's; 0 builds none).
        mtp_loss_weight: weight of the mean MTP loss added to the main loss; 0 skips MTP compute.
        init_seed: seed of the from-scratch init (same model on any world size).
        lr: peak learning rate, reached after `warmup_steps` of linear warmup.
        min_lr_ratio: cosine decay ends at lr * min_lr_ratio.
        warmup_steps: linear warmup steps (optimizer steps).
        decay_steps: steps until the end of the cosine decay (default: trainer.max_steps of the
            run that started training: a resumed run keeps that length whatever its own max_steps,
            and stays at lr * min_lr_ratio past it; set decay_steps to choose a new length).
        optimizer: `adamw` (default), `muon` (Muon on the matrices, AdamW on the rest; training/muon.py) or the
            class path of a torch.optim.Optimizer (e.g. torch.optim.SGD), built with lr, weight_decay and
            `optimizer_options` (step35/training/optimizer.py).
        optimizer_options: the optimizer's own keyword arguments, e.g. `{momentum: 0.9}` for SGD,
            `{amsgrad: true}` for AdamW (lr, betas, eps and weight_decay are the options below) or
            `{preset: stepfun}` / `{ns_steps: 6, coefficients: polar_express}` for muon (MuonOptions).
        weight_decay: decoupled weight decay (AdamW); never applied to norms.
        betas: AdamW betas.
        eps: AdamW epsilon.
        loss_chunk_size: tokens per chunk of the cross-entropy (bounds the logits in memory).
        moe_bias_update_rate: aux-loss-free load balancing: after each optimizer step every MoE
            layer's router bias (used only to choose experts) moves by
            rate * sign(mean load - load of the expert), from the step's token counts summed over
            all ranks (one all_reduce per step for all layers). 0 (default, as released): the
            biases never change and no collective runs. DeepSeek-V3 used 1e-3.
        moe_aux_loss_coef: coefficient of the sequence-level balance loss (per sequence
            sum_e f_e * P_e, mean over sequences and MoE layers, each sequence weighted by its share
            of trained labels; see model.moe.sequence_balance_loss) added to the training loss and
            logged as train/aux_loss. 0 (default): not computed.
        lora: LoRA fine-tuning (docs/lora.md): adapters on the named targets, the base frozen in
            its own dtype with no gradients or optimizer state; e.g. `--model.lora.rank 16`.
            None (default): every parameter trains, as without this option.
        objective: `lm` (default: next-token loss), `dpo` (preference pairs, training/dpo.py: the
            reference is the start model: with LoRA the policy with its adapters off, else a frozen
            sharded copy; mtp_loss_weight and moe_aux_loss_coef must be 0) or the class path of an
            Objective (training/objective.py).
        dpo: DPO options (training/dpo.py DpoOptions): beta, loss_type (sigmoid | ipo | hinge),
            label_smoothing, sft_weight, reference_free, gamma; e.g. `--model.dpo.beta 0.2`.
        objective_options: the options of an objective that reads them here (its `options_field`), as
            model.dpo is DPO's.
        rl: online RL options of `model.objective: grpo` (training/grpo.py GrpoOptions): reward_funcs,
            num_generations, temperature, max_new_tokens, loss_type, routing_replay, ...; e.g.
            `--model.rl.num_generations 8`.
        vision: Step-3.7's vision side (training/vision.py): `{}` or `{train: false}` builds the vision encoder and
            projector beside the language model, loaded from the checkpoint (or initialised), frozen; `{train:
            true}` trains them. Needed for `data.images`. None (default): the language model alone (a Step-3.7
            folder's vision tensors are carried to the export unchanged).
    """

    def __init__(
        self,
        config: str = "tiny",
        checkpoint: str | None = None,
        config_overrides: dict[str, Any] | None = None,
        num_mtp_layers: int | None = None,
        mtp_loss_weight: float = 0.0,
        init_seed: int = 0,
        optimizer: str = "adamw",
        optimizer_options: dict[str, Any] | None = None,
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        loss_chunk_size: int = 1024,
        moe_bias_update_rate: float = 0.0,
        moe_aux_loss_coef: float = 0.0,
        lora: LoraConfig | None = None,
        objective: str = "lm",
        dpo: dict[str, Any] | None = None,
        objective_options: dict[str, Any] | None = None,
        rl: dict[str, Any] | None = None,
        vision: VisionOptions | None = None,
    ):
        super().__init__()
        lora_config = LoraConfig.of(lora)
        # Saved as a plain dict: checkpoints are read with weights_only=True, which refuses dataclasses.
        lora = asdict(lora_config) if lora_config is not None else None
        self.vision_options = VisionOptions.of(vision)
        vision = self.vision_options.as_dict() if self.vision_options is not None else None
        self.save_hyperparameters()
        self.model: Step35ForCausalLM | None = None
        self.optimization = OptimizerOptions.of(dict(self.hparams))  # checked: model.lr=-1 is refused here
        objective_inputs = ObjectiveInputs(
            mtp_loss_weight,
            moe_aux_loss_coef,
            loss_chunk_size,
            lora_config,
            {key: self.hparams[key] for key in OPTION_FIELDS},
        )
        kind = objective_class(objective)
        self.objective = kind.build(objective_inputs)
        self.objective_needs = kind.needs(objective_inputs)  # what the objective needs of the model (its reference)
        check_rules({"moe_bias_update_rate": (moe_bias_update_rate, lambda v: v >= 0, ">= 0")})
        self._describe_model(config, checkpoint, config_overrides, num_mtp_layers, mtp_loss_weight, lora_config)
        # True once the checkpoint to resume was checked against this module's options (the CLI does
        # it before the Trainer exists); otherwise on_load_checkpoint checks what it is given.
        self.resume_checked = False
        self._restored = False  # a checkpoint was loaded into this module (on_load_checkpoint ran)
        # Reads the MoE layers' token counts (shared with the ExpertLoadMonitor callback); set in configure_model.
        self.expert_counter: ExpertCounter | None = None
        self._step_sums: torch.Tensor | None = None  # the objective's sums over the current optimizer step

    def _describe_model(self, config, checkpoint, config_overrides, num_mtp_layers, mtp_loss_weight, lora) -> None:
        """The model config and what of the model trains, checked now rather than after minutes of building."""
        self.model_config: Step35Config = model_config_of(config, checkpoint, config_overrides)
        rate = self.hparams.moe_bias_update_rate
        if rate > 0 and not self.model_config.use_moe_router_bias:
            raise ValueError(
                f"model.moe_bias_update_rate={rate} needs a router bias, but the model config has use_moe_router_bias=false"
            )
        options = self.vision_options
        if options is not None and options.train and lora is not None:
            raise ValueError(
                "model.vision.train: true with model.lora: under LoRA the vision side trains through adapters; name"
                " 'vision' and/or 'vision_projector' in model.lora.targets and leave model.vision.train false"
            )
        vision = vision_config_of(options, config, checkpoint)
        train_vision = options is not None and options.train
        self.trained = TrainedModel(self.model_config, num_mtp_layers, mtp_loss_weight, lora, vision, train_vision)
        self.trained.check(checkpoint)  # the shape against the folder's tensors, a LoRA rank: now, not at setup
        self.lora = lora
        if self.lora is not None:
            # Its checkpoints leave the frozen base out: loaded non-strictly, the keys checked in on_load_checkpoint.
            self.strict_loading = False

    # ------------------------------------------------------------------------------- building
    def num_routed_experts(self) -> int | None:
        """Routed experts per MoE layer (None without MoE layers). Step35Strategy asks this in its
        setup_environment, before any other hook runs, to check expert_parallel_size."""
        return self.model_config.moe_num_experts if self.model_config.use_moe else None

    def setup(self, stage: str) -> None:
        precision = str(getattr(self.trainer, "precision", ""))
        if self.lora is not None and precision.endswith("-true") and precision != "32-true":
            raise ValueError(
                f"model.lora with trainer.precision={precision}: that casts the fp32 adapters too; "
                f"use trainer.precision 32-true and model.lora.base_dtype=bfloat16 (the frozen base "
                f"and the compute in bf16, the adapters fp32)"
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        limit = self.model_config.max_position_embeddings
        if seq_len is not None and seq_len > limit:
            raise ValueError(
                f"data.seq_len={seq_len} is larger than the model supports "
                f"(max_position_embeddings={limit} in the model config)"
            )
        if hasattr(datamodule, "check_model_vocab"):
            datamodule.check_model_vocab(self.model_config.vocab_size)
        check_image_data(datamodule, self.trained.vision)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if getattr(tokenizer, "path", None) is not None:  # refused here (a link out), not at the first save
            run_tokenizer.folder_files(tokenizer.path)
        if self.objective_needs.batch_repeats > 1 and hasattr(datamodule, "repeat_batches"):
            datamodule.repeat_batches(self.objective_needs.batch_repeats)
        if self.objective_needs.generates is not None:
            self.objective.bind(self._objective_context(datamodule, tokenizer))

    def _objective_context(self, datamodule, tokenizer) -> ObjectiveContext:
        """What an objective that generates needs of the run (training/objective.py ObjectiveContext)."""
        trainer = self.trainer
        samples = Path(trainer.default_root_dir) / "rl_samples"  # the run folder under the CLI
        stop_ids = datamodule.generation_stop_ids() if hasattr(datamodule, "generation_stop_ids") else set()
        return ObjectiveContext(
            stop_ids=stop_ids,
            decode=tokenizer.decode if tokenizer is not None else ObjectiveContext.decode,
            step=lambda: trainer.global_step,
            keep_going=functools.partial(any_rank, device=trainer.strategy.root_device),
            sum_over_ranks=functools.partial(self._sum_over_data_parallel, device=trainer.strategy.root_device),
            write_samples=SampleTables(samples, trainer) if trainer.is_global_zero else _ignore,
        )

    def _sum_over_data_parallel(self, values: torch.Tensor, device: torch.device) -> torch.Tensor:
        if not (distributed() and self.trainer.world_size > 1):
            return values
        summed = values.to(device)
        torch.distributed.all_reduce(summed, group=getattr(self.trainer.strategy, "data_parallel_group", None))
        return summed.to(values.device)

    def _check_resume(self, saved: SavedRun) -> None:
        # A different model shape is refused with the fields listed; options this run changes are said
        # (step35/run/resume.py has the rule).
        notes = check_resume(saved, self.model_config, dict(self.hparams))
        self.resume_checked = True
        if notes and self.trainer.is_global_zero:
            print(
                f"step35: resuming {saved.path} with these settings changed by this run's options (the "
                f"checkpoint's are ignored): " + "; ".join(notes),
                flush=True,
            )

    def configure_model(self) -> None:
        if self.model is not None:
            return
        strategy = self.trainer.strategy
        resuming = checkpoint_to_load(self.trainer) is not None  # weights come from the Lightning checkpoint
        # ... except a LoRA run's frozen base, which its checkpoints do not hold: read again from its folder.
        checkpoint = None if resuming and self.lora is None else self.hparams.checkpoint
        # Step35Strategy shards (EP, checkpointing, compile, FSDP2); another strategy leaves it whole.
        self.model = training_model(
            self.trained,
            shard=getattr(strategy, "parallelize_model", None),
            device=strategy.root_device,
            checkpoint=checkpoint,
            seed=self.hparams.init_seed,
        )
        if not self.objective_needs.trains_mtp and self.trained.built_mtp_layers and self.trainer.is_global_zero:
            print(
                f"step35: model.objective {self.objective.name} trains the main model only; the MTP layer(s) "
                f"({self.trained.built_mtp_layers}) are kept as loaded, frozen (model.num_mtp_layers 0 leaves them out)",
                flush=True,
            )
        if self.objective_needs.reference == FROZEN_COPY:  # the run's start, also on a resume (checkpoint or init)
            self.objective.set_reference_model(
                build_reference_copy(
                    self.model_config,
                    shard=getattr(strategy, "parallelize_model", None),
                    param_dtype=getattr(strategy, "param_dtype", None),
                    device=strategy.root_device,
                    checkpoint=self.hparams.checkpoint,
                    seed=self.hparams.init_seed,
                )
            )
        self.expert_counter = ExpertCounter(self.model, reduce_every_step=self.hparams.moe_bias_update_rate > 0)

    def on_train_start(self) -> None:
        if self._restored:
            # The restore brought back the checkpoint's lr, betas, eps and weight decay in the
            # optimizer and its lr in the schedule: the run's own options win (step35/run/resume.py).
            schedulers = self.trainer.lr_scheduler_configs
            apply_resumed_settings(
                self.trainer.optimizers[0],
                self.optimization.group_settings(),
                schedulers[0].scheduler if schedulers else None,
            )

    @functools.cached_property
    def _lora_base(self) -> dict:
        """The identity of this LoRA run's base (checkpoint/hf/lora_base.py), computed once."""
        return lora_base.base_identity(self.hparams.checkpoint, self.hparams.init_seed)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._restored = True
        if self.lora is not None:
            where = checkpoint_to_load(self.trainer) or "the checkpoint"
            lora_base.check_base(checkpoint.get(keys.LORA_BASE), self._lora_base, where)
            if keys.STATE_DICT in checkpoint and keys.LORA_BASE in checkpoint:  # a file: loaded non-strictly
                check_lora_state(checkpoint[keys.STATE_DICT], self, where)
        # Without the CLI (`trainer.fit(ckpt_path=...)`) nobody checked the checkpoint yet: for a
        # single-file checkpoint this is still before the weights are loaded (a sharded one has loaded
        # them and failed on a shape).
        if not self.resume_checked:
            self._check_resume(
                SavedRun(
                    checkpoint_to_load(self.trainer) or Path("the checkpoint"),
                    dict(checkpoint.get(keys.HYPER_PARAMETERS) or {}),
                    checkpoint.get(keys.MODEL_CONFIG),
                )
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The model's own config.json travels with every checkpoint: `step35 export` needs no other source.
        checkpoint[keys.MODEL_CONFIG] = self.model_config.to_dict()
        if self.lora is not None:  # adapters, full targets and buffers; the frozen base only by its identity
            frozen = frozen_state_keys(self)
            checkpoint[keys.STATE_DICT] = {k: v for k, v in checkpoint[keys.STATE_DICT].items() if k not in frozen}
            checkpoint[keys.LORA_BASE] = self._lora_base
        # So does the tokenizer the data was encoded with (files, not a path: caches get cleaned).
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        if getattr(tokenizer, "path", None) is not None:
            checkpoint[keys.TOKENIZER] = run_tokenizer.record(tokenizer.path, tokenizer.eos_token_id)

    # ------------------------------------------------------------------------------- steps
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        micro_batch = self.objective.micro_batch(self.model, batch, training=True)
        self._step_sums = add_micro_batch(self._step_sums, micro_batch)
        self.log("train/tokens", float(micro_batch.slots), reduce_fx="sum")
        return micro_batch.loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Turn the step's summed gradient into the gradient of the objective's step mean (for the language
        model: the mean over every trained token of all micro-batches and data-parallel ranks; see
        StepResult.gradient_factor) and log the step's values.

        Lightning calls this after every callback's on_before_optimizer_step (DivergenceGuard may
        have dropped the gradients already) and before gradient clipping, so the clipped norm is
        the norm of the mean gradient."""
        sums, self._step_sums = self._step_sums, None
        if sums is None:
            return
        group = getattr(self.trainer.strategy, "data_parallel_group", None)
        shared = distributed() and self.trainer.world_size > 1  # a single-device strategy averages nothing
        ranks = torch.distributed.get_world_size(group) if shared else 1
        step = self.objective.reduce(sums, group, over_ranks=shared)
        if step.trained == 0:
            # Nothing to average over: no update at all (as DivergenceGuard's skip: AdamW then leaves
            # weights, moments and step count alone, clipping sees no gradient, router counts dropped).
            optimizer.zero_grad(set_to_none=True)
            rank_zero_warn(
                f"step {self.trainer.global_step}: every label of the step is masked (-100); "
                "no token to train on, the optimizer step is skipped"
            )
        else:
            factor = step.gradient_factor(self.trainer.accumulate_grad_batches, ranks)
            if factor is not None:
                for p in (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None):
                    p.grad.mul_(factor)  # one by one: a foreach op cannot mix the dense and expert meshes' DTensors
        for name, value in step.logged.items():  # values of the whole step, the same on every rank: no sync_dist
            self.log(name, value, prog_bar=name == "train/loss")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # Each value weighted by its weight (the LM: the batch's trained tokens; DPO: its pairs), summed over
        # batches and ranks as the values: val/loss is the mean over every trained token (pair) of the set.
        for name, (value, weight) in self.objective.validation(self.model, batch).items():
            self.log(name, value, sync_dist=True, prog_bar=name == "val/loss", batch_size=weight)

    def on_validation_epoch_end(self) -> None:
        for name, value in self.objective.validation_end(self.trainer.callback_metrics).items():
            self.log(name, value, sync_dist=False)  # from values already reduced over the set and the ranks

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # One global norm over dense and expert parameters, whatever meshes they live on.
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"trainer.gradient_clip_algorithm={gradient_clip_algorithm!r}: only 'norm' is supported")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(p.grad is None for p in params):
            return  # a skipped step (DivergenceGuard): nothing to clip, no norm to log
        if gradient_clip_val:
            norm = clip_grad_norm_(params, float(gradient_clip_val))
        else:
            norm = global_grad_norm(params)
        self.log("train/grad_norm", norm)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # After the step, the router counts hold every micro-batch of it. A step that applied no
        # gradient (skipped by DivergenceGuard; the same on every rank) learned nothing: its counts
        # are dropped and the biases stay.
        applied = any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
        counts = self.expert_counter.end_step(keep=applied) if self.expert_counter is not None else None
        if counts is not None and self.hparams.moe_bias_update_rate > 0:
            update_router_bias(self.expert_counter.layers, counts, self.hparams.moe_bias_update_rate)

    # ------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.optimization)
        scheduler = lr_schedule(optimizer, self.optimization, self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}
