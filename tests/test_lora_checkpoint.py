"""A LoRA run's training checkpoints (step35/checkpoint/hf/lora_base.py, docs/lora.md): they hold the adapters,
the trained targets, buffers and optimizer state plus the identity of the frozen base, not the base; resume
reads the base again from its HF folder (or the init) and refuses another base naming what differs; a resumed
run continues exactly as one that never stopped."""

from __future__ import annotations

import shutil

import pytest
import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.training.keys import LORA_BASE
from step35.model.lora import is_adapter
from tests.helpers import hf_base, lora_config, lora_fit, run_losses, write_run_config
from tests.runner import fit


def trained_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_checkpoint_holds_the_trained_state_and_the_base_identity_not_the_base(tmp_path, builtin_cache, tiny_run):
    base = hf_base(tmp_path / "base", seed=1)
    model = lora_fit(tmp_path / "run", builtin_cache, 2, base=base)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    names = {k.removeprefix("model.") for k in saved["state_dict"]}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n for n, _ in model.named_buffers() if n in model.state_dict()}
    assert names == trained | buffers  # adapters, the router, the router bias: no frozen weight
    assert any(is_adapter(n) for n in names) and "model.layers.0.self_attn.q_proj.weight" not in names
    record = saved[LORA_BASE]
    assert record["folder"] == str(base) and set(record["sizes"]) == {p.name for p in base.glob("*.safetensors")}
    assert record["index_sha256"] is None or len(record["index_sha256"]) == 64
    assert record["crc32"] and record["crc32"].keys() == record["sizes"].keys()  # the base's manifest checksums
    full = next((tiny_run[0] / "checkpoints").glob("step=*.ckpt")).stat().st_size
    print(f"LoRA checkpoint {ckpt.stat().st_size} bytes, the full tiny checkpoint {full} bytes")
    assert ckpt.stat().st_size < full / 3


def test_resume_rereads_the_base_and_refuses_another(tmp_path, builtin_cache):
    base = hf_base(tmp_path / "base", seed=1)
    straight = trained_state(lora_fit(tmp_path / "straight", builtin_cache, 4, base=base))
    lora_fit(tmp_path / "run", builtin_cache, 2, base=base)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    moved = tmp_path / "moved-base"
    shutil.copytree(base, moved)  # the same base in another place: accepted by its fingerprint
    resumed = trained_state(lora_fit(tmp_path / "run", builtin_cache, 4, base=moved, ckpt_path=ckpt))
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name  # exact: the base re-read, adapters and state restored

    other = hf_base(tmp_path / "other", seed=2)  # same shapes, sizes and index; other weights
    with pytest.raises(
        CheckpointError,
        match=r"a LoRA checkpoint of another base: .*other \(model.checkpoint\) is "
        r"not the base .*base the run trained on: model-00001-of-00001."
        r"safetensors has crc32 \w+ in its manifest, was \w+",
    ):
        lora_fit(tmp_path / "run", builtin_cache, 4, base=other, ckpt_path=ckpt)
    with pytest.raises(
        CheckpointError,
        match=r"the run's base was the HF folder .*base, this one is the init "
        r"\(seed 0\) \(model.checkpoint\)",
    ):
        lora_fit(tmp_path / "run", builtin_cache, 4, ckpt_path=ckpt)


def test_a_base_from_the_init_is_recorded_by_its_seed(tmp_path, builtin_cache):
    lora_fit(tmp_path / "run", builtin_cache, 2)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    assert torch.load(ckpt, weights_only=True)[LORA_BASE] == {"folder": None, "init_seed": 0}
    with pytest.raises(CheckpointError, match=r"the run's base was drawn with model.init_seed=0, this run's is 5"):
        lora_fit(tmp_path / "run", builtin_cache, 4, ckpt_path=ckpt, init_seed=5)


# ------------------------------------------------------------------ another EP size (torchrun); killed: tests/test_chaos.py
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_lora_run_saved_at_ep2_resumes_at_ep1(tmp_path, builtin_cache):
    """2 gloo ranks: a sharded LoRA checkpoint saved at EP 2 resumes at EP 1 (FSDP only) and continues with
    the losses of the run that stayed at EP 2, within 1e-5 (adapters and their optimizer state are saved
    EP-independent; the base is re-read)."""
    config = write_run_config(tmp_path, lora_config(), "lora.yaml")

    def on_two_ranks(run, ep: int, max_steps: int, *extra: str) -> None:
        fit(
            config,
            run,
            builtin_cache,
            f"--trainer.max_steps={max_steps}",
            "--trainer.devices=2",
            "--trainer.strategy=step35.strategy.Step35Strategy",
            f"--trainer.strategy.expert_parallel_size={ep}",
            *extra,
            nproc=2,
        )

    on_two_ranks(tmp_path / "straight", 2, 8)
    saved = tmp_path / "straight" / "checkpoints" / "step=000005.ckpt"  # RunCheckpoint's, every 5 steps (the
    assert saved.is_dir()  # schedule decays over 20, not max_steps)
    on_two_ranks(tmp_path / "resumed", 1, 8, f"--ckpt_path={saved}")
    straight, resumed = run_losses(tmp_path / "straight"), run_losses(tmp_path / "resumed")
    assert set(range(5, 8)) <= set(resumed), resumed
    for step in range(5, 8):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-5), (step, resumed[step], straight[step])
    print("EP 2 -> EP 1 losses", {s: (straight[s], resumed[s]) for s in range(5, 8)})
