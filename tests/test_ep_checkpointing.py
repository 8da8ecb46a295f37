"""Selective activation checkpointing keeps the expert-parallel all-to-all outputs and split sizes:
the backward replay of a layer runs no all-to-all and no host read of split sizes (2 gloo ranks,
EP 2, the tiny model's 4 MoE layers, counted per step by tests/dist/ep_all_to_all_count.py)."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.runner import run_process_group

SCRIPT = Path(__file__).parent / "dist" / "ep_all_to_all_count.py"
ROOT = Path(__file__).parent.parent


def counts(tmp_path: Path, ac: str) -> dict:
    out = tmp_path / f"{ac}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
           "--ac", ac, "--out", str(out)]
    proc = run_process_group(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_selective_checkpointing_replays_no_all_to_all(tmp_path):
    none, selective, full = (counts(tmp_path, ac) for ac in ("none", "selective", "full"))
    layers = none["moe_layers"]
    assert layers == 4
    # forward: count exchange + rows out + rows back per MoE layer; one split-size read each
    for c in (none, selective, full):
        assert c["forward"] == 3 * layers and c["host_syncs_forward"] == layers
        assert c["live_split_entries"] == 0  # nothing left behind once the step's graph is gone
    # backward without checkpointing: the two row all-to-alls' gradients
    assert none["backward"] == 2 * layers and none["host_syncs"] == layers
    # selective: the same; the replay reuses the kept all-to-all outputs and split sizes
    assert selective["backward"] == 2 * layers and selective["host_syncs"] == layers
    # full checkpointing replays the whole forward, communication included (the contrast)
    assert full["backward"] == 5 * layers and full["host_syncs"] == 2 * layers
    assert none["loss"] == selective["loss"] == full["loss"]
