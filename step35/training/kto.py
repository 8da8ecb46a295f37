"""Kahneman-Tversky optimisation (`model.objective: kto`, issue 43; Ethayarajh et al., 2024) on *unpaired*
feedback: a prompt, a completion and a label saying whether the completion is desirable (`data.format:
unpaired`), as an objective of the objective room (training/objective.py).

Batch (the contract the data side builds, step35/data): input_ids [B, S + 1], labels [B, S] (-100 = no
target: prompts, padding, a sequence's first token), position_ids [B, S] (restarting at every sequence), and
- unpaired [B, S] int64, label-aligned: 2 p on the slots of record p's matched sequence (its prompt and its own
  completion), 2 p + 1 on those of its KL sequence (its prompt and another record's completion, made by the
  data side), -1 elsewhere;
- unpaired_label [B, S // 2 + 1] int64: 1 (desirable), 0 (undesirable) or -1 (no record) for record slot p of
  the row.
A sequence's log-probability is the sum over its labelled slots of log softmax(logits)[label], read by the
machinery DPO uses (dpo.sequence_logprobs: the matched sequences play its chosen, the KL sequences its
rejected ones).

Per record p, with policy and reference log-probabilities of its matched sequence:
- r_p = log pi(y_p | x_p) - log pi_ref(y_p | x_p); its reward is beta r_p;
- z0 = max(0, mean over the micro-batch's KL sequences q of log pi(y_q | x_p) - log pi_ref(y_q | x_p)),
  detached (no gradient flows through the reference point);
- desirable: desirable_weight (1 - sigmoid(beta (r_p - z0)));
  undesirable: undesirable_weight (1 - sigmoid(beta (z0 - r_p))).
The step's loss is the mean over every record of the optimizer step (all micro-batches and data-parallel
ranks): a micro-batch backpropagates the sum of its records' losses and StepResult's factor divides the
step's summed gradient by the step's records (as DPO does with pairs).

Where z0's mean runs: over the KL sequences of the micro-batch itself (each rank its own), with no
collective. So it is the same whether a step's micro-batches run one after another on one process
(accumulate_grad_batches) or side by side on data-parallel ranks: each micro-batch holds the same records
either way. A mean over the whole step could not be: a micro-batch's loss is backpropagated before the
step's later micro-batches exist. (TRL averages over the processes' batches of one micro-step, with a
gather; with B rows each packing several records a micro-batch's own estimate is already over many
mismatched pairs.) A micro-batch without KL sequences has z0 = 0.

The reference (training/reference.py): the policy with its adapters off under LoRA, else a frozen copy of the
start model, sharded as the policy: one forward without gradients per micro-batch. The policy's forward runs
over the matched and the KL sequences of the packed rows at once; the KL sequences carry no gradient but
their activations are kept like any other token's (activations per token as the language model's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from step35.model import Step35ForCausalLM
from step35.model.lora import LoraConfig
from step35.training import dpo
from step35.training.objective import (
    MicroBatch,
    Needs,
    Objective,
    ObjectiveInputs,
    StepResult,
    labels_of,
    refuse_language_model_terms,
)
from step35.training.options import check_rules, options_of
from step35.training.reference import ComparesWithReference, reference_kind

# What a micro-batch sums (float64, in this order), then adds over the step and the ranks.
SUMS = (
    "records",
    "desirable_records",
    "undesirable_records",
    "loss",  # the records' summed losses
    "desirable_reward",  # beta r_p summed over the desirable records
    "undesirable_reward",
    "kl",  # z0 summed over the micro-batches that had KL sequences
    "kl_micro_batches",
)


@dataclass
class KtoOptions:
    """`model.objective_options` of `model.objective: kto`.

    Args:
        beta: scale of the log-ratio against the reference point (KTO's beta); > 0.
        desirable_weight: weight of a desirable record's loss (lambda_D); > 0.
        undesirable_weight: weight of an undesirable record's loss (lambda_U); > 0. The paper advises
            desirable_weight x desirable records / (undesirable_weight x undesirable records) in [1, 4/3].
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @classmethod
    def of(cls, value: KtoOptions | dict | None) -> KtoOptions:
        """KtoOptions from KtoOptions, a dict of its fields (a jsonargparse Namespace too) or None (the defaults)."""
        return options_of(cls, value, "objective_options", "kto")

    def check(self) -> None:
        """Refuse a value that is not a finite number > 0, naming model.objective_options.<field>."""

        def positive(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        check_rules(
            {
                f"objective_options.{f.name}": (getattr(self, f.name), positive, "a finite number > 0")
                for f in fields(self)
            }
        )


@dataclass
class RecordLosses:
    """Per record slot [N] (the log-probabilities' dtype), and the micro-batch's reference point."""

    valid: torch.Tensor  # bool: the slot holds a record with a matched sequence
    desirable: torch.Tensor  # bool: its label is desirable
    loss: torch.Tensor  # the weighted KTO loss (0 where not valid)
    reward: torch.Tensor  # beta r_p, detached
    z0: torch.Tensor  # scalar, detached, >= 0
    has_kl: torch.Tensor  # scalar bool: the micro-batch had KL sequences


def reference_point(kl_ratio: torch.Tensor, kl_valid: torch.Tensor) -> torch.Tensor:
    """z0: the mean of `kl_ratio` [N] over `kl_valid`, clamped at 0 and detached (0 when none is valid)."""
    mean = torch.where(kl_valid, kl_ratio.detach(), 0).sum() / kl_valid.sum().clamp(min=1)
    return mean.clamp(min=0)


def record_losses(
    options: KtoOptions,
    label: torch.Tensor,
    ratio: torch.Tensor,
    kl_ratio: torch.Tensor,
    matched_len: torch.Tensor,
    kl_len: torch.Tensor,
) -> RecordLosses:
    """The formulas of this module's docstring per record slot: label [N] (1, 0, -1), r_p = `ratio` [N] and
    the KL sequences' log-ratios `kl_ratio` [N] (policy minus reference), the sequences' label counts [N].
    Pure: no model, no reduction over the step."""
    present = label >= 0
    valid, desirable, kl_valid = present & (matched_len > 0), label == 1, present & (kl_len > 0)
    z0 = reference_point(kl_ratio, kl_valid)
    beta = options.beta
    gain = options.desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0)))
    aversion = options.undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio)))
    loss = torch.where(valid, torch.where(desirable, gain, aversion), 0)
    return RecordLosses(valid, desirable & valid, loss, (beta * ratio).detach(), z0, kl_valid.any())


