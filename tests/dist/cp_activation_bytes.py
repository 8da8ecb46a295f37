"""Bytes a training forward keeps for backward, per rank, at cp 1 and at cp 2 (2 gloo ranks), with
the counter of benchmarks/activation_memory.py (saved-tensor hooks, unique storages, parameters
excluded), on the issue-10 shape changed to the release's head ratio (8 query heads per KV group
on full layers, 12 on sliding ones). Rank 0 writes both counts and what the exchange itself keeps.

  torchrun --standalone --nproc-per-node 2 tests/dist/cp_activation_bytes.py --out bytes.pt
"""

import argparse

import torch
import torch.distributed as dist

from benchmarks.activation_memory import _config, _PartTracker, count_saved
from step35.model import build_model
from step35.parallel.context import ContextParallel

BATCH, SEQ = 1, 256


def saved_bytes(config, tokens, context) -> int:
    model = build_model(config, num_mtp_layers=0, device="cpu")
    model.init_weights(0)
    model.train()
    model.context_parallel = context
    tracker = _PartTracker()
    tracker.instrument(model)
    saved, _, out = count_saved(lambda: model.loss(tokens[:, :-1], tokens[:, 1:]).loss, tracker, model)
    out.backward()  # the exchanges' backward runs too (every rank must join it)
    return sum(b for *_, b in saved.values())


def exchange_bytes(config, cp: int) -> int:
    """What the exchange keeps beyond the local share: per full layer (or sliding window longer than
    a chunk + 1) the other ranks' K/V, per halo layer the 2 halos of window - 1 keys, fp32."""
    chunk = SEQ // (2 * cp)
    extra = 0
    for i in range(config.num_hidden_layers):
        spec = config.layer(i)
        per_token = 2 * BATCH * spec.num_kv_heads * spec.head_dim * 4
        window = config.sliding_window if spec.sliding else None
        if window is not None and 1 < window <= chunk + 1:
            extra += per_token * 2 * (window - 1)
        else:
            extra += per_token * (SEQ - SEQ // cp)
    return extra


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    config = _config("issue10", '{"num_attention_groups": 1, "attention_other_setting": {"attention_type": '
                                '"sliding_attention", "num_attention_heads": 12, "num_attention_groups": 1, '
                                '"head_dim": 32, "true_head_dim": 32}}')
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    one = saved_bytes(config, tokens, None)
    two = saved_bytes(config, tokens, ContextParallel(dist.group.WORLD))
    counts = torch.tensor([two])
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    if dist.get_rank() == 0:
        torch.save({"cp1": one, "cp2_by_rank": [int(t) for t in gathered], "exchange": exchange_bytes(config, 2)},
                   args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
