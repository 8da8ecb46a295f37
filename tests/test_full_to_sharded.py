"""A single-file checkpoint of a one-process run resumes in a 2-rank Step35Strategy job (FSDP2 +
EP 2, gloo, the real CLI under torchrun): every rank takes its slice of the full weights and of
the full optimizer state, which a one-process run numbers in optimizer order (decay group first),
not in module order."""

from __future__ import annotations

import json

import pytest
import torch

from step35.checkpoint.integrity import manifest_info
from step35.checkpoint.safe_load import load_torch
from tests.helpers import tiny_run_args
from tests.runner import step35, step35_in_process


def settings(group: dict) -> dict:
    """A parameter group's settings (lr, betas, ...) without its parameter list; betas come back
    from the sharded optimizer as a list."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_one_process_file_checkpoint_resumes_on_two_ranks_exactly(tmp_path, builtin_cache, capfd):
    step35_in_process(
        capfd, tiny_run_args("fit", tmp_path / "one", "--trainer.max_steps=2"), builtin_cache
    )  # this process
    ckpt_path = tmp_path / "one" / "checkpoints" / "last.ckpt"
    assert ckpt_path.is_file()
    out = tmp_path / "restored.pt"
    capture = {"class_path": "tests.dist.capture_restored.CaptureRestored", "init_args": {"out": str(out)}}
    args = [
        "--trainer.strategy=step35.strategy.Step35Strategy",
        "--trainer.strategy.expert_parallel_size=2",
        "--trainer.devices=2",
        f"--trainer.callbacks+={json.dumps(capture)}",
        "--trainer.max_steps=3",
        f"--ckpt_path={ckpt_path}",
    ]
    step35(tiny_run_args("fit", tmp_path / "two", *args), builtin_cache, nproc=2)

    saved, restored = load_torch(ckpt_path), torch.load(out, weights_only=True)
    assert (restored["global_step"], restored["world_size"]) == (2, 2)
    assert saved["state_dict"].keys() == restored["params"].keys()
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(tensor, restored["params"][name]), name
    # the one-process optimizer numbers its parameters group by group; the j-th of group g is the
    # j-th name torch lists for group g of the sharded optimizer
    optim = saved["optimizer_states"][0]
    sizes = [len(g["params"]) for g in optim["param_groups"]]
    assert sizes == [len(g["params"]) for g in restored["optim"]["param_groups"]]
    compared = 0
    for group, named in zip(optim["param_groups"], restored["optim"]["param_groups"]):
        assert settings(group) == settings(named)
        for pid, name in zip(group["params"], named["params"]):
            for key, value in optim["state"][pid].items():
                assert torch.equal(value, restored["optim"]["state"][name][key]), (name, key)
                compared += 1
    assert compared == 3 * len(optim["state"])  # step, exp_avg, exp_avg_sq of every parameter
    final = tmp_path / "two" / "checkpoints" / "last.ckpt"
    assert manifest_info(final)["extra"]["global_step"] == 3 and manifest_info(final)["extra"]["world_size"] == 2
