"""How long a checkpoint save holds the training loop: synchronous against `RunCheckpoint(async_save=true)`.

Two ranks (torchrun, gloo on the CPU, or one GPU each with `--accelerator gpu`), Step35Strategy with EP 2, the
model of benchmarks/activation_memory.py's `issue10` shape (hidden 256, 6 layers, 32 experts top-4; ~18 M
parameters, ~0.2 GB of fp32 weights and AdamW moments), a save every `--every` steps. Each mode runs as its own
job, the modes alternating `--rounds` times; prints one JSON row per save and a summary row per mode with the
medians of `checkpoint/blocking_s` (the loop held), `checkpoint/save_s` (until the checkpoint was complete) and
the step time, read from the runs' CSV logs.

    python benchmarks/async_checkpoint.py                       # CPU, 2 ranks
    python benchmarks/async_checkpoint.py --accelerator gpu     # 2 GPUs
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from activation_memory import _issue10_shape  # noqa: E402  (the shared benchmark model)

CONFIG = """
seed_everything: 0
trainer:
  accelerator: {accelerator}
  devices: 2
  precision: 32-true
  max_steps: {steps}
  limit_val_batches: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: step35.strategy.Step35Strategy
    init_args:
      expert_parallel_size: 2
  logger:
    - class_path: step35.loggers.CSVLogger
      init_args:
        name: csv
  callbacks:
    - class_path: step35.callbacks.RunCheckpoint
      init_args:
        every_n_train_steps: {every}
        keep_last: 2
        async_save: {async_save}
    - class_path: step35.callbacks.SpeedMonitor
      init_args:
        every_n_steps: 2
model:
  config: {model_config}
  warmup_steps: 2
data:
  seq_len: {seq}
  micro_batch_size: {batch}
  num_workers: 0
"""


def run(folder: Path, async_save: bool, args) -> dict:
    name = "async" if async_save else "sync"
    config = folder / f"{name}.yaml"
    config.write_text(
        CONFIG.format(
            accelerator=args.accelerator,
            steps=args.steps,
            every=args.every,
            async_save=str(async_save).lower(),
            model_config=folder / "config.json",
            seq=args.seq,
            batch=args.batch,
        )
    )
    run_dir = folder / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*cmd, "-m", "step35", "fit", "--config", str(config), f"--run_dir={run_dir}"],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{result.stderr[-4000:]}")
    (metrics,) = run_dir.glob("csv/version_*/metrics.csv")
    rows = list(csv.DictReader(open(metrics)))
    saves = [
        {k: float(r[k]) for k in ("checkpoint/blocking_s", "checkpoint/save_s", "checkpoint/bytes")}
        for r in rows
        if r.get("checkpoint/save_s")
    ]
    step_times = [float(r["throughput/step_time_s"]) for r in rows if r.get("throughput/step_time_s")]
    return {"mode": name, "saves": saves, "step_times": step_times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    summary: dict[str, dict[str, list[float]]] = {"sync": {}, "async": {}}
    with tempfile.TemporaryDirectory(prefix="step35-bench-ckpt-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(_issue10_shape()))
        for _ in range(args.rounds):
            for async_save in (False, True):
                result = run(folder, async_save, args)
                for save in result["saves"]:
                    print(json.dumps({"mode": result["mode"], **save}), flush=True)
                into = summary[result["mode"]]
                for save in result["saves"]:
                    for key, value in save.items():
                        into.setdefault(key, []).append(value)
                into.setdefault("step_time_s", []).extend(result["step_times"])
    for mode, values in summary.items():
        row = {"mode": mode, "saves": len(values.get("checkpoint/save_s", []))}
        row.update({f"median {k}": round(statistics.median(v), 4) for k, v in values.items() if v})
        print(json.dumps({"summary": row, "machine": os.uname().machine, "accelerator": args.accelerator}))


if __name__ == "__main__":
    main()
