"""EvalCallback's MTP draft acceptance on the device (callbacks/evaluation.py, eval/drafts.py draft_acceptance).

After its generation the callback runs Step35ForCausalLM.draft_logits on each of its `mtp_batches` validation
batches, one at a time: whole rows of micro_batch_size x seq_len tokens, in eval mode, without gradients, outside
the training step's autocast (the weights' dtype: FSDP's param_dtype, else the dtype they are held in; no fp32
upcast). It returns the main head's logits and every MTP depth's, [B, S, V] each, all alive at once; beside them
the token ids [B, S] int64 and the RoPE tables of the trunk live throughout. Its peak is the larger of two moments:
  last head    the main head's and every depth's logits (the last one being written), the last block's output,
               its next-token embeddings (`next_embeds` lives until the loop ends) and the head's normed input,
               [B, S, H] each: the peak on Step-3.5's shapes (a [B, S, V] logits tensor outweighs a layer's work)
  last block   the logits of the main head and the depths before it, the block's input and next-token
               embeddings [B, S, H] each, and the MTP layer's work, taken as activations.decoder_layer counts one
               layer of training (its saved set: within 20 % of the no-grad peak on the tiny model, where this
               moment is the peak)
The MTP layer running (its block and its own head) is the block gathered. mtp_acceptance then adds only argmax ids
and masks ([B, S] int64 and bool), under 20 bytes a token beside the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from step35.plan.activations import Shape, decoder_layer, rope_tables
from step35.plan.settings import RunSettings
from step35.plan.state import FsdpGroup

TOKEN_ID_BYTES = 8  # int64


@dataclass
class DraftMemory:
    """draft_logits on one validation micro-batch at its peak (this module's docstring)."""

    depths: int  # D: the MTP layers built, each drafting one token further
    tokens: int  # B x S: one validation micro-batch, whole rows
    head_logits: int  # one head's logits B x S x V in the eval dtype
    at_head: int  # beside (1 + D) logits at the last head: 3 x [B, S, H], the token ids, the RoPE tables
    at_block: int  # beside D logits in the last MTP block: 2 x [B, S, H], ids, RoPE and the layer's work
    block_gather: int  # the largest MTP layer's FSDP unit (block and head) gathered; 0 unsharded

    @property
    def peak_at_head(self) -> bool:
        return self.head_logits + self.at_head >= self.at_block

    @property
    def logits(self) -> int:
        """The logits alive at the peak moment."""
        return (self.depths + (1 if self.peak_at_head else 0)) * self.head_logits

    @property
    def beside(self) -> int:
        """What else is alive at the peak moment."""
        return self.at_head if self.peak_at_head else self.at_block


def mtp_block_numel(s: RunSettings, groups: list[FsdpGroup]) -> int:
    """Elements of the largest MTP layer's units (layers.{i} and its experts, i >= num_hidden_layers)."""
    n_main = s.model_config.num_hidden_layers
    sizes: dict[int, int] = {}
    for g in groups:
        if g.name.startswith("layers."):
            index = int(g.name.split(".")[1])
            if index >= n_main:
                sizes[index] = sizes.get(index, 0) + g.unsharded_numel
    return max(sizes.values(), default=0)


def eval_draft_memory(s: RunSettings, shape: Shape, groups: list[FsdpGroup]) -> DraftMemory | None:
    """The MTP drafts the run's EvalCallback scores (None: no callback, mtp_batches 0, or no MTP layer built);
    `shape`: the training forward's (kernels), here one validation micro-batch of whole rows in the eval dtype."""
    e = s.eval_generation
    if e is None or e.mtp_batches == 0 or s.num_mtp_layers == 0:
        return None
    cfg, a = s.model_config, torch.empty((), dtype=s.eval_dtype).element_size()
    B, S, D, H = s.micro_batch_size, s.seq_len, s.num_mtp_layers, cfg.hidden_size
    rows = replace(
        shape, batch=B, seq=S, act_bytes=a, expert_parallel_size=1, autocast=False,
        document_masking=s.document_masking, context_parallel=1,
    )  # fmt: skip
    layers = [cfg.layer(i) for i in range(cfg.num_hidden_layers + D)]
    always = B * S * TOKEN_ID_BYTES + rope_tables(cfg, layers, rows)
    work = max(decoder_layer(cfg, spec, rows).total for spec in layers[cfg.num_hidden_layers :])
    return DraftMemory(
        depths=D,
        tokens=B * S,
        head_logits=B * S * cfg.vocab_size * a,
        at_head=3 * B * S * H * a + always,
        at_block=2 * B * S * H * a + always + work,
        block_gather=mtp_block_numel(s, groups) * a if s.sharded else 0,
    )
