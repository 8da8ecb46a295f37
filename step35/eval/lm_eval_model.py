"""step35 as a model of lm-evaluation-harness (lm-eval 0.4.13, the `eval` extra: pip install 'step35[eval]').

    python -m step35.eval.lm_eval_model --model step35 --model_args checkpoint=runs/tiny --tasks hellaswag
    python -m step35.eval.lm_eval_model --model step35 --model_args checkpoint=runs/tiny,dtype=bfloat16 \\
        --tasks my_task --include_path my_tasks/ --apply_chat_template --device cuda:0 --batch_size 8

On this command line the device and batch size are lm-eval's own options (--device, --batch_size), not
model_args: lm-eval passes them to the model itself (a second value in model_args is refused by Python).

lm-eval finds a model only when its class is imported and registered (`@register_model`); 0.4.13 has no plugin
mechanism (no entry-point group is read), so `lm_eval --model step35` alone does not know step35: this module's
main registers the class, then runs lm-eval's own command line with the arguments given. From Python,
`run_lm_eval(checkpoint, tasks)` (what `step35 eval --lm_eval_tasks` calls) or lm_eval.simple_evaluate(model=
"step35", ...) after importing this module. lm-eval is imported here only: nothing of `step35 fit` imports it.

`checkpoint` is what `step35 generate` reads (a run folder, a .ckpt, a sharded checkpoint folder, an HF folder
or a PEFT adapter folder), loaded by the same code (step35/eval/generator.py): the main model without MTP layers,
the tokenizer the run trained with, and the start token every text is preceded by (BOS, else the EOS that
separates documents in training), so the model sees the start of a document as `step35 generate` shows it.

- loglikelihood: log p(continuation | context) summed over the continuation's tokens, and whether each of them
  is the argmax (is_greedy). Context and continuation are tokenized as lm-eval's TemplateLM does (the whole text
  and the context apart; the continuation is the tokens past the context's); an empty context is the start
  token alone. The model runs on (context + continuation)[-(max_length + 1):-1] (the left of the context cut
  to max_length tokens, as HF's model in lm-eval does), rows batched `batch_size` at a time, longest first, right-
  padded (causal attention: padding never reaches a scored token); the head runs on the scored positions only.
- loglikelihood_rolling: the text's tokens t_1..t_n, each scored once, t_1 after the start token. Windows of
  max_length predictions: window k feeds (start, t_1, ...)[kL : kL + L] and scores t_{kL+1}..t_{kL+L}; the last
  window is given a full max_length context ending at t_{n-1} and scores only the tokens no earlier window
  scored (lm-eval's rolling windows with a context of one token, as its HF model computes them).
- generate_until: one request at a time with the KV cache (Generator.generate_ids), the context's left cut to
  max_length - max_gen_toks tokens; greedy unless the request samples (do_sample true, or a temperature > 0
  without do_sample), then softmax(logits / temperature) within top_p, seeded by `seed` + the request's index.
  It stops at a stop token (config.json's eos_token_id, the tokenizer's EOS and, once a chat template was
  applied, its end-of-turn token), at any of `until`'s strings or at max_gen_toks; the text is cut before the
  first stop string. Generation kwargs other than until, max_gen_toks (max_new_tokens), do_sample,
  temperature, top_p (and num_beams 1) are refused.
- --apply_chat_template: the tokenizer's chat template (else step35's default), rendered as `step35 generate
  --chat` renders it; the rendered text is tokenized with its special tokens and preceded by the start token
  unless it begins with it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from step35.data.chat_template import ChatTemplate
from step35.eval.generator import Generator, load_generator

try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models first: get_model fills only an empty registry)
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # one line, naming the fix
    raise ImportError(f"step35.eval.lm_eval_model needs lm-eval 0.4.13: pip install 'step35[eval]' ({e})") from None

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The generation kwargs honoured; others (beam search, top_k, penalties) would be silently different decoding.
GENERATION_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_p", "num_beams")
# Model args besides `checkpoint` (run_lm_eval sorts its keywords into these and simple_evaluate's own).
MODEL_ARGS = ("dtype", "device", "max_length", "batch_size", "max_batch_size", "max_gen_toks", "seed", "tokenizer")


@register_model("step35")
class Step35LM(TemplateLM):
    """A step35 checkpoint as an lm-eval model (the module docstring says how each request type is computed)."""

    def __init__(
        self,
        checkpoint: str,
        dtype: str = "float32",
        device: str | None = None,
        max_length: int | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"step35 lm-eval model: dtype={dtype!r}; expected one of {sorted(DTYPES)}")
        device = _device(device)
        self.generator: Generator = load_generator(
            checkpoint, DTYPES[dtype], device, tokenizer, say=lambda line: log.info("step35: %s", line)
        )
        self._device = torch.device(device)
        limit = self.generator.model.config.max_position_embeddings
        self.max_length = limit if max_length is None else int(max_length)
        if not 1 <= self.max_length <= limit:
            raise ValueError(
                f"step35 lm-eval model: max_length={max_length} must be between 1 and the model's "
                f"max_position_embeddings ({limit})"
            )
        self.batch_size = _batch_size(batch_size, max_batch_size)
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        self._template: ChatTemplate | None = None

    # ------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        eos = self.generator.eos_id
        return eos if eos is not None else self.generator.start_id

    @property
    def prefix_token_id(self) -> int:
        return self.generator.start_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The text's ids (special tokens written in it included), preceded by the start token unless
        `add_special_tokens` is False or the text already begins with it."""
        ids = self.generator.tokenizer.encode(string, add_special_tokens=False).ids
        if add_special_tokens is False or ids[:1] == [self.prefix_token_id]:
            return ids
        return [self.prefix_token_id] + ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.generator.decode(ids)

    # ----------------------------------------------------------------------------------- log-likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids) -> (log p, is_greedy)."""
        results = self._score([(context, continuation) for _, context, continuation in requests], disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, t_1 after the start token, in windows of max_length (module docstring)."""
        pairs, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            windows = rolling_windows(
                self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length
            )
            pairs += windows
            owners += [index] * len(windows)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._score(pairs, disable_tqdm)):
            totals[owner] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (summed log-prob of the continuation, whether it is all argmax)."""
        windows = [model_window(context, continuation, self.max_length) for context, continuation in pairs]
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(windows)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in _progress(batches, disable_tqdm, "step35 log-likelihoods"):
            for index, result in zip(batch, self._score_batch([windows[i] for i in batch])):
                results[index] = result
        return results

    @torch.no_grad()
    def _score_batch(self, windows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward over right-padded rows of (inputs, targets): the targets are the last len(targets)
        next tokens of the inputs; the head and softmax run on those positions only."""
        model = self.generator.model
        width = max(len(inputs) for inputs, _ in windows)
        ids = torch.full((len(windows), width), self.eot_token_id, dtype=torch.long)
        for row, (inputs, _) in enumerate(windows):
            ids[row, : len(inputs)] = torch.tensor(inputs)
        hidden = model.model(ids.to(self._device))  # [B, S, H], before the final norm
        results = []
        for row, (inputs, targets) in enumerate(windows):
            if not targets:
                results.append((0.0, True))
                continue
            scored = hidden[row, len(inputs) - len(targets) : len(inputs)]
            logp = torch.log_softmax(model.lm_head(model.model.norm(scored)).float(), dim=-1)  # [T, V]
            expected = torch.tensor(targets, device=logp.device)
            total = float(logp.gather(-1, expected[:, None]).sum())
            results.append((total, bool((logp.argmax(-1) == expected).all())))
        return results

    # --------------------------------------------------------------------------------------- generation
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context continued until a stop string, a stop token or max_gen_toks (module docstring)."""
        texts = []
        for index, request in enumerate(_progress(requests, disable_tqdm, "step35 generate_until")):
            context, gen_kwargs = request.args
            until, max_new, temperature, top_p = generation_settings(gen_kwargs, self.max_gen_toks)
            room = self.max_length - max_new
            if room < 1:
                raise ValueError(
                    f"step35 lm-eval model: max_gen_toks={max_new} leaves no room for the context within "
                    f"max_length={self.max_length}"
                )
            prompt = self.tok_encode(context)[-room:]
            seen = self._stop_string_seen(until) if until else None
            new = self.generator.generate_ids(prompt, max_new, temperature, top_p, seed=self.seed + index, until=seen)
            text = cut_at_stops(self.generator.decode(new), until)
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

    def _stop_string_seen(self, until: list[str]):
        """Whether the text of the new ids holds one of the stop strings (decoded whole: a stop string may
        span tokens)."""
        return lambda new: any(stop in self.generator.decode(new) for stop in until)

    # --------------------------------------------------------------------------------------- chat
    def _chat(self) -> ChatTemplate:
        if self._template is None:
            self._template = self.generator.chat_template(say=lambda line: log.info("step35: %s", line))
        return self._template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text with the checkpoint's chat template (`step35 generate --chat`'s)."""
        return self.generator.chat_text(self._chat(), chat_history, add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template's source, recorded by lm-eval in its results (None when no template is applied)."""
        return self._chat().source if chat_template else None

    @property
    def tokenizer_name(self) -> str:
        return self.generator.tokenizer_origin.replace("/", "__")

    def get_model_info(self) -> dict:
        config = self.generator.model.config
        return {
            "model_num_parameters": sum(p.numel() for p in self.generator.model.parameters()),
            "model_dtype": str(next(self.generator.model.parameters()).dtype),
            "step35_layers": config.num_hidden_layers,
            "max_length": self.max_length,
        }


# ------------------------------------------------------------------------------------------- helpers
def model_window(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """(the model's inputs, the targets scored at its last positions): (context + continuation) cut on the left
    to max_length + 1 tokens, less its last token."""
    if len(continuation) > max_length:
        raise ValueError(
            f"step35 lm-eval model: a continuation of {len(continuation)} tokens does not fit max_length="
            f"{max_length}; raise max_length (at most the model's max_position_embeddings)"
        )
    whole = (context + continuation)[-(max_length + 1) :]
    return whole[:-1], continuation


def rolling_windows(tokens: list[int], start_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that score each of `tokens` once, t_1 after `start_id`: the predictions
    tokens[first : first + max_length] for first = 0, max_length, ...; each pair's model inputs (context +
    continuation less its last token) are the max_length tokens of start + tokens ending before the window's
    last prediction (fewer for the first window of a short text)."""
    sequence = [start_id] + tokens
    pairs = []
    for first in range(0, len(tokens), max_length):
        end = min(first + max_length, len(tokens))  # predicts tokens[first:end] = sequence[first + 1 : end + 1]
        begin = max(0, end - max_length)  # inputs sequence[begin:end]
        pairs.append((sequence[begin : first + 1], sequence[first + 1 : end + 1]))
    return pairs


def generation_settings(gen_kwargs: dict, max_gen_toks: int) -> tuple[list[str], int, float, float]:
    """(stop strings, new tokens at most, temperature (0: greedy), top_p) of a request's generation kwargs."""
    unknown = sorted(set(gen_kwargs) - set(GENERATION_KWARGS))
    if unknown or gen_kwargs.get("num_beams", 1) != 1:
        raise ValueError(
            f"step35 lm-eval model: generation kwargs {unknown or ['num_beams']} are not supported "
            f"(supported: {', '.join(GENERATION_KWARGS)}, num_beams 1 only)"
        )
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    max_new = int(gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_new_tokens", max_gen_toks)))
    do_sample = gen_kwargs.get("do_sample")
    temperature = float(gen_kwargs.get("temperature", 1.0 if do_sample else 0.0))
    if do_sample is False:
        temperature = 0.0
    top_p = float(gen_kwargs.get("top_p", 1.0))
    if max_new < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"step35 lm-eval model: generation kwargs {gen_kwargs} need max_gen_toks >= 1, "
            "temperature >= 0 and 0 < top_p <= 1"
        )
    return until, max_new, temperature, top_p


def cut_at_stops(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string."""
    for stop in until:
        text = text.split(stop)[0]
    return text


def _batch_size(batch_size: int | str, max_batch_size: int | None) -> int:
    """lm-eval's batch size: an int, or "auto"/"auto:N" (not tuned here: max_batch_size rows, else 1)."""
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        chosen = int(max_batch_size or 1)
        log.warning(
            "step35: batch_size=%s is not tuned by step35's lm-eval model; %d rows per batch", batch_size, chosen
        )
        return chosen
    if int(batch_size) < 1:
        raise ValueError(f"step35 lm-eval model: batch_size={batch_size} must be >= 1 (or auto)")
    return int(batch_size)


def _device(device: str | None) -> str:
    """The device to run on: CUDA where none is named and one is there; lm-eval's command line names cuda:0
    unless --device says otherwise, so a CUDA device on a machine without one is CPU (as lm-eval's HF model)."""
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
        if device is not None:
            log.warning("step35: device %s is not available here; running on %s", device, chosen)
        return chosen
    return device


def _progress(items: list, disable: bool, description: str) -> Iterable:
    from tqdm import tqdm

    return tqdm(items, desc=description, disable=disable or len(items) < 2)


# ----------------------------------------------------------------------------------------- entry points
def run_lm_eval(
    checkpoint: str | Path,
    tasks: list[str],
    include_path: str | Path | list[str | Path] | None = None,
    limit: int | float | None = None,
    **kw,
) -> dict:
    """lm-eval's results dict for `tasks` (names, or tasks of YAML files under `include_path`) with the model
    of `checkpoint`; at most `limit` examples per task. kw: model args (MODEL_ARGS: dtype, device, max_length,
    batch_size, max_gen_toks, seed, tokenizer), include_defaults (False: only the tasks under include_path,
    without indexing lm-eval's thousands of task files, ~10 s) and lm-eval's simple_evaluate arguments
    (num_fewshot, apply_chat_template, gen_kwargs, bootstrap_iters, ...); log_samples defaults to False here
    (True adds each request's inputs and outputs under results["samples"])."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = {"checkpoint": str(checkpoint)} | {name: kw.pop(name) for name in MODEL_ARGS if name in kw}
    paths = include_path if isinstance(include_path, list) else [include_path] if include_path else []
    manager = TaskManager(
        include_path=[str(p) for p in paths] or None, include_defaults=kw.pop("include_defaults", True)
    )
    kw.setdefault("log_samples", False)
    return simple_evaluate(
        model="step35", model_args=model_args, tasks=list(tasks), limit=limit, task_manager=manager, **kw
    )


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (`lm_eval ...`'s arguments) with the `step35` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":  # the class above registered itself as `step35` in this process
    main()
