"""`step35 plan --config <training yaml> [any step35 fit option]`: will the run fit, and how fast could it go.

Reads the YAML and overrides exactly as `step35 fit` does (same parser, same names), shards the real
model for the simulated world on the meta device, and prints per-device memory, FITS / DOES NOT FIT
(exit code 1 when it does not fit, 2 when the layout is invalid) and a speed bound.

    step35 plan --config configs/flash-196b-4k-npu.yaml
    step35 plan --config configs/flash-196b-4k-gpu.yaml --device h200 --trainer.num_nodes 4
    step35 plan --config configs/flash-196b-4k-gpu.yaml --trainer.strategy.activation_checkpointing selective --json
"""

from __future__ import annotations

import argparse
import sys

from step35.config import ConfigError
from step35.parallel import ParallelConfigError, valid_ep_sizes
from step35.plan.devices import DEFAULT_FOR_ACCELERATOR, DEVICES, Device
from step35.plan.planner import make_plan
from step35.plan.report import as_json, text
from step35.plan.settings import PlanInputError, read_settings
from step35.plan.suggest import expert_rows, other_ways, suggest

FITS, DOES_NOT_FIT, INVALID = 0, 1, 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="step35 plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other option is an option of `step35 fit` (see `step35 fit --help`), e.g. --config, "
        "--trainer.devices, --trainer.num_nodes, --trainer.strategy.expert_parallel_size, "
        "--data.seq_len, --data.micro_batch_size, --model.config. Assumptions: docs/plan.md.",
    )
    p.add_argument(
        "--device",
        choices=sorted(DEVICES),
        default=None,
        help="device model (memory, peak TFLOP/s, links); default by trainer.accelerator: "
        + ", ".join(f"{k} -> {v}" for k, v in DEFAULT_FOR_ACCELERATOR.items()),
    )
    p.add_argument("--device-memory-gib", type=float, default=None, help="device memory (default: the device's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 TFLOP/s of one device")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s per device and direction within a node")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per device and direction across nodes")
    p.add_argument(
        "--allocator-margin",
        type=float,
        default=0.05,
        help="fraction of the peak kept free for allocator fragmentation (default 0.05)",
    )
    p.add_argument(
        "--runtime-reserve-gib",
        type=float,
        default=None,
        help="memory outside the allocator: context, collective buffers (default: the device's)",
    )
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help="host memory per node: checked against what background checkpoint writes stage (RunCheckpoint async_save)",
    )
    p.add_argument("--no-suggestions", action="store_true", help="skip the search for layouts that fit")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    return p


def _device(args, accelerator: str, plan_device: str | None = None) -> Device:
    """--device, else the config's `plan_device`, else the accelerator's default device."""
    from dataclasses import replace

    if args.device is None and plan_device is not None and plan_device.lower() not in DEVICES:
        raise PlanInputError(
            f"plan_device={plan_device!r} is not a device the plan knows (one of: {', '.join(sorted(DEVICES))})"
        )
    base = DEVICES[
        args.device
        or (plan_device.lower() if plan_device else None)
        or DEFAULT_FOR_ACCELERATOR.get(accelerator, "h100")
    ]
    if base.name.startswith("CPU") and args.device_memory_gib is None:
        import psutil

        base = replace(base, memory_gib=psutil.virtual_memory().total / 1024**3)
    changes = {
        k: v
        for k, v in {
            "memory_gib": args.device_memory_gib,
            "peak_tflops": args.peak_tflops,
            "intra_node_gbps": args.intra_node_gbps,
            "inter_node_gbps": args.inter_node_gbps,
        }.items()
        if v is not None
    }
    return replace(base, **changes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, fit_args = parser().parse_known_args(argv)
    try:
        settings = read_settings(fit_args)
        device = _device(args, settings.accelerator, settings.plan_device)
    except (PlanInputError, ConfigError) as err:
        print(f"step35 plan: {err}", file=sys.stderr)
        return INVALID
    cfg = settings.model_config

    def evaluate(layout):
        return make_plan(
            layout, device, allocator_margin=args.allocator_margin, runtime_reserve_gib=args.runtime_reserve_gib
        )

    if settings.sharded:
        experts = cfg.moe_num_experts if cfg.use_moe else None
        ep, world = settings.expert_parallel_size, settings.world_size
        valid = valid_ep_sizes(world, experts, expert_rows(cfg))
        if ep not in valid:
            # The expert count is the model's (a pruned folder may have any): its divisors are the sizes some
            # world size allows, said beside the ones this world size allows.
            what = f"the {experts} experts and the world size" if experts else "the world size"
            rows, divisors = "", ""
            if experts:
                rows = (
                    f", and world / ep (efsdp) must divide each expert's rows (moe_intermediate_size "
                    f"{cfg.moe_intermediate_size}, hidden_size {cfg.hidden_size})"
                )
                divisors = f" (the {experts} experts' divisors: {', '.join(map(str, valid_ep_sizes(experts)))})"
            print(
                f"step35 plan: trainer.strategy.expert_parallel_size={ep} is invalid: it must divide {what} "
                f"{world} ({settings.num_nodes} x {settings.devices_per_node}){rows}. Valid sizes: "
                f"{', '.join(map(str, valid))}{divisors}",
                file=sys.stderr,
            )
            if not args.no_suggestions:
                nearest = sorted(valid, key=lambda d: (abs(d - ep), -d))[:3]
                for alt in (evaluate(settings.with_layout(expert_parallel_size=d)) for d in sorted(nearest)):
                    v = alt.verdict
                    print(
                        f"  expert_parallel_size={alt.settings.expert_parallel_size}: "
                        + (f"FITS, {v.margin_pct:.0f}% margin" if v.fits else "DOES NOT FIT")
                        + f" ({v.required / 1024**3:.1f} of {v.device_memory / 1024**3:.1f} GiB)",
                        file=sys.stderr,
                    )
            return INVALID

    try:
        plan = evaluate(settings)
    except ParallelConfigError as err:
        print(f"step35 plan: {err}", file=sys.stderr)
        return INVALID
    plan.host_memory_gib = args.host_memory_gib
    if not plan.verdict.fits and not args.no_suggestions:
        plan.suggestions = suggest(settings, evaluate)
        plan.other_ways = other_ways(settings, evaluate)
    print(as_json(plan) if args.json else text(plan))
    return FITS if plan.verdict.fits else DOES_NOT_FIT


def run(argv: list[str] | None = None) -> None:
    sys.exit(main(argv))
