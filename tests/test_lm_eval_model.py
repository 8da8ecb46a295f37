"""step35 as an lm-evaluation-harness model (step35/eval/lm_eval_model.py), on a tiny random model saved as an HF
folder with a byte-level BPE trained here, and tasks written here (a jsonl and a YAML file; no network).

References computed here, apart from the class: log-probs from the model's own forward (log_softmax of
model(ids), one row at a time, no padding, no cache), greedy text from an argmax loop over the full forward,
lm-eval's own rolling windows (lm_eval.utils) for a text longer than max_length. Tolerance 1e-5 (fp32 on CPU;
the class batches padded rows and runs the head on the scored positions only)."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip(
    "lm_eval",
    reason="lm-eval is not installed: pip install --no-deps --upgrade --target .oracle -r tests/oracles.txt",
)

from step35.checkpoint.hf.pretrained import save_pretrained  # noqa: E402
from tests.helpers import tiny_model, train_byte_bpe  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. A cat sat on the mat and looked at the fox.",
    "Question: what colour is the sky? Answer: blue. Question: what is two plus two? Answer: four.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
] * 20
QUESTIONS = [
    {"question": "what colour is the sky?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "what is two plus two?", "choices": ["three", "four", "five", "six"], "answer": 1},
    {"question": "which animal sat on the mat?", "choices": ["dog", "fox", "cat"], "answer": 2},
    {"question": "what does add return?", "choices": ["a + b", "a - b"], "answer": 0},
]
MC_TASK = """task: step35_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An HF folder: a randomised tiny model (every feature bites) and a BPE with <s> (BOS, 0) and </s> (EOS, 1),
    the ids config.json names. Returns (folder, the model in memory, the tokenizer)."""
    folder = tmp_path_factory.mktemp("lm-eval") / "hf"
    model = tiny_model(seed=0).eval()
    save_pretrained(model, folder)
    tokenizer = train_byte_bpe(TEXTS, ["<s>", "</s>"], folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / "step35_tiny_mc.yaml").write_text(MC_TASK.format(data=data, cache=root / "cache"))
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # simple_evaluate adds torch's collect_env report to its results (~2-4 s of subprocesses per call); the
    # results checked here do not include it.
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)


@torch.no_grad()
def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one full forward of the row."""
    logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@torch.no_grad()
