"""Rollout routing replay (model/routing.py): the experts recorded while decoding are the experts the training
forward uses, through packing, activation checkpointing and -1 padding; the routing weights stay the live
router's, so the router still learns."""

import pytest
import torch

from step35.model.routing import RouteRecorder, RouteReplay, RouteReplayError
from step35.parallel.parallelize import apply_activation_checkpointing
from step35.training.rollout import generate_group, pack_rollouts
from tests.helpers.models import tiny_model

PROMPTS = ([1, 5, 9, 13, 17], [1, 7, 3])


def rollout_rows(model, new_tokens: int = 10):
    """Two prompts x 3 samples, packed into rows of 32 inputs (several sequences per row)."""
    sequences = []
    for i, prompt in enumerate(PROMPTS):
        generator = torch.Generator().manual_seed(i)
        group = generate_group(
            model, prompt, 3, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, stop_ids=set(), generator=generator
        )
        sequences += [(group.prompt, c, lp, r) for c, lp, r in zip(group.completions, group.logp, group.routes)]
    return pack_rollouts(sequences, 32)


def logprobs(model, rows, replay: RouteReplay | None):
    share = model.token_logprobs(rows.input_ids, rows.labels, position_ids=rows.position_ids, routing=replay)
    return share.logp, share.routing


def completion_gap(logp: torch.Tensor, rows) -> float:
    mask = rows.sequence_ids >= 0
    return float((logp - rows.rollout_logp)[mask].abs().max())


@pytest.fixture(scope="module")
def rollout():
    model = tiny_model(seed=1).eval()
    return model, rollout_rows(model)


def test_packing_holds_several_sequences_per_row(rollout):
    _, rows = rollout
    assert rows.input_ids.shape[0] < 6  # 6 sequences of 14-16 inputs in rows of 64
    assert int((rows.sequence_ids >= 0).sum()) == 6 * 10


def test_replay_reproduces_the_rollout_after_the_router_bias_moves(rollout):
    model, rows = rollout
    assert completion_gap(logprobs(model, rows, RouteReplay(rows.routes))[0], rows) < 1e-5
    moved = tiny_model(seed=1).eval()  # the same weights, another selection bias (load balancing moved it)
    with torch.no_grad():
        for name, bias in moved.named_buffers():
            if name.endswith("router_bias"):
                bias.add_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    replayed, replay = logprobs(moved, rows, RouteReplay(rows.routes))
    live, _ = logprobs(moved, rows, None)
    assert completion_gap(replayed, rows) < 1e-5
    assert completion_gap(live, rows) > 1e-2  # without replay routes flip and the log-probabilities show it
    assert 0 < int(replay.agreed) < int(replay.compared)  # some routes flipped, measured in the replayed forward


def test_replay_off_measures_agreement_without_imposing(rollout):
    model, rows = rollout
    measured, replay = logprobs(model, rows, RouteReplay(rows.routes, impose=False))
    torch.testing.assert_close(measured, logprobs(model, rows, None)[0], rtol=0, atol=0)
    assert int(replay.agreed) == int(replay.compared) > 0  # same weights: the live router agrees everywhere


def test_routes_shifted_by_one_token_are_caught(rollout):
    """The planted bug: each row's routes one token late. The replayed forward no longer gives the rollout's
    log-probabilities, which is what the replay test above asserts."""
    model, rows = rollout
    shifted = {layer: torch.roll(r, 1, dims=1) for layer, r in rows.routes.items()}
    assert completion_gap(logprobs(model, rows, RouteReplay(shifted))[0], rows) > 1e-3


