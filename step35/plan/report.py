"""The plan as a readable table (per device) and as JSON with the same numbers (bytes, seconds)."""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from step35.kernels.sequence_split import rank_tokens
from step35.plan.lora import activations_per_token
from step35.plan.planner import GiB, Plan, activation_shape
from step35.plan.rollout import cached_tokens
from step35.training.reference import ADAPTERS_OFF, FROZEN_COPY

_REFERENCE = {
    None: "no reference",
    ADAPTERS_OFF: "the reference: the policy with its adapters off",
    FROZEN_COPY: "the reference: its frozen copy",
}


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _dtype(d: torch.dtype | None) -> str:
    return "-" if d is None else str(d).removeprefix("torch.")


def layout_line(p: Plan) -> str:
    s = p.settings
    cp = s.context_parallel_size
    par = (
        (
            f"FSDP over {s.world_size} ranks, EP {s.expert_parallel_size} (efsdp {p.efsdp})"
            + (f", HSDP replicate {s.replicate_size}" if s.replicate_size > 1 else "")
            + (
                f", context parallel {cp} ({rank_tokens(s.seq_len, cp)} tokens of each sequence per rank)"
                if cp > 1
                else ""
            )
        )
        if s.sharded
        else "1 device, unsharded"
    )
    return (
        f"{s.num_nodes} node(s) x {s.devices_per_node} devices; {par}; activation checkpointing "
        f"{s.activation_checkpointing}; micro-batch {s.micro_batch_size} x seq {s.seq_len}"
    )


def adapter_activation_line(p: Plan) -> str:
    """Bytes per token the adapters keep, by layer kind (per layer, and how many layers), and the total."""
    s = p.settings
    mtp = s.num_mtp_layers if s.train_mtp else 0
    per_layer = activations_per_token(
        p.trained, s.model_config, s.lora, activation_shape(s).act_bytes, s.activation_checkpointing, num_mtp_layers=mtp
    )
    kinds: dict[str, list[float]] = {}
    for by_kind in per_layer.values():
        for kind, per_token in by_kind.items():
            kinds.setdefault(kind, []).append(per_token)
    total = sum(sum(v) for v in kinds.values()) * activation_shape(s).tokens
    where = {
        "none": "kept",
        "selective": "kept (with their matmul results)",
        "full": "not kept: rebuilt block by block in backward",
    }
    return (
        ", ".join(f"{k} {max(v):,.0f} B/token x {len(v)} layers" for k, v in kinds.items())
        + f"; {total / GiB:.2f} GiB per micro-batch over all layers, {where[s.activation_checkpointing]}"
    )


def host_lines(p: Plan) -> list[str]:
    """The host memory background checkpoint writes stage (RunCheckpoint async_save), per rank and per node."""
    if not p.settings.async_save:
        return []
    s, per_rank = p.settings, p.state.checkpoint_bytes
    lines = [
        "",
        "Host memory (RunCheckpoint async_save: each rank's checkpoint share staged for the background write)",
        f"  staging per rank    {_gib(per_rank)}   trained parameters + optimizer states + buffers, as saved",
        f"  staging per node    {_gib(p.staging_per_node)}   x {s.devices_per_node} ranks"
        + (f", of {p.host_memory_gib:g} GiB host memory" if p.host_memory_gib is not None else ""),
    ]
    if p.staging_exceeds_host:
        lines.append(
            f"WARNING: the staging ({p.staging_per_node / GiB:.2f} GiB per node) exceeds the node's "
            f"{p.host_memory_gib:g} GiB of host memory (--host-memory-gib): saves fall back to synchronous (or the "
            f"node swaps); save synchronously, or on more nodes"
        )
    return lines


def text(p: Plan) -> str:
    """The plan as people read it: the run, what a rank holds, the peak by phase and the verdict, the
    speed bounds, and the layouts that would fit."""
    lines = _run_lines(p) + ["", "Per device (rank 0 holds the largest shards)", "  held for the whole run"]
    lines += _held_lines(p) + _transient_lines(p) + _activation_lines(p) + rollout_lines(p) + eval_lines(p)
    lines += _peak_lines(p)
    lines += host_lines(p) + rollout_host_lines(p)
    lines += ["", "Speed (upper bounds: kernels at peak, balanced routing)"] + _speed_lines(p)
    return "\n".join(lines + _alternative_lines(p))


