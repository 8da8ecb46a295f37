"""The NPU kernel calls (step35/accelerators.py) checked on CPU, without an NPU:

- `npu_attention` (full, sliding window, document-masked varlen) and, under context parallelism,
  `kernels.attention.npu_position_attention` (a rank's chunks against gathered or halo keys) with
  `torch_npu.npu_fusion_attention` replaced by Huawei's own CPU reference of that kernel,
  `msprobe.pytorch.bench_functions.npu_fusion_attention` from the `mindstudio-probe` package, against
  our CPU attention path. The
  reference decodes the compressed 2048 x 2048 mask for sparse modes 2/3/4 and applies
  pre_tockens / next_tockens itself, so our sparse-mode arguments are checked by Huawei's code.
  It has no TND (varlen) layout: the stand-in below runs it once per `actual_seq_qlen` segment, as
  Ascend's documentation describes varlen (each segment its own sequence); that part is ours.
  Skipped when mindstudio-probe is not installed (a test-only dependency: its own requirements,
  tensorboard, skl2onnx, pandas, ..., are not needed for this one module and are not installed).
- `npu_grouped_matmul` (no reference exists): our forward/backward against a stand-in written from
  the documented argument conventions (group_list cumulative, group_type 0 splits M, 2 splits K),
  compared with the per-expert loop.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from step35 import accelerators
from step35.kernels.attention import _varlen_segments, attention, npu_position_attention
from step35.kernels.grouped_gemm import _grouped_mm_by_segments
from step35.kernels.masks import DocumentMask, causal_mask


def _load_reference():
    """Huawei's npu_fusion_attention reference, loaded from its file as shipped. The msprobe package's
    __init__ imports its whole tool suite (tensorboard, ...); the module itself needs only numpy,
    einops, msprobe's constants (loaded from their file) and a logger (a plain logging.Logger here)."""
    spec = importlib.util.find_spec("msprobe")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("einops") is None:
        pytest.skip(
            "mindstudio-probe (and einops) not installed: `pip install --no-deps --upgrade --target .oracle -r tests/oracles.txt`"
        )
    root = Path(spec.submodule_search_locations[0])

    def load(name: str, path: Path):
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module

    utils = types.ModuleType("msprobe.pytorch.common.utils")
    utils.logger = logging.getLogger("msprobe")
    saved = {name: sys.modules.get(name) for name in ("msprobe.pytorch.common.utils", "msprobe.core.common.const")}
    try:
        sys.modules["msprobe.pytorch.common.utils"] = utils
        sys.modules["msprobe.core.common.const"] = load("msprobe.core.common.const", root / "core/common/const.py")
        return load("step35_msprobe_npu_fusion_attention", root / "pytorch/bench_functions/npu_fusion_attention.py")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.fixture(scope="module")
def reference():
    return _load_reference()


@pytest.fixture
def fake_torch_npu(monkeypatch):
    module = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def _reference_kernel(reference, calls: list):
    """torch_npu.npu_fusion_attention on CPU: BNSD straight to Huawei's reference; TND one
    actual_seq_qlen segment at a time (each segment [T_i, N, D] as a [1, N, T_i, D] sequence)."""

    def npu_fusion_attention(
        q,
        k,
        v,
        head_num,
        input_layout,
        *,
        atten_mask=None,
        scale=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        sparse_mode=0,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
    ):
        calls.append(
            {
                "layout": input_layout,
                "sparse_mode": sparse_mode,
                "pre_tockens": pre_tockens,
                "next_tockens": next_tockens,
                "actual_seq_qlen": actual_seq_qlen,
                "actual_seq_kvlen": actual_seq_kvlen,
            }
        )
        kw = dict(
            atten_mask=atten_mask,
            scale=scale,
            pre_tockens=pre_tockens,
            next_tockens=next_tockens,
            sparse_mode=sparse_mode,
        )
        if input_layout == "BNSD":
            return reference.npu_fusion_attention(q, k, v, head_num, "BNSD", **kw)
        assert input_layout == "TND" and actual_seq_qlen[-1] == q.shape[0] and actual_seq_kvlen[-1] == k.shape[0]
        assert len(actual_seq_qlen) == len(actual_seq_kvlen)
        outs, q_start, kv_start = [], 0, 0
        for q_end, kv_end in zip(actual_seq_qlen, actual_seq_kvlen):  # segment i: its queries, its keys
            seg = [
                t[a:b].transpose(0, 1)[None]
                for t, a, b in ((q, q_start, q_end), (k, kv_start, kv_end), (v, kv_start, kv_end))
            ]  # [1, N, T_i, D]
            outs.append(reference.npu_fusion_attention(*seg, head_num, "BNSD", **kw)[0][0].transpose(0, 1))
            q_start, kv_start = q_end, kv_end
        return (torch.cat(outs),)

    return npu_fusion_attention


