"""Selective activation checkpointing keeps the expert-parallel all-to-all outputs and split sizes:
the backward replay of a layer runs no all-to-all and no host read of split sizes (2 gloo ranks,
EP 2, the tiny model's 4 MoE layers, counted per step by tests/dist/ep_all_to_all_count.py)."""

import json
from pathlib import Path

import pytest

from tests.dist.cases import case_args
from tests.runner import run_script

SCRIPT = Path(__file__).parent / "dist" / "ep_all_to_all_count.py"


def counts(tmp_path: Path, *modes: str) -> list[dict]:
    """The counts of each activation checkpointing mode, all from one 2-rank job."""
    out = tmp_path / "counts.json"
    run_script(SCRIPT, 2, "--out", str(out), *case_args({ac: ["--ac", ac] for ac in modes}), timeout=400)
    found = json.loads(out.read_text())
    return [found[ac] for ac in modes]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_selective_checkpointing_replays_no_all_to_all(tmp_path):
    none, selective, full = counts(tmp_path, "none", "selective", "full")
    layers = none["moe_layers"]
    assert layers == 4
    # forward: count exchange + rows out + their routing weights out + rows back (weighted) per MoE layer; one
    # split-size read each
    for c in (none, selective, full):
        assert c["forward"] == 4 * layers and c["host_syncs_forward"] == layers
        assert c["live_split_entries"] == 0  # nothing left behind once the step's graph is gone
    # backward without checkpointing: the gradients of the rows, the weights and the rows back
    assert none["backward"] == 3 * layers and none["host_syncs"] == layers
    # selective: the same; the replay reuses the kept all-to-all outputs and split sizes
    assert selective["backward"] == 3 * layers and selective["host_syncs"] == layers
    # full checkpointing replays the whole forward, communication included (the contrast)
    assert full["backward"] == 7 * layers and full["host_syncs"] == 2 * layers
    assert none["loss"] == selective["loss"] == full["loss"]
