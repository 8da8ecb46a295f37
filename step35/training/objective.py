"""The objective room: what one micro-batch's loss is, how an optimizer step's losses are summed over its
micro-batches and data-parallel ranks, and the gradient factor that makes the applied gradient the one of
the step's mean (docs/architecture.md §2.11); and the one interface through which the module, `step35 plan`
and the resume rules ask an objective what it is, never by its name.

`model.objective` is a short name of OBJECTIVES (`lm`: LanguageModelObjective, next-token loss, MTP and the
sequence balance loss; `dpo`: training/dpo.py's DpoObjective, preference pairs) or the class path of an
Objective: a new objective is one file in step35/training/ and one line of OBJECTIVES.

An Objective declares, as class attributes and classmethods (answered without building a model):
- `record_kinds`: the data formats it trains on; a batch of another objective's kind (the data side marks
  one with a tensor named after the kind, e.g. `preference`) is refused where it arrives (check_records);
- `sequences_per_record`: the sequences one record becomes (a preference pair: 2);
- `logged`: the train/ values `reduce` logs each step;
- `options_field`: the module option holding its own options (`model.dpo`; a new one `model.objective_options`);
- `needs(inputs)` -> Needs: what it needs from the model (no reference, the policy with its adapters off,
  a frozen copy: training/reference.py decides its dtype and sharding) and adds to a step (forwards
  without gradients, activations per token), which the module builds and the plan counts;
- `build(inputs)`: the objective, its options checked against the module's.
and three parts the LightningModule calls and nothing else:
- `micro_batch(model, batch, training)` -> MicroBatch: the loss to backpropagate and a float64 vector of
  sums (on the device, no host sync) that the module adds up over the step;
- `reduce(sums, group, over_ranks)` -> StepResult: the sums over the ranks, the step's trained count, the
  gradient factor and what is logged;
- `validation(model, batch)` -> {name: (value, weight)}: each logged as the weighted mean over the
  validation set (val/loss among them); `validation_end(metrics)`: values of the whole set (val/ppl).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from step35.model import LossOutput, Step35ForCausalLM
from step35.model.lora import LoraConfig
from step35.training.options import check_rules
from step35.training.vision import image_inputs

# model.objective's short names: the built-in objectives, by class path (imported when named).
OBJECTIVES = {
    "lm": "step35.training.objective.LanguageModelObjective",
    "dpo": "step35.training.dpo.DpoObjective",
    "kto": "step35.training.kto.KtoObjective",
    "grpo": "step35.training.grpo.GrpoObjective",
}
DEFAULT_OBJECTIVE = "lm"
# The module options that hold an objective's own options (each objective reads one: its options_field).
OPTION_FIELDS = ("dpo", "objective_options", "rl")

# Objective options a resume may change (the command line wins; each is reported when it does).
RESUMABLE = ("loss_chunk_size", "mtp_loss_weight", "moe_aux_loss_coef", "dpo", "objective_options", "rl")


def resume_refusals(saved: dict, hparams: dict) -> list[str]:
    """Why a run cannot resume a checkpoint of another objective (`model.objective`): another objective
    trains another model from the checkpoint's step on, and the full-fine-tuning reference is the run's
    start, which a language-model checkpoint never recorded as such."""
    before, after = saved.get("objective") or DEFAULT_OBJECTIVE, hparams.get("objective") or DEFAULT_OBJECTIVE
    if before != after:
        return [
            f"model.objective: {before} -> {after}: the checkpoint trained the {before} objective; resume with "
            f"model.objective={before}, or start a new run from an exported model (model.checkpoint)"
        ]
    return []


@dataclass
class MicroBatch:
    loss: torch.Tensor  # what the micro-batch backpropagates
    sums: torch.Tensor  # float64 [n]: added over the micro-batches of the step, then over the ranks
    slots: int  # label slots of the micro-batch (logged as train/tokens)


@dataclass
class StepResult:
    """One optimizer step, summed over its micro-batches and data-parallel ranks."""

    trained: int  # tokens whose loss trains (0: nothing to average over, the step is skipped)
    logged: dict[str, float]  # the step's values, the same on every rank
    numerator: int  # the gradient factor as a ratio of integers (see gradient_factor)
    denominator: int

    def gradient_factor(self, accumulate_grad_batches: int, ranks: int) -> float | None:
        """What the summed gradient is multiplied by: Lightning divided each micro-batch's loss by
        accumulate_grad_batches and the sharding averaged over the ranks; undo both, then divide the
        summed losses by the trained tokens. Integers decide: None when the factor is exactly 1 (every
        label trained, plain text), so the gradients stay bit for bit as they were."""
        numerator, denominator = accumulate_grad_batches * ranks * self.numerator, self.denominator
        return None if numerator == denominator else numerator / denominator


@dataclass(frozen=True)
class Needs:
    """What an objective needs from the model and adds to a training step, from its options alone."""

    reference: str | None = None  # None | ADAPTERS_OFF | FROZEN_COPY (training/reference.py)
    extra_forwards: int = 0  # forwards without gradients per micro-batch beside the policy's (the reference's)
    activation_factor: float = 1.0  # activations per token kept for backward, relative to the language model's
    trains_mtp: bool = True  # whether it can train the MTP layers (False: kept as loaded, frozen)
    generates: tuple[int, int] | None = None  # (sequences per record, new tokens each) it samples per micro-batch
    batch_repeats: int = 1  # each step's batches handed to it this many steps in a row (online RL's mu)


@dataclass(frozen=True)
class ObjectiveInputs:
    """What the module's options give an objective: the language model's loss options, model.lora, and the
    objectives' own option fields as given (`model.dpo`, `model.objective_options`; None: not given)."""

    mtp_loss_weight: float = 0.0
    moe_aux_loss_coef: float = 0.0
    loss_chunk_size: int = 1024
    lora: LoraConfig | None = None
    options: dict[str, Any] = field(default_factory=dict)