def test_minus_one_falls_back_to_the_live_router_and_is_counted(rollout):
    model, rows = rollout
    none = {layer: torch.full_like(r, -1) for layer, r in rows.routes.items()}
    replayed, replay = logprobs(model, rows, RouteReplay(none))
    torch.testing.assert_close(replayed, logprobs(model, rows, None)[0], rtol=0, atol=0)
    assert int(replay.fallbacks) == rows.input_ids.numel() * len(rows.routes)
    padding = int((rows.routes[next(iter(rows.routes))] < 0).any(-1).sum())
    assert int(RouteReplay(rows.routes).fallbacks) == 0
    _, counted = logprobs(model, rows, RouteReplay(rows.routes))
    assert int(counted.fallbacks) == padding * len(rows.routes)  # the padding's tokens, in every MoE layer
    assert padding == int((~rows.tokens).sum()) > 0
    _, real = logprobs(model, rows, RouteReplay(rows.routes, counted=rows.tokens))
    assert int(real.fallbacks) == 0 and int(real.compared) == int(rows.tokens.sum()) * len(rows.routes)
    holes = {layer: r.clone() for layer, r in rows.routes.items()}
    first = next(iter(holes))
    holes[first][0, 3] = -1  # a real token recorded without routes in one layer: counted as a fallback
    _, one = logprobs(model, rows, RouteReplay(holes, counted=rows.tokens))
    assert int(one.fallbacks) == 1


def test_each_route_is_used_once_per_forward_and_once_per_recompute(rollout):
    _, rows = rollout
    model = tiny_model(seed=1)
    for layer in model.model.main_layers:
        apply_activation_checkpointing(layer, "full")
    logp, replay = logprobs(model, rows, RouteReplay(rows.routes))
    replay.check_forward()
    assert set(replay.consumed["recompute"].values()) == {0}
    (logp * (rows.sequence_ids >= 0)).sum().backward()
    replay.check_recompute()
    assert set(replay.consumed["forward"].values()) == {1} and set(replay.consumed["recompute"].values()) == {1}
    gate = next(p for n, p in model.named_parameters() if n.endswith("moe.gate.weight"))
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # the router learns from the replayed weights


def test_a_route_used_twice_or_of_the_wrong_shape_names_the_layer(rollout):
    model, rows = rollout
    replay = RouteReplay(rows.routes)
    with torch.no_grad():
        model.model(rows.input_ids, routing=replay)
        with pytest.raises(
            RouteReplayError, match=r"MoE layer \d+: its recorded routes were used twice in one forward"
        ):
            model.model(rows.input_ids, routing=replay)
    short = {layer: r[:, :-1] for layer, r in rows.routes.items()}
    with pytest.raises(RouteReplayError, match=r"MoE layer \d+: recorded routes of shape"):
        logprobs(model, rows, RouteReplay(short))
    missing = dict(list(rows.routes.items())[1:])
    with pytest.raises(RouteReplayError, match="no recorded routes to replay"):
        logprobs(model, rows, RouteReplay(missing))


def test_the_recorder_keeps_prefill_then_each_token(rollout):
    model, _ = rollout
    recorder = RouteRecorder()
    from step35.model import KVCache

    cache = KVCache()
    model.step(torch.tensor([[1, 2, 3], [1, 2, 4]]), cache, routing=recorder)
    model.step(torch.tensor([[5], [6]]), cache, routing=recorder)
    routes = recorder.routes()
    K = model.config.moe_top_k
    assert routes and all(r.shape == (2, 4, K) and r.dtype == torch.int16 for r in routes.values())


def test_bf16_rollout_and_replay_combine_in_fp32_alike():
    """Under bf16 the rollout (recording) and the training forward (replaying) sum the experts' rows in fp32: the
    replayed log-probabilities stay within bf16's rounding of the rollout's (measured 0.024 nats at most)."""
    model = tiny_model(seed=1, dtype=torch.bfloat16).eval()
    rows = rollout_rows(model, new_tokens=6)
    replayed, replay = logprobs(model, rows, RouteReplay(rows.routes, counted=rows.tokens))
    assert completion_gap(replayed.detach().float(), rows) < 0.05
    assert int(replay.fallbacks) == 0
