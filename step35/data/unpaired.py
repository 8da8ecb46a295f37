"""Unpaired feedback (`format: unpaired`, for `--model.objective kto`): a prompt, a completion and a label
saying whether the completion is desirable, as TRL's unpaired preference format:
`{"prompt": ..., "completion": ..., "label": true|false}`.

* `prompt` and `completion` strings: the sequence is ids(prompt) + ids(completion) + EOS, trained on the
  completion and the EOS, as a string prompt/completion pair (sft.text_pair).
* `prompt` a list of messages, `completion` a list of messages or a string (the assistant's reply); an
  optional `tools`: the conversation prompt + completion rendered with the chat template exactly as a
  preference pair's side is (preference.py): trained on the completion's assistant turns (reasoning,
  content, tool calls, end-of-turn token); `data.train_on: last_assistant` trains only its final one, `all`
  is refused (a prompt token is not what the label judges); `data.train_reasoning` applies.

One record becomes two sequences, packed side by side in one window like a preference pair: the matched
sequence (its prompt, its completion) and the KL sequence (its prompt, another record's completion), from
which KTO estimates its reference point z0. The KL sequence is spliced from tokens, as TRL splices them: the
record's tokens before its completion's first trained token (the prompt, with the assistant header a
conversation renders before the reply), then the other record's tokens from its first trained token on.
Partner rule: in a window of n >= 2 records, record p's partner is record (p + 1) mod n, so the window holds
exactly twice its records' matched tokens. A record alone in its window (too long to share one) takes the
completion of the next record of the same stream shard: the record that opens the next window, which the
packer has read anyway when it closes this one, so the rule carries no state across windows and a resume
(the cursor names the window's first record, as for conversations) rebuilds the same windows. A finite
stream (validation) leaves out its last record when it would be alone in its window: it has no partner.

Batches (the KTO batch contract; `unpaired_window`): input_ids [B, S + 1], labels [B, S] (-100 where no
target: prompts, padding, a sequence's first token), position_ids [B, S] restarting at every sequence;
unpaired [B, S], label-aligned: 2p on the slots of the matched sequence of the row's record p, 2p + 1 on
those of its KL sequence, -1 elsewhere; unpaired_label [B, S // 2 + 1]: 1 where record p is desirable, 0
undesirable, -1 where the row has no record p.

Overlong records: a record shares a window only where both its sequences fit beside the others'. Alone, where
its two sequences do not fit the window, the KL sequence is cut at its tail first, down to one trained token
(it only samples z0), then the matched one (`fit_alone`): a record whose own sequence had to be cut is
truncated (`data.overlong: truncate`) or dropped (`drop`), either counted and reported like an overlong
preference pair; one whose matched sequence would keep no trained token is dropped. A partner that was itself
too long (encoded only as far as a window needs) lends the completion tokens that were encoded.

Bad records (skipped with `file:line` and counted, or refused under `data.strict`): a missing `prompt`,
`completion` or `label`, a label that is not a boolean, a prompt or completion of the wrong type (a number;
a string prompt with a message-list completion), an empty completion (`""`, `[]`), a completion without an
assistant message, a conversation the template refuses, a sequence with nothing to train.

The built-in records (`builtin_unpaired_records`, for `data.format: unpaired` with no files) are the built-in
preference pairs (builtin_chat.py) taken one side each: pair k gives its chosen reply labelled desirable for
even k, its rejected reply (an answer to another question of the same form) undesirable for odd k.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from step35.data.builtin_chat import builtin_jsonl, builtin_preference_pairs
from step35.data.chat_messages import ChatTemplateError, check_messages
from step35.data.packing import PackedConversations, pair_window
from step35.data.preference import PreferenceEncoder, reply_start
from step35.data.readers import BadRecord, MissingField, Record
from step35.data.sft import Example, text_pair

UNPAIRED_FIELDS = ("prompt", "completion", "label")
UNPAIRED_KEYS = ("unpaired", "unpaired_label")  # the tensors a batch adds (module docstring)


@dataclass(frozen=True)
class Unpaired:
    """An unpaired record as tokens: its matched sequence (prompt + completion), the index of its completion's
    first trained token (`split`: where a KL sequence swaps completions) and its label."""

    example: Example
    split: int
    desirable: bool
    where: str

    @property
    def length(self) -> int:
        """What the record takes of a window shared with others: its matched sequence and a KL sequence, which
        in a window of n >= 2 records together hold exactly twice the matched tokens."""
        return 2 * len(self.example.ids)


def kl_sequence(record: Unpaired, other: Unpaired) -> Example:
    """`record`'s prompt side followed by `other`'s completion side, as tokens with their trained flags."""
    ids = record.example.ids[: record.split] + other.example.ids[other.split :]
    trained = record.example.trained[: record.split] + other.example.trained[other.split :]
    return Example(ids, trained, record.where, complete=other.example.complete)


class UnpairedEncoder(PreferenceEncoder):
    """Turns a record of an `unpaired` source into an `Unpaired` (the `read` of `Source.documents`). Picklable.
    Options as preference.PreferenceEncoder, whose rendering of a prompt + reply it shares."""

    TRAIN_ON_ALL_REFUSED = (
        "data.train_on: all trains prompt tokens, but an unpaired record's label judges its completion only;"
        " unpaired sources train the completions (data.train_on: assistant or last_assistant)"
    )

    def __call__(self, record: Record) -> Unpaired | None:
        value = record.value()
        if value is None:
            return None
        where = record.where()
        for name in UNPAIRED_FIELDS:
            if name not in value:
                raise MissingField(name, sorted(value), what="field")
        prompt, completion, label = (value[name] for name in UNPAIRED_FIELDS)
        if not isinstance(label, bool):
            raise BadRecord(f"'label' is {label!r}; a label is true (desirable) or false (undesirable)")
        for name, part in (("prompt", prompt), ("completion", completion)):
            if not isinstance(part, (str, list)):
                raise BadRecord(f"{name!r} is {type(part).__name__}; it is a string or a list of messages")
        if not completion:
            raise BadRecord("'completion' is empty: there is nothing to judge")
        if isinstance(prompt, list) or isinstance(completion, list):
            if isinstance(prompt, str):
                raise BadRecord(
                    "'prompt' is a string but 'completion' is a list of messages; give the prompt as messages"
                )
            example = self._conversation(prompt, completion, value.get("tools"), where)
        else:
            example = text_pair(self.tokenizer, prompt, completion, self.limit, where)
        if example.complete and reply_start(example) is None:
            raise BadRecord("'completion': nothing to train (no completion token after the sequence's first token)")
        split = next((i for i, trained in enumerate(example.trained) if trained), len(example.ids))
        return Unpaired(example, split, label, where)

    def _conversation(self, prompt: list, completion: Any, tools: Any, where: str) -> Example:
        reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        try:
            for messages in (prompt, reply):
                if messages:
                    check_messages(messages, where, require_assistant=False)
            turns = [len(prompt) + k for k, m in enumerate(reply) if m["role"] == "assistant"]
            if not turns:
                raise BadRecord("'completion' has no assistant message: there is nothing to judge")
            if self.train_on == "last_assistant":
                turns = turns[-1:]
            return self._rendered(prompt + reply, turns, tools, where)
        except ChatTemplateError as error:
            raise BadRecord(str(error)) from None


class PackedUnpaired(PackedConversations):
    """Windows of `window` tokens from one shard of an unpaired source: whole records, each its matched then its
    KL sequence (partners as the module docstring says), packed greedily and never split across windows; the
    rest of a window is padding. Each window comes out as (tokens [window], labels [window - 1], positions
    [window - 1], unpaired [window - 1], unpaired_label [(window - 1) // 2 + 1]), built by `unpaired_window`.

    A window is closed when the next record does not fit it, and handed out then, with the cursor on that
    record (read again on resume, as for conversations); a record alone in its window takes that record's
    completion for its KL sequence. State and counts as `PackedConversations`."""

    kind = "unpaired record"
    cut_fails = "cut, the completion would keep no trained token"

    def windows(self) -> Any:
        if self.state["done"]:
            return
        cursor, documents = self._encoded()
        current: list[Unpaired] = []
        used, placed = 0, cursor.epoch  # placed: the epoch of the last window handed out
        for start, _, record in documents:
            if current and used + record.length > self.window:
                sequences = self._sequences(current, record)
                current, used = [], 0
                if sequences is None:  # a record alone that could not be cut to fit: dropped
                    self._check_progress(start.epoch, placed)
                else:
                    placed = start.epoch
                    yield self._emit(sequences, start)
            current.append(record)
            used += record.length
        if len(current) > 1:  # a finite stream's last window (a record alone there has no partner)
            yield self._emit(self._sequences(current, None), None)
        self._finish()

    def _sequences(self, records: list[Unpaired], following: Unpaired | None) -> list | None:
        """(matched, KL, desirable) of each record of a window; a record alone takes `following`'s completion,
        cut to fit as the module docstring says, or is dropped (None)."""
        if len(records) > 1:
            partners = records[1:] + records[:1]
            return [(r.example, kl_sequence(r, q), r.desirable) for r, q in zip(records, partners)]
        (record,) = records
        assert following is not None
        matched, kl = record.example, kl_sequence(record, following)
        cut = fit_alone(matched, kl, self.window)
        size = f"{matched.size} + {kl.size} (the record + its KL sequence)"
        matched_cut = cut is None or len(cut[0].ids) < len(matched.ids) or not matched.complete
        if cut is None or (matched_cut and self.overlong_mode == "drop"):
            why = f"{size} tokens, a window holds {self.window}" + (f"; {self.cut_fails}" if cut is None else "")
            self.overlong.drop(record.where, why)
            return None
        if matched_cut:
            self.overlong.truncate(record.where, size, self.window)
        return [(*cut, record.desirable)]

    def _window_of(self, sequences: list) -> tuple[list[int], ...]:
        return unpaired_window(sequences, self.window, self.tokenizer.eos_token_id)


def fit_alone(matched: Example, kl: Example, window: int) -> tuple[Example, Example] | None:
    """A record's two sequences cut at their tails to fit `window` tokens together: the KL sequence first, down
    to one trained token (it only samples z0), then the matched one; None when the matched sequence would keep
    no trained token (preference.reply_start: a target past its first token)."""
    starts = reply_start(matched), reply_start(kl)
    if len(matched.ids) + len(kl.ids) <= window:
        return matched, kl
    if starts[0] is None or starts[1] is None:
        return None
    kl_keep = max(starts[1] + 1, window - len(matched.ids))
    matched_keep = min(len(matched.ids), window - kl_keep)
    if matched_keep <= starts[0]:
        return None
    return head(matched, matched_keep), head(kl, kl_keep)


def head(example: Example, keep: int) -> Example:
    """The first `keep` tokens of `example`."""
    return Example(example.ids[:keep], example.trained[:keep], example.where)


def unpaired_window(
    records: list[tuple[Example, Example, bool]], window: int, pad_id: int
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(tokens, labels, positions, unpaired, unpaired_label) of one window holding `records`: (matched
    sequence, KL sequence, desirable) each. The first four as packing.pair_window with the matched sequence in
    the chosen's place; unpaired_label [(window - 1) // 2 + 1]: 1 / 0 for record p desirable / not, -1 past
    the last record."""
    sequences = [(e.ids, e.trained) for matched, kl, _ in records for e in (matched, kl)]
    tokens, labels, positions, unpaired = pair_window(sequences, window, pad_id)
    slots = (window - 1) // 2 + 1
    label = [int(desirable) for _, _, desirable in records]
    return tokens, labels, positions, unpaired, label + [-1] * (slots - len(label))


def builtin_unpaired_records() -> list[dict]:
    """The built-in unpaired records, conversational: {"prompt": [...], "completion": [reply], "label": bool},
    one per built-in preference pair, in its order (module docstring)."""
    records = []
    for k, pair in enumerate(builtin_preference_pairs()):
        desirable = k % 2 == 0
        completion = pair["chosen"] if desirable else pair["rejected"]
        records.append({"prompt": pair["prompt"], "completion": completion, "label": desirable})
    return records


def builtin_unpaired_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in unpaired records as jsonl (one record per line), written on first use."""
    return builtin_jsonl("unpaired", builtin_unpaired_records, cache_dir)