def _run_lines(p: Plan) -> list[str]:
    """The model, the layout, the dtypes and the device; LoRA, carried weights and notes when there are."""
    s, st = p.settings, p.state
    cfg = s.model_config
    mtp = (
        f"{s.num_mtp_layers} MTP layer(s) held"
        + (
            ", trained"
            if s.train_mtp
            else ", frozen (mtp_loss_weight 0): no gradients, optimizer states or activations"
        )
        if s.num_mtp_layers
        else "no MTP layers"
    )
    lines = [
        f"step35 plan  ({p.seconds:.1f} s)",
        f"model      {s.model_source}: {_count(st.params_total)} parameters, {cfg.num_hidden_layers} layers, "
        f"{cfg.moe_num_experts if cfg.use_moe else 0} experts top-{cfg.moe_top_k}; {mtp}",
        f"layout     {layout_line(p)}",
        f"dtypes     stored {_dtype(s.stored_dtype)} (precision {s.precision}), compute {_dtype(s.compute_dtype)}, "
        f"gradient reduce {_dtype(s.reduce_dtype)}",
        f"device     {p.device.name}: {p.verdict.device_memory / GiB:.1f} GiB",
    ]
    if s.lora is not None:
        lines.append(
            f"lora       {s.lora.describe()}; {_count(st.adapters_total)} adapter parameters, base frozen "
            f"in {_dtype(s.base_dtype)} (no gradients, no optimizer state)"
        )
    if s.carried is not None:
        lines.append(f"vision     {s.carried.describe()}")
    if s.vision is not None:
        lines.append(f"vision     {vision_line(p)}")
    if p.rollout is not None:
        r = p.rollout
        lines.append(
            f"rollouts   {s.objective}: {r.num_generations} completions of up to {r.max_new_tokens} new tokens per "
            f"prompt of up to {s.seq_len} (+1); trained on {s.rows_per_micro_batch} rows x {s.row_tokens} tokens per "
            "micro-batch (packed whole, at most one row each)"
        )
    if s.objective_needs.extra_forwards:
        lines.append(
            f"objective  {s.objective}: {s.objective_needs.extra_forwards} forward(s) without gradients per "
            f"micro-batch beside the policy's ({_REFERENCE[s.objective_needs.reference]})"
        )
    return lines + [f"note       {n}" for n in s.notes]


_VISION_MODE = {
    "trained": "trained (model.vision.train): gradients and optimizer states",
    "frozen": "frozen: no gradients, no optimizer states",
}


def vision_line(p: Plan) -> str:
    """Step-3.7's vision side on the devices: what it is, how it trains, the images one micro-batch encodes."""
    s, v, st = p.settings, p.settings.vision, p.state
    grad = s.vision_grad
    how = _VISION_MODE.get(grad.mode) or (
        "LoRA adapters on "
        + ", ".join(t for t, on in (("vision", grad.blocks), ("vision_projector", grad.projector)) if on)
    )
    line = (
        f"encoder + projector on the devices (model.vision; {how}): {_count(st.vision_total)} parameters, "
        f"{v.num_hidden_layers} blocks of width {v.hidden_size}"
        + (", each an FSDP unit (the rest of the encoder one more; the projector in the root)" if s.sharded else "")
    )
    if s.images is None:
        return line + "; no data.images: the encoder runs on no view"
    im = s.images
    return line + (
        f"; images per micro-batch at most {s.micro_batch_size} window(s) x ({im.max_images} views of "
        f"{im.view_size} px + {im.max_crops} crops of {im.crop_size} px) = {p.vision.tokens:,} encoder tokens, "
        f"{p.vision.features:,} image features"
    )


