"""`step35 generate`: text from a run checkpoint and from its exported HF folder, the same tokens greedily;
top-p sampling draws from the nucleus with the renormalised probabilities."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from step35.checkpoint.export import export_hf
from step35.generate import load_generator, next_token

ROOT = Path(__file__).parent.parent
PROMPT = "The for statement"


@pytest.fixture(scope="module")
def folders(tiny_run, tmp_path_factory):
    run, _ = tiny_run
    out = tmp_path_factory.mktemp("generate") / "hf"
    export_hf(run, out)
    return run, out


def test_checkpoint_and_exported_folder_generate_the_same_tokens(folders, tiny_run):
    run, hf = folders
    from_run, from_hf = load_generator(run), load_generator(hf)
    prompt = from_run.encode(PROMPT)
    assert prompt == from_hf.encode(PROMPT) and prompt[0] == 0  # starts a document: EOS, the tokenizer has no BOS
    greedy = from_run.generate_ids(prompt, max_new_tokens=12)
    assert len(greedy) >= 1 and greedy == from_hf.generate_ids(prompt, max_new_tokens=12)
    # Greedy is the argmax of the trained model's logits, step by step (independent recomputation).
    _, model = tiny_run
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for token in greedy:
            assert token == int(model(ids)[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    sampled = from_run.generate_ids(prompt, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    assert sampled == from_hf.generate_ids(prompt, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)


def test_top_p_samples_the_nucleus_with_renormalised_probabilities():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    rng = torch.Generator().manual_seed(0)
    # top_p=0.8: 0.4 + 0.3 = 0.7 < 0.8, so the nucleus is {1, 3, 4} (0.85); 0 and 2 never come.
    draws = torch.tensor([next_token(logits, 1.0, 0.8, rng) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=5).float() / len(draws)
    assert counts[0] == 0 and counts[2] == 0
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    assert torch.allclose(counts, expected, atol=0.03), counts  # 4000 draws: std <= 0.008
    assert next_token(logits, 0.0, 0.5, rng) == 1  # greedy
    assert {next_token(logits, 1.0, 0.3, rng) for _ in range(50)} == {1}  # the top token alone reaches 0.3


def step35(args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "step35", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(600)
def test_generate_command_prints_text_from_run_and_export(folders):
    run, hf = folders
    args = ["--prompt", PROMPT, "--max_new_tokens", "16"]
    from_run = step35(["generate", "--checkpoint", str(run), *args])
    assert from_run.startswith(PROMPT) and len(from_run.strip()) > len(PROMPT), from_run
    assert step35(["generate", "--checkpoint", str(hf), *args]) == from_run
