"""Planning the released model on a simulated 192-rank world: the real sharding code on the meta
device, in seconds, allocating nothing (torch's fake process group; a subprocess keeps it apart)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def run_plan(*args: str) -> tuple[dict, int]:
    code = ("import json, resource, sys; from dataclasses import asdict; from step35.plan import plan; "
            "p = plan(*sys.argv[1:2], *map(int, sys.argv[2:])); "
            "print(json.dumps({'plan': asdict(p), 'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["plan"], out["rss"] * 1024


@pytest.mark.timeout(300)
def test_flash_196b_on_192_ranks_ep96():
    plan, peak_rss = run_plan("flash-196b", "192", "96")
    assert plan["seconds_to_plan"] < 30  # ~2 s measured on 2 cores
    assert peak_rss < 1.5e9  # the model is 394 GB in bf16: nothing was materialised
    assert plan["efsdp"] == 2
    # 288 experts / ep 96 = 3 per rank; FSDP over efsdp=2 splits each expert's rows (dim 1).
    assert plan["local_expert_shapes"] == {"gate_proj.weight": [3, 640, 4096], "up_proj.weight": [3, 640, 4096],
                                           "down_proj.weight": [3, 2048, 1280]}
    experts_total = 42 * 288 * 3 * 4096 * 1280
    assert plan["local_expert_params"] == experts_total // 192
    assert plan["total_params"] == 196_956_130_368 - 42 * 288  # parameters; router_bias is a buffer
    dense_total = plan["total_params"] - experts_total
    # rank 0 holds the ceil-sized chunk of every dense tensor (e.g. 672 of 128,896 embedding rows)
    assert dense_total / 192 <= plan["local_dense_params"] <= dense_total / 192 * 1.05
    assert plan["flops_per_token"] == pytest.approx(73.506e9, rel=1e-4)  # docs/architecture.md §5, causal-exact


@pytest.mark.timeout(300)
def test_plan_refuses_ep_that_does_not_divide_experts():
    code = "from step35.plan import plan; plan('flash-196b', 192, 64)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "expert_parallel_size=64 must divide num_experts=288" in proc.stderr