def _held_lines(p: Plan) -> list[str]:
    """What a rank holds for the whole run: parameters (LoRA: base, adapters, full targets), gradients,
    optimizer states, buffers, the objective's reference copy, the local expert shapes."""
    s, st = p.settings, p.state
    lines = [
        f"    parameters          {_gib(st.params)}   {st.params_local / 1e6:,.1f} M local values",
        f"    gradients           {_gib(st.grads)}   trainable shards",
        f"    optimizer states    {_gib(st.optimizer)}   {s.optimizer}: {s.describe_slots()}",
        f"    buffers             {_gib(st.buffers)}   router biases, token counters",
    ]
    if s.lora is not None:
        full = st.params - st.frozen - st.adapter_params
        lines[-4:-3] = [
            f"    frozen base         {_gib(st.frozen)}   {_dtype(s.base_dtype)} shards, no gradients",
            f"    LoRA adapters       {_gib(st.adapter_params)}   {_dtype(s.stored_dtype)} local shards",
        ]
        if full:
            lines.insert(
                len(lines) - 3, f"    full targets        {_gib(full)}   {_dtype(s.stored_dtype)}, trained whole"
            )
    if st.reference:
        lines.append(
            f"    reference copy      {_gib(st.reference)}   {_dtype(s.reference_dtype)} frozen copy of the start "
            f"model, sharded as the policy (model.objective {s.objective})"
        )
    if s.vision is not None:
        lines.append(
            f"    of which vision     {_gib(st.vision_params)}   parameters; gradients "
            f"{_gib(st.vision_grads).strip()}, optimizer states {_gib(st.vision_optimizer).strip()}"
        )
    if st.expert_shapes:
        shapes = ", ".join(f"{k.removesuffix('.weight')} {v}" for k, v in st.expert_shapes.items())
        lines.append(f"    local experts of one MoE layer: {shapes}")
    return lines


def _transient_lines(p: Plan) -> list[str]:
    """The largest transient buffers: gathered blocks, reduce-scatter, all-to-all, the loss backward."""
    s, t = p.settings, p.transients
    lines = ["  transient buffers (largest)"]
    if s.sharded:
        lines += [
            f"    root gathered       {_gib(t.root_gathered)}   embedding + final norm + lm_head, whole step",
            f"    block all-gather    {_gib(t.block_gather)}   biggest block, x{t.gathered_blocks} in backward "
            f"(prefetch)"
            if s.reshard_after_forward
            else f"    blocks gathered     {_gib(t.block_gather * t.gathered_blocks)}   reshard_after_forward false: all",
            f"    reduce-scatter      {_gib(t.block_grads + t.reduce_scatter)}   block gradients "
            f"({_dtype(s.compute_dtype)}) + {_dtype(s.reduce_dtype)} copy",
        ]
    if s.sharded and s.expert_parallel_size > 1:
        lines.append(f"    EP all-to-all       {_gib(t.all_to_all)}   receive + regrouped rows, one MoE layer")
    lm_head_grad = "fp32 [vocab, hidden] gradient + " if s.lora is None or s.lora.adapts("lm_head") else ""
    lines.append(f"    loss backward       {_gib(t.loss_backward)}   {lm_head_grad}chunk of {s.loss_chunk_size} logits")
    return lines


