"""A trained model loaded for inference: the main model (no MTP layers) of a run checkpoint, an HF folder or a
PEFT adapter folder, in eval mode, with the tokenizer it trained with, the start token every text is preceded by
and the ids that end a text; greedy or top-p generation with a KV cache. Used by `step35 generate`
(step35/commands/generate.py, whose docstring describes the choices) and by `step35 eval` (step35/eval/).

Here, below the commands, so that step35/eval/ (layer 5) loads a model the way `step35 generate` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.peft import is_peft_folder, peft_base, peft_model
from step35.checkpoint.hf.pretrained import load_pretrained
from step35.checkpoint.training import run_tokenizer
from step35.checkpoint.training.export import align_special_ids
from step35.checkpoint.training.trained import TrainedCheckpoint, is_hf_folder, open_checkpoint
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
    image_sizes: tuple[int, int] | None = None  # a vision-language model's (view, crop) sides; None: text only

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
        until: Callable[[list[int]], bool] | None = None,
        images: dict | None = None,
    ) -> list[int]:
        """The new token ids (the stop token included when one ended the text). `until`, when given, hears the
        new ids after each token and ends the text by returning True (e.g. at a stop string). `images`: the
        prompt's images (a vision-language model's image_features arguments), read where its placeholders are."""
        device = self.model.lm_head.weight.device
        rng = torch.Generator(device=device).manual_seed(seed)
        ids = torch.tensor([prompt_ids], device=device)
        limit = self.model.config.max_position_embeddings
        cache = KVCache() if self.use_cache else None
        new: list[int] = []
        for _ in range(max_new_tokens):
            if images is not None and ids.shape[1] > limit:
                raise ValueError(f"a prompt with images longer than max_position_embeddings ({limit}) tokens")
            if cache is not None and ids.shape[1] <= limit:  # the tokens the cache has not seen yet
                embeds = self.model.embed_with_images(ids, images) if images is not None and not cache.length else None
                logits = self.model.step(ids[:, cache.length :], cache, True, inputs_embeds=embeds)[0, -1].float()
            elif images is not None:
                logits = self.model(ids, **images)[0, -1].float()
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
            if token in self.stop_ids or (until is not None and until(new)):
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

    def chat_ids(self, template: ChatTemplate, user: str | list, system: str | None = None) -> list[int]:
        """The ids a reply is generated after: [system,] user turn (its text, or its content parts) and the
        generation prompt. The template's end-of-turn token joins the stop ids (a reply ends there even when
        config.json's eos_token_id does not list it)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        tokenizer = self._text_tokenizer()
        ids = template.prompt_ids(tokenizer, messages, where="the conversation of --system and --prompt")
        self._stop_at_end_of_turn(template, tokenizer)
        return ids if ids[:1] == [self.start_id] else [self.start_id] + ids

    def chat_text(self, template: ChatTemplate, messages: list, add_generation_prompt: bool = True) -> str:
        """The conversation as text, as `chat_ids` renders it (the tokenizer's EOS as eos_token where the
        template names none), for callers that tokenize it themselves; the end-of-turn token joins the stop ids."""
        tokenizer = self._text_tokenizer()
        named = template.eos_token is not None
        extra = {} if named else {"eos_token": self.tokenizer.id_to_token(tokenizer.eos_token_id)}
        text = template.render(messages, add_generation_prompt=add_generation_prompt, where="the chat", **extra)
        self._stop_at_end_of_turn(template, tokenizer)
        return text

    def _text_tokenizer(self) -> TextTokenizer:
        eos = self.eos_id if self.eos_id is not None else self.start_id
        return TextTokenizer(self.tokenizer, eos, Path(self.tokenizer_origin))

    def _stop_at_end_of_turn(self, template: ChatTemplate, tokenizer: TextTokenizer) -> None:
        try:
            self.stop_ids = self.stop_ids | {template.end_of_turn_id(tokenizer)}
        except ChatTemplateError:
            pass  # no special token ends a reply: the EOS ids alone stop it


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
    num_mtp_layers: int = 0,
) -> Generator:
    """The main model of a run checkpoint or an HF folder (and its first `num_mtp_layers` MTP layers, which
    generation does not run: `step35 eval` measures their drafts), and its tokenizer. `say` (a print-like
    callable) hears where the model, config and tokenizer were read from."""
    from tokenizers import Tokenizer

    say = say or (lambda line: None)
    path = Path(checkpoint)
    meta = None  # a run checkpoint's Lightning dict (the data options it trained with)
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
        model = load_pretrained(
            path, dtype=dtype, device=device, num_mtp_layers=num_mtp_layers, vision=has_vision_side(path)
        )
        files = run_tokenizer.folder_files(tokenizer or path)
        config, run_eos = model.config, None
        say(f"model: {path}; tokenizer: {tokenizer or path}")
    else:

        def read(chosen: Path) -> tuple[TrainedCheckpoint, Step35ForCausalLM]:
            trained = open_checkpoint(chosen)
            return trained, _model_from(trained, dtype, device, num_mtp_layers, trained.vision_config)

        trained, model = read_checkpoint(path, read, say)  # again from the newest, if a live run pruned it
        meta = trained.meta
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
        image_sizes=image_sizes_of(model, meta),
    )


def image_sizes_of(model: Step35ForCausalLM, meta: dict | None) -> tuple[int, int] | None:
    """(view, crop) sides images are cut into for a vision-language model: those its run trained on (data.images
    in the checkpoint), else the release's for a 728-pixel encoder (728, 504), else its image_size and the
    multiple of 56 nearest below 9/13 of it (the release's proportion: 112 -> 56). None without a vision side."""
    vision = getattr(model, "vision_config", None)
    if vision is None:
        return None
    recorded = ((meta or {}).get("datamodule_hyper_parameters") or {}).get("images")
    if isinstance(recorded, dict) and {"view_size", "crop_size"} <= set(recorded):
        return int(recorded["view_size"]), int(recorded["crop_size"])
    side = vision.image_size
    return side, max(56, side * 9 // 13 // 56 * 56)


def has_vision_side(folder: Path) -> bool:
    """Whether an HF folder's config.json describes a vision side (a Step-3.7 folder). A config.json that cannot be
    read says False: reading the folder then names what is wrong with it (Step35Config.from_json)."""
    import json

    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("vision_config"), dict)


def _model_from(
    trained: TrainedCheckpoint, dtype: torch.dtype, device: str, num_mtp_layers: int = 0, vision=None
) -> Step35ForCausalLM:
    """Build on meta, allocate on `device`, fill every tensor from the checkpoint (MTP layers beyond
    `num_mtp_layers` skipped; LoRA adapters merged into their weights); with `vision` (a VisionConfig), the
    vision-language model, its encoder and projector filled too."""
    model = build_model(trained.config, num_mtp_layers=num_mtp_layers, device="meta", vision=vision)
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
