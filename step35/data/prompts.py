"""Prompt records (`format: prompt`, for `--model.objective grpo`): online RL reads prompts, and the objective
generates the completions itself. A record is TRL's prompt-only form, `{"prompt": ..., <any other fields>}`:
the other fields (a reference answer, a checker's regex, ...) travel with it to the reward.

Detection (`data.format: auto`): a record with `prompt` and none of `completion`, `chosen`, `rejected`, `label`
or `messages` (the fields of the formats whose records also may hold a prompt), and without the source's text
field (a record with both was text before prompt records existed, and stays text: `text_field: prompt` trains
prompts as plain text).

Tokens (`PromptEncoder`): the start token, then
* a string prompt: its text tokenized, as the text stream tokenizes a document;
* a list of messages: the conversation rendered with the run's chat template and the generation prompt
  (`add_generation_prompt=True`: the assistant header the reply follows), the record's `tools` passed to the
  template as for conversation data. The start token is left out when the rendering already begins with it
  (a template that writes `bos_token` itself).
The start token is the tokenizer's BOS (tokenizer_config.json's `bos_token`, else special_tokens_map.json's),
else the EOS, the separator the data stream puts between documents: what `step35 generate` puts before a
prompt, so that training generates from the ids inference starts from.

Batches (the GRPO batch contract; `prompt_window`), one prompt per row, S = data.seq_len:
* input_ids [B, S + 1] int64: the prompt's ids, right-padded with the EOS id;
* labels [B, S] int64: all -100 (nothing here is trained as a language model);
* position_ids [B, S] int64: 0 .. S - 1;
* prompt [B] int64: the prompt's token count n >= 1 (its ids are input_ids[b, :n]); the tensor's name marks
  the batch as prompt records (training/objective.py `check_records`);
* prompt_record [B, PROMPT_RECORD_BYTES] uint8: the record as read, every field (the prompt too), as UTF-8
  JSON, zero-padded; `decode_prompt_records(batch)` gives the records back as dicts.

Overlong prompts (more tokens than the window of S + 1) are dropped, whatever `data.overlong` says (a cut
prompt asks another question), counted and reported as other formats' overlong records. `data.train_on` and
`data.train_reasoning` change nothing: nothing is trained from these tokens.

Bad records (skipped with `file:line` and counted, or refused under `data.strict`): a missing `prompt`; a
prompt that is neither a non-empty string nor a non-empty list of messages; messages the template refuses; a
prompt whose last message is the assistant's (a prompt asks for the assistant's reply); a record whose JSON
takes more than PROMPT_RECORD_BYTES bytes, or that JSON cannot carry (a parquet timestamp, say).

The built-in records (`builtin_prompt_records`, for `data.format: prompt` with no files) are a verifiable
task made from the built-in conversations (builtin_chat.py): one per subject, the first question asked about
it, with the subject's name as `answer` and `answer_regex`, a case-insensitive regex matching any text that
holds the subject's key word.
"""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from step35.data.builtin_chat import builtin_conversations, builtin_jsonl
from step35.data.chat_messages import ChatTemplateError, ImagesNotSupported, check_messages, check_train_choice
from step35.data.packing import IGNORE_INDEX, PackedConversations
from step35.data.readers import BadRecord, MissingField, Record
from step35.data.tokenizer import TextTokenizer

PROMPT_FIELDS = ("prompt",)
PROMPT_NOT_WITH = ("completion", "chosen", "rejected", "label", "messages")  # a record with one is of another format
PROMPT_KEYS = ("prompt", "prompt_record")  # the tensors a batch adds (module docstring)
PROMPT_RECORD_BYTES = 65536  # the most bytes a record's JSON may take: every batch row carries this many


@dataclass(frozen=True)
class Prompt:
    """A prompt record as tokens (the start token first) and as the JSON bytes its batch row carries."""

    ids: list[int]
    record: bytes
    where: str

    @property
    def size(self) -> str:
        return str(len(self.ids))


def start_token_id(tokenizer: TextTokenizer) -> int:
    """The token a prompt starts with: the BOS of the tokenizer folder (tokenizer_config.json's `bos_token`,
    else special_tokens_map.json's, looked up in the vocabulary, as `step35 generate` reads it), else the EOS
    (the document separator)."""
    folder = Path(tokenizer.path)

    def read(name: str) -> dict:
        file = folder / name
        if not file.is_file():
            return {}
        try:
            content = json.loads(file.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"{file}: not valid JSON ({error})") from None
        return content if isinstance(content, dict) else {}

    config = read("tokenizer_config.json")
    token = config.get("bos_token", read("special_tokens_map.json").get("bos_token"))
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return tokenizer.eos_token_id
    found = tokenizer.tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"tokenizer {str(folder)!r}: bos_token {token!r} is not in the vocabulary of tokenizer.json")
    return found


