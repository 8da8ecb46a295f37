"""Activation bytes of one training forward of a tiny-shaped model on 2 gloo ranks with expert
parallelism 2 (the real all-to-all dispatcher; each rank holds half the experts as plain tensors, no
FSDP), per activation checkpointing mode: every storage created during the forward and still alive
after it, parameters excluded. Each rank writes {mode: bytes} to --out/rank{r}.json.

  torchrun --standalone --nproc-per-node 2 tests/dist/plan_ep_activations.py --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from step35.config import Step35Config
from step35.model import Step35ForCausalLM
from step35.model.moe import moe_layers
from step35.parallel.expert_parallel import ExpertParallelDispatcher
from step35.parallel.parallelize import apply_activation_checkpointing

BATCH, SEQ = 2, 64


class CreatedStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.created: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.created.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        return out


def kept_bytes(config: Step35Config, mode: str, rank: int, group) -> int:
    torch.manual_seed(0)
    model = Step35ForCausalLM(config)
    model.init_weights(0)
    model.to(torch.bfloat16).train()
    for _, moe in moe_layers(model):
        half = moe.num_experts // 2
        for proj in (moe.gate_proj, moe.up_proj, moe.down_proj):
            proj.weight = nn.Parameter(proj.weight.detach()[rank * half:(rank + 1) * half].clone())
        moe.dispatcher = ExpertParallelDispatcher(group, 2, moe.num_experts)
    if mode != "none":
        for layer in model.model.layers:
            apply_activation_checkpointing(layer, mode)
    owned = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    created = CreatedStorages()
    with created:
        out = model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=0.3)
    kept = sum(n for ref, n in created.created.items() if not ref.expired() and ref not in owned)
    out.loss.backward()
    return kept


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="config.json of the model")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = Step35Config.from_json(args.config)
    group = dist.new_group([0, 1])
    result = {mode: kept_bytes(config, mode, rank, group) for mode in ("none", "selective", "full")}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
