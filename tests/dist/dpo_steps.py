"""One step of a preference objective (DPO, or KTO with --objective kto: the loss, the logged values and every
trained parameter's gradient) of the tiny model, plain (one process) or distributed (torchrun, gloo, FSDP2 + EP,
optionally context parallelism), from the same init and the same global batch of hand-packed records; several runs
in one job with --case (tests/dist/cases.py). The plain run is the first thing every case computes, on every rank,
so the result holds both. KTO's reference point is a mean over each micro-batch's KL sequences, so its plain run
takes the global batch as one micro-batch per data-parallel rank of the case (--micro-batches), as one process
with gradient accumulation would.

  torchrun --standalone --nproc-per-node 2 tests/dist/dpo_steps.py --out r.pt --case ep2="--ep 2" --case cp2="--cp 2"

Also home of the batches by hand, following the batch contracts (tests/test_dpo.py and tests/test_kto.py use them
too): `pack` and `sample_rows` (preference pairs, issue 26), `pack_unpaired` and `sample_records` (KTO's unpaired
records, each with its KL sequence).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import build_model
from step35.model.lora import LoraConfig, apply_lora
from step35.parallel import ParallelDims, parallelize
from step35.training.dpo import DpoObjective, DpoOptions
from step35.training.kto import KtoObjective, KtoOptions
from step35.training.objective import add_micro_batch
from tests.dist.cases import main

EOS = 1
SEQ = 40
LORA = LoraConfig(rank=4, targets=["attention", "mlp", "shared_expert", "experts"], expert_rank=2)


def pack(rows: list[list[tuple[list[int], list[int], list[int]]]], seq_len: int = SEQ) -> dict:
    """The contract's tensors for rows of pairs (prompt ids, chosen reply ids, rejected reply ids): each pair's chosen
    then rejected sequence side by side, labels on the reply tokens whose previous token is of the same sequence,
    position_ids restarting per sequence (the padding one more document), preference 2 p / 2 p + 1 on the slots whose
    token lies in pair p's chosen / rejected sequence, -1 on padding."""
    out = {k: [] for k in ("input_ids", "labels", "position_ids", "preference")}
    for pairs in rows:
        tokens, reply, seq_of, pref_of, pos = [], [], [], [], []
        for p, (prompt, chosen, rejected) in enumerate(pairs):
            for side, answer in enumerate((chosen, rejected)):
                q = 2 * p + side
                for j, t in enumerate(prompt + answer):
                    tokens.append(t)
                    reply.append(j >= len(prompt))
                    seq_of.append(q)
                    pref_of.append(q)
                    pos.append(j)
        pad = seq_len + 1 - len(tokens)
        assert pad >= 1, "the row is too long"
        tokens += [EOS] * pad
        reply += [False] * pad
        seq_of += [-1] * pad
        pref_of += [-1] * pad
        pos += list(range(pad))
        labels = [tokens[i + 1] if reply[i + 1] and seq_of[i + 1] == seq_of[i] else -100 for i in range(seq_len)]
        out["input_ids"].append(tokens)
        out["labels"].append(labels)
        out["position_ids"].append(pos[:seq_len])
        out["preference"].append(pref_of[:seq_len])
    return {k: torch.tensor(v) for k, v in out.items()}


def sample_rows(seed: int = 0) -> list:
    """Two rows: three pairs, then two pairs (several pairs per row), replies of varied lengths."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(2, 1024, (n,), generator=g).tolist()

    return [
        [(ids(3), ids(4), ids(2)), (ids(2), ids(3), ids(5)), (ids(4), ids(2), ids(2))],
        [(ids(5), ids(6), ids(3)), (ids(1), ids(4), ids(4))],
    ]


Record = tuple[list[int], list[int], list[int], bool]  # prompt, completion, KL completion, desirable


def mismatched(records: list[tuple[list[int], list[int], bool]]) -> list[Record]:
    """The contract's KL completions of one window: record p takes the completion of record (p + 1) mod n."""
    n = len(records)
    return [
        (prompt, completion, records[(p + 1) % n][1], label) for p, (prompt, completion, label) in enumerate(records)
    ]


