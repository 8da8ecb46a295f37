"""Forward+backward time of one training micro-batch, on whatever device is given, with model
TFLOP/s from the FLOPs formula of docs/architecture.md §5. Run by hand; results go to docs/benchmarks.md.

    python benchmarks/step_time.py --config tiny --device cpu --batch 8 --seq 128
    python benchmarks/step_time.py --config tiny --device cuda --dtype bfloat16 --batch 8 --seq 4096
"""

import argparse
import json
import platform
import time

import torch

from step35.config import load_config
from step35.flops import training_flops_per_token
from step35.model import build_model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mtp", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    config = load_config(args.config)
    model = build_model(config, config.num_nextn_predict_layers if args.mtp else 0, device="cpu")
    model.init_weights(0)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=args.device)
    times = []
    for step in range(args.steps + 2):
        sync(args.device)
        start = time.perf_counter()
        out = model.loss(tokens[:, :-1], tokens[:, 1:], mtp_loss_weight=args.mtp)
        out.loss.backward()
        sync(args.device)
        if step >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    step_time = sorted(times)[len(times) // 2]
    n_tokens = args.batch * args.seq
    flops = training_flops_per_token(config, args.seq, model.num_mtp_layers if args.mtp else 0) * n_tokens
    print(
        json.dumps(
            {
                "config": args.config,
                "device": args.device,
                "dtype": args.dtype,
                "batch": args.batch,
                "seq": args.seq,
                "median_step_s": round(step_time, 4),
                "tokens_per_s": round(n_tokens / step_time),
                "model_tflops": round(flops / step_time / 1e12, 4),
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
