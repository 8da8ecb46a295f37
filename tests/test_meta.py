"""The released 196B model built on the meta device: parameter counts, the 804 checkpoint names and
shapes, checkpoint dtypes and the active-parameter count, all against docs/architecture.md §3 and §4 (the
expected values below are typed in from there, not derived from step35 code)."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from step35.config import preset
from step35.model import Step35ForCausalLM, build_model

# Spec section 4.
TOTAL_WITH_MTP = 199_384_301_376
TOTAL_WITHOUT_MTP = 196_956_130_368
ACTIVE_NON_EMBEDDING = 10_931_395_840
ACTIVE_WITH_LM_HEAD = 11_459_353_856
NUM_TENSORS = 804

H, V, E, I_MOE, I_DENSE = 4096, 128896, 288, 1280, 11264
FULL_LAYERS = set(range(0, 45, 4))  # 0, 4, ..., 44 (docs/architecture.md §1.3, layer map)


def _attention_shapes(sliding: bool) -> dict[str, tuple[int, ...]]:
    # Spec section 3: full-attention layer table; sliding layer: q 12288, o 12288, g 96.
    nq = 96 if sliding else 64
    return {
        "input_layernorm.weight": (4096,),
        "self_attn.q_proj.weight": (nq * 128, 4096),
        "self_attn.k_proj.weight": (1024, 4096),
        "self_attn.v_proj.weight": (1024, 4096),
        "self_attn.o_proj.weight": (4096, nq * 128),
        "self_attn.g_proj.weight": (nq, 4096),
        "self_attn.q_norm.weight": (128,),
        "self_attn.k_norm.weight": (128,),
        "post_attention_layernorm.weight": (4096,),
    }


DENSE_MLP = {
    "mlp.gate_proj.weight": (11264, 4096),
    "mlp.up_proj.weight": (11264, 4096),
    "mlp.down_proj.weight": (4096, 11264),
}

MOE = {
    "moe.gate.weight": (288, 4096),
    "moe.router_bias": (288,),
    "moe.gate_proj.weight": (288, 1280, 4096),
    "moe.up_proj.weight": (288, 1280, 4096),
    "moe.down_proj.weight": (288, 4096, 1280),
    "share_expert.gate_proj.weight": (1280, 4096),
    "share_expert.up_proj.weight": (1280, 4096),
    "share_expert.down_proj.weight": (4096, 1280),
}

MTP_EXTRA = {
    "enorm.weight": (4096,),
    "hnorm.weight": (4096,),
    "eh_proj.weight": (4096, 8192),
    "transformer.shared_head.norm.weight": (4096,),
    "transformer.shared_head.output.weight": (128896, 4096),
}


def expected_names_and_shapes(with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    table = {
        "model.embed_tokens.weight": (128896, 4096),
        "model.norm.weight": (4096,),
        "lm_head.weight": (128896, 4096),
    }
    for i in range(45):
        layer = dict(_attention_shapes(sliding=i not in FULL_LAYERS))
        layer.update(DENSE_MLP if i < 3 else MOE)
        table.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    if with_mtp:
        for i in (45, 46, 47):  # MTP layers: sliding shapes, dense MLP, own head
            layer = dict(_attention_shapes(sliding=True))
            layer.update(DENSE_MLP)
            layer.update(MTP_EXTRA)
            table.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return table


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def meta_models():
    rss0 = _rss()
    full = build_model(preset("flash-196b"))  # meta by default
    no_mtp = build_model(preset("flash-196b"), num_mtp_layers=0)
    return full, no_mtp, _rss() - rss0


def test_expected_table_matches_spec_counts():
    # The table typed in above reproduces the totals of docs/architecture.md §4 (guards the table itself).
    table = expected_names_and_shapes()
    assert len(table) == NUM_TENSORS
    assert sum(_numel(s) for s in table.values()) == TOTAL_WITH_MTP
    assert sum(_numel(s) for s in expected_names_and_shapes(False).values()) == TOTAL_WITHOUT_MTP


def test_parameter_counts(meta_models):
    full, no_mtp, _ = meta_models
    assert sum(t.numel() for t in full.state_dict().values()) == TOTAL_WITH_MTP
    assert sum(t.numel() for t in no_mtp.state_dict().values()) == TOTAL_WITHOUT_MTP
    # router_bias is a buffer, not a parameter: parameters alone miss exactly 42 x 288 values.
    assert sum(p.numel() for p in full.parameters()) == TOTAL_WITH_MTP - 42 * 288


def test_state_dict_names_and_shapes(meta_models):
    full, no_mtp, _ = meta_models
    got = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    want = expected_names_and_shapes(True)
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert len(got) == NUM_TENSORS
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert bad == {}
    got_no_mtp = {k: tuple(v.shape) for k, v in no_mtp.state_dict().items()}
    assert got_no_mtp == expected_names_and_shapes(False)
    assert len(got_no_mtp) == NUM_TENSORS - 3 * 17


def test_checkpoint_dtypes(meta_models):
    full, _, _ = meta_models
    dtypes = full.checkpoint_dtypes()
    assert set(dtypes) == set(expected_names_and_shapes(True))
    for name, dtype in dtypes.items():
        want = torch.float32 if name.endswith("moe.router_bias") else torch.bfloat16
        assert dtype == want, name
    assert sum(1 for n in dtypes if n.endswith("router_bias")) == 42
    # Spec section 3: 398,768,626,944 bytes = bf16 everywhere + fp32 router bias.
    nbytes = sum(t.numel() * (4 if dtypes[n] == torch.float32 else 2) for n, t in full.state_dict().items())
    assert nbytes == 398_768_626_944


def test_build_model_in_the_stored_dtype():
    # build_model(dtype=) casts every weight but keeps the router bias fp32: the checkpoint's dtypes.
    model = build_model(preset("flash-196b"), dtype=torch.bfloat16)
    got = {name: t.dtype for name, t in model.state_dict().items()}
    assert got == model.checkpoint_dtypes()
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}


def test_nothing_allocated(meta_models):
    full, no_mtp, rss_growth = meta_models
    for model in (full, no_mtp):
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            assert t.device.type == "meta", name
    # 199B params in bf16 would be ~400 GB; building both models must stay far below that.
    assert rss_growth < 200 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"


def active_parameters(model: Step35ForCausalLM, include_lm_head: bool = False) -> int:
    """Parameters used per token, from the model's shapes: every main-layer tensor, except that an
    MoE layer uses top_k of its stacked experts and not its selection-only router bias; no
    embedding (a lookup), no MTP layers; lm_head optionally."""
    cfg = model.config
    total = model.model.norm.weight.numel()
    for layer in model.model.layers[: cfg.num_hidden_layers]:
        for name, t in layer.state_dict().items():
            if name.startswith("moe.") and name.endswith("_proj.weight"):
                assert t.shape[0] == cfg.moe_num_experts
                total += t[0].numel() * cfg.moe_top_k  # one expert's slice times top-k
            elif name.endswith("router_bias"):
                continue
            else:
                total += t.numel()
    if include_lm_head:
        total += model.lm_head.weight.numel()
    return total


def test_active_parameters(meta_models):
    full, no_mtp, _ = meta_models
    assert active_parameters(full) == ACTIVE_NON_EMBEDDING
    assert active_parameters(no_mtp) == ACTIVE_NON_EMBEDDING
    assert active_parameters(full, include_lm_head=True) == ACTIVE_WITH_LM_HEAD
