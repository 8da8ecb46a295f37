"""`step35 generate`: a few lines from a trained model, to see in seconds that it still talks.

    step35 generate --checkpoint runs/tiny --prompt "The for statement" [--max_new_tokens 64]
                    [--temperature 0.8 --top_p 0.95 --seed 0]

`--checkpoint` is a run folder (its newest intact checkpoint), a `.ckpt` file, a sharded
checkpoint folder, an HF folder (`step35 export`'s output, the release) or a PEFT adapter folder
(`step35 export` of a LoRA run without --merge; run on the base it names). A LoRA run's checkpoint
runs with its adapters merged into the weights, as `step35 export --merge` writes them. Checkpoints are read
through the same verified, code-free readers as `step35 export`; the text is encoded with the
tokenizer the run trained with (recorded in the checkpoint; an HF folder's own otherwise).

One process with a KV cache (Step35ForCausalLM.step): the prompt runs once, then each new token
attends to the kept keys (sliding layers keep their window), so a long sample is not quadratic; the
tokens are those of rerunning the whole context each time (`--cache false` does that). Past
max_position_embeddings the context is cut to its last max_position_embeddings tokens and rerun at
every token, as positions beyond the limit do not exist. This is a check for small models; serve a
large model with vLLM or SGLang. temperature 0 (the default) is greedy decoding; otherwise the
logits are divided by the temperature and sampled from the smallest set of tokens whose probability
reaches top_p.
The prompt is preceded by the BOS token, or by the EOS (the document separator the data stream
puts before every document) when the tokenizer has no BOS, so the model sees the start of a document.
Generation stops at max_new_tokens or at one of config.json's eos_token_id (the tokenizer's EOS
for a run checkpoint, as `step35 export` would write it). stdout holds the text alone; where the
model, config and tokenizer were read from goes to stderr.

    step35 generate --checkpoint runs/tiny --chat true --prompt "Hi" [--system "Be brief."]

    step35 generate --checkpoint runs/tiny-vision --chat true --image shape.png --prompt "Describe the image."

`--image PATH` (with `--chat`; several: `--image '[a.png, b.png]'`) puts images before the prompt in the user's turn, for a
vision-language model (a run with model.vision, or a Step-3.7 folder): each is cut into the views the run trained
on (its data.images; a folder: the release's 728/504 pixels) and placed as its placeholder run, as in training
(step35/data/image_records.py); the prompt's first forward reads their features.

`--chat` renders the prompt as the user's turn (after `--system`, if given) with the chat template,
plus the generation prompt, and prints only the assistant's reply. The template is the tokenizer's
(chat_template.jinja, else tokenizer_config.json's chat_template: for a run checkpoint, of the
tokenizer files it records), else step35's default one (step35.data.chat_template); stderr says which. The
rendered ids are preceded by the start token as above unless the template already begins with it.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import torch

from step35.commands.function_cli import run_function
from step35.data.chat_messages import ChatTemplateError

# The loading and generation live in step35/eval/generator.py (step35 eval loads models the same way); their
# names stay importable from here.
from step35.eval.generator import Generator, NonFiniteLogits, load_generator, next_token  # noqa: F401


def generate(
    checkpoint: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str = "cpu",
    tokenizer: str | None = None,
    chat: bool = False,
    system: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    cache: bool = True,
    image: list[str] | str | None = None,
) -> None:
    """Continue a prompt with a trained model and print prompt + continuation (with --chat: the reply).

    Args:
        checkpoint: a run folder (its newest complete checkpoint), a .ckpt file, a sharded checkpoint folder,
            an HF folder, or a PEFT adapter folder (on the base folder it names).
        prompt: the text to continue.
        max_new_tokens: the most tokens to generate (fewer when an EOS comes first).
        temperature: 0: greedy; else the softmax temperature of sampling.
        top_p: sample from the smallest set of tokens whose probability reaches top_p (1: all).
        seed: seed of the sampling.
        dtype: dtype of the weights in memory.
        device: where the model runs: cpu, cuda, npu (one device).
        tokenizer: a tokenizer folder instead of the checkpoint's.
        chat: the prompt is the user's turn of a conversation, rendered with the chat template; print
            only the assistant's reply.
        system: with chat: a system message before the user's turn.
        chat_template_kwargs: with chat: variables the template renders with, as in training's
            data.chat_template_kwargs, e.g. '{"reasoning_effort": "high"}'.
        cache: keep a KV cache (false: rerun the whole context for every token, the same tokens slower).
        image: with chat: image files (paths, or data: URLs) put before the prompt in the user's turn (a
            vision-language model).
    """
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise SystemExit("step35 generate: need max_new_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
    if system is not None and not chat:
        raise SystemExit("step35 generate: --system needs --chat true (a system message opens a conversation)")
    if image and not chat:
        raise SystemExit("step35 generate: --image needs --chat true (an image is part of the user's turn)")
    if chat_template_kwargs and not chat:
        raise SystemExit("step35 generate: --chat_template_kwargs needs --chat true (they reach the chat template)")

    def say(line: str) -> None:
        print(f"step35 generate: {line}", file=sys.stderr)

    generator = load_generator(checkpoint, getattr(torch, dtype), device, tokenizer, say=say)
    generator.use_cache = cache
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    try:
        if not chat:
            print(prompt + generator(prompt, **sampling), flush=True)
            return
        template = generator.chat_template(say)
        if chat_template_kwargs:
            template = template.with_variables(chat_template_kwargs, "--chat_template_kwargs")
        paths = [image] if isinstance(image, str) else image
        content, images = (prompt, None) if not paths else image_prompt(generator, prompt, paths)
        ids = generator.chat_ids(template, content, system)
        print(generator.decode(generator.generate_ids(ids, images=images, **sampling)), flush=True)
    except (ChatTemplateError, NonFiniteLogits) as e:
        raise SystemExit(f"step35 generate: {e}") from None


def image_prompt(generator: Generator, prompt: str, paths: list[str]) -> tuple[list, dict]:
    """(the user's content: the images' placeholder runs, then the prompt; the model's image arguments)."""
    from pathlib import Path

    from step35.data.image_records import ImageOptions, record_images
    from step35.data.readers import BadRecord

    if generator.image_sizes is None:
        raise SystemExit("step35 generate: --image needs a vision-language model (a run with model.vision, or a"
                         " Step-3.7 folder); this checkpoint has no vision side")  # fmt: skip
    view, crop = generator.image_sizes
    options = ImageOptions(view, crop, max_images=len(paths), max_crops=36 * len(paths))
    content = [{"type": "image", "image": path} for path in paths] + [{"type": "text", "text": prompt}]
    try:
        messages, images = record_images({}, [{"role": "user", "content": content}], Path.cwd(), options)
    except BadRecord as error:
        raise SystemExit(f"step35 generate: --image: {error}") from None
    return messages[0]["content"], {
        "pixel_values": torch.cat([i.pixel_values for i in images]),
        "pixel_values_local": torch.cat([i.pixel_values_local for i in images]),
        "num_local_patches": [i.n_crops for i in images],
    }


def main(argv: list[str] | None = None) -> None:
    run_function(generate, "step35 generate", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
