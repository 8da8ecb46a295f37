"""The CUDA attention path for sliding windows and packed documents, run on the CPU.

Every GPU run's sliding-window and document-masked attention goes through
`step35.kernels.attention._flex_attention` with the block masks built in step35/kernels/masks.py.
torch compiles FlexAttention's forward for the CPU too (its backward is not supported there), so the
forward, masks included, is checked here against the CPU path (`kernels.attention.attention` on CPU:
SDPA with an explicit boolean mask) at every landing. The first call compiles (tens of seconds); the
three cases share the compiled function.
"""

import pytest
import torch

from step35.kernels.attention import _compiled_flex_attention, _flex_attention, attention
from step35.kernels.masks import DocumentMask, sliding_block_mask

pytestmark = pytest.mark.heavy  # compiles FlexAttention for the CPU (tens of seconds)

B, HQ, HKV, S, D = 2, 4, 2, 256, 32
WINDOW = 64
# Row 0: documents of 100 and 156 tokens; row 1: 170 and 86 (a boundary inside a 128-token block).
DOCUMENT_STARTS = ((0, 100), (0, 170))


def packed_positions() -> torch.Tensor:
    rows = []
    for starts in DOCUMENT_STARTS:
        ends = [*starts[1:], S]
        rows.append(torch.cat([torch.arange(end - start) for start, end in zip(starts, ends)]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def qkv():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, S, D, generator=generator)
    k = torch.randn(B, HKV, S, D, generator=generator)
    v = torch.randn(B, HKV, S, D, generator=generator)
    return q, k, v


@pytest.fixture(scope="module", autouse=True)
def flex_available():
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no FlexAttention")
    yield
    _compiled_flex_attention.cache_clear()
    sliding_block_mask.cache_clear()


@pytest.mark.parametrize(
    "window, packed", [(WINDOW, False), (None, True), (WINDOW, True)], ids=["window", "documents", "window+documents"]
)
def test_flex_forward_matches_the_cpu_path(qkv, window, packed):
    q, k, v = qkv
    scale = D**-0.5
    documents = DocumentMask(packed_positions()) if packed else None
    expected = attention(q, k, v, window, scale, documents)  # CPU: SDPA with the dense mask
    with torch.no_grad():
        got = _flex_attention(q, k, v, window, scale, documents)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # The masks mattered: without them the output differs (a test of an unmasked call would pass too).
    unmasked = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    assert (got - unmasked).abs().max() > 1e-2
