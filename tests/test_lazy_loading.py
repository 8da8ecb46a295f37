"""Per-rank lazy loading of an HF checkpoint on 4 gloo ranks (FSDP x EP 2): each rank reads only
its own slices and its host memory grows by about its shard, not by the model."""

import json
from pathlib import Path

import pytest
import torch

from step35.checkpoint.hf.pretrained import save_pretrained
from step35.config import Step35Config
from step35.model import Step35ForCausalLM
from tests.helpers import tiny_config
from tests.runner import run_script

ROOT = Path(__file__).parent.parent
WORLD = 4


def wide_tiny() -> Step35Config:
    """The tiny layout with wider experts, so the checkpoint (~190 MB) dwarfs interpreter noise."""
    return tiny_config(
        hidden_size=256, moe_num_experts=16, moe_intermediate_size=1024, share_expert_dim=256, intermediate_size=512
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_each_rank_reads_only_its_slices(tmp_path):
    model = Step35ForCausalLM(wide_tiny())
    model.init_weights(seed=5)
    save_pretrained(model, tmp_path / "hf", max_shard_size="40MB")
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    total = sum(sizes.values())
    replicated = sum(v for n, v in sizes.items() if n.endswith("router_bias"))  # buffers: a copy per rank
    run_script(
        ROOT / "tests" / "dist" / "lazy_load.py",
        WORLD,
        "--checkpoint",
        str(tmp_path / "hf"),
        "--ep",
        "2",
        "--out",
        str(tmp_path),
        timeout=500,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # Every byte of the checkpoint is read exactly once across ranks (replicated buffers once per rank).
    assert sum(r["bytes_read"] for r in ranks) == total + (WORLD - 1) * replicated
    for r in ranks:
        assert r["bytes_read"] == r["local_bytes"]  # what a rank read is what it holds
        assert r["bytes_read"] < 0.3 * total  # ~1/4 of the model each
        # Peak host memory grows by about the shard, not the model. Measured (2 cores, 2026-11-30):
        # shard 53.6 MB, growth 77-78 MB (mapped file pages and the slice being copied), model 214 MB;
        # a rank that read the whole model would grow by >= 214 MB.
        assert r["peak_rss_growth"] < 0.5 * total, (r, total)
    # And the shards put together are the checkpoint, bit for bit.
    loaded = torch.load(tmp_path / "full.pt")
    reference = model.state_dict()
    assert loaded.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(loaded[name], value), name
