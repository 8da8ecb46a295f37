"""The KV cache of `step35 generate` (Step35ForCausalLM.step, step35/model/cache.py): the logits and tokens of
rerunning the whole context, at a cost linear in the sample's length."""

import torch

from step35.commands.generate import Generator
from step35.config import preset
from step35.model import KVCache, build_model
from tests.hf_oracle import random_state_dict


def random_model(**overrides):
    """The tiny preset with a 16-key sliding window and random weights of O(1) activations, router
    biases that change the top-k and clamps that bite (tests/hf_oracle.py)."""
    config = preset("tiny").with_overrides({"sliding_window": 16, **overrides})
    model = build_model(config, num_mtp_layers=0, device="cpu")
    state = random_state_dict(config.to_dict(), seed=1)
    model.load_state_dict({name: state[name] for name in model.state_dict()})
    return model.eval()


def test_steps_through_the_cache_give_the_logits_of_the_whole_sequence():
    model = random_model()
    ids = torch.randint(0, 1024, (2, 45), generator=torch.Generator().manual_seed(0))
    cache = KVCache()
    with torch.no_grad():
        # a 10-token prompt, 25 single tokens (past the window), then a 10-token chunk
        parts = [model.step(ids[:, :10], cache)] + [model.step(ids[:, t : t + 1], cache) for t in range(10, 35)]
        parts.append(model.step(ids[:, 35:], cache))
        # logits up to ~5 here: 3e-5 is fp32 rounding of sums in another order (an off-by-one window gives 5)
        torch.testing.assert_close(torch.cat(parts, dim=1), model(ids), atol=3e-5, rtol=0)
    assert cache.length == 45
    sliding = [kv for kv in cache.layers.values() if kv.window is not None]
    full = [kv for kv in cache.layers.values() if kv.window is None]
    assert sliding and full
    assert all(kv.keys.shape[2] == 15 for kv in sliding)  # the window less the token to come
    assert all(kv.keys.shape[2] == 45 for kv in full)


def count_embedded(model):
    """A list that each forward appends its number of input tokens to."""
    counts = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: counts.append(args[0].numel()))
    return counts


def test_cached_generation_equals_rerunning_the_context_and_runs_each_token_once():
    model = random_model()
    counts = count_embedded(model)
    prompt = [0, 17, 300, 45, 9, 12, 800, 3]
    cached = Generator(model, None, 0, set(), use_cache=True)
    rerun = Generator(model, None, 0, set(), use_cache=False)
    greedy = cached.generate_ids(prompt, max_new_tokens=60)
    assert sum(counts) == len(prompt) + 59 and len(counts) == 60  # linear: each token is run once
    counts.clear()
    assert rerun.generate_ids(prompt, max_new_tokens=60) == greedy
    assert sum(counts) == sum(range(len(prompt), len(prompt) + 60))  # quadratic without the cache
    assert len(set(greedy)) > 3  # not one token repeated: a real comparison
    kwargs = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    assert cached.generate_ids(prompt, **kwargs) == rerun.generate_ids(prompt, **kwargs)


def test_past_max_position_embeddings_the_cut_context_is_rerun_as_without_cache():
    model = random_model(max_position_embeddings=24)
    counts = count_embedded(model)
    prompt = [0, 5, 6, 7]
    cached = Generator(model, None, 0, set(), use_cache=True).generate_ids(prompt, max_new_tokens=30)
    assert counts[:21] == [4] + [1] * 20 and counts[21:] == [24] * 9  # cached up to 24 tokens, then cut and rerun
    assert cached == Generator(model, None, 0, set(), use_cache=False).generate_ids(prompt, max_new_tokens=30)
