"""Context parallelism (trainer.strategy.context_parallel_size): the load-balanced split, the
attention of a share against gathered or halo keys, bad sizes refused with the valid ones listed,
and on real gloo ranks (with FSDP2 and EP) the same loss and gradients as one process, in
`step35 fit` too. (The bytes a cp-2 rank keeps for backward are measured in tests/test_plan_cp.py, beside the
plan's prediction of them: one measurement for both.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from step35.kernels.attention import _flex_attention, attention
from step35.kernels.masks import DocumentMask, PositionMask
from step35.kernels.sequence_split import chunk_owner, chunk_tokens, exchanged_tokens, local_positions
from step35.parallel import ParallelConfigError, ParallelDims, valid_cp_sizes
from tests.dist.cases import case_args
from tests.helpers import simulated_shard, write_run_config
from tests.runner import cli_fit, run_dist_script

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "tests" / "dist" / "cp_equivalence.py"
REL = 1e-5


# ------------------------------------------------------------------------------ the split
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_split_covers_every_token_once_and_balances_causal_work(cp):
    S = 64
    shares = [local_positions(S, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(shares).sort().values, torch.arange(S))
    # causal attention work of a query = its position + 1: the same on every rank
    work = {int((p + 1).sum()) for p in shares}
    assert len(work) == 1, work
    assert torch.equal(local_positions(S, cp, cp - 1), local_positions(S, cp, cp - 1))  # deterministic
    c = chunk_tokens(S, cp)
    for r, p in enumerate(shares):
        assert p[:c].tolist() == list(range(r * c, (r + 1) * c))
        assert p[c:].tolist() == list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    assert [chunk_owner(j, 2) for j in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]


# ------------------------------------------------------------------------------ attention of a share
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_share_attention_equals_whole_sequence_attention(cp, docs):
    torch.manual_seed(0)
    B, Hq, Hkv, S, D = 2, 8, 1, 32, 8  # the release's 8 query heads per KV group
    q, k, v = torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    pos_ids = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ([5, 13, 9, 5], [20, 12])])
    documents = DocumentMask(pos_ids) if docs else None
    c = chunk_tokens(S, cp)
    # windows: itself only, shorter than a chunk, chunk + 1 (the largest halo at cp 4), longer, full
    for window in (1, 3, c + 1, 12, None):
        whole = attention(q, k, v, window, 0.3, documents=documents)
        for r in range(cp):
            p = local_positions(S, cp, r)
            shard = simulated_shard(k, v, p, S, c, documents.ids if docs else None)
            uses_halo = shard.uses_halo(window)
            assert uses_halo == (window is not None and 1 < window <= c + 1)
            got = attention(q[:, :, p], k[:, :, p], v[:, :, p], window, 0.3, documents=shard)
            torch.testing.assert_close(
                got, whole[:, :, p], rtol=1e-5, atol=1e-6, msg=f"cp {cp} rank {r} window {window}"
            )


@pytest.mark.parametrize("cp", [2, 4])
def test_the_planned_exchange_is_the_keys_a_share_reads_beyond_its_own(cp):
    """kernels.sequence_split.exchanged_tokens (what `step35 plan` counts per layer) against the keys
    SequenceShard.keys hands to the attention kernel: the remote S - S / cp of a gathering layer, two
    halos of window - 1, none for a window of 1 (each token reads itself)."""
    S = 32
    c = chunk_tokens(S, cp)
    k = v = torch.zeros(1, 1, S, 2)
    for window in (1, 2, 3, c + 1, c + 2, S, None):
        for r in range(cp):
            p = local_positions(S, cp, r)
            _, keys, _, _ = simulated_shard(k, v, p, S, c, None).keys(k[:, :, p], v[:, :, p], window)
            assert keys.shape[-2] - len(p) == exchanged_tokens(window, S, cp), (cp, r, window)


def test_position_mask_flex_attention_forward_matches_on_cpu():
    """The CUDA path's block mask (FlexAttention, compiled) on the CPU, forward only (torch 2.13 has
    no CPU backward): a share's queries against gathered and halo keys, with documents."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    B, Hq, Hkv, S, D, cp = 1, 4, 2, 256, 16, 2
    q, k, v = torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    pos_ids = torch.cat([torch.arange(100), torch.arange(156)])[None]
    documents = DocumentMask(pos_ids)
    c = chunk_tokens(S, cp)
    for window in (None, 33):
        whole = attention(q, k, v, window, 0.25, documents=documents)
        p = local_positions(S, cp, 1)
        shard = simulated_shard(k, v, p, S, c, documents.ids)
        kv = shard.gather(None) if window is None else None
        if window is None:
            mask = PositionMask(p, torch.arange(S), documents.ids[:, p], documents.ids)
            got = _flex_attention(q[:, :, p], kv[0], kv[1], None, 0.25, mask)
        else:
            n = window - 1
            halo = shard.halo(None, n)
            keys = torch.cat(
                [
                    halo[..., :n, :],
                    torch.stack([k, v])[..., p[:c], :],
                    halo[..., n:, :],
                    torch.stack([k, v])[..., p[c:], :],
                ],
                dim=-2,
            )
            before = torch.arange(-n, 0)
            k_pos = torch.cat([p[0] + before, p[:c], torch.full((n,), -1), p[c:]])  # rank 1 of 2: chunks adjacent
            mask = PositionMask(p, k_pos, documents.ids[:, p], documents.ids[:, k_pos.clamp(min=0)])
            got = _flex_attention(q[:, :, p], keys[0], keys[1], window, 0.25, mask)
        torch.testing.assert_close(got, whole[:, :, p], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ bad sizes
def test_bad_sizes_are_refused_with_the_valid_ones():
    with pytest.raises(
        ParallelConfigError,
        match=r"context_parallel_size=8 is larger than the world size 4 "
        r"\(valid: \[1, 2, 4\]\)",
    ):
        ParallelDims(4, context_parallel_size=8)
    with pytest.raises(
        ParallelConfigError,
        match=r"context_parallel_size=3 must divide the world size 4 "
        r"\(valid: \[1, 2, 4\]\)",
    ):
        ParallelDims(4, context_parallel_size=3)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size=3 must divide num_experts=8"):
        ParallelDims(6, 3, num_experts=8, context_parallel_size=2)
    dims = ParallelDims(8, 2, num_experts=8, context_parallel_size=4)
    assert (dims.data_parallel_size, dims.data_parallel_rank(5)) == (2, 1)
    dims.check_seq_len(64)
    with pytest.raises(
        ParallelConfigError,
        match=r"context_parallel_size=4 needs data.seq_len divisible by 2 x cp = 8 "
        r".*data.seq_len=36 .*valid cp sizes for this world size 8: \[1, 2\]",
    ):
        dims.check_seq_len(36)
    assert valid_cp_sizes(8, 36) == [1, 2]


def test_a_sequence_the_split_cannot_cut_is_refused_at_forward_time_as_at_setup():
    from step35.parallel.context import ContextParallel

    cp = ContextParallel.__new__(ContextParallel)  # the length check comes before any communication
    cp.size, cp.rank, cp.world_size = 4, 0, 8
    with pytest.raises(
        ParallelConfigError,
        match=r"context_parallel_size=4 needs data.seq_len divisible by 2 x cp = 8 "
        r".*data.seq_len=36 .*valid cp sizes for this world size 8: \[1, 2\]",
    ):
        cp.split(torch.zeros(1, 36, dtype=torch.long))


def test_halo_longer_than_a_chunk_is_refused():
    from step35.parallel.context import ContextParallel

    cp = ContextParallel.__new__(ContextParallel)  # the size check comes before any communication
    with pytest.raises(
        ParallelConfigError,
        match=r"a halo of 9 keys does not fit in one chunk of 8 tokens: a sliding "
        r"window longer than chunk \+ 1 = 9 must gather",
    ):
        cp.halo(torch.zeros(1, 1, 16, 4), 9)


def test_aux_loss_with_context_parallel_is_refused():
    from tests.helpers import tiny_model

    model = tiny_model()
    model.context_parallel = object()  # refused before the split is asked for
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="moe_aux_loss_coef > 0 with context parallelism"):
        model.loss(ids, ids, moe_aux_loss_coef=0.01)


