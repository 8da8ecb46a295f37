"""Context parallelism in one process: a SequenceShard whose exchanges (gather, halo) read the whole K/V that
this process holds, as the cp ranks would together; the attention tests compare a shard's output with the
whole sequence's."""

from __future__ import annotations

import torch


def simulated_shard(k, v, positions, S, c, doc_ids):
    """A SequenceShard whose exchanges read the whole K/V of this process (what the cp ranks hold)."""
    from step35.kernels.masks import SequenceShard

    full = torch.stack([k, v])

    def gather(x):
        return full

    def halo(x, n):
        pieces = []
        for start in (int(positions[0]), int(positions[c])):
            idx = torch.arange(start - n, start)
            pieces.append(full[..., idx.clamp(min=0), :] * (idx >= 0).to(full.dtype)[:, None])
        return torch.cat(pieces, dim=-2)

    return SequenceShard(positions, S, c, doc_ids, gather=gather, halo=halo)
