"""Preference optimisation (`model.objective: dpo`, issue 26): DPO and its common variants on pairs of a
chosen and a rejected reply, as an objective of the objective room (training/objective.py has the three
parts a LightningModule calls: micro_batch, reduce, validation).

Batch (the contract the data side builds, step35/data): input_ids [B, S + 1], labels [B, S] (-100 = no
target: prompts, padding, a sequence's first token), position_ids [B, S] (restarting at every sequence),
preference [B, S] (label-aligned: 2 p for the chosen and 2 p + 1 for the rejected sequence of pair p of
its row, -1 padding). A sequence's log-probability is the sum over its labelled slots of
log softmax(logits)[label] (Step35ForCausalLM.sequence_logprobs); its length the number of those slots.

Per pair, with policy log-probabilities pi_c, pi_r, reference ones ref_c, ref_r, lengths n_c, n_r:
- h = (pi_c - ref_c) - (pi_r - ref_r); for `ipo` every log-probability is divided by its length
  (length-normalised, as in the IPO paper and TRL); `reference_free` (SimPO): h = pi_c / n_c - pi_r / n_r
  - gamma / beta, no reference model;
- sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h) (ls = label_smoothing, conservative DPO);
  ipo: (h - 1 / (2 beta))^2; hinge: relu(1 - beta h);
- plus sft_weight x the chosen reply's NLL per token, -pi_c / n_c (RPO / pref_ftx).
Rewards: beta (pi - ref) of the summed log-probabilities (reference_free: beta pi / n, SimPO's).
The step's loss is the mean over every pair of the optimizer step (all micro-batches and data-parallel
ranks): a micro-batch backpropagates the sum of its pairs' losses and StepResult's factor divides the
step's summed gradient by the step's pairs.

The reference model (training/reference.py): with LoRA the policy with its adapters off; for full
fine-tuning a frozen copy made by the one training setup, sharded as the policy. Not
`precompute_reference` (refused): a first pass over the data with its log-probabilities kept beside the
stream position would need the data side to store per-pair values across resumes and re-epochs and a
whole extra pass before step 1; a sharded frozen copy costs the parameter bytes in its dtype
(training/reference.py: param_dtype, else the stored dtype) divided over the ranks (counted by `step35
plan`), no optimizer state and no gradients: about 1/4 (fp32) or 1/8 (bf16) of what the policy already
holds with AdamW (fp32 weights, gradients and two moments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from step35.model import Step35ForCausalLM
from step35.model.lora import LoraConfig
from step35.training.objective import (
    MicroBatch,
    Needs,
    Objective,
    ObjectiveInputs,
    StepResult,
    labels_of,
    refuse_language_model_terms,
)
from step35.training.objective import build_objective as build_objective  # where it used to live
from step35.training.options import options_of
from step35.training.reference import ComparesWithReference, reference_kind

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
# The logged values, in the order of a micro-batch's sums after the pair count; each a sum over pairs.
PAIR_VALUES = (
    "loss",
    "dpo_loss",
    "reward_accuracy",
    "reward_margin",
    "chosen_reward",
    "rejected_reward",
    "chosen_logp",
    "rejected_logp",
)


@dataclass
class DpoOptions:
    """`model.dpo`: preference optimisation's options (used with `model.objective: dpo`).

    Args:
        beta: scale of the log-ratio difference (DPO's beta); > 0.
        loss_type: `sigmoid` (DPO), `ipo` (squared loss on length-normalised log-ratios), `hinge` (SLiC).
        label_smoothing: conservative DPO's assumed label-flip rate, in [0, 0.5); sigmoid only.
        sft_weight: weight of the chosen reply's mean NLL per token added to each pair's loss (RPO); >= 0.
        reference_free: SimPO: length-normalised log-probabilities, no reference model, margin gamma.
        gamma: SimPO's target reward margin (reference_free only): h = mean logp_c - mean logp_r - gamma / beta.
        precompute_reference: not built (refused); see this module's docstring for why.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    reference_free: bool = False
    gamma: float = 0.5
    precompute_reference: bool = False

    @classmethod
    def of(cls, value: DpoOptions | dict | None) -> DpoOptions:
        """DpoOptions from DpoOptions, a dict of its fields (a jsonargparse Namespace too) or None (the defaults)."""
        return options_of(cls, value, "dpo", "DPO")

    def check(self) -> None:
        """Refuse options that cannot work, naming model.dpo.<field>."""

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not number(self.beta) or self.beta <= 0:
            raise ValueError(f"model.dpo.beta={self.beta!r}: must be a number > 0")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"model.dpo.loss_type={self.loss_type!r}: must be one of {list(LOSS_TYPES)}")
        if not number(self.label_smoothing) or not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"model.dpo.label_smoothing={self.label_smoothing!r}: must be in [0, 0.5)")
        if self.label_smoothing > 0 and self.loss_type != "sigmoid":
            raise ValueError(
                f"model.dpo.label_smoothing={self.label_smoothing} with model.dpo.loss_type={self.loss_type}: "
                "label smoothing is defined for the sigmoid loss only"
            )
        if not number(self.sft_weight) or self.sft_weight < 0:
            raise ValueError(f"model.dpo.sft_weight={self.sft_weight!r}: must be a number >= 0")
        if not isinstance(self.reference_free, bool):
            raise ValueError(f"model.dpo.reference_free={self.reference_free!r}: must be true or false")
        if not number(self.gamma) or self.gamma < 0:
            raise ValueError(f"model.dpo.gamma={self.gamma!r}: must be a number >= 0")
        if self.precompute_reference:
            raise ValueError(
                "model.dpo.precompute_reference=true is not built: full fine-tuning keeps a frozen reference "
                "copy sharded like the policy (its bytes are in `step35 plan`), LoRA uses the policy with its "
                "adapters off; set it to false"
            )


