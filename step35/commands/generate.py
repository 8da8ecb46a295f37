"""`step35 generate`: a few lines from a trained model, to see in seconds that it still talks.

    step35 generate --checkpoint runs/tiny --prompt "The for statement" [--max_new_tokens 64]
                    [--temperature 0.8 --top_p 0.95 --seed 0]

`--checkpoint` is a run folder (its newest intact checkpoint), a `.ckpt` file, a sharded
checkpoint folder, an HF folder (`step35 export`'s output, the release) or a PEFT adapter folder
(`step35 export` of a LoRA run without --merge; run on the base it names). A LoRA run's checkpoint
runs with its adapters merged into the weights, as `step35 export --merge` writes them. Checkpoints are read
through the same verified, code-free readers as `step35 export`; the text is encoded with the
tokenizer the run trained with (recorded in the checkpoint; an HF folder's own otherwise).

One process, no KV cache: each new token runs the model over the whole context (capped at
max_position_embeddings), which is fine for the small models this is meant for; serve a large model
with vLLM or SGLang. temperature 0 (the default) is greedy decoding; otherwise the logits are divided
by the temperature and sampled from the smallest set of tokens whose probability reaches top_p.
The prompt is preceded by the BOS token, or by the EOS (the document separator the data stream
puts before every document) when the tokenizer has no BOS, so the model sees the start of a document.
Generation stops at max_new_tokens or at one of config.json's eos_token_id (the tokenizer's EOS
for a run checkpoint, as `step35 export` would write it). stdout holds the text alone; where the
model, config and tokenizer were read from goes to stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from step35.checkpoint import run_tokenizer
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.export import align_special_ids
from step35.checkpoint.trained import TrainedCheckpoint, is_hf_folder, open_checkpoint
from step35.commands.function_cli import run_function
from step35.checkpoint.peft import is_peft_folder, peft_base, peft_model
from step35.checkpoint.pretrained import load_pretrained
from step35.config import Step35Config
from step35.run import checkpoint_of
from step35.model import Step35ForCausalLM, build_model


@dataclass
class Generator:
    """A model in eval mode with the tokenizer it was trained with and the ids that end a text."""

    model: Step35ForCausalLM
    tokenizer: object  # tokenizers.Tokenizer
    start_id: int  # put before the prompt: BOS, else the document separator (EOS)
    stop_ids: set[int]

    def encode(self, prompt: str) -> list[int]:
        return [self.start_id] + self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=False)

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0) -> list[int]:
        """The new token ids (the stop token included when one ended the text)."""
        device = self.model.lm_head.weight.device
        rng = torch.Generator(device=device).manual_seed(seed)
        ids = torch.tensor([prompt_ids], device=device)
        limit = self.model.config.max_position_embeddings
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits = self.model(ids[:, -limit:])[0, -1].float()  # [V]
            token = next_token(logits, temperature, top_p, rng)
            new.append(token)
            if token in self.stop_ids:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        return new

    def __call__(self, prompt: str, **kwargs) -> str:
        return self.decode(self.generate_ids(self.encode(prompt), **kwargs))


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


def load_generator(checkpoint: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   tokenizer: str | Path | None = None, say: Callable[[str], None] | None = None) -> Generator:
    """The main model (no MTP layers) of a run checkpoint or an HF folder, and its tokenizer. `say`
    (a print-like callable) hears where the model, config and tokenizer were read from."""
    from tokenizers import Tokenizer

    say = say or (lambda line: None)
    path = Path(checkpoint)
    if is_peft_folder(path):  # a LoRA run's adapter export: on the base it names
        if peft_base(path) is None and tokenizer is None:
            raise CheckpointError(f"{path}: an adapter folder over a base drawn from the init, which has no "
                                  "tokenizer; pass --tokenizer <folder>")
        model, base = peft_model(path, dtype, device)
        files = run_tokenizer.folder_files(tokenizer or base)
        config, run_eos = Step35Config.from_dict(model.config.to_dict()), None
        say(f"model: {base or 'the init'} with the adapters of {path} merged in; tokenizer: {tokenizer or base}")
    elif is_hf_folder(path):
        model = load_pretrained(path, dtype=dtype, device=device, num_mtp_layers=0)
        files = run_tokenizer.folder_files(tokenizer or path)
        config, run_eos = model.config, None
        say(f"model: {path}; tokenizer: {tokenizer or path}")
    else:
        trained = open_checkpoint(checkpoint_of(path, say))
        for note in trained.notes:
            say(note)
        if trained.lora is not None:
            say(f"LoRA run: its adapters merged into the weights (alpha={trained.lora.scale_alpha:g})")
        model = _model_from(trained, dtype, device)
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
    return Generator(model.eval(), text_tokenizer, start, stop_ids)


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
                raise CheckpointError(f"{trained.path}: {name} has shape {list(tensor.shape)}, the model config "
                                      f"needs {list(state[name].shape)}")
            state[name].copy_(tensor)
            filled.add(name)
    missing = sorted(set(state) - filled - ({"lm_head.weight"} if trained.config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{trained.path}: lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
    return model


def generate(checkpoint: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, dtype: Literal["float32", "bfloat16", "float16"] = "float32", device: str = "cpu",
             tokenizer: str | None = None) -> None:
    """Continue a prompt with a trained model and print prompt + continuation.

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
    """
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise SystemExit("step35 generate: need max_new_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
    generator = load_generator(checkpoint, getattr(torch, dtype), device, tokenizer,
                               say=lambda line: print(f"step35 generate: {line}", file=sys.stderr))
    text = generator(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    print(prompt + text, flush=True)


def main(argv: list[str] | None = None) -> None:
    run_function(generate, "step35 generate", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
