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

`--chat` renders the prompt as the user's turn (after `--system`, if given) with the chat template,
plus the generation prompt, and prints only the assistant's reply. The template is the tokenizer's
(chat_template.jinja, else tokenizer_config.json's chat_template: for a run checkpoint, of the
tokenizer files it records), else step35's default one (step35.data.chat_template); stderr says which. The
rendered ids are preceded by the start token as above unless the template already begins with it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.peft import is_peft_folder, peft_base, peft_model
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.checkpoint.training import run_tokenizer
from step35.checkpoint.training.export import align_special_ids
from step35.checkpoint.training.trained import TrainedCheckpoint, is_hf_folder, open_checkpoint
from step35.commands.function_cli import run_function
from step35.config import Step35Config
from step35.data.chat_messages import ChatTemplateError
from step35.data.chat_template import ChatTemplate
from step35.data.tokenizer import TextTokenizer
from step35.model import KVCache, Step35ForCausalLM, build_model
from step35.run.resolution import read_checkpoint


@dataclass
class Generator:
    """A model in eval mode with the tokenizer it was trained with and the ids that end a text."""

    model: Step35ForCausalLM
    tokenizer: object  # tokenizers.Tokenizer
    start_id: int  # put before the prompt: BOS, else the document separator (EOS)
    stop_ids: set[int]
    use_cache: bool = True  # False: rerun the whole context for every token
    eos_id: int | None = None  # the tokenizer's EOS (a template's eos_token when it names none)
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)  # where a chat template is looked up
    tokenizer_origin: str = ""

    def encode(self, prompt: str) -> list[int]:
        return [self.start_id] + self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=False)

    @torch.no_grad()
    def generate_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[int]:
        """The new token ids (the stop token included when one ended the text)."""
        device = self.model.lm_head.weight.device
        rng = torch.Generator(device=device).manual_seed(seed)
        ids = torch.tensor([prompt_ids], device=device)
        limit = self.model.config.max_position_embeddings
        cache = KVCache() if self.use_cache else None
        new: list[int] = []
        for _ in range(max_new_tokens):
            if cache is not None and ids.shape[1] <= limit:  # the tokens the cache has not seen yet
                logits = self.model.step(ids[:, cache.length :], cache, last_only=True)[0, -1].float()  # [V]
            else:
                logits = self.model(ids[:, -limit:])[0, -1].float()
            if not bool(torch.isfinite(logits).all()):  # (a host sync, as the token's own)
                raise NonFiniteLogits(
                    f"the model's next-token logits hold NaN/Inf after {len(new)} new tokens: weights that "
                    f"overflow {next(self.model.parameters()).dtype} (try --dtype float32) or that are not "
                    f"finite; nothing more is generated"
                )
            token = next_token(logits, temperature, top_p, rng)
            new.append(token)
            if token in self.stop_ids:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        return new

    def __call__(self, prompt: str, **kwargs) -> str:
        return self.decode(self.generate_ids(self.encode(prompt), **kwargs))

    def chat_template(self, say: Callable[[str], None] | None = None) -> ChatTemplate:
        """The tokenizer's chat template, else step35's default; `say` hears which."""
        template = ChatTemplate.from_files(self.tokenizer_files, self.tokenizer_origin)
        if say is not None:
            say(
                f"chat template: {template.origin} of {self.tokenizer_origin}"
                if template is not None
                else f"chat template: step35's default ({self.tokenizer_origin} has none)"
            )
        return template if template is not None else ChatTemplate.default()

    def chat_ids(self, template: ChatTemplate, user: str, system: str | None = None) -> list[int]:
        """The ids a reply is generated after: [system,] user turn and the generation prompt. The
        template's end-of-turn token joins the stop ids (a reply ends there even when config.json's
        eos_token_id does not list it)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        eos = self.eos_id if self.eos_id is not None else self.start_id
        tokenizer = TextTokenizer(self.tokenizer, eos, Path(self.tokenizer_origin))
        ids = template.prompt_ids(tokenizer, messages, where="the conversation of --system and --prompt")
        try:
            self.stop_ids = self.stop_ids | {template.end_of_turn_id(tokenizer)}
        except ChatTemplateError:
            pass  # no special token ends a reply: the EOS ids alone stop it
        return ids if ids[:1] == [self.start_id] else [self.start_id] + ids


class NonFiniteLogits(RuntimeError):
    """The model's logits are not finite: any token drawn from them would be noise (argmax of NaN)."""


