"""A few optimizer steps of online RL (`model.objective: grpo`, training/grpo.py) on the tiny model, plain (one
process) or distributed (torchrun, gloo, FSDP2 + EP, or context parallelism), from the same init and the same
prompts: every step's rollouts (G completions per prompt, sampled by the policy under the run's sharding), their
rewards and advantages, the logged values and, after the last step, every parameter; several runs in one job with
--case (tests/dist/cases.py). The plain run is the first thing every case computes, on every rank, so the result
holds both.

The plain run takes the step's global batch as `--plain-micro-batches` micro-batches: the data-parallel ranks'
batches one after the other (gradient accumulation; what makes the step identical to the ranks' when the
advantages are normalised per group), or all of them at once (what `scale_rewards: batch` needs: the batch std
is over one micro-batch of every data-parallel rank). Context-parallel ranks share their prompts: the plain run
takes them as one micro-batch.

The reward (`spread_reward`) is an integer per completion, computed from its ids, so that the completions of a
group differ in reward (non-zero advantages) and every sum of rewards is exact in float64. Some ids stop a
completion (STOP_IDS, 1 in 16), so completions differ in length and the ranks decode in lockstep through
`keep_going` while their prompts end at different tokens. SGD with momentum: AdamW's normalised step would
turn fp32 reduction-order noise in near-zero gradients into parameter differences of the size of its lr.

  torchrun --standalone --nproc-per-node 2 tests/dist/grpo_steps.py --out r.pt --case ep2="--ep 2" --case cp2="--cp 2"
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import preset
from step35.model import build_model
from step35.parallel import ParallelDims, parallelize
from step35.parallel.collectives import any_rank
from step35.training.objective import ObjectiveContext, add_micro_batch, build_objective
from step35.training.reference import FROZEN_COPY
from tests.dist.cases import main

PROMPTS_PER_STEP = 4  # the global batch: prompts of one optimizer step (over every data-parallel rank)
STOP_IDS = set(range(0, 1024, 16))
RECORD_BYTES = 64


def spread_reward(prompts, completions, completion_ids, **fields) -> list[float]:
    """The number of ids of the completion divisible by 3, minus 2 when it was stopped by a stop id."""
    return [float(sum(t % 3 == 0 for t in ids) - 2 * (bool(ids) and ids[-1] in STOP_IDS)) for ids in completion_ids]


def prompt_sets(count: int, seed: int = 5) -> list[list[list[int]]]:
    """`count` global batches of PROMPTS_PER_STEP distinct prompts of 3 to 9 ids."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(count):
        lengths = torch.randint(3, 10, (PROMPTS_PER_STEP,), generator=g).tolist()
        sets.append([torch.randint(1, 1024, (n,), generator=g).tolist() for n in lengths])
    return sets


