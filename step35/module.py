"""The LightningModule: builds Step-3.5-Flash in `configure_model` (meta device, then sharded by the
strategy when it can, then filled from an HF checkpoint or the deterministic init), computes the
next-token loss (chunked cross-entropy) plus the MTP loss and the optional sequence balance loss as
the mean over every trained token of the optimizer step (all micro-batches and data-parallel ranks;
`micro_batch_loss`, `on_before_optimizer_step`, docs/architecture.md §2.11), owns the optimizer and LR schedule, and balances expert load with the aux-loss-free router-bias
update after each optimizer step."""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from step35.balancing import ExpertCounter, update_router_bias
from step35.checkpoint import lora_base, run_tokenizer
from step35.checkpoint.hf import check_config_fits
from step35.checkpoint.materialize import materialize
from step35.checkpoint.trainer_io import frozen_state_keys
from step35.config import ConfigError, Step35Config, load_config
from step35.model import LossOutput, Step35ForCausalLM, build_model
from step35.model.lora import LoraConfig, apply_lora, check_sizes
from step35.parallel.collectives import distributed
from step35.parallel.grad import clip_grad_norm_, global_grad_norm
from step35.run import SavedRun, apply_optimizer_settings, check_resume, checkpoint_to_load
from step35.schedule import WarmupCosineLR