def pack_unpaired(rows: list[list[Record]], seq_len: int = 64) -> dict:
    """The contract's tensors for rows of records (each record's matched then its KL sequence, side by side)."""
    out = {k: [] for k in ("input_ids", "labels", "position_ids", "unpaired", "unpaired_label")}
    for records in rows:
        tokens, trained, seq_of, pos = [], [], [], []
        for p, (prompt, completion, kl, _) in enumerate(records):
            for side, answer in enumerate((completion, kl)):
                for j, t in enumerate(prompt + answer):
                    tokens.append(t)
                    trained.append(j >= len(prompt))
                    seq_of.append(2 * p + side)
                    pos.append(j)
        pad = seq_len + 1 - len(tokens)
        assert pad >= 1, "the row is too long"
        tokens, trained, seq_of, pos = tokens + [EOS] * pad, trained + [False] * pad, seq_of + [-1] * pad, pos
        pos += list(range(pad))  # the padding: one more document
        labels = [tokens[i + 1] if trained[i + 1] and seq_of[i + 1] == seq_of[i] else -100 for i in range(seq_len)]
        record_labels = [int(r[3]) for r in records] + [-1] * (seq_len // 2 + 1 - len(records))
        for key, value in zip(out, (tokens, labels, pos[:seq_len], seq_of[:seq_len], record_labels)):
            out[key].append(value)
    return {k: torch.tensor(v) for k, v in out.items()}


def sample_records(seed: int = 0) -> list[list[Record]]:
    """Two windows: three records, then two, both labels in each, completions of varied lengths."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(2, 1024, (n,), generator=g).tolist()

    first = mismatched([(ids(3), ids(4), True), (ids(2), ids(3), False), (ids(4), ids(2), True)])
    second = mismatched([(ids(5), ids(6), False), (ids(1), ids(4), True)])
    return [first, second]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--loss-type", default="sigmoid")
    p.add_argument("--objective", default="dpo", choices=["dpo", "kto"])
    p.add_argument("--micro-batches", type=int, default=1, help="the plain run's micro-batches (KTO: the dp ranks)")
    return p


def one_step(args: argparse.Namespace, meshes=None, dims: ParallelDims | None = None) -> dict:
    """Loss, logged values and gradients (full tensors) of one step over the whole global batch (each data-parallel
    rank its rows when `meshes` is given)."""

    def model_of(seed: int):
        model = build_model(preset("tiny"), 0)
        if args.lora:
            apply_lora(model, LORA)
        if meshes is not None:
            parallelize(model, meshes)
        materialize(model, "cpu", seed=seed)
        return model

    if args.objective == "dpo":
        policy_seed, reference_seed, adapter = 3, 11, 0.02
    else:  # KTO: every micro-batch's reference point above 0 (not clamped), so the split into them is what is tested
        policy_seed, reference_seed, adapter = (3 if args.lora else 11), 3, -0.02
    policy = model_of(policy_seed)
    if args.lora:  # adapters that are not zero: the policy differs from its reference (the base)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if name.endswith("lora_B"):
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.fill_(adapter)
    lora = LORA if args.lora else None
    if args.objective == "kto":
        objective, batch = KtoObjective(KtoOptions(beta=0.5), lora=lora), pack_unpaired(sample_records())
    else:
        objective, batch = DpoObjective(DpoOptions(beta=0.5, loss_type=args.loss_type), lora=lora), pack(sample_rows())
    if objective.reference == "model":
        objective.set_reference_model(model_of(reference_seed))
    group, ranks, parts = None, 1, args.micro_batches
    if meshes is not None:
        group = meshes.data_parallel_group()
        ranks, parts = dims.world_size // dims.context_parallel_size, 1
        rows = batch["input_ids"].shape[0] // ranks
        r = dims.data_parallel_rank(dist.get_rank())
        batch = {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}
    sums, rows = None, batch["input_ids"].shape[0] // parts
    for i in range(parts):  # the plain run's micro-batches, as gradient accumulation makes them
        mb = objective.micro_batch(policy, {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()})
        (mb.loss / parts).backward()
        sums = add_micro_batch(sums, mb)
    step = objective.reduce(sums, group, over_ranks=meshes is not None)
    factor = step.gradient_factor(parts, ranks)
    grads = {
        n: full(p.grad) * (1.0 if factor is None else factor)
        for n, p in policy.named_parameters()
        if p.grad is not None
    }
    return {"logged": step.logged, "grads": grads, "pairs": step.trained}


def run(args: argparse.Namespace, distributed: bool) -> dict:
    torch.manual_seed(0)
    if not distributed:
        return {"plain": one_step(args)}
    dims = ParallelDims(
        dist.get_world_size(), args.ep, num_experts=preset("tiny").moe_num_experts, context_parallel_size=args.cp
    )
    return {"plain": one_step(args), "parallel": one_step(args, dims.build("cpu"), dims)}


if __name__ == "__main__":
    main(options(), run)