CASES = [  # (window, documents)
    (None, False),  # full attention through the fused kernel (sparse mode 3)
    (5, False),  # sliding window: band (sparse mode 4)
    (None, True),  # full layer over packed documents: varlen TND, causal per document
    (5, True),  # sliding layer over packed documents: varlen TND, band per document
]


@pytest.mark.parametrize("window,documents", CASES)
def test_npu_attention_matches_huawei_reference(reference, fake_torch_npu, window, documents):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D = 2, 6, 2, 16, 8
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 0, 1, 2, 3], list(range(11)) + list(range(5))])
    docs = DocumentMask(positions) if documents else None
    calls: list = []
    fake_torch_npu.npu_fusion_attention = _reference_kernel(reference, calls)
    got = accelerators.npu_attention(q, k, v, window, 0.35, docs)
    expected = attention(q, k, v, window, 0.35, documents=docs)  # the CPU path
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, atol=2e-6, rtol=1e-5)  # reference runs in float64
    (call,) = calls
    assert call["sparse_mode"] == (4 if window else 3)
    assert call["layout"] == ("TND" if documents else "BNSD")
    if documents:
        assert call["actual_seq_qlen"] == [9, 12, 16, 27, 32]
    # the band bites: a window one key wider gives a different output
    if window:
        calls.clear()
        wider = accelerators.npu_attention(q, k, v, window + 1, 0.35, docs)
        assert not torch.allclose(wider.float(), expected, atol=1e-3)


def test_reference_band_semantics_directly(reference):
    """pre_tockens = window - 1, next_tockens = 0 in sparse mode 4 keeps exactly i - window < j <= i
    (read off the reference's decoded mask: True = masked)."""
    S, window = 12, 4
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    masked = reference.generate_atten_mask(4, compressed, 1, 1, S, S, window - 1, 0, torch.float64).bool()
    assert torch.equal(~masked, causal_mask(S, window))
    causal = reference.generate_atten_mask(3, compressed, 1, 1, S, S, 2147483647, 2147483647, torch.float64).bool()
    assert torch.equal(~causal, causal_mask(S, None))


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_huawei_reference(reference, fake_torch_npu, cp, docs):
    """Under context parallelism each rank's two chunks of queries (global positions) against the
    gathered or halo keys: the NPU calls (kernels.attention.npu_position_attention: varlen TND with
    causal offsets for full layers, an explicit mask for sliding windows) give, through Huawei's reference,
    the CPU path's cp attention and the whole sequence's, and the CPU path's gradients. Windows: itself only, shorter than a chunk,
    chunk + 1 (the largest halo), longer than a chunk (gathered), full; documents cross chunk borders."""
    from step35.kernels.sequence_split import chunk_tokens, local_positions
    from tests.helpers import simulated_shard

    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, S, D = 2, 4, 2, 32, 8
    q, k, v = (torch.randn(B, h, S, D, generator=g, requires_grad=True) for h in (Hq, Hkv, Hkv))
    pos_ids = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ([5, 13, 9, 5], [20, 12])])
    documents = DocumentMask(pos_ids) if docs else None
    c = chunk_tokens(S, cp)
    calls: list = []
    fake_torch_npu.npu_fusion_attention = _reference_kernel(reference, calls)
    for window in (1, 3, c + 1, 12, None):
        whole = attention(q, k, v, window, 0.3, documents=documents)
        for r in range(cp):
            p = local_positions(S, cp, r)
            shard = simulated_shard(k, v, p, S, c, documents.ids if docs else None)
            expected = attention(q[:, :, p], k[:, :, p], v[:, :, p], window, 0.3, documents=shard)  # CPU
            whole_p = whole[:, :, p].detach()
            calls.clear()
            w, keys, values, mask = shard.keys(k[:, :, p], v[:, :, p], window)
            got = npu_position_attention(q[:, :, p], keys, values, w, 0.3, mask, {})
            where = f"cp {cp} rank {r} window {window}"
            torch.testing.assert_close(got.float(), expected, atol=2e-6, rtol=1e-5, msg=where)
            torch.testing.assert_close(got.float(), whole_p, atol=2e-6, rtol=1e-5, msg=where)
            # backward: the reference is plain torch ops (float64), so autograd runs through it and through
            # our key selection (index_select / halo assembly) back to the whole sequence's q, k, v
            cot = torch.randn(got.shape, generator=g)
            grads = torch.autograd.grad((got.float() * cot).sum(), (q, k, v))
            expected_grads = torch.autograd.grad((expected * cot).sum(), (q, k, v))
            for name, a, b in zip("qkv", grads, expected_grads):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{where}: d{name}")
            (call,) = calls
            assert (call["layout"], call["sparse_mode"]) == (("TND", 3) if w is None else ("BNSD", 0)), where
            if w is None and not docs:  # per row, one segment per run of positions (the last rank's chunks are
                # adjacent: one run), each reading the keys from 0 to its last query (causal offset = its start)
                runs = [c, 2 * c] if p[c] != p[c - 1] + 1 else [2 * c]
                ends = [int(p[e - 1]) + 1 for e in runs]
                assert call["actual_seq_qlen"] == runs + [2 * c + e for e in runs], where
                assert call["actual_seq_kvlen"] == [sum(ends[: i + 1]) for i in range(len(ends))] + [
                    sum(ends) + sum(ends[: i + 1]) for i in range(len(ends))
                ], where