class Step35LightningModule(pl.LightningModule):
    def __init__(
        self,
        config: str = "tiny",
        checkpoint: str | None = None,
        config_overrides: dict[str, Any] | None = None,
        num_mtp_layers: int | None = None,
        mtp_loss_weight: float = 0.0,
        init_seed: int = 0,
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
    ):
        """
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
            weight_decay: AdamW decoupled weight decay; never applied to norms.
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
        """
        super().__init__()
        lora_config = LoraConfig.of(lora)
        # Saved as a plain dict: checkpoints are read with weights_only=True, which refuses dataclasses.
        lora = asdict(lora_config) if lora_config is not None else None
        self.save_hyperparameters()
        self.model: Step35ForCausalLM | None = None
        _check_options(lr=lr, min_lr_ratio=min_lr_ratio, warmup_steps=warmup_steps, decay_steps=decay_steps,
                       weight_decay=weight_decay, betas=betas, eps=eps, loss_chunk_size=loss_chunk_size,
                       mtp_loss_weight=mtp_loss_weight, moe_bias_update_rate=moe_bias_update_rate,
                       moe_aux_loss_coef=moe_aux_loss_coef)
        source = ("model.checkpoint", checkpoint) if checkpoint else ("model.config", config)
        try:
            self.model_config: Step35Config = load_config(source[1])
        except ConfigError as e:
            raise ConfigError(f"{source[0]}={source[1]}: {e}") from None
        if config_overrides:
            try:
                self.model_config = self.model_config.with_overrides(config_overrides)
            except ConfigError as e:
                raise ConfigError(f"model.config_overrides: {e}") from None
        available = self.model_config.num_nextn_predict_layers
        if num_mtp_layers is not None and not 0 <= num_mtp_layers <= available:
            raise ValueError(f"model.num_mtp_layers={num_mtp_layers}: must be between 0 and the config's "
                             f"num_nextn_predict_layers={available}")
        if checkpoint:  # its shape against the folder's tensors now, not after minutes of building
            check_config_fits(self.model_config, checkpoint, num_mtp_layers)
        built = available if num_mtp_layers is None else num_mtp_layers
        if mtp_loss_weight > 0 and built == 0:
            raise ValueError(f"model.mtp_loss_weight={mtp_loss_weight}: no MTP layer is built (num_mtp_layers="
                             f"{num_mtp_layers}, config num_nextn_predict_layers={available}); set it to 0")
        if moe_bias_update_rate > 0 and not self.model_config.use_moe_router_bias:
            raise ValueError(f"model.moe_bias_update_rate={moe_bias_update_rate} needs a router bias, but the "
                             "model config has use_moe_router_bias=false")
        self.lora = lora_config
        if self.lora is not None:
            # Its checkpoints leave the frozen base out: loaded non-strictly, the keys checked in on_load_checkpoint.
            self.strict_loading = False
            # The options and a too-large rank: now, not at setup.
            check_sizes(self.lora, self.model_config, num_mtp_layers, mtp_loss_weight)
        # True once the checkpoint to resume was checked against this module's options (the CLI does
        # it before the Trainer exists); otherwise on_load_checkpoint checks what it is given.
        self.resume_checked = False
        self._restored = False  # a checkpoint was loaded into this module (on_load_checkpoint ran)
        # Reads the MoE layers' token counts (shared with the ExpertLoadMonitor callback); set in configure_model.
        self.expert_counter: ExpertCounter | None = None
        self._step_totals: StepTotals | None = None  # sums of the micro-batches of the current optimizer step

    # ------------------------------------------------------------------------------- building
    def num_routed_experts(self) -> int | None:
        """Routed experts per MoE layer (None without MoE layers). Step35Strategy asks this in its
        setup_environment, before any other hook runs, to check expert_parallel_size."""
        return self.model_config.moe_num_experts if self.model_config.use_moe else None

    def setup(self, stage: str) -> None:
        precision = str(getattr(self.trainer, "precision", ""))
        if self.lora is not None and precision.endswith("-true") and precision != "32-true":
            raise ValueError(f"model.lora with trainer.precision={precision}: that casts the fp32 adapters too; "
                             f"use trainer.precision 32-true and model.lora.base_dtype=bfloat16 (the frozen base "
                             f"and the compute in bf16, the adapters fp32)")
        datamodule = getattr(self.trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        limit = self.model_config.max_position_embeddings
        if seq_len is not None and seq_len > limit:
            raise ValueError(f"data.seq_len={seq_len} is larger than the model supports "
                             f"(max_position_embeddings={limit} in the model config)")
        if hasattr(datamodule, "check_model_vocab"):
            datamodule.check_model_vocab(self.model_config.vocab_size)

    def _check_resume(self, saved: SavedRun) -> None:
        # A different model shape is refused with the fields listed; options this run changes are said
        # (step35/run/resume.py has the rule).
        notes = check_resume(saved, self.model_config, dict(self.hparams))
        self.resume_checked = True
        if notes and self.trainer.is_global_zero:
            print(f"step35: resuming {saved.path} with these settings changed by this run's options (the "
                  f"checkpoint's are ignored): " + "; ".join(notes), flush=True)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = build_model(self.model_config, self.hparams.num_mtp_layers)
        if self.lora is not None:
            apply_lora(model, self.lora)  # before sharding: FSDP2 sees the adapters and the frozen base
        strategy = self.trainer.strategy
        if hasattr(strategy, "parallelize_model"):  # Step35Strategy: EP, checkpointing, compile, FSDP2
            strategy.parallelize_model(model)
        resuming = checkpoint_to_load(self.trainer) is not None  # weights come from the Lightning checkpoint
        # ... except a LoRA run's frozen base, which its checkpoints do not hold: read again from its folder.
        checkpoint = None if resuming and self.lora is None else self.hparams.checkpoint
        materialize(model, strategy.root_device, checkpoint=checkpoint, seed=self.hparams.init_seed)
        if self.hparams.mtp_loss_weight == 0:
            # MTP layers are kept (and exported) but get no gradient: freeze them, so the optimizer
            # holds no state for them (a sharded optimizer checkpoint would otherwise lack their
            # entries and refuse to resume).
            for layer in model.model.mtp_layers:
                layer.requires_grad_(False)
        self.model = model
        self.expert_counter = ExpertCounter(model, reduce_every_step=self.hparams.moe_bias_update_rate > 0)

    def on_train_start(self) -> None:
        if self._restored:
            # The restore brought back the checkpoint's lr, betas, eps and weight decay in the
            # optimizer and its lr in the schedule: the run's own options win (step35/run/resume.py).
            schedulers = self.trainer.lr_scheduler_configs
            apply_optimizer_settings(self.trainer.optimizers[0], self._group_settings(),
                                     schedulers[0].scheduler if schedulers else None)

    @functools.cached_property
    def _lora_base(self) -> dict:
        """The identity of this LoRA run's base (checkpoint/lora_base.py), computed once."""
        return lora_base.base_identity(self.hparams.checkpoint, self.hparams.init_seed)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._restored = True
        if self.lora is not None:
            where = checkpoint_to_load(self.trainer) or "the checkpoint"
            lora_base.check_base(checkpoint.get(lora_base.RECORD_KEY), self._lora_base, where)
            if "state_dict" in checkpoint and lora_base.RECORD_KEY in checkpoint:  # a file: loaded non-strictly
                _check_lora_state(checkpoint["state_dict"], self, where)
        # Without the CLI (`trainer.fit(ckpt_path=...)`) nobody checked the checkpoint yet: for a
        # single-file checkpoint this is still before the weights are loaded (a sharded one has loaded
        # them and failed on a shape).
        if not self.resume_checked:
            self._check_resume(SavedRun(checkpoint_to_load(self.trainer) or Path("the checkpoint"),
                                        dict(checkpoint.get("hyper_parameters") or {}), checkpoint.get("step35_config")))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The model's own config.json travels with every checkpoint: `step35 export` needs no other source.
        checkpoint["step35_config"] = self.model_config.to_dict()
        if self.lora is not None:  # adapters, full targets and buffers; the frozen base only by its identity
            frozen = frozen_state_keys(self)
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in frozen}
            checkpoint[lora_base.RECORD_KEY] = self._lora_base
        # So does the tokenizer the data was encoded with (files, not a path: caches get cleaned).
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        if getattr(tokenizer, "path", None) is not None:
            checkpoint[run_tokenizer.RECORD_KEY] = run_tokenizer.record(tokenizer.path, tokenizer.eos_token_id)

    # ------------------------------------------------------------------------------- steps
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss(self, batch: dict):
        """(LossOutput, labels [B, S]) of one batch: input_ids [B, S + 1], optional labels [B, S]
        (-100 = no loss; default input_ids[:, 1:]) and position_ids [B, S] (data.document_masking)."""
        tokens = batch["input_ids"]  # [B, S + 1]
        labels = batch.get("labels")
        if labels is None:
            labels = tokens[:, 1:]
        elif labels.shape != (tokens.shape[0], tokens.shape[1] - 1):
            raise ValueError(f"batch['labels'] has shape {tuple(labels.shape)}, but batch['input_ids'] of shape "
                             f"{tuple(tokens.shape)} needs labels of shape {(tokens.shape[0], tokens.shape[1] - 1)} "
                             "(the targets of input_ids[:, :-1])")
        weight = self.hparams.mtp_loss_weight if self.training else 0.0
        aux_coef = self.hparams.moe_aux_loss_coef if self.training else 0.0
        out = self.model.loss(tokens[:, :-1], labels, mtp_loss_weight=weight, moe_aux_loss_coef=aux_coef,
                              loss_chunk_size=self.hparams.loss_chunk_size, position_ids=batch.get("position_ids"))
        return out, labels

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out, labels = self._loss(batch)
        loss = micro_batch_loss(out, labels.shape, self.hparams.mtp_loss_weight)
        if self._step_totals is None:
            self._step_totals = StepTotals(len(out.mtp_sums), loss.device)
        self._step_totals.add(out, loss, labels.numel())
        self.log("train/tokens", float(labels.numel()), reduce_fx="sum")
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Turn the step's summed gradient into the mean over every trained token of the step (all
        micro-batches, all data-parallel ranks) and log the step's losses; see `micro_batch_loss`.

        Lightning calls this after every callback's on_before_optimizer_step (DivergenceGuard may
        have dropped the gradients already) and before gradient clipping, so the clipped norm is
        the norm of the mean gradient."""
        totals, self._step_totals = self._step_totals, None
        if totals is None:
            return
        group = getattr(self.trainer.strategy, "data_parallel_group", None)
        shared = distributed() and self.trainer.world_size > 1  # a single-device strategy averages nothing
        ranks = torch.distributed.get_world_size(group) if shared else 1
        step = totals.reduce(group, over_ranks=shared)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if step.trained == 0:
            # Nothing to average over: no update at all (as DivergenceGuard's skip: AdamW then leaves
            # weights, moments and step count alone, clipping sees no gradient, router counts dropped).
            optimizer.zero_grad(set_to_none=True)
            rank_zero_warn(f"step {self.trainer.global_step}: every label of the step is masked (-100); "
                           "no token to train on, the optimizer step is skipped")
        else:
            # Lightning divided each micro-batch's loss by accumulate_grad_batches and the sharding
            # averaged over the ranks: undo both, then divide the summed losses by the trained tokens.
            # Integers decide: with every label trained (plain text) the factor is exactly 1 and the
            # gradients stay bit for bit as they were.
            numerator = self.trainer.accumulate_grad_batches * ranks * step.slots
            denominator = step.micro_batches * step.trained
            if numerator != denominator:
                factor = numerator / denominator
                for p in params:  # one by one: a foreach op cannot mix the dense and expert meshes' DTensors
                    p.grad.mul_(factor)
        self._log_step(step)

    def _log_step(self, step: "StepMeans") -> None:
        # Values of the whole step, the same on every rank: no sync_dist.
        self.log("train/loss", step.loss, prog_bar=True)
        self.log("train/lm_loss", step.lm_loss)
        for depth, loss in enumerate(step.mtp_losses, start=1):
            self.log(f"train/mtp{depth}_loss", loss)
        if self.hparams.moe_aux_loss_coef > 0:
            self.log("train/aux_loss", step.aux_loss)
        self.log("train/trained_tokens", float(step.trained))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out, _ = self._loss(batch)
        # Weighted by the batch's trained tokens (summed over batches and ranks, as the values):
        # val/loss is the mean over every trained token of the validation set.
        self.log("val/loss", out.lm_loss, sync_dist=True, prog_bar=True, batch_size=int(out.num_tokens))

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss.float()), sync_dist=False)

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
    def _group_settings(self) -> list[dict]:
        """AdamW settings of the two param groups (decayed, then norms without decay); the names make
        LearningRateMonitor log `lr/decay` and `lr/no_decay`."""
        hp = self.hparams
        common = {"lr": hp.lr, "betas": tuple(hp.betas), "eps": hp.eps}
        return [{**common, "weight_decay": hp.weight_decay, "name": "decay"},
                {**common, "weight_decay": 0.0, "name": "no_decay"}]

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if name.endswith("norm.weight") else decay).append(param)
        decay_settings, no_decay_settings = self._group_settings()
        groups = [{"params": decay, **decay_settings}, {"params": no_decay, **no_decay_settings}]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                      foreach=_foreach_ok(decay + no_decay))
        total = hp.decay_steps or self.trainer.max_steps
        if total is None or total < 0:
            raise ValueError("set trainer.max_steps or model.decay_steps: the cosine schedule needs a length")
        # A resumed run keeps the length its checkpoint was started with, unless decay_steps is set.
        scheduler = WarmupCosineLR(optimizer, hp.warmup_steps, total, hp.min_lr_ratio,
                                   length_from_option=hp.decay_steps is not None)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}


# Above this peak lr a warning is printed (see _check_options).
LR_WARN_ABOVE = 0.1


def _check_options(**values: Any) -> None:
    """Refuse optimisation options that cannot mean anything, naming the option (`model.lr=-1: must be >= 0`);
    warn about an lr above LR_WARN_ABOVE (allowed, but it diverges)."""
    rules = {
        "lr": (lambda v: v >= 0, ">= 0"),  # 0 is allowed: the weights stay, e.g. to study the router alone
        "min_lr_ratio": (lambda v: 0 <= v <= 1, "between 0 and 1"),
        "warmup_steps": (lambda v: v >= 0, ">= 0"),
        "decay_steps": (lambda v: v is None or v > values["warmup_steps"], "> model.warmup_steps (or null: trainer.max_steps)"),
        "weight_decay": (lambda v: v >= 0, ">= 0"),
        "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
        "eps": (lambda v: v > 0, "> 0"),
        "loss_chunk_size": (lambda v: v >= 1, ">= 1"),
        "mtp_loss_weight": (lambda v: v >= 0, ">= 0"),
        "moe_bias_update_rate": (lambda v: v >= 0, ">= 0"),
        "moe_aux_loss_coef": (lambda v: v >= 0, ">= 0"),
    }
    for name, (ok, requirement) in rules.items():
        value = values[name]
        try:
            good = bool(ok(value))  # NaN fails every comparison, so it is refused too
        except TypeError:
            good = False
        if not good:
            shown = list(value) if isinstance(value, tuple) else value
            raise ValueError(f"model.{name}={shown}: must be {requirement}")
    if values["lr"] > LR_WARN_ABOVE:
        # Legal but almost surely a slip (1e6 for 1e-6): said, not refused, so an experiment can still try it.
        warnings.warn(f"model.lr={values['lr']} is above {LR_WARN_ABOVE}: AdamW moves every weight by about lr per step "
                      f"whatever the gradient's size, and Step-3.5's weights start with std 0.02, so a step would "
                      f"change each weight by more than its own size and training diverges (pretraining uses about "
                      f"1e-5 to 1e-2; a slip such as 1e6 for 1e-6?)", stacklevel=3)


def _foreach_ok(params: list[torch.Tensor]) -> bool:
    # foreach kernels group tensors by device and dtype but cannot mix DTensors of different meshes
    # (dense params on the FSDP mesh, experts on the efsdp x ep mesh).
    meshes = {id(getattr(p, "device_mesh", None)) for p in params}
    return len(meshes) <= 1


def micro_batch_loss(out: LossOutput, label_shape: tuple[int, int], mtp_loss_weight: float) -> torch.Tensor:
    """What one micro-batch backpropagates: its summed losses over its label slots, not its trained tokens.

    (summed main-head loss) / (B * S) + w * mean over depths k of (summed depth-k loss) / (B * (S - k))
    + aux. Step35LightningModule.on_before_optimizer_step then multiplies
    the step's gradient by (accumulate_grad_batches * data-parallel ranks * label slots) /
    (micro-batches * trained tokens), all summed over the step, so the main loss is the sum over every
    trained token of the step divided by their number, whatever the split into micro-batches and ranks.

    With every label trained (plain text) the counts equal the slots: this is exactly the old
    per-micro-batch mean (lm_loss + w * mean MTP loss + aux) and the factor is exactly 1.

    MTP depth k shares the main head's normalisation: its sum is divided by the step's trained tokens
    times (S - k) / S (the share of positions that have a depth-k target), not by its own count, which
    one factor for the whole gradient cannot also respect; with labels trained in spans (chat) the
    two differ by about k / S. The aux balance loss stays a mean over sequences and layers, but each
    sequence's balance loss is weighted by its share of trained labels (model.loss does it): under the
    factor the aux term becomes coef x sum over the step's sequences of (trained labels x balance
    loss) / trained tokens: a trained-token weighted mean, so the coefficient keeps its scale against
    the cross-entropy (unweighted, the factor would multiply it by slots / trained tokens).
    All slot counts must be equal across micro-batches for the factor to be exact (fixed B and S).
    """
    B, S = label_shape
    count = out.num_tokens
    loss = out.lm_sum / count.new_full((), B * S)  # a tensor divisor, as the old lm_sum / count
    if out.mtp_sums:
        per_depth = [total / count.new_full((), max(B * (S - k), 1)) for k, total in enumerate(out.mtp_sums, start=1)]
        loss = loss + mtp_loss_weight * torch.stack(per_depth).mean()
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    return loss


class StepMeans:
    """One optimizer step's totals over its micro-batches and data-parallel ranks, and their means."""

    def __init__(self, values: list[float], depths: int):
        self.trained, self.slots, self.micro_batches = int(values[0]), int(values[1]), int(values[2])
        objective, lm_sum, aux_sum = values[3], values[4], values[5]
        mtp_sums, mtp_counts = values[6:6 + depths], values[6 + depths:6 + 2 * depths]
        per = max(self.trained, 1)
        # The objective whose gradient is applied: the sum of the micro-batch losses times the factor
        # of on_before_optimizer_step over accumulate_grad_batches * ranks (the aux loss: its part of it).
        factor = self.slots / (self.micro_batches * per) if self.micro_batches else 0.0
        self.loss = objective * factor
        self.lm_loss = lm_sum / per
        self.aux_loss = aux_sum * factor
        self.mtp_losses = [total / max(n, 1) for total, n in zip(mtp_sums, mtp_counts)]  # each depth's own mean


