"""Preference pairs (`format: preference`, for `--model.objective dpo`): one record becomes two sequences,
prompt + chosen reply and prompt + rejected reply, each an `Example` (sft.py) trained on its reply only.

Records, as TRL's preference formats:

* standard: `{"prompt": str, "chosen": str, "rejected": str}`, `prompt` optional (absent: an empty prompt,
  so the whole of each reply is trained; no common prefix is split off). A sequence is ids(prompt) +
  ids(reply) + EOS, as a string prompt/completion pair: trained on the reply and the EOS.
* conversational: `prompt` a list of messages (optional), `chosen` and `rejected` each a list of messages or a
  string (the assistant's reply: `[{"role": "assistant", "content": ...}]`); an optional `tools`. A sequence
  is the conversation prompt + reply rendered with the chat template exactly as for SFT, trained on the
  reply's assistant turns (what the model emits: reasoning, content, tool calls, end-of-turn token; a tool
  result inside a reply is context). Messages at the start of both replies that are the same are context too
  (TRL's implicit prompt: `chosen` and `rejected` holding the whole conversation, without `prompt`), as are
  earlier assistant turns of the prompt. `data.train_on: last_assistant` trains only the reply's final
  assistant turn; `all` is refused (a prompt token is no part of a preference); `data.train_reasoning`
  applies as for SFT.

Bad records (skipped with `file:line` and counted, or refused under `data.strict`): a missing `chosen` or
`rejected`, a field of the wrong type (a string prompt with message-list replies, a number, ...), an empty
reply (an empty string or list, a reply without an assistant message), a conversation the template refuses,
a sequence with nothing to train, and `chosen` identical to `rejected` (the same tokens): such a pair has a
margin of exactly 0 under every model, so it adds a constant ln 2 to the DPO loss and no gradient, and it is
almost always a data error.

Overlong pairs (both sequences must fit one window): `fit_pair` cuts the reply tails, the longer reply first,
keeping at least one trained reply token each, or gives None (dropped). A cut pair whose replies differ only
past the window (the same tokens within it, `same_in_window`) would train as a zero-margin pair: a bad record
too, said to raise `data.seq_len`.
"""

from dataclasses import dataclass
from typing import Any

from step35.data.chat_messages import ChatTemplateError, check_messages, check_train_choice
from step35.data.readers import BadRecord, MissingField, Record
from step35.data.sft import PREFERENCE_FIELDS, Example, text_pair
from step35.data.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Pair:
    """A preference record as tokens: its chosen and its rejected sequence (each prompt + reply)."""

    chosen: Example
    rejected: Example
    where: str

    @property
    def length(self) -> int:
        """The tokens both sequences hold (what the pair takes of a window)."""
        return len(self.chosen.ids) + len(self.rejected.ids)

    @property
    def size(self) -> str:
        """How many tokens the pair has, as reports say it: "12 + 9 (chosen + rejected)"."""
        return f"{self.chosen.size} + {self.rejected.size} (chosen + rejected)"