def _activation_lines(p: Plan) -> list[str]:
    s, act = p.settings, p.activations
    lines = [
        f"  activations         {_gib(act.total)}   {s.activation_checkpointing} checkpointing, one micro-batch"
        + (f" (+{_gib(act.recompute).strip()} rebuilt per block in backward)" if act.recompute else "")
    ]
    parts = sorted(act.parts.items(), key=lambda kv: -kv[1])[:6]
    lines.append("    largest parts: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts) + " GiB")
    if s.lora is not None:
        lines.append("    LoRA adapters add: " + adapter_activation_line(p))
    if p.vision is not None:
        lines.append("    vision: " + vision_activation_line(p))
    return lines


def vision_activation_line(p: Plan) -> str:
    """What the vision forward keeps (per view of each size), and its transients."""
    v, s = p.vision, p.settings
    work = (
        f"; transient: the features before the splice {_gib(v.features_bytes).strip()}, one encoder block's work "
        f"<= {_gib(v.block_work).strip()}"
    )
    if not v.total:
        return f"nothing kept ({v.mode}: no gradient asked of the encoder){work}"
    views = ", ".join(f"{nbytes / 1024**2:,.2f} MiB per {side} px view" for side, nbytes in v.per_view.items())
    how = f"{v.checkpointing} checkpointing of the encoder blocks"
    return f"{_gib(v.total).strip()} kept in {_dtype(s.vision_dtype)}, {how} ({views}){work}"


def _main_layer_counts(cfg) -> tuple[int, int, int]:
    """(full-attention, sliding-window, MoE) main layers: what a KV cache and the recorded routes span."""
    specs = [cfg.layer(i) for i in range(cfg.num_hidden_layers)]
    return sum(not x.sliding for x in specs), sum(x.sliding for x in specs), sum(x.is_moe for x in specs)


def rollout_lines(p: Plan) -> list[str]:
    """One prompt's rollout on the device (plan/rollout.py): the KV cache, the prefill, the recorded routes."""
    r, s = p.rollout, p.settings
    if r is None:
        return []
    cfg = s.model_config
    full, sliding, moe = _main_layer_counts(cfg)
    G, dtype = r.num_generations, _dtype(s.compute_dtype)
    kept = cached_tokens(cfg.sliding_window, s.seq_len, r.max_new_tokens)
    return [
        f"  rollouts            one prompt's {G} rows at a time, before each micro-batch's forward",
        f"    KV cache            {_gib(r.decode_cache)}   end of decoding: {full} full layers x {r.window_tokens} "
        f"tokens, {sliding} sliding x {kept}; {dtype} (at the prefill {_gib(r.prefill_cache).strip()})",
        f"    KV concatenation    {_gib(r.decode_copy)}   one layer's old storage beside the step's new one",
        f"    prefill layer work  {_gib(r.prefill_work)}   one layer on {G} x {s.seq_len + 1} tokens, no gradients",
        f"    recorded routes     {_gib(r.decode_routes)}   int16 top-{cfg.moe_top_k} x {moe} MoE layers x {G} x "
        f"{r.window_tokens} tokens, recorded + joined (then on the host)",
    ]


def eval_lines(p: Plan) -> list[str]:
    """EvalCallback's generation on the device (plan/rollout.py eval_generation_memory): one prompt record's
    KV cache, its concatenation copy and prefill work, and the prompt length it is counted with."""
    e, s = p.eval_generation, p.settings
    if e is None:
        return []
    cfg = s.model_config
    full, sliding, _ = _main_layer_counts(cfg)
    kept = cached_tokens(cfg.sliding_window, s.seq_len, e.max_new_tokens)
    every = s.eval_generation.every_n_steps
    return [
        f"  eval generation     EvalCallback every {every} steps, after the optimizer step: one prompt record's "
        f"{e.rows} row(s) of <= {e.max_new_tokens} new tokens at a time",
        f"    KV cache            {_gib(e.decode_cache)}   end of decoding: {full} full layers x {e.window_tokens} "
        f"tokens, {sliding} sliding x {kept}; {_dtype(s.eval_dtype)} (at the prefill {_gib(e.prefill_cache).strip()})",
        f"    + one layer's concatenation {_gib(e.decode_copy).strip()}, prefill layer work "
        f"{_gib(e.prefill_work).strip()}; prompts counted at <= data.seq_len + 1 = {s.seq_len + 1} ids "
        f"(EvalCallback cuts none: a longer one holds more)",
    ] + draft_lines(p)


def draft_lines(p: Plan) -> list[str]:
    """EvalCallback's MTP draft scoring (plan/drafts.py): every depth's logits of one validation micro-batch."""
    d, s = p.eval_drafts, p.settings
    if d is None:
        return []
    where = "head" if d.peak_at_head else "MTP block"
    return [
        f"    MTP draft logits    {_gib((d.depths + 1) * d.head_logits)}   main head + {d.depths} depth(s) at once: "
        f"{d.tokens} tokens x {s.model_config.vocab_size} vocab, {_dtype(s.eval_dtype)}; "
        f"{s.eval_generation.mtp_batches} validation batch(es), one at a time",
        f"    + at the peak (last {where}): {_gib(d.logits).strip()} of logits + {_gib(d.beside).strip()} "
        f"hidden states/work; MTP layer gathered {_gib(d.block_gather).strip()}",
    ]


def rollout_host_lines(p: Plan) -> list[str]:
    """The rollouts' routes kept on the host until their micro-batch's loss (every micro-batch of the step)."""
    r, s = p.rollout, p.settings
    if r is None:
        return []
    return [
        "",
        "Host memory (rollouts: each completion's recorded routes, kept with the step's rollouts)",
        f"  routes per rank     {_gib(r.host_routes)}   {s.accumulate_grad_batches} micro-batch(es) x "
        f"{s.micro_batch_size} prompts x {r.num_generations}, + one micro-batch packed into its rows",
        f"  routes per node     {_gib(r.host_routes * s.devices_per_node)}   x {s.devices_per_node} ranks",
    ]


def _peak_lines(p: Plan) -> list[str]:
    """The peak by phase, what is required of the device, and whether it fits."""
    v = p.verdict
    lines = ["", "  peak by phase"]
    for ph in p.phases:
        mark = "  <- peak" if ph.name == v.peak_phase else ""
        lines.append(f"    {ph.name:18s}{_gib(ph.total)}{mark}")
    return lines + [
        "",
        f"  peak allocated      {_gib(v.peak)}   ({v.peak_phase})",
        f"  + allocator margin  {_gib(v.allocator_margin)}",
        f"  + runtime reserve   {_gib(v.runtime_reserve)}   context, collective buffers, workspaces",
        f"  = required          {_gib(v.required)}   of {v.device_memory / GiB:.1f} GiB",
        "",
        (
            f"FITS: {v.free / GiB:.1f} GiB free, margin {v.margin_pct:.0f}% of device memory"
            if v.fits
            else f"DOES NOT FIT: needs {v.required / GiB:.1f} GiB, {-v.free / GiB:.1f} GiB more than the device's "
            f"{v.device_memory / GiB:.1f} GiB"
        ),
    ]


def _speed_lines(p: Plan) -> list[str]:
    """FLOPs, bytes moved per step (all-to-all, FSDP, cp, the optimizer's exchange), step time and MFU bounds."""
    s, sp = p.settings, p.speed
    lines = [
        f"  training FLOPs/token    {sp.flops_per_token / 1e9:,.2f} GFLOP (model; "
        f"{sp.hardware_flops_per_token / 1e9:,.2f} with recomputation)",
        f"  tokens per rank-step    {sp.tokens_per_rank_step:,}",
        f"  all-to-all per step     {sp.all_to_all_bytes / GiB:,.2f} GiB sent per rank",
        f"  FSDP per step           {sp.fsdp_gather_bytes / GiB:,.2f} GiB gathered + "
        f"{sp.fsdp_reduce_bytes / GiB:,.2f} GiB reduce-scattered per rank",
    ]
    if s.context_parallel_size > 1:
        lines.append(
            f"  cp K/V per step         {sp.context_bytes / GiB:,.2f} GiB received per rank "
            f"(all-gathers, reduce-scatters, halos)"
        )
    label = s.optimizer_kind.exchange_label
    if label:
        lines.append(
            f"  {label + ' per step':24s}{sp.muon_bytes / GiB:,.2f} GiB sent per rank "
            f"(whole matrices to their owners and back, fp32)"
        )
    if p.vision is not None:
        lines.append("  vision encoder          not in these bounds: its compute (its FSDP gathers are)")
    if p.rollout is not None:
        lines.append(
            "  rollouts                not in these bounds: their decoding, one token per forward, comes first"
        )
    return lines + [
        f"  step time >=            {sp.step_seconds_overlapped:.3f} s (compute {sp.compute_seconds:.3f}, "
        f"intra-node {sp.intra_node_seconds:.3f}, inter-node {sp.inter_node_seconds:.3f}; "
        f"{p.device.peak_tflops:g} TFLOP/s, {p.device.intra_node_gbps:g}/{p.device.inter_node_gbps:g} GB/s)",
        f"  MFU <=                  {100 * sp.mfu_bound:.0f}% with full overlap, {100 * sp.mfu_serial:.0f}% "
        f"with none; <= {sp.tokens_per_second_per_device:,.0f} tokens/s per device",
    ]


def _alternative_lines(p: Plan) -> list[str]:
    """The nearest layouts that fit, and other ways on the same devices (LoRA, context parallelism)."""
    lines = []
    if p.suggestions:
        lines += ["", "Nearest layouts that fit:"]
        for alt in p.suggestions:
            lines.append(
                f"  {layout_line(alt)}: {alt.verdict.margin_pct:.0f}% margin "
                f"({alt.verdict.required / GiB:.1f} of {alt.verdict.device_memory / GiB:.1f} GiB)"
            )
    elif not p.verdict.fits:
        lines += ["", "No layout with up to 64x the nodes fits this device."]
    if p.other_ways:
        lines += ["", "Other ways on the same devices:"]
        lines += [f"  {w.what}: {_verdict(w.verdict)}" for w in p.other_ways]
    return lines


def _verdict(v) -> str:
    return (
        f"FITS, {v.margin_pct:.0f}% margin" if v.fits else "DOES NOT FIT"
    ) + f" ({v.required / GiB:.1f} of {v.device_memory / GiB:.1f} GiB)"


def _summary(p: Plan) -> dict:
    s = p.settings
    return {
        "num_nodes": s.num_nodes,
        "devices_per_node": s.devices_per_node,
        "world_size": s.world_size,
        "expert_parallel_size": s.expert_parallel_size,
        "efsdp": p.efsdp,
        "context_parallel_size": s.context_parallel_size,
        "replicate_size": s.replicate_size,
        "activation_checkpointing": s.activation_checkpointing,
        "micro_batch_size": s.micro_batch_size,
        "accumulate_grad_batches": s.accumulate_grad_batches,
        "seq_len": s.seq_len,
        "required_bytes": p.verdict.required,
        "margin_pct": round(p.verdict.margin_pct, 2),
        "fits": p.verdict.fits,
    }


def as_dict(p: Plan) -> dict:
    s = p.settings
    return {
        "model": {
            "source": s.model_source,
            "params_total": p.state.params_total,
            "num_mtp_layers": s.num_mtp_layers,
            "mtp_trained": s.train_mtp,
        },
        "layout": _summary(p),
        "dtypes": {
            "stored": _dtype(s.stored_dtype),
            "compute": _dtype(s.compute_dtype),
            "reduce": _dtype(s.reduce_dtype),
            "precision": s.precision,
        },
        "device": asdict(p.device),
        "state": asdict(p.state),
        "transients": asdict(p.transients),
        "activations": asdict(p.activations),
        "phases": {ph.name: {"total": ph.total, **ph.rows} for ph in p.phases},
        "verdict": asdict(p.verdict),
        "speed": asdict(p.speed),
        "suggestions": [_summary(alt) for alt in p.suggestions],
        "other_ways": [
            {
                "what": w.what,
                "fits": w.verdict.fits,
                "required_bytes": w.verdict.required,
                "margin_pct": round(w.verdict.margin_pct, 2),
            }
            for w in p.other_ways
        ],
        "lora": None
        if s.lora is None
        else {
            **{k: v for k, v in asdict(s.lora).items() if k != "options"},
            "adapter_params": p.state.adapters_total,
            "base_dtype": _dtype(s.base_dtype),
        },
        "rollout": None if p.rollout is None else asdict(p.rollout),
        "eval_generation": None
        if p.eval_generation is None
        else {
            **asdict(s.eval_generation),
            **asdict(p.eval_generation),
            "prompt_tokens": s.seq_len + 1,
            "dtype": _dtype(s.eval_dtype),
        },
        "eval_drafts": None
        if p.eval_drafts is None
        else {**asdict(p.eval_drafts), "peak_at_head": p.eval_drafts.peak_at_head, "logits": p.eval_drafts.logits},
        "carried": None if s.carried is None else asdict(s.carried),  # on the host, in no per-device number
        "vision": vision_dict(p),
        "host_staging": None
        if not s.async_save
        else {
            "per_rank_bytes": p.state.checkpoint_bytes,
            "per_node_bytes": p.staging_per_node,
            "host_memory_gib": p.host_memory_gib,
            "exceeds_host_memory": p.staging_exceeds_host,
        },
        "notes": s.notes,
        "seconds": round(p.seconds, 3),
    }


def vision_dict(p: Plan) -> dict | None:
    """model.vision's numbers: its config, how it trains, the images counted, its bytes on rank 0."""
    s, st, v = p.settings, p.state, p.vision
    if s.vision is None:
        return None
    return {
        "config": asdict(s.vision),
        "mode": s.vision_grad.mode,
        "images": None if s.images is None else asdict(s.images),
        "params_total": st.vision_total,
        "param_bytes": st.vision_params,
        "grad_bytes": st.vision_grads,
        "optimizer_bytes": st.vision_optimizer,
        "activation_dtype": _dtype(s.vision_dtype),
        "activations": {**asdict(v), "total": v.total},
    }


def as_json(p: Plan) -> str:
    return json.dumps(as_dict(p), indent=2)
