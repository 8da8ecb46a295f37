"""Bytes a training forward keeps for backward, per token, with a per-module breakdown.

Two counts, both over unique storages (a view shares its base's bytes) and without parameters:
- `saved`: every tensor autograd packs for backward, seen through torch.autograd.graph.saved_tensors_hooks
  and charged to the part of the model whose op saved it. This is the usual definition; it cannot
  see inside activation checkpointing (the checkpoint packs with its own hooks and keeps nothing).
- `retained`: every storage created during the forward that is still alive once the forward has
  returned (the graph, the checkpoint inputs, the selective-checkpoint cache), charged to the part
  that created it. This is what activation checkpointing changes, so it is the number reported for
  `selective` and `full`; for `none` it matches `saved` up to tensors that exist before the forward
  (the labels).

    python benchmarks/activation_memory.py --shape issue10 --batch 2 --seq 256
    python benchmarks/activation_memory.py --config tiny --batch 8 --seq 128 --ac selective
    python benchmarks/activation_memory.py --config path/config.json --set '{"sliding_window": 128}'

Prints one JSON row: totals in bytes per token and the breakdown in bytes per token per part.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from collections import defaultdict

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from step35.config import PRESETS, Step35Config, load_config
from step35.model import DecoderLayer, Step35ForCausalLM, build_model
from step35.model.moe import MoE
from step35.parallel.parallelize import apply_activation_checkpointing


def _issue10_shape() -> dict:
    """The Step-3.5-shaped model of issue 10: hidden 256, 6 layers (layer 0 dense), 32 experts top-4."""
    raw = PRESETS["tiny"]()
    raw.update(
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 6,
            "vocab_size": 4096,
            "moe_layers_enum": "1,2,3,4,5",
            "num_attention_heads": 8,
            "num_attention_groups": 2,
            "head_dim": 32,
            "moe_num_experts": 32,
            "moe_top_k": 4,
            "moe_intermediate_size": 128,
            "share_expert_dim": 128,
            "sliding_window": 64,
            "num_nextn_predict_layers": 0,
            "layer_types": ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"],
            "rope_theta": [5000000.0, 10000.0, 10000.0, 10000.0, 5000000.0, 10000.0],
            "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 0.5, 1.0],
            "attention_other_setting": {
                "attention_type": "sliding_attention",
                "num_attention_heads": 12,
                "num_attention_groups": 2,
                "head_dim": 32,
                "true_head_dim": 32,
            },
            "swiglu_limits": [0.0, 0.0, 0.0, 0.0, 7.0, 7.0],
            "swiglu_limits_shared": [0.0, 0.0, 0.0, 0.0, 0.0, 16.0],
        }
    )
    return raw


SHAPES = {"issue10": _issue10_shape}
PARTS = (
    "embedding",
    "residual",
    "attention_norm",
    "attention",
    "ffn_norm",
    "router",
    "dispatch",
    "experts",
    "shared_expert",
    "dense_mlp",
    "final_norm",
    "loss",
    "other",
)


class _PartTracker:
    """Which part of the model is running now: a stack of labels pushed by module hooks and wrappers."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, int | None]] = [("other", None)]  # (part, decoder layer id or None)

    @property
    def current(self) -> tuple[str, int | None]:
        return self.stack[-1]

    @contextlib.contextmanager
    def part(self, label: str):
        self.stack.append((label, self.stack[-1][1]))
        try:
            yield
        finally:
            self.stack.pop()

    def wrap(self, fn, label: str):
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            with self.part(label):
                return fn(*args, **kwargs)

        return labelled

    def instrument(self, model: Step35ForCausalLM) -> None:
        """Label the model's modules (hooks) and the MoE steps that are not modules (instance wrappers)."""
        labels = {
            "embed_tokens": "embedding",
            "input_layernorm": "attention_norm",
            "self_attn": "attention",
            "post_attention_layernorm": "ffn_norm",
            "share_expert": "shared_expert",
            "mlp": "dense_mlp",
        }
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            label = "final_norm" if name == "model.norm" else labels.get(leaf)
            if isinstance(module, DecoderLayer):
                label = "residual"  # the block's own ops: the residual adds (its modules relabel the rest)
            if isinstance(module, MoE):
                label = "dispatch"  # permutation, combine; route and experts are relabelled inside
                module.route = self.wrap(module.route, "router")
                module.dispatcher = self.wrap(module.dispatcher, "experts")
            if label is not None:
                layer = module.spec.layer_id if isinstance(module, DecoderLayer) else None
                module.register_forward_pre_hook(functools.partial(self._enter, label, layer))
                module.register_forward_hook(self._leave)

    def _enter(self, label: str, layer: int | None, module: nn.Module, args) -> None:
        self.stack.append((label, layer if layer is not None else self.stack[-1][1]))

    def _leave(self, module: nn.Module, args, output) -> None:
        self.stack.pop()


