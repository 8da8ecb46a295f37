"""Filling a meta-device model: the init is the same whatever the slicing, and a checkpoint that
does not fit the config is refused before anything is allocated."""

import pytest
import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.materialize import materialize
from step35.checkpoint.hf.pretrained import save_pretrained
from step35.config import preset
from step35.model import Step35ForCausalLM
from step35.model.init import init_tensor
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "name,shape,index",
    [
        ("model.layers.1.moe.gate_proj.weight", (8, 64, 128), (slice(2, 6), slice(16, 48))),  # EP x efsdp shard
        ("model.embed_tokens.weight", (1024, 128), (slice(300, 700),)),  # FSDP rows across init blocks
        ("model.layers.0.self_attn.o_proj.weight", (128, 128), (slice(0, 0),)),  # an empty shard
    ],
)
def test_init_slice_equals_slice_of_full_init(name, shape, index):
    config = preset("tiny")
    full = init_tensor(name, shape, config, seed=3)
    assert torch.equal(init_tensor(name, shape, config, seed=3, index=index), full[index])
    assert not torch.equal(full, init_tensor(name, shape, config, seed=4))


def test_init_statistics():
    config = preset("tiny")
    w = init_tensor("model.layers.0.self_attn.q_proj.weight", (4096, 256), config, seed=0)
    assert abs(w.std().item() - 0.02) < 1e-3 and abs(w.mean().item()) < 1e-3
    out = init_tensor("model.layers.0.self_attn.o_proj.weight", (4096, 256), config, seed=0)
    assert abs(out.std().item() - 0.02 / (2 * config.num_hidden_layers) ** 0.5) < 1e-3  # depth-scaled
    assert torch.count_nonzero(init_tensor("model.norm.weight", (128,), config, seed=0)) == 0  # zero-centred
    assert torch.count_nonzero(init_tensor("model.layers.1.moe.router_bias", (8,), config, seed=0)) == 0


def test_checkpoint_not_matching_the_config_is_refused_before_allocation(tmp_path):
    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(0)
    save_pretrained(model, tmp_path / "hf")
    with torch.device("meta"):  # the config the run asks for differs from the checkpoint's
        target = Step35ForCausalLM(tiny_config(moe_intermediate_size=96))
    with pytest.raises(
        CheckpointError, match=r"model.layers.1.moe.gate_proj.weight .*shape \[8, 64, 128\].*\[8, 96, 128\]"
    ):
        materialize(target, "cpu", checkpoint=tmp_path / "hf")
    assert all(t.is_meta for t in target.state_dict().values())  # nothing was allocated