# ------------------------------------------------------------------------------ real ranks
CP_CASES = [(2, "none"), (4, "selective")]  # on 4 ranks, one job for both


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    """{f"cp{cp}_{ac}": results} of every CP_CASES case, one torchrun job on 4 ranks."""
    cases = {f"cp{cp}_{ac}": ["--cp", str(cp), "--ep", "2", "--ac", ac] for cp, ac in CP_CASES}
    return run_dist_script(SCRIPT, tmp_path_factory.mktemp("cp") / "results.pt", 4, *case_args(cases), timeout=800)


@pytest.mark.multiprocess
@pytest.mark.timeout(1000)  # the first case waits for the job
@pytest.mark.parametrize("cp,ac", [*CP_CASES, pytest.param(2, "full", marks=pytest.mark.slow)])
def test_cp_with_ep_matches_one_process(request, tmp_path, cp, ac):
    """4 gloo ranks, EP 2, cp 2 (two data-parallel groups) or cp 4, with activation checkpointing
    (the exchanges replayed in backward): loss and every parameter's gradient as one process, for
    sliding windows shorter than a chunk, of chunk + 1 keys and longer, documents crossing chunk
    borders, MTP on."""
    if (cp, ac) in CP_CASES:
        results = request.getfixturevalue("four_ranks")[f"cp{cp}_{ac}"]
    else:
        results = run_dist_script(
            SCRIPT, tmp_path / f"cp{cp}.pt", 4, "--cp", str(cp), "--ep", "2", "--ac", ac, timeout=500
        )
    assert len(results) == 4
    for case, r in results.items():
        assert r["missing"] == [], (case, r["missing"])
        assert r["dp_group_sum"] == r["dp"] == 4 // cp  # Meshes.data_parallel_group: one rank per cp group
        assert abs(r["loss"] - r["ref_loss"]) <= REL * abs(r["ref_loss"]), (case, r["loss"], r["ref_loss"])
        assert len(r["grad_errors"]) == 96  # every parameter, MTP layer included
        worst = max(r["grad_errors"], key=r["grad_errors"].get)
        assert r["grad_errors"][worst] <= REL, (case, worst, r["grad_errors"][worst])