def by_hand(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """(log p(continuation | <s> context), is_greedy): lm-eval's split of the text's tokens (the continuation is
    the tokens of context + continuation past those of the context), scored with one full forward."""
    context_ids = [0] + tokenizer.encode(context).ids
    whole = [0] + tokenizer.encode(context + continuation).ids
    logits = model(torch.tensor([whole[:-1]]))[0].float()
    n = len(whole) - len(context_ids)
    targets = torch.tensor(whole[len(context_ids) :])
    logp = torch.log_softmax(logits[-n:], dim=-1)
    return float(logp.gather(-1, targets[:, None]).sum()), bool((logp.argmax(-1) == targets).all())


def mc_by_hand(model, tokenizer) -> tuple[list[list[tuple[float, bool]]], float]:
    """Each question's (loglikelihood, is_greedy) per choice, and the accuracy of the argmax choice."""
    scores = [
        [by_hand(model, tokenizer, f"Question: {q['question']}\nAnswer:", f" {choice}") for choice in q["choices"]]
        for q in QUESTIONS
    ]
    correct = [max(range(len(s)), key=lambda i: s[i][0]) == q["answer"] for s, q in zip(scores, QUESTIONS)]
    return scores, sum(correct) / len(correct)


def test_simple_evaluate_loglikelihoods_and_accuracy_match_the_model(folder, task_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import step35.eval.lm_eval_model  # noqa: F401  (registers "step35")

    hf, model, tokenizer = folder
    results = simple_evaluate(
        model="step35",
        model_args=f"checkpoint={hf},device=cpu,batch_size=3",
        tasks=["step35_tiny_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),  # (no index of ~10 s)
        log_samples=True,
        bootstrap_iters=0,
    )
    expected, accuracy = mc_by_hand(model, tokenizer)
    samples = sorted(results["samples"]["step35_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    for sample, want in zip(samples, expected):
        got = [resp[0] for resp in sample["resps"]]  # one (loglikelihood, is_greedy) per choice
        assert len(got) == len(want)
        for (logp, greedy), (want_logp, want_greedy) in zip(got, want):
            assert abs(logp - want_logp) < 1e-5 and greedy == want_greedy, (got, want)
    assert results["results"]["step35_tiny_mc"]["acc,none"] == pytest.approx(accuracy, abs=1e-12)
    # The scores differ between choices (a random model that scored everything alike would prove nothing).
    assert len({round(logp, 3) for row in expected for logp, _ in row}) > len(QUESTIONS)


def test_run_lm_eval_returns_the_same_accuracy(folder, task_dir):
    from step35.eval.lm_eval_model import run_lm_eval

    hf, model, tokenizer = folder
    results = run_lm_eval(
        hf, ["step35_tiny_mc"], include_path=task_dir, limit=3, device="cpu", bootstrap_iters=0, include_defaults=False
    )
    questions = QUESTIONS[:3]
    scores, _ = mc_by_hand(model, tokenizer)
    correct = [max(range(len(s)), key=lambda i: s[i][0]) == q["answer"] for s, q in zip(scores, questions)]
    assert results["results"]["step35_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / 3, abs=1e-12)
    assert "samples" not in results


def test_loglikelihood_rolling_sums_every_token_once(folder):
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from step35.eval.lm_eval_model import Step35LM

    hf, model, tokenizer = folder
    short, long = "A cat sat on the mat.", " ".join(TEXTS[:3])
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate([short, long])]
    lm = Step35LM(str(hf), device="cpu", max_length=16, batch_size=2)
    got = lm.loglikelihood_rolling(requests, disable_tqdm=True)

    short_ids = tokenizer.encode(short).ids
    assert len(short_ids) < 16  # one window: the whole text after <s>, one forward
    assert abs(got[0] - float(token_logprobs(model, [0] + short_ids).sum())) < 1e-5
    long_ids = tokenizer.encode(long).ids
    assert len(long_ids) > 3 * 16 and len(long_ids) % 16 != 0  # several windows and a last, partial one
    want = 0.0
    for window in get_rolling_token_windows(long_ids, 0, 16, 1):  # lm-eval's own windows
        context, continuation = make_disjoint_window(window)
        want += float(token_logprobs(model, context + continuation)[-len(continuation) :].sum())
    assert abs(got[1] - want) < 1e-4  # ~60 token log-probs summed


@torch.no_grad()
def test_generate_until_is_the_greedy_text_up_to_the_stop_string(folder):
    from lm_eval.api.instance import Instance

    from step35.eval.lm_eval_model import Step35LM

    hf, model, tokenizer = folder
    prompt = "Question: what is two plus two? Answer:"
    ids, greedy = [0] + tokenizer.encode(prompt).ids, []
    for _ in range(24):  # the argmax of the full forward, token by token, until an EOS id (config.json: 1)
        token = int(model(torch.tensor([ids + greedy]))[0, -1].argmax())
        if token == 1:
            break
        greedy.append(token)
    text = tokenizer.decode(greedy, skip_special_tokens=False)
    assert len(greedy) > 6, text
    # A stop string the greedy text reaches after some tokens: a later token's own text, if ASCII (a random
    # model also draws single bytes of UTF-8 characters, and ids past the tokenizer's vocabulary, decoded to "").
    pieces = [tokenizer.decode([token]) for token in greedy]
    stop = next(piece for piece in pieces[3:] if piece.strip() and piece.isascii())
    assert text.split(stop)[0] != text, (stop, text)

    lm = Step35LM(str(hf), device="cpu")
    kwargs = {"until": [stop], "max_gen_toks": 24, "do_sample": False}
    free = {"until": [], "max_gen_toks": 24, "temperature": 0.0}
    got = lm.generate_until([Instance("generate_until", {}, (prompt, kw), i) for i, kw in enumerate([kwargs, free])])
    assert got == [text.split(stop)[0], text]
    with pytest.raises(ValueError, match="generation kwargs \\['top_k'\\] are not supported"):
        lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "top_k": 5}), 0)])


def test_apply_chat_template_renders_what_generate_chat_prompts(folder):
    from step35.eval.generator import load_generator
    from step35.eval.lm_eval_model import Step35LM

    hf, _, _ = folder
    lm, generator = Step35LM(str(hf), device="cpu"), load_generator(hf)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is two plus two?"}]
    text = lm.apply_chat_template(chat)
    # `step35 generate --chat --system "Be brief." --prompt ...`'s ids: the same template, tokens and start token.
    assert lm.tok_encode(text) == generator.chat_ids(generator.chat_template(), chat[1]["content"], chat[0]["content"])
    assert "what is two plus two?" in text and lm.chat_template(True) == generator.chat_template().source
    assert lm.tokenizer_name == str(hf).replace("/", "__")


def test_step35_eval_runs_lm_eval_tasks_and_records_them(folder, task_dir, tmp_path, capfd):
    """`step35 eval --lm_eval_tasks` on the HF folder: the same accuracy in the results JSON and on the terminal."""
    from tests.runner import cli

    hf, model, tokenizer = folder
    code, out, err = cli(capfd, "eval", "--checkpoint", str(hf), "--lm_eval_tasks", "[step35_tiny_mc]",
                         "--lm_eval_include_path", str(task_dir), "--lm_eval_limit", "3", "--out", str(tmp_path))  # fmt: skip
    assert code == 0, err[-3000:]
    scores, _ = mc_by_hand(model, tokenizer)
    correct = [max(range(len(s)), key=lambda i: s[i][0]) == q["answer"] for s, q in zip(scores, QUESTIONS[:3])]
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["lm_eval"]["results"]["step35_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / 3, abs=1e-12)
    assert "lm-eval step35_tiny_mc" in out