def check_unpaired_batch(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(unpaired [B, S], unpaired_label [B * K]) of an unpaired batch; a batch without them is refused."""
    unpaired, label = batch.get("unpaired"), batch.get("unpaired_label")
    if unpaired is None or label is None:
        missing = "unpaired" if unpaired is None else "unpaired_label"
        raise ValueError(
            f"model.objective=kto needs unpaired feedback, but the batch has no `{missing}` ids: give it "
            "data.format: unpaired sources (prompt/completion/label records), or set model.objective: lm"
        )
    labels = labels_of(batch)
    B, S = labels.shape
    if unpaired.shape != labels.shape or label.shape != (B, S // 2 + 1):
        raise ValueError(
            f"batch['unpaired'] {tuple(unpaired.shape)} and batch['unpaired_label'] {tuple(label.shape)} with "
            f"labels {tuple(labels.shape)}: they must be {(B, S)} (label-aligned) and {(B, S // 2 + 1)} (record slots)"
        )
    return unpaired, label.reshape(-1)


class KtoObjective(ComparesWithReference, Objective):
    """KTO (this module's docstring). `reference` is where the reference log-probabilities come from
    (training/reference.py): ADAPTERS_OFF under LoRA, else FROZEN_COPY (`reference_model`, set by the module)."""

    name = "kto"
    record_kinds = {"unpaired": "unpaired feedback"}
    sequences_per_record = 2  # the matched and the KL sequence, packed side by side
    logged = ("loss", "kto_loss", "desirable_reward", "undesirable_reward", "kl", *SUMS[1:3])
    options_field = "objective_options"

    def __init__(self, options: KtoOptions, loss_chunk_size: int = 1024, lora: LoraConfig | None = None):
        options.check()
        self.options = options
        self.loss_chunk_size = loss_chunk_size
        self.reference = reference_kind(self.name, lora)
        self.reference_model: Step35ForCausalLM | None = None

    @classmethod
    def needs(cls, inputs: ObjectiveInputs) -> Needs:
        """The reference (one forward without gradients per micro-batch); the MTP layers never train."""
        return Needs(reference=reference_kind(cls.name, inputs.lora), extra_forwards=1, trains_mtp=False)

    @classmethod
    def from_inputs(cls, inputs: ObjectiveInputs) -> KtoObjective:
        refuse_language_model_terms(cls.name, inputs)
        return cls(KtoOptions.of(inputs.options.get(cls.options_field)), inputs.loss_chunk_size, inputs.lora)

    def records(self, model: Step35ForCausalLM, batch: dict) -> RecordLosses:
        """The batch's RecordLosses: the reference's log-probabilities, then the policy's."""
        self.check_records(batch)  # another objective's records (e.g. `preference` pairs) are refused
        unpaired, label = check_unpaired_batch(batch)

        def logprobs(m: Step35ForCausalLM) -> tuple[torch.Tensor, ...]:
            # (matched sums, KL sums, matched lengths, KL lengths) [B * K], record p of row b at b K + p: DPO's
            # sequence log-probabilities with the `unpaired` ids as pair ids (matched = chosen, KL = rejected)
            return dpo.sequence_logprobs(m, batch, self.loss_chunk_size, pair_ids=unpaired)

        ref_matched, ref_kl, _, _ = self.on_reference(model, logprobs)
        matched, kl, matched_len, kl_len = logprobs(model)
        return record_losses(self.options, label, matched - ref_matched, kl - ref_kl, matched_len, kl_len)

    def _values(self, losses: RecordLosses) -> torch.Tensor:
        """float64 [len(SUMS)]: the micro-batch's sums."""
        undesirable = losses.valid & ~losses.desirable
        parts = [
            losses.valid.sum(),
            losses.desirable.sum(),
            undesirable.sum(),
            losses.loss.detach().sum(),
            torch.where(losses.desirable, losses.reward, 0).sum(),
            torch.where(undesirable, losses.reward, 0).sum(),
            losses.z0,
            losses.has_kl,
        ]
        return torch.stack([p.double() for p in parts])

    def micro_batch(self, model: Step35ForCausalLM, batch: dict, training: bool = True) -> MicroBatch:
        losses = self.records(model, batch)
        # The records' summed losses; StepResult's factor makes it the mean over the step's records.
        return MicroBatch(losses.loss.sum(), self._values(losses), labels_of(batch).numel())

    @staticmethod
    def means(values: list[float]) -> dict[str, float]:
        """The logged values (without prefix) from summed SUMS."""
        total = dict(zip(SUMS, values))
        loss = total["loss"] / max(total["records"], 1)
        return {
            "loss": loss,
            "kto_loss": loss,
            "desirable_reward": total["desirable_reward"] / max(total["desirable_records"], 1),
            "undesirable_reward": total["undesirable_reward"] / max(total["undesirable_records"], 1),
            "kl": total["kl"] / max(total["kl_micro_batches"], 1),
            "desirable_records": total["desirable_records"],
            "undesirable_records": total["undesirable_records"],
        }

    def reduce(self, sums: torch.Tensor, group=None, over_ranks: bool = True) -> StepResult:
        """Sum over the data-parallel ranks; the step's means (kl: the mean of the micro-batches' z0) and a
        gradient factor of accumulate_grad_batches x ranks / records."""
        if over_ranks:
            torch.distributed.all_reduce(sums, group=group)
        values = sums.tolist()
        records = int(values[0])
        logged = {f"train/{name}": value for name, value in self.means(values).items()}
        return StepResult(records, logged, 1, records)

    def validation(self, model: Step35ForCausalLM, batch: dict) -> dict[str, tuple[torch.Tensor, int]]:
        """{val/<value>: (the batch's value, its weight)}: the losses weighted by the batch's records, each
        reward by its records, kl (z0) and the two counts by 1 (their means per validation batch)."""
        values = self._values(self.records(model, batch))
        means = self.means(values.tolist())
        n = dict(zip(SUMS, (int(v) for v in values[:3])))
        weights = {
            "loss": n["records"],
            "kto_loss": n["records"],
            "desirable_reward": n["desirable_records"],
            "undesirable_reward": n["undesirable_records"],
        }
        return {
            f"val/{name}": (values.new_tensor(value).float(), weights.get(name, 1)) for name, value in means.items()
        }