# (`step35 fit` with cp 2 against one process, through each launcher: tests/test_launchers.py)


def test_fit_refuses_a_cp_larger_than_the_world(tmp_path, builtin_cache, capfd):
    proc = cli_fit(
        capfd,
        write_run_config(tmp_path),
        tmp_path / "run",
        builtin_cache,
        "--trainer.strategy=step35.strategy.Step35Strategy",
        "--trainer.strategy.context_parallel_size=2",
        check=False,
    )
    assert proc.returncode != 0
    assert "context_parallel_size=2 is larger than the world size 1 (valid: [1])" in proc.stderr, proc.stderr[-3000:]


def test_speed_monitor_counts_a_cp_ranks_share_of_the_tokens():
    """Every rank of a cp group sees the whole batch but computes 1/cp of it: tokens/s and TFLOP/s
    per device count that share (tokens/s over the world is then the batch tokens, once)."""
    from types import SimpleNamespace

    from step35.callbacks import SpeedMonitor

    batch = {"input_ids": torch.zeros(2, 33, dtype=torch.long)}
    counted = {}
    for cp in (1, 2):
        monitor = SpeedMonitor(every_n_steps=1)
        monitor._config = None  # (on_train_start sets it from the module: no FLOPs counted here)
        trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(context_parallel_size=cp))
        monitor.on_train_batch_end(trainer, None, None, batch, 0)
        counted[cp] = monitor._tokens
    assert counted == {1: 64, 2: 32}


@pytest.mark.parametrize("documents", [False, True])
def test_share_attention_forward_and_backward_summed_over_ranks(documents):
    """The device check's cp attention comparison (benchmarks/cuda_check.py, run there on CUDA in
    bf16) on the CPU in fp32: all cp 4 ranks' outputs and the q, k, v gradients summed over them equal
    whole-sequence attention's, for full attention, a halo window and a gathered window."""
    from benchmarks.cuda_check import cp_share_attention_errors

    errors = cp_share_attention_errors("cpu", torch.float32, 64, 4, (None, 5, 12), documents)
    for window, errs in errors.items():
        assert max(errs.values()) <= 1e-5, (window, errs)