def next_token(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator) -> int:
    """Greedy for temperature 0, else a sample from the top-p nucleus of softmax(logits / temperature)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep each token whose predecessors do not yet reach top_p: the smallest set reaching it (>= 1 token).
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    choice = torch.multinomial(sorted_probs * keep, 1, generator=rng)
    return int(order[choice])


def load_generator(
    checkpoint: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tokenizer: str | Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Generator:
    """The main model (no MTP layers) of a run checkpoint or an HF folder, and its tokenizer. `say`
    (a print-like callable) hears where the model, config and tokenizer were read from."""
    from tokenizers import Tokenizer

    say = say or (lambda line: None)
    path = Path(checkpoint)
    if is_peft_folder(path):  # a LoRA run's adapter export: on the base it names
        if peft_base(path) is None and tokenizer is None:
            raise CheckpointError(
                f"{path}: an adapter folder over a base drawn from the init, which has no "
                "tokenizer; pass --tokenizer <folder>"
            )
        model, base = peft_model(path, dtype, device)
        files = run_tokenizer.folder_files(tokenizer or base)
        config, run_eos, origin = Step35Config.from_dict(model.config.to_dict()), None, str(tokenizer or base)
        say(f"model: {base or 'the init'} with the adapters of {path} merged in; tokenizer: {origin}")
    elif is_hf_folder(path):
        model = load_pretrained(path, dtype=dtype, device=device, num_mtp_layers=0)
        files = run_tokenizer.folder_files(tokenizer or path)
        config, run_eos = model.config, None
        say(f"model: {path}; tokenizer: {tokenizer or path}")
    else:

        def read(chosen: Path) -> tuple[TrainedCheckpoint, Step35ForCausalLM]:
            trained = open_checkpoint(chosen)
            return trained, _model_from(trained, dtype, device)

        trained, model = read_checkpoint(path, read, say)  # again from the newest, if a live run pruned it
        for note in trained.notes:
            say(note)
        if trained.lora is not None:
            say(f"LoRA run: its adapters merged into the weights (alpha={trained.lora.scale_alpha:g})")
        if tokenizer:
            files, run_eos, origin = run_tokenizer.folder_files(tokenizer), None, str(tokenizer)
        else:
            files, run_eos, origin = trained.tokenizer_files()
        say(f"model: {trained.path}; tokenizer: {origin}")
        config = Step35Config.from_dict(trained.config.to_dict())
    ids = run_tokenizer.special_ids(files, tokenizer or path)
    if not is_hf_folder(path):
        align_special_ids(config, ids, run_eos)  # what the exported config.json would say
    stop_ids = set(config.eos_token_ids) | ({ids.eos} if ids.eos is not None else set())
    start = ids.bos if ids.bos is not None else ids.eos if ids.eos is not None else run_eos
    if start is None:
        raise CheckpointError(f"{path}: the tokenizer has neither a BOS nor an EOS token to start a document with")
    text_tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    text_tokenizer.no_truncation()
    text_tokenizer.no_padding()
    return Generator(
        model.eval(),
        text_tokenizer,
        start,
        stop_ids,
        eos_id=ids.eos,
        tokenizer_files=files,
        tokenizer_origin=str(tokenizer or path) if is_hf_folder(path) else origin,
    )


def _model_from(trained: TrainedCheckpoint, dtype: torch.dtype, device: str) -> Step35ForCausalLM:
    """Build on meta, allocate on `device`, fill every tensor from the checkpoint (MTP ones skipped;
    LoRA adapters merged into their weights)."""
    model = build_model(trained.config, num_mtp_layers=0, device="meta")
    model.to(dtype)  # router_bias stays fp32 (MoE._apply)
    model.to_empty(device=device)
    state = model.state_dict()
    filled = set()
    with torch.no_grad():
        for name, tensor in trained.merged_tensors():
            if name not in state:
                continue  # MTP layers
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise CheckpointError(
                    f"{trained.path}: {name} has shape {list(tensor.shape)}, the model config "
                    f"needs {list(state[name].shape)}"
                )
            state[name].copy_(tensor)
            filled.add(name)
    missing = sorted(set(state) - filled - ({"lm_head.weight"} if trained.config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{trained.path}: lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
    return model


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
    """
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise SystemExit("step35 generate: need max_new_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
    if system is not None and not chat:
        raise SystemExit("step35 generate: --system needs --chat true (a system message opens a conversation)")
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
        ids = generator.chat_ids(template, prompt, system)
        print(generator.decode(generator.generate_ids(ids, **sampling)), flush=True)
    except (ChatTemplateError, NonFiniteLogits) as e:
        raise SystemExit(f"step35 generate: {e}") from None


def main(argv: list[str] | None = None) -> None:
    run_function(generate, "step35 generate", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