class PreferenceEncoder:
    """Turns a record of a `preference` source into a `Pair` (the `read` of `Source.documents`). Picklable.

    `template`, `template_missing`, `train_reasoning` and `window` as for sft.SftEncoder: each sequence is
    encoded only as far as one token past the window (an overlong pair is cut or dropped by the packer).
    `train_on`: "assistant" (every assistant turn of the reply) or "last_assistant" (its final one)."""

    TRAIN_ON_ALL_REFUSED = (
        "data.train_on: all trains prompt tokens, which a preference pair does not compare; preference"
        " sources train the replies (data.train_on: assistant or last_assistant)"
    )

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
        if train_on == "all":
            raise ValueError(self.TRAIN_ON_ALL_REFUSED)
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = train_on
        self.template_missing = template_missing
        self.train_reasoning = train_reasoning
        self.limit = None if window is None else window + 1

    def __call__(self, record: Record) -> Pair | None:
        value = record.value()
        if value is None:
            return None
        where = record.where()
        for name in PREFERENCE_FIELDS:
            if name not in value:
                raise MissingField(name, sorted(value), what="field")
        prompt, chosen, rejected = value.get("prompt"), value["chosen"], value["rejected"]
        for name, part in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(part, (str, list)):
                raise BadRecord(f"{name!r} is {type(part).__name__}; a reply is a string or a list of messages")
            if not part:
                raise BadRecord(f"{name!r} is empty: a pair needs two replies")
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise BadRecord(f"'prompt' is {type(prompt).__name__}; a prompt is a string or a list of messages")
        conversational = isinstance(prompt, list) or isinstance(chosen, list) or isinstance(rejected, list)
        if not conversational and chosen == rejected:  # compared as given: a cut could hide it (`same_in_window`)
            raise BadRecord("'chosen' and 'rejected' are the same text: the pair has nothing to prefer")
        if conversational:
            if isinstance(prompt, str):
                raise BadRecord("'prompt' is a string but a reply is a list of messages; give the prompt as messages")
            pair = self._conversations(prompt or [], chosen, rejected, value.get("tools"), where)
        else:
            sides = [text_pair(self.tokenizer, prompt or "", reply, self.limit, where) for reply in (chosen, rejected)]
            pair = Pair(sides[0], sides[1], where)
        for name, example in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            if example.complete and reply_start(example) is None:
                raise BadRecord(f"{name!r}: nothing to train (no reply token after the sequence's first token)")
        if pair.chosen.complete and pair.rejected.complete and pair.chosen.ids == pair.rejected.ids:
            raise BadRecord("'chosen' and 'rejected' are the same tokens: the pair has nothing to prefer")
        return pair

    def _conversations(self, prompt: list, chosen: Any, rejected: Any, tools: Any, where: str) -> Pair:
        replies = [[{"role": "assistant", "content": r}] if isinstance(r, str) else r for r in (chosen, rejected)]
        try:
            for messages in (prompt, *replies):
                if messages:
                    check_messages(messages, where, require_assistant=False)
            if replies[0] == replies[1]:
                raise BadRecord("'chosen' and 'rejected' are the same messages: the pair has nothing to prefer")
            shared = 0  # leading messages both replies have: context, like the prompt
            while shared < min(map(len, replies)) and replies[0][shared] == replies[1][shared]:
                shared += 1
            context = prompt + replies[0][:shared]
            examples = []
            for name, reply in zip(("chosen", "rejected"), replies):
                turns = [len(context) + k for k, m in enumerate(reply[shared:]) if m["role"] == "assistant"]
                if not turns:
                    raise BadRecord(f"{name!r} has no assistant message after what both replies share")
                if self.train_on == "last_assistant":
                    turns = turns[-1:]
                examples.append(self._rendered(context + reply[shared:], turns, tools, where))
        except ChatTemplateError as error:
            raise BadRecord(str(error)) from None
        return Pair(examples[0], examples[1], where)

    def _rendered(self, messages: list, turns: list[int], tools: Any, where: str) -> Example:
        if self.template is None:
            check_messages(messages, where)
            raise ValueError(f"{where}: a conversation, and {self.template_missing}")
        self.template.check_tools(tools, where, source=self)
        ids, trained, total = self.template.encode_prefix(
            self.tokenizer, messages, self.limit, train_reasoning=self.train_reasoning, tools=tools, where=where,
            trained_turns=turns,
        )  # fmt: skip
        return Example(list(ids), [bool(t) for t in trained], where, total, complete=total == len(ids))


def reply_start(example: Example) -> int | None:
    """The first token of `example` past its first that is trained (its first label's target), or None."""
    return next((i for i in range(1, len(example.ids)) if example.trained[i]), None)


def fit_pair(pair: Pair, window: int) -> Pair | None:
    """`pair` with its reply tails cut so that both sequences fit `window` tokens, or None when they cannot
    while keeping one trained reply token each. The longer reply (tokens from `reply_start` on) is cut first,
    down to the other's length; then both, alike (the chosen keeps the odd token)."""
    starts = [reply_start(pair.chosen), reply_start(pair.rejected)]
    if starts[0] is None or starts[1] is None:
        return None
    room = window - starts[0] - starts[1]  # tokens both replies may keep
    if room < 2:
        return None
    replies = [len(pair.chosen.ids) - starts[0], len(pair.rejected.ids) - starts[1]]
    if replies[0] + replies[1] <= room:
        return pair
    # The longer reply down to the other's length first, then both alike: the chosen keeps half the room (the
    # odd token too) unless its reply is shorter or the rejected's reply leaves it more.
    keep = [min(replies[0], max(room - replies[1], (room + 1) // 2))]
    keep.append(room - keep[0])
    sides = (pair.chosen, pair.rejected)
    cut = [Example(e.ids[: s + k], e.trained[: s + k], e.where) for e, s, k in zip(sides, starts, keep)]
    return Pair(cut[0], cut[1], pair.where)


def same_in_window(pair: Pair, cut: Pair) -> bool:
    """Whether `cut` (`fit_pair`'s cut of `pair`) leaves nothing to prefer: its sequences are the same tokens as
    far as the shorter goes, and the shorter was cut, so that what the longer has beyond is the cut's doing, not
    the data's (a reply that ends there on its own ends with its end-of-turn token, which tells them apart)."""
    sides = [(cut.chosen, pair.chosen), (cut.rejected, pair.rejected)]
    (shorter, whole), (longer, _) = sorted(sides, key=lambda side: len(side[0].ids))
    cut_short = len(shorter.ids) < len(whole.ids) or not whole.complete
    return cut_short and longer.ids[: len(shorter.ids)] == shorter.ids
