"""One prepared device check for a lent GPU (run once, ~3 minutes): correctness of the CUDA paths
against the CPU ones, then speed. Writes a JSON report to $OUT (or ./cuda_check.json).

    PYTHONPATH=. python benchmarks/cuda_check.py

1. kernels: torch._grouped_mm (bf16) vs the per-expert loop; FlexAttention sliding window and
   packed-document block masks vs SDPA with a dense mask, forward and backward.
   Context parallelism's attention (cp 4 simulated in one process: gathered and halo keys, with and
   without documents) vs whole-sequence attention, forward and backward.
2. the tiny model: CUDA bf16 logits vs CPU fp32 logits of the same weights.
3. speed: a wider config (hidden 2048, 8 layers, 64 experts top-8) at 4K tokens in bf16: step time,
   tokens/s, model TFLOP/s (FLOPs formula of docs/architecture.md §5) and MFU against the H100/H200 dense bf16 peak.
"""

import json
import os
import time

import torch

from step35.config import PRESETS, Step35Config, preset
from step35.flops import training_flops_per_token
from step35.kernels.attention import attention
from step35.kernels.grouped_gemm import _grouped_mm_by_segments, grouped_mm
from step35.kernels.masks import DocumentMask, SequenceShard, causal_mask
from step35.model import build_model

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def check_kernels(report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w = torch.randn(16, 512, 1024, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    counts = torch.bincount(torch.randint(0, 16, (4096,), device="cuda", generator=g), minlength=16)
    y = grouped_mm(x, w, counts)
    ref = _grouped_mm_by_segments(x, w, counts)
    grad = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    report["grouped_mm_rel_err"] = {"out": rel(y, ref), "grad_x": rel(gx, rx), "grad_w": rel(gw, rw)}
    q = torch.randn(2, 12, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(2, 4, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = attention(q, k, v, window=512, scale=128**-0.5)  # FlexAttention on CUDA
    mask = causal_mask(2048, 512, "cuda")
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=128**-0.5, enable_gqa=True)
    go = torch.randn_like(out)
    a = torch.autograd.grad(out, (q, k, v), go)
    b = torch.autograd.grad(dense, (q, k, v), go)
    report["flex_sliding_rel_err"] = {
        "out": rel(out, dense),
        **{f"grad_{n}": rel(i, j) for n, i, j in zip("qkv", a, b)},
    }
    # packed documents (data.document_masking): FlexAttention document block mask vs the dense mask
    positions = torch.cat([torch.arange(n, device="cuda") for n in (700, 300, 1048)])[None].repeat(2, 1)
    docs = DocumentMask(positions)
    for window in (None, 512):
        out = attention(q, k, v, window=window, scale=128**-0.5, documents=docs)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=docs.dense(window), scale=128**-0.5, enable_gqa=True
        )
        a = torch.autograd.grad(out, (q, k, v), go)
        b = torch.autograd.grad(dense, (q, k, v), go)
        report[f"flex_documents_window{window}_rel_err"] = {
            "out": rel(out, dense),
            **{f"grad_{n}": rel(i, j) for n, i, j in zip("qkv", a, b)},
        }


def cp_share_attention_errors(device: str, dtype: torch.dtype, seq: int, cp: int, windows, documents: bool) -> dict:
    """Context parallelism's attention (kernels.masks.SequenceShard) on `device`, every cp rank simulated in
    this process (the exchanges read the whole K/V): the ranks' outputs and the gradients of q, k, v
    summed over ranks against whole-sequence attention. Relative errors per window."""
    from step35.kernels.sequence_split import chunk_tokens, local_positions

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 8, seq, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(1, 1, seq, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(1, 1, seq, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
    go = torch.randn(1, 8, seq, 64, device=device, dtype=dtype, generator=g)
    lens = (seq // 3, seq // 2, seq - seq // 3 - seq // 2)
    docs = DocumentMask(torch.cat([torch.arange(n, device=device) for n in lens])[None]) if documents else None
    c = chunk_tokens(seq, cp)
    errors = {}
    for window in windows:
        whole = attention(q, k, v, window, 0.125, documents=docs)
        ref = torch.autograd.grad(whole, (q, k, v), go)
        kv = torch.stack([k, v])
        outs, total = [], 0
        for r in range(cp):
            p = local_positions(seq, cp, r, device)

            def halo(x, n, p=p, kv=kv):
                pieces = []
                for start in (p[0], p[c]):
                    idx = start + torch.arange(-n, 0, device=device)
                    pieces.append(kv[..., idx.clamp(min=0), :] * (idx >= 0).to(dtype)[:, None])
                return torch.cat(pieces, dim=-2)

            shard = SequenceShard(p, seq, c, docs.ids if docs else None, gather=lambda x, kv=kv: kv, halo=halo)
            out = attention(q[:, :, p], k[:, :, p], v[:, :, p], window, 0.125, documents=shard)
            outs.append((p, out))
            total = total + (out.float() * go[:, :, p].float()).sum()
        got = torch.autograd.grad(total, (q, k, v))
        out = torch.empty_like(whole)
        for p, o in outs:
            out[:, :, p] = o.detach()
        errors[f"window{window}"] = {
            "out": rel(out, whole),
            **{f"grad_{n}": rel(i, j) for n, i, j in zip("qkv", got, ref)},
        }
    return errors


def check_context_parallel(report: dict) -> None:
    """The cp attention's CUDA path (FlexAttention with PositionMask block masks), forward and backward."""
    for documents in (False, True):
        report[f"cp4_share_attention_documents{int(documents)}_rel_err"] = cp_share_attention_errors(
            "cuda", torch.bfloat16, 2048, 4, (None, 129, 512), documents
        )


def check_tiny(report: dict) -> None:
    model = build_model(preset("tiny"), device="cpu")
    model.init_weights(0)
    ids = torch.randint(0, 1024, (2, 256))
    with torch.no_grad():
        cpu = model(ids)
        gpu = model.to("cuda", torch.bfloat16)(ids.cuda()).float().cpu()
    report["tiny_cuda_bf16_vs_cpu_fp32_rel_err"] = rel(gpu, cpu)


def bench_wide(report: dict) -> None:
    raw = PRESETS["tiny"]()
    raw.update(
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 8,
            "moe_layers_enum": "1,2,3,4,5,6,7",
            "moe_num_experts": 64,
            "moe_top_k": 8,
            "moe_intermediate_size": 768,
            "share_expert_dim": 768,
            "num_attention_heads": 16,
            "head_dim": 128,
            "num_attention_groups": 4,
            "vocab_size": 32768,
            "sliding_window": 512,
            "num_nextn_predict_layers": 0,
            "layer_types": (["full_attention"] + ["sliding_attention"] * 3) * 2,
            "rope_theta": [5e6, 1e4, 1e4, 1e4] * 2,
            "partial_rotary_factors": [0.5, 1, 1, 1] * 2,
            "swiglu_limits": [0.0] * 6 + [7.0, 7.0],
            "swiglu_limits_shared": [0.0] * 7 + [16.0],
            "attention_other_setting": {
                "attention_type": "sliding_attention",
                "num_attention_heads": 24,
                "num_attention_groups": 4,
                "head_dim": 128,
            },
        }
    )
    config = Step35Config.from_dict(raw)
    model = build_model(config, device="cpu")
    model.init_weights(0)
    model.to("cuda", torch.bfloat16)
    tokens = torch.randint(0, config.vocab_size, (2, 4097), device="cuda")
    times = []
    for step in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.loss(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        torch.cuda.synchronize()
        if step >= 3:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    step = sorted(times)[len(times) // 2]
    flops = training_flops_per_token(config, 4096) * tokens[:, 1:].numel()
    report["wide_bf16_4k"] = {
        "step_s": step,
        "tokens_per_s": tokens[:, 1:].numel() / step,
        "tflops": flops / step / 1e12,
        "mfu": flops / step / 1e12 / PEAK_TFLOPS,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for check in (check_kernels, check_context_parallel, check_tiny, bench_wide):
        try:
            check(report)
        except Exception as e:  # keep going: one broken path must not hide the others
            report[check.__name__ + "_error"] = f"{type(e).__name__}: {e}"
    out = os.path.join(os.environ.get("OUT", "."), "cuda_check.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