def test_context_parallel_varlen_segments_follow_documents():
    """The full layer's TND segments on cp rank 0 of 2 (chunks 0..7 and 24..31), documents [5, 13, 9, 5]:
    runs split at document starts, each reading its document from its first token."""
    from step35.kernels.sequence_split import local_positions
    from tests.helpers import simulated_shard

    S, c = 32, 8
    doc_ids = DocumentMask(torch.cat([torch.arange(n) for n in (5, 13, 9, 5)])[None]).ids
    p = local_positions(S, 2, 0)
    k = torch.zeros(1, 1, S, 2)
    _, keys, _, mask = simulated_shard(k, k, p, S, c, doc_ids).keys(k[:, :, p], k[:, :, p], None)
    q_ends, kv_ends, index = _varlen_segments(mask, 1)
    # queries 0-4 (doc 0), 5-7 (doc 1), 24-26 (doc 2: 18..26), 27-31 (doc 3)
    assert q_ends == [5, 8, 11, 16]
    assert kv_ends == [5, 5 + 3, 8 + 9, 17 + 5]
    assert index.tolist() == list(range(5)) + list(range(5, 8)) + list(range(18, 27)) + list(range(27, 32))


def _documented_grouped_matmul(x_list, weight_list, *, group_list, split_item, group_type, group_list_type):
    """torch_npu.npu_grouped_matmul as documented, for the arguments step35 uses: one x and one
    stacked weight, group_list cumulative (group_list_type 0), one output (split_item 3).
    group_type 0: x [M, K] split along M; weight [G, K, N] -> y [M, N], y_g = x_g @ weight[g].
    group_type 2: x [M, K] split along K, weight [K, N] split along K -> y [G, M, N], y_g = x[:, K_g] @ w[K_g]."""
    assert len(x_list) == len(weight_list) == 1 and split_item == 3 and group_list_type == 0
    x, w = x_list[0], weight_list[0]
    ends = group_list.tolist()
    starts = [0] + ends[:-1]
    if group_type == 0:
        assert w.dim() == 3 and w.shape[0] == len(ends) and w.shape[1] == x.shape[1] and ends[-1] == x.shape[0]
        return [torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends))])]
    assert group_type == 2 and w.dim() == 2 and x.shape[1] == w.shape[0] == ends[-1]
    return [torch.stack([x[:, a:b] @ w[a:b] for a, b in zip(starts, ends)])]


def test_npu_grouped_matmul_argument_conventions(fake_torch_npu):
    fake_torch_npu.npu_grouped_matmul = _documented_grouped_matmul
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 6, generator=g, requires_grad=True)
    weight = torch.randn(4, 7, 6, generator=g, requires_grad=True)  # [G, out, in], nn.Linear layout
    y = accelerators.npu_grouped_matmul(x, weight, counts)
    cot = torch.randn(10, 7, generator=g)
    gx, gw = torch.autograd.grad(y, (x, weight), cot)
    x2, w2 = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y2 = _grouped_mm_by_segments(x2, w2, counts)
    gx2, gw2 = torch.autograd.grad(y2, (x2, w2), cot)
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(gx, gx2)
    torch.testing.assert_close(gw, gw2)
    assert gw[1].abs().sum() == 0  # an expert without rows gets a zero gradient
