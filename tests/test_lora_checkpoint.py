"""A LoRA run's training checkpoints (step35/checkpoint/hf/lora_base.py, docs/lora.md): they hold the adapters,
the trained targets, buffers and optimizer state plus the identity of the frozen base, not the base; resume
reads the base again from its HF folder (or the init) and refuses another base naming what differs; a resumed
run continues exactly as one that never stopped."""

from __future__ import annotations

import shutil

import lightning.pytorch as pl
import pytest
import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.training.keys import LORA_BASE
from step35.checkpoint.hf.materialize import materialize
from step35.checkpoint.hf.pretrained import save_pretrained
from step35.config import preset
from step35.model import build_model
from step35.model.lora import is_adapter

LORA = {"rank": 4, "targets": ["attention", "mlp", "shared_expert", "experts", "router"]}


def hf_base(folder, seed):
    model = build_model(preset("tiny"))
    materialize(model, "cpu", seed=seed)
    save_pretrained(model, folder)
    return folder


def fit(root, cache, steps, base=None, ckpt_path=None, init_seed=0):
    from step35.callbacks import RunCheckpoint
    from step35.checkpoint.training.trainer_io import Step35CheckpointIO
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    module = Step35LightningModule(config="tiny", checkpoint=str(base) if base else None, lora=dict(LORA), lr=1e-2,
                                   warmup_steps=1, decay_steps=4, init_seed=init_seed,
                                   moe_bias_update_rate=1e-3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                         plugins=[Step35CheckpointIO()], callbacks=[RunCheckpoint(every_n_train_steps=2)])
    trainer.fit(module, datamodule=Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(cache)),
                ckpt_path=str(ckpt_path) if ckpt_path else None)
    return module.model


def trained_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_checkpoint_holds_the_trained_state_and_the_base_identity_not_the_base(tmp_path, builtin_cache, tiny_run):
    base = hf_base(tmp_path / "base", seed=1)
    model = fit(tmp_path / "run", builtin_cache, 2, base=base)
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
    straight = trained_state(fit(tmp_path / "straight", builtin_cache, 4, base=base))
    fit(tmp_path / "run", builtin_cache, 2, base=base)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    moved = tmp_path / "moved-base"
    shutil.copytree(base, moved)  # the same base in another place: accepted by its fingerprint
    resumed = trained_state(fit(tmp_path / "run", builtin_cache, 4, base=moved, ckpt_path=ckpt))
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name  # exact: the base re-read, adapters and state restored

    other = hf_base(tmp_path / "other", seed=2)  # same shapes, sizes and index; other weights
    with pytest.raises(CheckpointError, match=r"a LoRA checkpoint of another base: .*other \(model.checkpoint\) is "
                                              r"not the base .*base the run trained on: model-00001-of-00001."
                                              r"safetensors has crc32 \w+ in its manifest, was \w+"):
        fit(tmp_path / "run", builtin_cache, 4, base=other, ckpt_path=ckpt)
    with pytest.raises(CheckpointError, match=r"the run's base was the HF folder .*base, this one is the init "
                                              r"\(seed 0\) \(model.checkpoint\)"):
        fit(tmp_path / "run", builtin_cache, 4, ckpt_path=ckpt)


def test_a_base_from_the_init_is_recorded_by_its_seed(tmp_path, builtin_cache):
    fit(tmp_path / "run", builtin_cache, 2)
    ckpt = next((tmp_path / "run").rglob("step=000002.ckpt"))
    assert torch.load(ckpt, weights_only=True)[LORA_BASE] == {"folder": None, "init_seed": 0}
    with pytest.raises(CheckpointError, match=r"the run's base was drawn with model.init_seed=0, this run's is 5"):
        fit(tmp_path / "run", builtin_cache, 4, ckpt_path=ckpt, init_seed=5)


# ------------------------------------------------------------------ killed runs, another EP size (subprocesses)

def lora_config_text() -> str:
    from tests.test_chaos import CONFIG

    assert "  config: tiny\n" in CONFIG and "mtp_loss_weight: 0.3" in CONFIG
    return CONFIG.replace("  config: tiny\n", "  config: tiny\n  decay_steps: 20\n  lora:\n    rank: 4\n"
                          "    targets: [attention, mlp, shared_expert, experts, mtp, router]\n")


@pytest.mark.timeout(1500)
def test_lora_run_killed_twice_resumes_bitwise(tmp_path, builtin_cache):
    """SIGKILL (once during a save), then --ckpt_path auto: the final adapters, router, buffers and optimizer
    state are bitwise those of a run never killed (tests/test_chaos.py's chaos() with a LoRA config)."""
    from tests.test_chaos import chaos

    chaos(tmp_path, builtin_cache, max_steps=16, kills=2, seed=5, deadline_s=1200, config_text=lora_config_text())
    final = torch.load(tmp_path / "chaos" / "checkpoints" / "step=000016.ckpt", weights_only=True)
    assert final[LORA_BASE] == {"folder": None, "init_seed": 0}
    assert not [k for k in final["state_dict"] if k.endswith("self_attn.q_proj.weight")]  # no frozen base


def torchrun_fit(config, run, cache, ep: int, max_steps: int, *extra: str) -> None:
    import os
    import sys

    from tests.runner import run_process_group
    from tests.test_chaos import ROOT

    env = {**os.environ, "STEP35_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "step35", "fit",
           "--config", str(config), f"--run_dir={run}", f"--trainer.max_steps={max_steps}", "--trainer.devices=2",
           "--trainer.strategy=step35.strategy.Step35Strategy", f"--trainer.strategy.expert_parallel_size={ep}", *extra]
    proc = run_process_group(cmd, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def losses(run) -> dict[int, float]:
    import csv

    rows = {}
    for file in sorted(run.rglob("metrics.csv")):
        with open(file) as f:
            rows.update({int(r["step"]): float(r["train/lm_loss"]) for r in csv.DictReader(f) if r.get("train/lm_loss")})
    return rows


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_lora_run_saved_at_ep2_resumes_at_ep1(tmp_path, builtin_cache):
    """2 gloo ranks: a sharded LoRA checkpoint saved at EP 2 resumes at EP 1 (FSDP only) and continues with
    the losses of the run that stayed at EP 2, within 1e-5 (adapters and their optimizer state are saved
    EP-independent; the base is re-read)."""
    config = tmp_path / "lora.yaml"
    config.write_text(lora_config_text())
    torchrun_fit(config, tmp_path / "straight", builtin_cache, 2, 8)
    torchrun_fit(config, tmp_path / "run", builtin_cache, 2, 5)
    saved = tmp_path / "run" / "checkpoints" / "step=000005.ckpt"
    assert saved.is_dir()
    torchrun_fit(config, tmp_path / "resumed", builtin_cache, 1, 8, f"--ckpt_path={saved}")
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert set(range(5, 8)) <= set(resumed), resumed
    for step in range(5, 8):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-5), (step, resumed[step], straight[step])
    print("EP 2 -> EP 1 losses", {s: (straight[s], resumed[s]) for s in range(5, 8)})
