"""Shared helpers of the step35 tests: the one tiny config dict every test starts from, the one hand
computation of RoPE inverse frequencies with llama3 scaling (docs/architecture.md §2.4-2.5), which the
model tests and the reference forward share; readers of what runs leave (wandb records, TensorBoard events, the
CSV metrics, complete checkpoints); the run configs of the run-folder and chaos tests, a LoRA run in this process
and its HF base; a cp shard simulated in one process; and the tokenizers, files and chat templates the data and
chat tests share. Starting step35 (a subprocess, torchrun, a launcher, the CLI in this process) is
tests/runner.py's. Other reference math stays in the test that needs it, written from docs/architecture.md."""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import subprocess
from pathlib import Path

import torch

from step35.config import PRESETS, Step35Config
from step35.model import Step35ForCausalLM


def tiny_config_dict(**overrides) -> dict:
    """The `tiny` preset's config dict (released layout), with top-level keys replaced."""
    raw = PRESETS["tiny"]()
    raw.update(copy.deepcopy(overrides))
    return raw


def tiny_config(**overrides) -> Step35Config:
    return Step35Config.from_dict(tiny_config_dict(**overrides))


def flash_config_dict() -> dict:
    return PRESETS["flash-196b"]()


def hand_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """Inverse frequency of each rotary pair, theta^(-2j/r) (docs/architecture.md §2.4 step 3), then
    llama3 scaling (§2.5) when `scaling` is given; one pair at a time in Python floats (float64)."""
    inv = [theta ** (-2.0 * j / rotary_dim) for j in range(rotary_dim // 2)]
    if scaling is None:
        return inv
    factor, l_orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    out = []
    for f in inv:
        wavelength = 2 * math.pi / f
        if wavelength < l_orig / high:  # high frequencies: unchanged
            out.append(f)
        elif wavelength > l_orig / low:  # low frequencies: divided by the factor
            out.append(f / factor)
        else:  # in between: interpolated
            s = (l_orig / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return out


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Fill every state-dict tensor with random values so that each feature bites: norm weights
    away from 0 (so 1 + w matters), router bias non-zero (so it changes the chosen experts),
    projections large enough that activations are O(1)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight"):
            values = torch.rand(t.shape, generator=g) - 0.5  # w in [-0.5, 0.5): scale 1 + w
        elif name.endswith("router_bias"):
            values = torch.randn(t.shape, generator=g) * 0.2
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(t.shape, generator=g)
        else:
            values = torch.randn(t.shape, generator=g) * std
        t.copy_(values.to(t.dtype))
    return model


def tiny_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, num_mtp_layers: int | None = None, **overrides
) -> Step35ForCausalLM:
    """A randomised tiny Step-3.5 model (5 main layers + 1 MTP layer, every feature switched on)."""
    torch.manual_seed(seed)
    model = Step35ForCausalLM(tiny_config(**overrides), num_mtp_layers=num_mtp_layers)
    randomize_(model, seed)
    return model.to(dtype)


def state_numel(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict().values())


def wandb_records(run_root, kind: str) -> list:
    """Records of one type ("history", "config", ...) of an offline wandb run, read from its .wandb
    file with wandb's own protobuf classes (offline runs write no wandb-summary.json, and wandb 0.31
    ships no reader). The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks
    [crc32 u32][length u16][type u8][data], types full=1, first=2, middle=3, last=4."""
    from pathlib import Path

    from wandb.proto import wandb_internal_pb2 as pb

    data = next(Path(run_root).glob("**/run-*.wandb")).read_bytes()
    block, pos, chunks, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, chunk_type = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if chunk_type == 1:
            chunks.append(chunk)
        elif chunk_type == 2:
            pending = chunk
        elif chunk_type == 3:
            pending += chunk
        elif chunk_type == 4:
            chunks.append(pending + chunk)
    records = []
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == kind:
            records.append(record)
    return records


def tensorboard_events(folder: Path) -> list:
    """Every Event of the tfevents files under `folder` (TFRecord framing: length, crc, data, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(Path(folder).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12 : at + 12 + length])
            events.append(event)
            at += 12 + length + 4
    return events


# ------------------------------------------------------------------------------ run configs and what runs leave
# The tiny run of the run-folder tests (10 steps, RunCheckpoint every 5 steps keeping 3, the CSV flushed every
# step); `--trainer.callbacks.<option>` sets RunCheckpoint's options (it is the list's last callback).
RUN_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  precision: 32-true
  max_steps: 10
  val_check_interval: 1000
  check_val_every_n_epoch: null
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    - class_path: step35.loggers.CSVLogger
      init_args:
        name: csv
        flush_logs_every_n_steps: 1
  callbacks:
    - class_path: lightning.pytorch.callbacks.LearningRateMonitor
      init_args:
        logging_interval: step
    - class_path: step35.callbacks.RunCheckpoint   # last in the list: --trainer.callbacks.keep_last=N sets it
      init_args:
        every_n_train_steps: 5
        keep_last: 3
model:
  config: tiny
  mtp_loss_weight: 0.3
  lr: 3.0e-3
  warmup_steps: 4
  moe_bias_update_rate: 1.0e-3
data:
  seq_len: 32
  micro_batch_size: 2
  num_workers: 0
"""

# The chaos runs' config (tests/test_chaos.py): no max_steps (the command line gives it), RunCheckpoint every
# 5 steps keeping 2, warmup 10.
CHAOS_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  precision: 32-true
  val_check_interval: 1000
  check_val_every_n_epoch: null
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    - class_path: step35.loggers.CSVLogger
      init_args:
        name: csv
  callbacks:
    - class_path: step35.callbacks.RunCheckpoint
      init_args:
        every_n_train_steps: 5
        keep_last: 2
model:
  config: tiny
  mtp_loss_weight: 0.3
  lr: 3.0e-3
  warmup_steps: 10
  moe_bias_update_rate: 1.0e-3
data:
  seq_len: 32
  micro_batch_size: 2
  num_workers: 0
"""


def write_run_config(folder: Path, text: str = RUN_CONFIG, name: str = "resume.yaml") -> Path:
    """`text` (RUN_CONFIG unless given) written as `folder`/`name`; the path."""
    path = Path(folder) / name
    path.write_text(text)
    return path


def lora_config(text: str = CHAOS_CONFIG) -> str:
    """A run config (CHAOS_CONFIG unless given) turned into a LoRA run: rank 4 on every target, decay over 20 steps."""
    assert "  config: tiny\n" in text and "mtp_loss_weight: 0.3" in text
    return text.replace(
        "  config: tiny\n",
        "  config: tiny\n  decay_steps: 20\n  lora:\n    rank: 4\n"
        "    targets: [attention, mlp, shared_expert, experts, mtp, router]\n",
    )


def metric_rows(folder: Path) -> list[dict]:
    """The rows of `folder`/metrics.csv (a CSVLogger version folder), as dicts of strings."""
    with open(Path(folder) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def steps_of(rows: list[dict], column: str) -> dict[int, float]:
    """{step: value} of the rows that hold `column`."""
    return {int(r["step"]): float(r[column]) for r in rows if r.get(column)}


def run_losses(run: Path, column: str = "train/lm_loss") -> dict[int, float]:
    """{step: `column`} of every metrics.csv under `run` (every attempt of a run folder, in version order)."""
    out: dict[int, float] = {}
    for file in sorted(Path(run).rglob("metrics.csv")):
        out.update(steps_of(metric_rows(file.parent), column))
    return out


def saved_steps(folder: Path) -> list[int]:
    """Global steps of the complete checkpoints in `folder`, oldest first."""
    from step35.checkpoint.training import catalog

    return [c.global_step for c in catalog.complete_checkpoints(folder)]


# ------------------------------------------------------------------------------ LoRA runs in this process
LORA = {"rank": 4, "targets": ["attention", "mlp", "shared_expert", "experts", "router"]}


def hf_base(folder: Path, seed: int) -> Path:
    """A tiny model drawn with `seed`, saved as an HF folder at `folder` (a LoRA run's frozen base)."""
    from step35.checkpoint.hf.materialize import materialize
    from step35.checkpoint.hf.pretrained import save_pretrained
    from step35.config import preset
    from step35.model import build_model

    model = build_model(preset("tiny"))
    materialize(model, "cpu", seed=seed)
    save_pretrained(model, folder)
    return folder


def lora_fit(
    root: Path, cache: Path, steps: int, base: Path | None = None, ckpt_path: Path | None = None, init_seed: int = 0
) -> torch.nn.Module:
    """A tiny LoRA run (LORA) of `steps` steps in this process, RunCheckpoint every 2 steps under `root`, on the base
    HF folder `base` (else the init drawn with `init_seed`), resumed from `ckpt_path` when given; its model."""
    import lightning.pytorch as pl

    from step35.callbacks import RunCheckpoint
    from step35.checkpoint.training.plugin import Step35CheckpointIO
    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    module = Step35LightningModule(
        config="tiny",
        checkpoint=str(base) if base else None,
        lora=dict(LORA),
        lr=1e-2,
        warmup_steps=1,
        decay_steps=4,
        init_seed=init_seed,
        moe_bias_update_rate=1e-3,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        plugins=[Step35CheckpointIO()],
        callbacks=[RunCheckpoint(every_n_train_steps=2)],
    )
    trainer.fit(
        module,
        datamodule=Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(cache)),
        ckpt_path=str(ckpt_path) if ckpt_path else None,
    )
    return module.model


# ------------------------------------------------------------------------------ context parallelism in one process
def simulated_shard(k, v, positions, S, c, doc_ids):
    """A SequenceShard whose exchanges read the whole K/V of this process (what the cp ranks hold)."""
    from step35.kernels.masks import SequenceShard

    full = torch.stack([k, v])

    def gather(x):
        return full

    def halo(x, n):
        pieces = []
        for start in (int(positions[0]), int(positions[c])):
            idx = torch.arange(start - n, start)
            pieces.append(full[..., idx.clamp(min=0), :] * (idx >= 0).to(full.dtype)[:, None])
        return torch.cat(pieces, dim=-2)

    return SequenceShard(positions, S, c, doc_ids, gather=gather, halo=halo)


def train_byte_bpe(texts: list[str], special_tokens: list[str], folder, vocab_size: int = 400):
    """A byte-level BPE (tokenizers' Tokenizer) trained on `texts` here, saved as `folder`/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    return tokenizer


# ------------------------------------------------------------------------------ data files and word-level tokenizers
def write_jsonl(path: Path, records: list) -> Path:
    """`records` as JSON lines at `path`: a dict as it is, a string as {"text": string}."""
    import json

    path.write_text("".join(json.dumps({"text": r} if isinstance(r, str) else r) + "\n" for r in records))
    return path


WORD_EOS = 0  # <eos> of the word-level tokenizers below (<unk> is 1, their words follow from 2)


def word_tokenizer_folder(folder: Path, words: list[str], chat_template: str | None = None) -> Path:
    """A tokenizer folder at `folder` whose tokens are whole words (split at whitespace): <eos> WORD_EOS,
    <unk> 1, then `words` in order; with `chat_template`, its chat_template.jinja."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<eos>": WORD_EOS, "<unk>": 1} | {w: i + 2 for i, w in enumerate(words)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    return folder


# Documents that name themselves (the token stream tests): document i starts with the word `d{i}`, so every
# token of every window traces back to its document.
DOC_WORDS = [f"d{i}" for i in range(2000)] + [f"w{i}" for i in range(50)] + ["a", "b"]


def make_word_tokenizer(folder: Path):
    """The TextTokenizer of DOC_WORDS, saved at `folder`."""
    from step35.data.tokenizer import TextTokenizer

    return TextTokenizer.from_folder(word_tokenizer_folder(folder, DOC_WORDS))


def doc_id(token: int) -> int:
    """The document a token of DOC_WORDS comes from (its `d{i}` word)."""
    return int(DOC_WORDS[token - 2][1:])


def take(loader, n: int) -> list[torch.Tensor]:
    """The input_ids of the first `n` batches of `loader`."""
    batches = []
    for batch in loader:
        batches.append(batch["input_ids"])
        if len(batches) == n:
            break
    return batches


def worker_stack_on_hang(worker_id: int) -> None:
    """A DataLoader `worker_init_fn`: a worker still alive 50 s after it started prints every thread's stack to
    stderr (the test's captured output), once. With the loader's `timeout` of 70 s, a hung forked worker (seen
    once in a full parallel run, never reproduced alone) fails its test showing where it hangs."""
    import faulthandler

    faulthandler.dump_traceback_later(50.0)


def resume_matches(make_stream, num_batches: int, save_at: list[int], batch_size: int = 2) -> list[dict]:
    """Run once recording a state after `save_at` batches; every restored run must replay the rest exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader_of(stream):
        return StatefulDataLoader(
            stream, batch_size=batch_size, num_workers=2, worker_init_fn=worker_stack_on_hang, timeout=70
        )

    reference, states = [], {}
    loader = loader_of(make_stream())
    for batch in loader:
        reference.append(batch["input_ids"])
        if len(reference) in save_at:
            states[len(reference)] = copy.deepcopy(loader.state_dict())
        if len(reference) == num_batches:
            break
    for k, state in states.items():
        restored = loader_of(make_stream())
        restored.load_state_dict(state)
        replay = take(restored, num_batches - k)
        assert len(replay) == num_batches - k
        for i, (a, b) in enumerate(zip(replay, reference[k:])):
            assert torch.equal(a, b), f"state after batch {k}: batch {k + i} differs"
    return list(states.values())


# Conversations traceable word by word (the chat data tests): a conversation renders as `<role> <words>` per
# turn, an assistant turn as `assistant <words> <eos>` with the words and the EOS trained.
CHAT_ROLES = ["system", "user", "assistant", "tool"]
CHAT_WORDS = CHAT_ROLES + [f"c{i}" for i in range(400)] + [f"w{i}" for i in range(50)]
CHAT_IDS = {"<eos>": WORD_EOS, "<unk>": 1} | {w: i + 2 for i, w in enumerate(CHAT_WORDS)}
# Generation marks around the trained part: the assistant's words and the EOS that ends its turn.
CHAT_WORD_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}assistant {% generation %}{{ m.content }} {{ eos_token }}"
    "{% endgeneration %} {% else %}{{ m.role }} {{ m.content }} {% endif %}{% endfor %}"
)


def make_chat_tokenizer(folder: Path, template: bool = False) -> Path:
    """The tokenizer folder of CHAT_WORDS at `folder`, with CHAT_WORD_TEMPLATE as its chat template when `template`."""
    return word_tokenizer_folder(folder, CHAT_WORDS, CHAT_WORD_TEMPLATE if template else None)


def chat_source(name: str, files: list[Path], **kwargs):
    """A FileSource of whole chat records."""
    from step35.data.sources import FileSource

    source = FileSource(name, files, whole_records=True, **kwargs)
    source.format = "chat"
    return source


# ------------------------------------------------------------------------------ test chat templates
# Written for the tests (tests/test_chat_template.py): a ChatML-style one that renders every turn the same way
# whatever follows it, and three Step-3.5-style ones that drop the reasoning of turns before the last user
# message (step-a: generation prompt `<|im_start|>assistant\n`; step-b: it ends in `<think>\n`; step-c: as
# step-b, but a turn without reasoning gets no think block), each with (`marked`) and without (`plain`)
# `{% generation %}` marks; and a conversation with reasoning, a tool call and its result.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# [[GEN]] / [[/GEN]] become the generation tags in the marked copy and vanish in the plain one; they sit
# between tags and expressions, never before a newline, so trim_blocks treats both copies alike.
TOOL_CALLS = (
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>\\n' + c.function.name + '\\n' + (c.function.arguments | tojson)"
    " + '\\n</tool_call>' }}{% endfor %}"
)
CHATML = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}[[GEN]]"
    "{%- if m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n' }}{%- endif -%}"
    "{{ m.content or '' }}" + TOOL_CALLS + "{{ '<|im_end|>' }}[[/GEN]]{{ '\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def step_style(think_in_prompt: bool, only_with_reasoning: bool = False) -> str:
    """A template that renders reasoning only for assistant turns after the last user message (variant A), and
    with `think_in_prompt` ends its generation prompt in `<think>\\n` (variant B). Reasoning comes from
    reasoning_content or from a `<think>...</think>` block at the start of the content. A user message wrapped in
    `<tool_response>` counts as a tool result, not as the last user message (so its content decides the
    rendering of other turns). With
    `only_with_reasoning` (variant C) a recent turn without reasoning gets no think block either, so the
    generation prompt's `<think>` is part of what the turn's reasoning decides."""
    opener = "{{ '<think>\\n' }}"
    return (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' and not (m.content.startswith('<tool_response>')"
        " and m.content.endswith('</tool_response>')) -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if messages[0].role == 'system' -%}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- set content = m.content or '' -%}{%- set reasoning = m.reasoning_content or '' -%}"
        "{%- if '</think>' in content -%}"
        "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
        "{%- endif -%}"
        "{%- set recent = loop.index0 > ns.last_user" + (" and reasoning" if only_with_reasoning else "") + " -%}"
        "{{ '<|im_start|>assistant\\n' }}"
        + ("{%- if recent -%}" + opener + "{%- endif -%}" if think_in_prompt else "")
        + "[[GEN]]{%- if recent -%}"
        + ("" if think_in_prompt else opener)
        + "{{ reasoning + '\\n</think>\\n' }}{%- endif -%}"
        "{{ content }}" + TOOL_CALLS + "{{ '<|im_end|>' }}[[/GEN]]{{ '\\n' }}"
        "{%- elif m.role == 'system' and loop.first -%}"
        "{%- elif m.role == 'tool' -%}"
        "{{ '<|im_start|>tool\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
        "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
        + (opener if think_in_prompt else "")
        + "{%- endif -%}"
    )


SOURCES = {"chatml": CHATML, "step-a": step_style(False), "step-b": step_style(True), "step-c": step_style(True, True)}


def plain(name: str) -> str:
    return SOURCES[name].replace("[[GEN]]", "").replace("[[/GEN]]", "")


def marked(name: str) -> str:
    return SOURCES[name].replace("[[GEN]]", "{% generation %}").replace("[[/GEN]]", "{% endgeneration %}")


CONVERSATION = [
    {"role": "system", "content": "You are a careful helper."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "reasoning_content": "Add the two numbers.", "content": "Four."},
    {"role": "user", "content": "And the weather in Paris today?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "I need the weather tool for this.",  # another name for reasoning_content
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp": 18, "sky": "clear"}'},
    {"role": "assistant", "content": "<think>\nThe tool says 18.\n</think>\nIt is 18 degrees and clear in Paris."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def one_step_from(source: Path, folder: Path, cache: Path):
    """One training step (in this process, lr 1e-2) from the HF folder `source` with its own tokenizer, saved as
    `folder`/run.ckpt: (the trained LightningModule, the checkpoint's path)."""
    import lightning.pytorch as pl

    from step35.data import Step35DataModule
    from step35.module import Step35LightningModule

    module = Step35LightningModule(checkpoint=str(source), lr=1e-2, warmup_steps=1)
    data = Step35DataModule(tokenizer=str(source), seq_len=16, micro_batch_size=1, cache_dir=str(cache))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=folder / "run",
        enable_checkpointing=False,
    )
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(folder / "run.ckpt")
    return module, folder / "run.ckpt"


# ------------------------------------------------------------------------------ Step-3.7-Flash folders
# config.json keys of an HF config that say how it was saved, not what the model is
BOOKKEEPING = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path")
STEP37_VISION = ("vision_model.", "vit_large_projector.")  # the vision encoder's and projector's tensors


def vision_tensors_and_config(tmp: Path, text: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A tiny Step-3.7 vision encoder + projector saved by transformers: its tensors in the release's names
    (`vision_model.*`, `vit_large_projector.*`) and its config.json (without text_config)."""
    import json

    from safetensors.torch import load_file
    from transformers.models.step3p7.configuration_step3p7 import Step3p7Config, Step3p7VisionConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    from tests.hf_oracle import hf_config_from_dict

    vision = Step3p7VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14, mlp_ratio=2.0
    )
    torch.manual_seed(0)
    model = Step3p7ForConditionalGeneration(
        Step3p7Config(text_config=hf_config_from_dict(text).to_dict(), vision_config=vision.to_dict())
    )
    model.save_pretrained(tmp / "transformers_saved")
    tensors = {}
    for file in sorted((tmp / "transformers_saved").glob("*.safetensors")):
        tensors |= {n: t for n, t in load_file(file).items() if n.startswith(STEP37_VISION)}
    assert any(n.startswith("vit_large_projector.") for n in tensors) and len(tensors) > 10, sorted(tensors)
    config = json.loads((tmp / "transformers_saved" / "config.json").read_text())
    config.pop("text_config")
    return tensors, config


def step37_folder(
    tmp: Path, nested: bool, text: dict | None = None, language: dict | None = None
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Step-3.7 folder `tmp`/flat or `tmp`/nested: (its path, the language model's tensors in step35's
    names). `nested`: the NVFP4 export's layout (model.language_model.*, no MTP layers), else the BF16/FP8
    releases' (Step-3.5's names). `text` / `language`: the language model's config and tensors (default:
    tests/hf_oracle.py's tiny, random)."""
    import json

    from safetensors.torch import save_file

    from tests.hf_oracle import random_state_dict
    from tests.hf_oracle import tiny_config_dict as oracle_tiny

    text = {k: v for k, v in (text or oracle_tiny()).items() if k not in BOOKKEEPING}
    text["torch_dtype"] = "float32"
    language = language if language is not None else random_state_dict(text, seed=1)
    if nested:
        first_mtp = text["num_hidden_layers"]
        language = {
            n: t
            for n, t in language.items()
            if not n.startswith(tuple(f"model.layers.{first_mtp + j}." for j in range(3)))
        }
    vision, config = vision_tensors_and_config(tmp, text)
    config["text_config"] = {**text, "model_type": "step3p5"}
    folder = tmp / ("nested" if nested else "flat")
    folder.mkdir()
    stored = {(n.replace("model.", "model.language_model.", 1) if nested else n): t for n, t in language.items()}
    save_file({**stored, **vision}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, language


def flip_byte(file: Path) -> None:
    """One bit of `file`'s middle byte flipped: damage a checksum finds and a loader might not."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def assert_bitwise(a, b, where: str = "") -> None:
    """`a` and `b` (tensors, or dicts / lists / tuples of them and of plain values) are equal to the bit, dtypes
    too; the message names the first place (`where`/key[index]) that differs."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where}: differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(set(a) ^ set(b)))
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@contextlib.contextmanager
def small_filesystem(folder: Path, size: str):
    """A tmpfs of `size` (e.g. "6m") mounted at the existing `folder` for the block, then unmounted; the test is
    skipped where mounting is not allowed."""
    import pytest

    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