class StepTotals:
    """Sums over the micro-batches of one optimizer step on this rank, on the device (no host sync):
    [trained tokens, label slots, micro-batches, summed micro-batch losses, main-head loss sum,
    summed aux losses, MTP sums per depth, MTP counts per depth], float64 (exact counts)."""

    def __init__(self, depths: int, device: torch.device):
        self.depths = depths
        self.values = torch.zeros(6 + 2 * depths, dtype=torch.float64, device=device)

    def add(self, out: LossOutput, loss: torch.Tensor, slots: int) -> None:
        count = out.num_tokens.double()
        aux = out.aux_loss.detach().double() if out.aux_loss is not None else count.new_zeros(())
        parts = [count, count.new_full((), slots), count.new_ones(()), loss.detach().double(),
                 out.lm_sum.detach().double(), aux]
        parts += [s.detach().double() for s in out.mtp_sums] + [c.double() for c in out.mtp_counts]
        if len(parts) != self.values.numel():
            raise RuntimeError(f"a micro-batch computed {len(out.mtp_sums)} MTP depths, the step's first {self.depths}")
        self.values += torch.stack(parts)

    def reduce(self, group=None, over_ranks: bool = True) -> StepMeans:
        """Sum over the data-parallel ranks `group` (None: the world; every rank must call it) and read
        the means (one host sync)."""
        if over_ranks:
            torch.distributed.all_reduce(self.values, group=group)
        return StepMeans(self.values.tolist(), self.depths)


def _check_lora_state(saved: dict, module: pl.LightningModule, where) -> None:
    """A LoRA checkpoint file must hold every state-dict key of `module` but the frozen base, and no other."""
    from step35.checkpoint.errors import CheckpointError
    from step35.checkpoint.trainer_io import _bare_name

    expected = {_bare_name(k) for k in module.state_dict()} - frozen_state_keys(module)
    missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{where}: a LoRA checkpoint that does not fit this model: "
                              + (f"lacks {missing[:3]} " if missing else "")
                              + (f"holds unknown {unexpected[:3]}" if unexpected else "")
                              + f" ({len(missing)} missing, {len(unexpected)} unknown; same model.lora options?)")