@dataclass
class PairLosses:
    """Per pair [P] (float, the log-probabilities' dtype): what a micro-batch sums and logs."""

    loss: torch.Tensor  # the whole objective: the preference loss + sft_weight x chosen NLL per token
    dpo_loss: torch.Tensor  # the preference loss alone
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor


def pair_losses(
    options: DpoOptions,
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
    ref_chosen_logp: torch.Tensor | None = None,
    ref_rejected_logp: torch.Tensor | None = None,
) -> PairLosses:
    """The formulas of this module's docstring, per pair: summed log-probabilities [P] of the policy (and of
    the reference, None with reference_free), lengths [P] (>= 1). Pure: no model, no reduction."""
    beta = options.beta
    n_c, n_r = chosen_len.to(chosen_logp.dtype), rejected_len.to(chosen_logp.dtype)
    if options.reference_free:
        h = chosen_logp / n_c - rejected_logp / n_r - options.gamma / beta
        chosen_reward, rejected_reward = beta * chosen_logp / n_c, beta * rejected_logp / n_r
    else:
        if ref_chosen_logp is None or ref_rejected_logp is None:
            raise ValueError("pair_losses: the reference log-probabilities are needed unless model.dpo.reference_free")
        chosen_ratio, rejected_ratio = chosen_logp - ref_chosen_logp, rejected_logp - ref_rejected_logp
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        h = chosen_ratio / n_c - rejected_ratio / n_r if options.loss_type == "ipo" else chosen_ratio - rejected_ratio
    if options.loss_type == "sigmoid":
        ls = options.label_smoothing
        dpo = -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)
    elif options.loss_type == "ipo":
        dpo = (h - 1 / (2 * beta)) ** 2
    else:
        dpo = F.relu(1 - beta * h)
    loss = dpo + options.sft_weight * (-chosen_logp / n_c) if options.sft_weight > 0 else dpo
    return PairLosses(loss, dpo, chosen_reward.detach(), rejected_reward.detach())


def check_preference_batch(batch: dict) -> torch.Tensor:
    """batch['preference'] [B, S] of a preference batch; a batch without it is refused (not a preference file)."""
    preference = batch.get("preference")
    if preference is None:
        raise ValueError(
            "model.objective=dpo needs preference pairs, but the batch has no `preference` ids: give it "
            "data.format: preference sources (prompt/chosen/rejected records), or set model.objective: lm"
        )
    labels = labels_of(batch)
    if preference.shape != labels.shape:
        raise ValueError(
            f"batch['preference'] has shape {tuple(preference.shape)}, the labels {tuple(labels.shape)} "
            "(it is label-aligned: one id per target slot)"
        )
    return preference