def record_bytes(value: dict) -> bytes:
    """The record as compact UTF-8 JSON (never holding a 0 byte: JSON escapes control characters); a BadRecord
    when JSON cannot carry it or it is longer than PROMPT_RECORD_BYTES."""
    try:
        data = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise BadRecord(f"the record cannot travel as JSON: {error}") from None
    except UnicodeEncodeError:
        raise BadRecord("the record holds text that is not valid Unicode (a lone surrogate)") from None
    if len(data) > PROMPT_RECORD_BYTES:
        raise BadRecord(
            f"the record takes {len(data)} bytes as JSON, over the limit of {PROMPT_RECORD_BYTES}"
            " (PROMPT_RECORD_BYTES) a prompt record's batch row holds"
        )
    return data


class PromptEncoder:
    """Turns a record of a `prompt` source into a `Prompt` (the `read` of `Source.documents`). Picklable.

    Called as the other formats' encoders: `template` renders message prompts (None: a message prompt is an
    error naming `template_missing`); `train_on` and `train_reasoning` are checked but change nothing;
    `window` is the packer's (a record is at most PROMPT_RECORD_BYTES of JSON, so it is encoded whole)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        template: Any = None,
        train_on: str = "assistant",
        template_missing: str = "",
        train_reasoning: bool = True,
        window: int | None = None,
    ) -> None:
        check_train_choice(train_on, train_reasoning, "data")
        self.tokenizer = tokenizer
        self.template = template
        self.template_missing = template_missing
        self.start_id = start_token_id(tokenizer)

    def __call__(self, record: Record) -> Prompt | None:
        value = record.value()
        if value is None:
            return None
        where = record.where()
        if "prompt" not in value:
            raise MissingField("prompt", sorted(value), what="field")
        data = record_bytes(value)
        prompt = value["prompt"]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise BadRecord("'prompt' is empty: there is nothing to ask")
            return Prompt([self.start_id, *self.tokenizer.encode(prompt)], data, where)
        if not isinstance(prompt, list) or not prompt:
            what = "[]" if isinstance(prompt, list) else type(prompt).__name__
            raise BadRecord(f"'prompt' is {what}; a prompt is a non-empty string or a non-empty list of messages")
        ids = self._rendered(prompt, value.get("tools"), where)
        return Prompt(ids if ids[:1] == [self.start_id] else [self.start_id, *ids], data, where)

    def _rendered(self, messages: list, tools: Any, where: str) -> list[int]:
        """The ids of `messages` rendered with the generation prompt; refused messages are a BadRecord."""
        try:  # (`where` left out of the messages: the bad-record report names the record)
            check_messages(messages, require_assistant=False)
            if messages[-1]["role"] == "assistant":
                raise BadRecord(
                    "the prompt's last message is the assistant's; a prompt asks for the assistant's reply (leave"
                    " the reply out, or give prompt and completion as a prompt_completion record)"
                )
            if self.template is None:
                raise ValueError(f"{where}: a conversation, and {self.template_missing}")
            self.template.check_tools(tools, where, source=self)  # warns once per source (one encoder each)
            return self.template.prompt_ids(self.tokenizer, messages, tools=tools)
        except ChatTemplateError as error:
            raise BadRecord(str(error)) from None
        except ImagesNotSupported as error:  # no bad record: it stops the run, naming the record
            raise ImagesNotSupported(f"{where}: {error}") from None


class PackedPrompts(PackedConversations):
    """Windows of `window` tokens from one shard of a prompt source: one prompt each, padded, as
    `prompt_window` builds them. A prompt longer than the window is dropped and counted (never cut).
    State and resume as `PackedConversations`: after each window the cursor names the next record."""

    kind = "prompt"

    def windows(self) -> Iterator[tuple[Any, ...]]:  # type: ignore[override]
        if self.state["done"]:
            return
        cursor, documents = self._encoded()
        placed = cursor.epoch  # the epoch of the last prompt handed out
        for start, after, prompt in documents:
            if len(prompt.ids) > self.window:
                why = f"{prompt.size} tokens, a window holds {self.window}; a prompt is never cut (raise data.seq_len)"
                self.overlong.drop(prompt.where, why)
                self._check_progress(start.epoch, placed)
                continue
            placed = start.epoch
            yield self._emit([prompt], after)
        self._finish()

    def _window_of(self, prompts: list[Prompt]) -> tuple[Any, ...]:
        (prompt,) = prompts
        return prompt_window(prompt, self.window, self.tokenizer.eos_token_id)


def prompt_window(prompt: Prompt, window: int, pad_id: int) -> tuple[Any, ...]:
    """(tokens [window], labels [window - 1], positions [window - 1], token count, record bytes
    [PROMPT_RECORD_BYTES] uint8) of one prompt: the batch contract of the module docstring, per row."""
    if len(prompt.ids) > window:
        raise ValueError(f"{prompt.where}: a prompt of {len(prompt.ids)} tokens does not fit a window of {window}")
    tokens = prompt.ids + [pad_id] * (window - len(prompt.ids))
    record = torch.zeros(PROMPT_RECORD_BYTES, dtype=torch.uint8)
    record[: len(prompt.record)] = torch.frombuffer(bytearray(prompt.record), dtype=torch.uint8)
    return tokens, [IGNORE_INDEX] * (window - 1), list(range(window - 1)), len(prompt.ids), record


def decode_prompt_records(batch: dict) -> list[dict]:
    """The records of a batch of prompt records, as read: each row of `prompt_record` up to its first 0 byte,
    parsed as JSON."""
    rows = batch["prompt_record"]
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"prompt_record must be uint8 [batch, bytes], got {rows.dtype} {list(rows.shape)}")
    return [json.loads(row.tobytes().partition(b"\0")[0]) for row in rows.cpu().numpy()]


# ------------------------------------------------------------------------------------------ built-in records

_ASKED = (  # the question forms of builtin_chat.py, each naming a subject
    re.compile(r"What does the documentation say about (?P<subject>.+)\?"),
    re.compile(r"What is (?P<subject>.+) for\?"),
    re.compile(r"In one sentence: (?P<subject>.+)\?"),
    re.compile(r"Tell me about (?P<subject>.+)\."),
)
_MODULE = re.compile(r"the (?P<name>\S+) module")
_QUOTED = re.compile(r'"([^"]+)"')
_WORD = re.compile(r"[A-Za-z]{3,}")
_COMMON = {"the", "and", "with", "for", "from", "into", "its", "types", "type", "objects", "object"}


def subject_name(subject: str) -> str:
    """A subject's name, as the records' `answer` gives it: a module's name ("fnmatch"), a topic's title
    ('The "for" statement': builtin_chat.py lowercased its "The" inside the questions)."""
    module = _MODULE.fullmatch(subject)
    if module is not None:
        return module["name"]
    return "The " + subject[4:] if subject.startswith("the ") else subject


def key_words(subjects: list[str]) -> list[str]:
    """The key word of each subject (as the questions name it), which an answer about it must hold: a module's
    name; a topic's first quoted word ('the "for" statement': for); else the topic's word, in lower case, that
    the fewest subjects hold (ties: the longer, then the earlier), so that two topics seldom share one."""
    words = [{w.lower() for w in _WORD.findall(subject)} for subject in subjects]
    found = []
    for subject in subjects:
        module, quoted = _MODULE.fullmatch(subject), _QUOTED.search(subject)
        if module is not None or quoted is not None:
            found.append(module["name"] if module is not None else quoted[1])
            continue
        candidates = [w.lower() for w in _WORD.findall(subject)]
        candidates = [w for w in candidates if w not in _COMMON] or candidates
        held_by = {w: sum(w in other for other in words) for w in candidates}
        found.append(min(candidates, key=lambda w: (held_by[w], -len(w), candidates.index(w))))
    return found


def builtin_prompt_records() -> list[dict]:
    """The built-in prompt records: per subject of the built-in conversations, in their order, the first
    question asked about it (after its system message, if any), {"prompt": [...], "answer": its name,
    "answer_regex": "(?is).*\\b<key word>\\b.*", "subject": as the question names it}."""
    prompts: dict[str, list[dict]] = {}
    for conversation in builtin_conversations():
        messages = conversation["messages"]
        first = next(k for k, m in enumerate(messages) if m["role"] == "user")
        asked = next(m for m in (p.fullmatch(messages[first]["content"]) for p in _ASKED) if m is not None)
        prompts.setdefault(asked["subject"], [m for m in messages[:first] if m["role"] == "system"] + [messages[first]])
    return [
        {"prompt": prompt, "answer": subject_name(subject), "answer_regex": rf"(?is).*\b{re.escape(word)}\b.*",
         "subject": subject}
        for (subject, prompt), word in zip(prompts.items(), key_words(list(prompts)))
    ]  # fmt: skip


def builtin_prompt_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in prompt records as jsonl (one record per line), written on first use."""
    return builtin_jsonl("prompt", builtin_prompt_records, cache_dir)