def prompt_batch(prompts: list[list[int]], width: int = 16) -> dict:
    """The prompt records' batch contract (data/prompts.py): ids right-padded, lengths, the records as JSON."""
    ids = torch.zeros(len(prompts), width + 1, dtype=torch.long)
    records = torch.zeros(len(prompts), RECORD_BYTES, dtype=torch.uint8)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt)
        data = json.dumps({"prompt": f"question {prompt[0]}", "length": len(prompt)}).encode()
        records[i, : len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return {
        "input_ids": ids,
        "labels": torch.full((len(prompts), width), -100),
        "position_ids": torch.arange(width).expand(len(prompts), width).clone(),
        "prompt": torch.tensor([len(p) for p in prompts]),
        "prompt_record": records,
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--plain-micro-batches", type=int, default=1, help="the plain run's micro-batches per step")
    p.add_argument("--rl", default="{}", help="model.rl options (JSON) over the defaults of `rl_options`")
    return p


def rl_options(args: argparse.Namespace) -> dict:
    defaults = {
        "reward_funcs": ["tests.dist.grpo_steps:spread_reward"],  # an import path, as a user names theirs
        "num_generations": 4,
        "max_new_tokens": 12,
        "temperature": 1.3,
        "seed": 17,
        "sample_every": 0,
    }
    return {**defaults, **json.loads(args.rl)}


def local_batches(prompts: list[list[int]], parts: int, meshes, dims: ParallelDims | None) -> list[dict]:
    """This process's micro-batches of a step: the plain run's `parts`, or this data-parallel rank's share."""
    if meshes is not None:
        ranks = dims.data_parallel_size
        per_rank = len(prompts) // ranks
        r = dims.data_parallel_rank(dist.get_rank())
        return [prompt_batch(prompts[r * per_rank : (r + 1) * per_rank])]
    size = len(prompts) // parts
    return [prompt_batch(prompts[i * size : (i + 1) * size]) for i in range(parts)]


def step_groups(objective, rl: dict) -> list[tuple[list[int], list[list[int]], list[float]]]:
    """This process's groups of the step, micro-batch after micro-batch: (prompt, its G completions, their
    advantages)."""
    G = rl["num_generations"]
    out = []
    for rollouts in objective._kept:
        advantages = rollouts.advantages.tolist()
        for i, group in enumerate(rollouts.groups):
            out.append((group.prompt, group.completions, advantages[i * G : (i + 1) * G]))
    return out


def gathered(value: list, meshes) -> list:
    """Every rank's `value` (a list), world order; without `meshes`, [value]."""
    if meshes is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def tiny(meshes):
    """The tiny model at the init every case starts from, sharded by `meshes` (None: whole)."""
    model = build_model(preset("tiny"), 0)
    if meshes is not None:
        parallelize(model, meshes)
    materialize(model, "cpu", seed=3)
    return model


def context(step: list[int], meshes) -> ObjectiveContext:
    """What the module binds (module.py `_objective_context`): the step, the lockstep decoding and the sum over
    the data-parallel ranks; one process: the defaults."""
    if meshes is None:
        return ObjectiveContext(stop_ids=STOP_IDS, step=lambda: step[0])

    def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
        summed = values.clone()
        dist.all_reduce(summed, group=meshes.data_parallel_group())
        return summed

    return ObjectiveContext(stop_ids=STOP_IDS, step=lambda: step[0], keep_going=any_rank, sum_over_ranks=sum_over_ranks)


def train(args: argparse.Namespace, meshes=None, dims: ParallelDims | None = None) -> dict:
    """args.steps optimizer steps (each data-parallel rank its prompts when `meshes` is given): per step the
    completions and advantages of every rank, the logged values; then every parameter (full tensors)."""
    model = tiny(meshes)
    start = {name: full(p) for name, p in model.named_parameters()}
    rl = rl_options(args)
    objective = build_objective("grpo", rl=rl)
    if objective.reference == FROZEN_COPY:  # beta > 0: the start model, frozen, sharded as the policy
        objective.set_reference_model(tiny(meshes))
    step = [0]
    objective.bind(context(step, meshes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, foreach=False)
    group, ranks, parts = None, 1, args.plain_micro_batches
    if meshes is not None:
        group, ranks, parts = meshes.data_parallel_group(), dims.data_parallel_size, 1
    repeats = rl.get("num_iterations", 1)
    sets = prompt_sets(-(-args.steps // repeats))
    steps = []
    for index in range(args.steps):
        step[0], sums = index, None
        for batch in local_batches(sets[index // repeats], parts, meshes, dims):
            micro = objective.micro_batch(model, batch)
            (micro.loss / parts).backward()
            sums = add_micro_batch(sums, micro)
        result = objective.reduce(sums, group, over_ranks=meshes is not None)
        factor = result.gradient_factor(parts, ranks)
        for p in model.parameters():
            if p.grad is not None and factor is not None:
                p.grad.mul_(factor)
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"logged": result.logged, "groups": gathered(step_groups(objective, rl), meshes)})
    params = {name: full(p) for name, p in model.named_parameters()}
    return {"steps": steps, "params": params, "start": start}


def run(args: argparse.Namespace, distributed: bool) -> dict:
    torch.manual_seed(0)
    if not distributed:
        return {"plain": train(args)}
    dims = ParallelDims(
        dist.get_world_size(), args.ep, num_experts=preset("tiny").moe_num_experts, context_parallel_size=args.cp
    )
    return {"plain": train(args), "parallel": train(args, dims.build("cpu"), dims)}


if __name__ == "__main__":
    main(options(), run)