def sequence_logprobs(
    model: Step35ForCausalLM, batch: dict, loss_chunk_size: int, pair_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """(chosen sums, rejected sums, chosen lengths, rejected lengths) [B * K] of every pair slot of the
    batch: K = S // 2 + 1 pair slots per row (a pair needs at least two tokens), pair p of row b at b K + p.
    A slot without a pair has lengths 0. `pair_ids` [B, S]: label-aligned 2p / 2p + 1 / -1 ids (default: the
    batch's `preference` ids; KTO passes its `unpaired` ids, matched sequences first)."""
    labels = labels_of(batch)
    preference = check_preference_batch(batch) if pair_ids is None else pair_ids
    B, S = labels.shape
    per_row = 2 * (S // 2 + 1)  # sequence ids per row (even: chosen and rejected side by side)
    rows = torch.arange(B, device=preference.device)[:, None] * per_row
    ids = torch.where(preference >= 0, rows + preference, -1)
    sums, counts = model.sequence_logprobs(
        batch["input_ids"][:, :-1],
        labels,
        ids,
        B * per_row,
        position_ids=batch.get("position_ids"),
        loss_chunk_size=loss_chunk_size,
    )
    return sums[0::2], sums[1::2], counts[0::2], counts[1::2]


class DpoObjective(ComparesWithReference, Objective):
    """Preference optimisation (this module's docstring). `reference` is where the reference log-probabilities
    come from (training/reference.py): "lora" (the policy with model.lora's adapters off), "model" (the frozen
    copy `reference_model`, set by the module after it built the policy) or None (reference_free)."""

    name = "dpo"
    record_kinds = {"preference": "preference pairs"}
    sequences_per_record = 2  # the chosen and the rejected sequence, packed side by side
    logged = (*PAIR_VALUES, "pairs")
    options_field = "dpo"

    def __init__(self, options: DpoOptions, loss_chunk_size: int = 1024, lora: LoraConfig | None = None):
        options.check()
        self.options = options
        self.loss_chunk_size = loss_chunk_size
        self.reference = reference_kind(self.name, lora, options.reference_free, "model.dpo.reference_free")
        self.reference_model: Step35ForCausalLM | None = None

    @classmethod
    def needs(cls, inputs: ObjectiveInputs) -> Needs:
        """The reference (one forward without gradients per micro-batch); the MTP layers never train."""
        options = DpoOptions.of(inputs.options.get(cls.options_field))
        reference = reference_kind(cls.name, inputs.lora, options.reference_free, "model.dpo.reference_free")
        return Needs(reference=reference, extra_forwards=0 if reference is None else 1, trains_mtp=False)

    @classmethod
    def from_inputs(cls, inputs: ObjectiveInputs) -> DpoObjective:
        """Refuses the language-model terms it does not compute (MTP, the sequence balance loss)."""
        refuse_language_model_terms(cls.name, inputs)
        return cls(DpoOptions.of(inputs.options.get(cls.options_field)), inputs.loss_chunk_size, inputs.lora)

    def reference_logprobs(self, model: Step35ForCausalLM, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) summed log-probabilities [B * K] of the reference on the batch's pairs."""
        chosen, rejected, _, _ = self.on_reference(model, lambda m: sequence_logprobs(m, batch, self.loss_chunk_size))
        return chosen, rejected

    def pairs(self, model: Step35ForCausalLM, batch: dict) -> tuple[torch.Tensor, PairLosses, torch.Tensor]:
        """(valid [B * K] bool: the slots holding a pair, their PairLosses, (chosen, rejected) policy logps)."""
        reference = (None, None) if self.reference is None else self.reference_logprobs(model, batch)
        chosen, rejected, n_c, n_r = sequence_logprobs(model, batch, self.loss_chunk_size)
        valid = (n_c > 0) & (n_r > 0)
        losses = pair_losses(self.options, chosen, rejected, n_c.clamp(min=1), n_r.clamp(min=1), *reference)
        return valid, losses, torch.stack([chosen.detach(), rejected.detach()])

    def _values(self, valid: torch.Tensor, losses: PairLosses, logps: torch.Tensor) -> torch.Tensor:
        """float64 [len(PAIR_VALUES)]: each value summed over the valid pairs."""
        margin = losses.chosen_reward - losses.rejected_reward
        per_pair = [
            losses.loss.detach(),
            losses.dpo_loss.detach(),
            (margin > 0).to(margin.dtype),
            margin,
            losses.chosen_reward,
            losses.rejected_reward,
            logps[0],
            logps[1],
        ]
        return torch.stack([torch.where(valid, v, 0).double().sum() for v in per_pair])

    def micro_batch(self, model: Step35ForCausalLM, batch: dict, training: bool = True) -> MicroBatch:
        valid, losses, logps = self.pairs(model, batch)
        loss = torch.where(valid, losses.loss, 0).sum()  # the pairs' summed losses; the factor makes it a mean
        count = valid.sum().double()
        sums = torch.cat([count[None], self._values(valid, losses, logps)])
        return MicroBatch(loss, sums, labels_of(batch).numel())

    def reduce(self, sums: torch.Tensor, group=None, over_ranks: bool = True) -> StepResult:
        """Sum over the data-parallel ranks; the step's mean over its pairs, and a gradient factor of
        accumulate_grad_batches x ranks / pairs (Lightning divided by the first, FSDP by the second)."""
        if over_ranks:
            torch.distributed.all_reduce(sums, group=group)
        values = sums.tolist()
        pairs = int(values[0])
        per = max(pairs, 1)
        logged = {f"train/{name}": total / per for name, total in zip(PAIR_VALUES, values[1:])}
        logged["train/pairs"] = float(pairs)
        return StepResult(pairs, logged, 1, pairs)

    def validation(self, model: Step35ForCausalLM, batch: dict) -> dict[str, tuple[torch.Tensor, int]]:
        """{val/<value>: (its mean over the batch's pairs, the pairs)} (val/loss is the whole objective)."""
        valid, losses, logps = self.pairs(model, batch)
        pairs = int(valid.sum())
        means = self._values(valid, losses, logps) / max(pairs, 1)
        return {f"val/{name}": (means[i].float(), pairs) for i, name in enumerate(PAIR_VALUES)}
