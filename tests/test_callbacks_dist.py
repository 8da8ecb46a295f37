"""The observability callbacks, bias update and divergence guard under torchrun (2 processes, gloo,
Step35Strategy with EP 2, full activation checkpointing, bf16 FSDP compute): rank 0's logged expert
counts are the sum of what each rank routed, the router biases stay identical across ranks, a NaN on
one rank makes both skip the same step and name the same parameter, the sequence aux loss reaches
the loss through FSDP's input casting and checkpoint replays, and memory max/min over ranks are logged."""

import csv
import json
from pathlib import Path

import pytest

from tests.runner import run_script

SCRIPT = Path(__file__).parent / "dist" / "observability_run.py"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_ranks_expert_counts_bias_and_guard(tmp_path):
    nan_step, steps = 1, 4
    run_script(
        SCRIPT,
        2,
        "--out",
        str(tmp_path),
        "--ep",
        "2",
        "--steps",
        str(steps),
        "--accum",
        "2",
        "--nan-step",
        str(nan_step),
        "--nan-rank",
        "1",
        "--ac",
        "full",
        "--param-dtype",
        "bfloat16",
        timeout=540,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    run = tmp_path / "csv" / "version_0"
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))

    # Both ranks skipped the step whose gradient went NaN on rank 1 only, naming the same parameter.
    for r in ranks:
        assert r["skipped_steps"] == 1
        assert r["guard_message"].startswith(f"step {nan_step}: non-finite gradients in 1 of")
        assert "first in backward order: model.layers.2.moe.gate.weight" in r["guard_message"]

    # Expected window counts: sum over ranks of each rank's own recount, skipped step left out.
    def expected(window_steps):
        return [
            [
                sum(r["recount"][str(s)][layer][e] for r in ranks for s in window_steps if s != nan_step)
                for e in range(8)
            ]
            for layer in range(4)
        ]

    for end in (2, 4):  # monitor windows: steps {0, 1} and {2, 3} (0-based), written at steps 2 and 4
        want = expected(range(end - 2, end))
        with open(run / "expert_load" / f"counts_step{end:07d}.csv") as f:
            got = [list(map(int, row[1:])) for row in list(csv.reader(f))[1:]]
        assert got == want, (end, got, want)
        logged = next(r for r in rows if r.get("expert_load/layer1/routed") and int(r["step"]) == end - 1)
        for i, layer in enumerate((1, 2, 3, 4)):
            assert float(logged[f"expert_load/layer{layer}/routed"]) == sum(want[i])
    # each kept step routes 2 ranks x 2 micro-batches x 2 x 32 tokens x top-2 per layer
    assert sum(expected(range(0, 2))[0]) == 1 * 2 * 2 * 64 * 2
    assert sum(expected(range(2, 4))[0]) == 2 * 2 * 2 * 64 * 2

    # The bias update ran from global counts: identical on both ranks, and it moved.
    assert ranks[0]["router_bias"] == ranks[1]["router_bias"]
    assert any(b != 0 for layer in ranks[0]["router_bias"] for b in layer)

    memory = [r for r in rows if r.get("memory/peak_gib_max")]
    assert memory and all(float(r["memory/peak_gib_max"]) >= float(r["memory/peak_gib_min"]) > 0 for r in memory)
    assert any(r.get("throughput/mfu") for r in rows)
    # coef 0.01 x a balance loss near 1, at every step: the collector got through FSDP's input
    # casting (a list would have been copied and the aux loss lost)
    aux = [float(r["train/aux_loss"]) for r in rows if r.get("train/aux_loss")]
    assert len(aux) == steps and all(0.009 < a < 0.02 for a in aux), aux