class _CreatedStorages(TorchDispatchMode):
    """Records a weak reference to every storage an op creates, with the part that created it."""

    def __init__(self, tracker: _PartTracker, existing: set):
        super().__init__()
        self.tracker, self.existing = tracker, existing  # storages made before (parameters: views of them)
        self.created: dict[StorageWeakRef, tuple[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.created and _storage_key(t) not in self.existing:
                    self.created[ref] = (*self.tracker.current, t.untyped_storage().nbytes())
        return out


def _storage_key(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


def count_saved(forward, tracker: _PartTracker, model: nn.Module):
    """Run `forward()` and count what it leaves for backward: (saved, retained, its output), the two
    dicts mapping a storage to (part, bytes). See the module docstring for the two counts."""
    params = {_storage_key(p) for p in model.parameters()} | {_storage_key(b) for b in model.buffers()}
    saved: dict[tuple[int, str], tuple[str, int]] = {}

    def pack(t: torch.Tensor):
        key = _storage_key(t)
        if key not in params and key not in saved:
            saved[key] = (*tracker.current, t.untyped_storage().nbytes())
        return t

    # Hooks the model installs itself (model/moe.py `regathered`) take a tensor before this counter's: see what
    # they keep as a tensor, and not what they replace by a note to rebuild it in backward.
    hooks = torch.autograd.graph.saved_tensors_hooks
    original_init = hooks.__init__

    def observed_init(self, pack_hook, unpack_hook):
        def observed(t):
            packed = pack_hook(t)
            if isinstance(packed, torch.Tensor):
                pack(packed)
            return packed

        original_init(self, observed, unpack_hook)

    mode = _CreatedStorages(tracker, params)
    hooks.__init__ = observed_init
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            out = forward()
    finally:
        hooks.__init__ = original_init
    retained = {ref: v for ref, v in mode.created.items() if not ref.expired()}
    return saved, retained, out


def measure(
    config: Step35Config, batch: int, seq: int, ac: str = "none", seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict:
    """One training forward (model.loss(input_ids, labels)) on CPU; returns the JSON row."""
    torch.manual_seed(seed)
    model = build_model(config, num_mtp_layers=0, device="cpu")
    model.init_weights(seed)
    model.to(dtype)
    model.train()
    if ac != "none":
        for layer in model.model.layers:
            apply_activation_checkpointing(layer, ac)
    tracker = _PartTracker()
    tracker.instrument(model)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    saved, retained, out = count_saved(lambda: model.loss(input_ids, labels).loss, tracker, model)
    n = batch * seq

    def per_part(entries) -> dict:
        parts: dict[str, float] = defaultdict(float)
        for label, _, nbytes in entries:
            parts[label] += nbytes / n
        return {p: round(parts[p], 1) for p in PARTS if parts.get(p)}

    def per_layer(entries) -> dict:
        """{layer id: {kind, total, part: bytes per token}}: what one decoder layer of each kind costs."""
        layers: dict[int, list] = defaultdict(list)
        for label, layer, nbytes in entries:
            if layer is not None:
                layers[layer].append((label, layer, nbytes))
        kinds = {
            layer.spec.layer_id: ("moe" if layer.spec.is_moe else "dense") + "/" + layer.spec.attention_type
            for layer in model.model.layers
        }
        return {
            str(i): {"kind": kinds[i], "total": round(sum(b for *_, b in layers[i]) / n, 1), **per_part(layers[i])}
            for i in sorted(layers)
        }

    row = {
        "batch": batch,
        "seq": seq,
        "activation_checkpointing": ac,
        "dtype": str(dtype).removeprefix("torch."),
        "saved_bytes_per_token": round(sum(b for *_, b in saved.values()) / n, 1),
        "retained_bytes_per_token": round(sum(b for *_, b in retained.values()) / n, 1),
        "saved_by_part": per_part(saved.values()),
        "retained_by_part": per_part(retained.values()),
        "saved_by_layer": per_layer(saved.values()),
    }
    out.backward()  # the graph is whole (a check that the instrumented model still trains)
    return row


def _config(name: str, overrides: str | None) -> Step35Config:
    raw = SHAPES[name]() if name in SHAPES else load_config(name).to_dict()
    if overrides:
        raw.update(json.loads(overrides))
    return Step35Config.from_dict(raw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="issue10", help=f"a preset, a config.json, or one of {sorted(SHAPES)}")
    p.add_argument("--set", dest="overrides", help="JSON object of config.json fields to change")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    row = measure(_config(args.config, args.overrides), args.batch, args.seq, args.ac, dtype=getattr(torch, args.dtype))
    print(
        json.dumps(
            {"config": args.config, **({"overrides": json.loads(args.overrides)} if args.overrides else {}), **row}
        )
    )


if __name__ == "__main__":
    main()