def _same(value: Any) -> Any:
    return value


@dataclass
class ObjectiveContext:
    """What the run gives an objective that needs more than its batches (online RL generates, decodes, logs
    samples), set by the module at setup (`Objective.bind`); the defaults are one process without a run."""

    stop_ids: set[int] = field(default_factory=set)  # ids that end a generated text (EOS, the end of a turn)
    decode: Callable[[list[int]], str] = lambda ids: " ".join(map(str, ids))  # the run's tokenizer
    step: Callable[[], int] = lambda: 0  # the optimizer step being computed
    keep_going: Callable[[bool], bool] = _same  # True while any rank is still generating
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _same  # a sum over the data-parallel ranks
    write_samples: Callable[[int, list[dict]], None] = lambda step, rows: None  # a table of samples (rank 0)


class Objective:
    """The interface of this module's docstring; subclasses set the class attributes and override the parts."""

    name: ClassVar[str] = ""
    record_kinds: ClassVar[dict[str, str]] = {}  # data format -> what one record of it is
    sequences_per_record: ClassVar[int] = 1
    logged: ClassVar[tuple[str, ...]] = ()
    options_field: ClassVar[str] = "objective_options"

    @classmethod
    def needs(cls, inputs: ObjectiveInputs) -> Needs:
        return Needs()

    @classmethod
    def build(cls, inputs: ObjectiveInputs) -> Objective:
        """The objective of `inputs`; option fields of other objectives are refused."""
        for option, value in inputs.options.items():
            if value is not None and option != cls.options_field:
                readers = [c.name for c in builtin_objectives() if c.options_field == option]
                where = f"set model.objective: {' or '.join(readers)}, or drop" if readers else "drop"
                raise ValueError(f"model.{option} is set but model.objective={cls.name}: {where} model.{option}")
        return cls.from_inputs(inputs)

    @classmethod
    def from_inputs(cls, inputs: ObjectiveInputs) -> Objective:
        raise NotImplementedError

    def bind(self, context: ObjectiveContext) -> None:
        """The run's context (ObjectiveContext); objectives that read only their batches ignore it."""

    def check_records(self, batch: dict) -> None:
        """Refuse a batch of records another objective trains on (marked by a tensor named after its kind)."""
        for other in builtin_objectives():
            for kind, what in other.record_kinds.items():
                if kind in batch and kind not in self.record_kinds:
                    mine = " / ".join(self.record_kinds)
                    raise ValueError(
                        f"the batch holds {what} (`{kind}` ids from data.format: {kind} sources), which "
                        f"model.objective={self.name} would train on as {mine}: set model.objective: {other.name}, "
                        f"or give the run {mine} sources"
                    )

    def validation_end(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Values of the whole validation set, from its logged means `metrics` (none by default)."""
        return {}


def objective_class(name: str) -> type[Objective]:
    """The Objective class `model.objective` names: a short name of OBJECTIVES or a class path."""
    path = OBJECTIVES.get(name, name)
    module, _, attr = path.rpartition(".")
    known = ", ".join(OBJECTIVES)
    if not module:
        raise ValueError(f"model.objective={name!r}: not one of {known}, nor the class path of an Objective")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model.objective={name!r}: cannot import it ({err}); use one of {known}") from None
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise ValueError(f"model.objective={name!r} is not an Objective (step35/training/objective.py)")
    return cls


def builtin_objectives() -> list[type[Objective]]:
    return [objective_class(name) for name in OBJECTIVES]


def build_objective(
    objective: str,
    dpo: Any = None,
    *,
    mtp_loss_weight: float = 0.0,
    moe_aux_loss_coef: float = 0.0,
    loss_chunk_size: int = 1024,
    lora: LoraConfig | None = None,
    objective_options: Any = None,
    rl: Any = None,
) -> Objective:
    """The objective `model.objective` names, checked against the module options it cannot use."""
    options = dict(zip(OPTION_FIELDS, (dpo, objective_options, rl)))
    inputs = ObjectiveInputs(mtp_loss_weight, moe_aux_loss_coef, loss_chunk_size, lora, options)
    return objective_class(objective).build(inputs)


def refuse_language_model_terms(name: str, inputs: ObjectiveInputs) -> None:
    """Refuse the language-model terms a sequence-log-probability objective does not compute (MTP, the
    sequence balance loss) and a chunk size below 1."""
    if inputs.mtp_loss_weight > 0:
        raise ValueError(
            f"model.mtp_loss_weight={inputs.mtp_loss_weight} with model.objective={name}: it does not train "
            "the MTP layers (they stay frozen); set model.mtp_loss_weight: 0"
        )
    if inputs.moe_aux_loss_coef > 0:
        raise ValueError(
            f"model.moe_aux_loss_coef={inputs.moe_aux_loss_coef} with model.objective={name}: the sequence balance "
            "loss is a language-model term that sequence_logprobs does not compute; set it to 0 (router-bias "
            "balancing, model.moe_bias_update_rate, does not depend on the objective)"
        )
    if inputs.loss_chunk_size < 1:
        raise ValueError(f"model.loss_chunk_size={inputs.loss_chunk_size}: must be >= 1")


def labels_of(batch: dict) -> torch.Tensor:
    """batch['labels'] [B, S] (-100 = no loss), default input_ids[:, 1:] of input_ids [B, S + 1]."""
    tokens = batch["input_ids"]
    labels = batch.get("labels")
    if labels is None:
        return tokens[:, 1:]
    if labels.shape != (tokens.shape[0], tokens.shape[1] - 1):
        raise ValueError(
            f"batch['labels'] has shape {tuple(labels.shape)}, but batch['input_ids'] of shape "
            f"{tuple(tokens.shape)} needs labels of shape {(tokens.shape[0], tokens.shape[1] - 1)} "
            "(the targets of input_ids[:, :-1])"
        )
    return labels


class LanguageModelObjective(Objective):
    """Next-token cross-entropy as the mean over every trained token of the optimizer step, plus
    mtp_loss_weight x the mean MTP loss and the sequence balance loss (moe_aux_loss_coef)."""

    name = "lm"
    record_kinds = {"text": "text", "chat": "conversations", "prompt_completion": "prompt/completion records"}
    logged = ("loss", "lm_loss", "mtp<k>_loss", "aux_loss", "trained_tokens")
    options_field = ""  # none of its own: model.mtp_loss_weight, moe_aux_loss_coef, loss_chunk_size

    @classmethod
    def from_inputs(cls, inputs: ObjectiveInputs) -> LanguageModelObjective:
        return cls(inputs.mtp_loss_weight, inputs.moe_aux_loss_coef, inputs.loss_chunk_size)

    def __init__(self, mtp_loss_weight: float = 0.0, moe_aux_loss_coef: float = 0.0, loss_chunk_size: int = 1024):
        check_rules(
            {
                "loss_chunk_size": (loss_chunk_size, lambda v: v >= 1, ">= 1"),
                "mtp_loss_weight": (mtp_loss_weight, lambda v: v >= 0, ">= 0"),
                "moe_aux_loss_coef": (moe_aux_loss_coef, lambda v: v >= 0, ">= 0"),
            }
        )
        self.mtp_loss_weight = mtp_loss_weight
        self.moe_aux_loss_coef = moe_aux_loss_coef
        self.loss_chunk_size = loss_chunk_size

    def forward(self, model: Step35ForCausalLM, batch: dict, training: bool) -> tuple[LossOutput, torch.Tensor]:
        """(LossOutput, labels [B, S]) of a batch: input_ids [B, S + 1], optional labels [B, S] and
        position_ids [B, S] (data.document_masking), and the image tensors of data.images (training/vision.py
        image_inputs: a vision-language model's loss encodes them first). MTP and the aux loss only in training.
        A batch of another objective's records (e.g. `preference` pairs) is refused (check_records)."""
        self.check_records(batch)
        labels = labels_of(batch)
        return model.loss(
            batch["input_ids"][:, :-1],
            labels,
            mtp_loss_weight=self.mtp_loss_weight if training else 0.0,
            moe_aux_loss_coef=self.moe_aux_loss_coef if training else 0.0,
            loss_chunk_size=self.loss_chunk_size,
            position_ids=batch.get("position_ids"),
            **image_inputs(batch),
        ), labels

    def micro_batch(self, model: Step35ForCausalLM, batch: dict, training: bool = True) -> MicroBatch:
        out, labels = self.forward(model, batch, training)
        loss = micro_batch_loss(out, tuple(labels.shape), self.mtp_loss_weight)
        count = out.num_tokens.double()
        aux = out.aux_loss.detach().double() if out.aux_loss is not None else count.new_zeros(())
        # [trained tokens, label slots, micro-batches, loss, main-head loss sum, aux loss,
        #  MTP sums per depth, MTP counts per depth]
        parts = [
            count,
            count.new_full((), labels.numel()),
            count.new_ones(()),
            loss.detach().double(),
            out.lm_sum.detach().double(),
            aux,
        ]
        parts += [s.detach().double() for s in out.mtp_sums] + [c.double() for c in out.mtp_counts]
        return MicroBatch(loss, torch.stack(parts), labels.numel())

    def reduce(self, sums: torch.Tensor, group=None, over_ranks: bool = True) -> StepResult:
        """Sum the step's `sums` over the data-parallel ranks `group` (None: the world; every rank must
        call it) and read the means (one host sync)."""
        if over_ranks:
            torch.distributed.all_reduce(sums, group=group)
        values = sums.tolist()
        depths = (len(values) - 6) // 2
        trained, slots, micro_batches = int(values[0]), int(values[1]), int(values[2])
        objective, lm_sum, aux_sum = values[3], values[4], values[5]
        mtp_sums, mtp_counts = values[6 : 6 + depths], values[6 + depths : 6 + 2 * depths]
        per = max(trained, 1)
        # The objective whose gradient is applied: the sum of the micro-batch losses times the gradient
        # factor over accumulate_grad_batches * ranks (the aux loss: its part of it).
        factor = slots / (micro_batches * per) if micro_batches else 0.0
        logged = {"train/loss": objective * factor, "train/lm_loss": lm_sum / per}
        for depth, (total, n) in enumerate(zip(mtp_sums, mtp_counts), start=1):
            logged[f"train/mtp{depth}_loss"] = total / max(n, 1)  # each depth's own mean
        if self.moe_aux_loss_coef > 0:
            logged["train/aux_loss"] = aux_sum * factor
        logged["train/trained_tokens"] = float(trained)
        return StepResult(trained, logged, slots, micro_batches * trained)

    def validation(self, model: Step35ForCausalLM, batch: dict) -> dict[str, tuple[torch.Tensor, int]]:
        """{"val/loss": (the batch's mean main-head loss, its trained tokens)}: each value logged is a mean
        weighted by its weight, so val/loss is the mean over every trained token of the validation set."""
        out, _ = self.forward(model, batch, training=False)
        return {"val/loss": (out.lm_loss, int(out.num_tokens))}

    def validation_end(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """val/ppl: the perplexity of the next-token loss over the whole validation set."""
        loss = metrics.get("val/loss")
        return {} if loss is None else {"val/ppl": torch.exp(loss.float())}


def add_micro_batch(step_sums: torch.Tensor | None, micro_batch: MicroBatch) -> torch.Tensor:
    """The step's sums so far plus one micro-batch's (None: the step's first)."""
    if step_sums is None:
        return micro_batch.sums.clone()
    if step_sums.shape != micro_batch.sums.shape:
        raise RuntimeError(
            f"a micro-batch summed {micro_batch.sums.numel()} values, the step's first "
            f"{step_sums.numel()} (another number of MTP depths?)"
        )
    return step_sums + micro_batch.sums


def micro_batch_loss(out: LossOutput, label_shape: tuple[int, int], mtp_loss_weight: float) -> torch.Tensor:
    """What one micro-batch backpropagates: its summed losses over its label slots, not its trained tokens.

    (summed main-head loss) / (B * S) + w * mean over depths k of (summed depth-k loss) / (B * (S - k))
    + aux. StepResult.gradient_factor then multiplies the step's gradient by
    (accumulate_grad_batches * data-parallel ranks * label slots) / (micro-batches * trained tokens),
    all summed over the step, so the main loss is the sum over every trained token of the step divided
    by their number, whatever the split into micro-batches and ranks.

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
