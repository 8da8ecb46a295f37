"""Which tokens of a rendered conversation the loss trains: character spans of the rendering, located per
assistant turn, and turned into a per-token mask by the tokenizer's offsets (`token_mask`). A token is trained
when any of its characters lies in a span (the rule transformers uses for `return_assistant_tokens_mask`), so a
token straddling a span border is trained.

- A template with `{% generation %}...{% endgeneration %}` marks its spans itself: each block's output is the
  span. We find them by having the tag wrap its output in unique markers (chat_sandbox.generation_marks), then
  check that the text without the markers is exactly the ordinary rendering (so a template that post-processes
  a marked block fails loudly instead of giving wrong spans).
- A template without the tag: each trained assistant turn is located by rendering the conversation again with
  that turn's text (content, reasoning, tool-call names) replaced by unique sentinels; the part where the two
  renderings differ is the turn's own text. This never renders a prefix of the conversation as if it were a
  prefix of the whole, which is wrong for templates that rewrite history (Step-3.5's drops the reasoning of
  turns before the last user message). The span then runs from the end of the generation prompt that
  inference would emit before the turn (found as whole lines of it starting before the turn's text; for an
  earlier turn whose reasoning was dropped, the header lines only) to the template's end-of-turn token
  inclusive (the first special token after an assistant reply, learned once on a probe conversation). The
  messages on either side bound both searches; each is found by a sentinel inserted in the middle of its text,
  which keeps what templates test about a message (how its text starts and ends). When a turn cannot be
  located this way, `ChatTemplate.encode` raises `ChatTemplateError`; it never guesses.

With `train_reasoning=False` the reasoning of the trained turns is taken out of those spans. Each piece of a
turn's reasoning (the field, or a `<think>` block inline in the content, split off as templates split it: before
the first `</think>`, after the last `<think>`) is replaced alone by a sentinel; the rendering must then differ
only where the sentinel stands, and the text it stands for in the real rendering is the reasoning. The
`<think>`/`</think>` wrappers and the whitespace the template puts around the reasoning stay trained.
"""

from __future__ import annotations

import bisect
import operator
import uuid
from collections.abc import Callable

from step35.data.chat_messages import REASONING_FIELDS, ChatTemplateError, where_prefix
from step35.data.chat_sandbox import generation_marks


class Conversation:
    """One conversation being masked: its full rendering and, cached, where each message lies in it.

    `render(messages, where=..., add_generation_prompt=...)` renders messages with the chat template (the
    conversation's tools and template variables bound: `ChatTemplate.encode_prefix` passes its `_render` so);
    `origin` names the template in errors, `where` the record."""

    def __init__(self, render: Callable[..., str], origin: str, messages: list, where: str):
        self._render_messages, self.origin, self.messages, self.where = render, origin, messages, where
        self.text = self.render(messages, False)
        self._regions: dict[int, tuple[int | None, int | None]] = {}
        self._points: dict[int, int | None] = {}

    def render(self, messages: list, add_generation_prompt: bool, where: str | None = None) -> str:
        """`messages` (this conversation's, or a copy with sentinels) rendered by the template."""
        where = self.where if where is None else where
        return self._render_messages(messages, where=where, add_generation_prompt=add_generation_prompt)

    def marked_spans(self, turns: list[int]) -> list[tuple[int, int]]:
        """The spans of the template's `{% generation %}` blocks (outermost ones) that belong to `turns`."""
        tag = uuid.uuid4().hex
        marks = (f"\ue000open-{tag}\ue001", f"\ue000close-{tag}\ue001")
        with generation_marks(marks):
            marked = self.render(self.messages, False)
        plain, spans = _strip_marks(marked, marks)
        if plain != self.text:
            raise ChatTemplateError(
                f"{where_prefix(self.where)}chat template from {self.origin}: a {{% generation %}} block's output is"
                " changed after the block (e.g. captured by {% set %} and filtered), so its spans cannot be located"
            )
        if turns[0] != min(i for i, m in enumerate(self.messages) if m["role"] == "assistant"):
            # Only the last turn is trained: its blocks are those after the end of the message before it (its
            # whole text: an assistant message before it may have several blocks, e.g. content and tool calls).
            after = next((end for j in range(turns[0] - 1, -1, -1) if (end := self.region(j)[1]) is not None), 0)
            spans = [span for span in spans if span[0] >= after]
        if not spans:
            raise ChatTemplateError(
                f"{where_prefix(self.where)}chat template from {self.origin} renders no {{% generation %}} block"
                f" for the trained assistant turns (messages {', '.join(map(str, turns))})"
            )
        return spans

    def in_window(self, limit: int | None, spans_of: Callable[[Conversation], tuple[list, bool]]) -> list:
        """The spans `spans_of` finds, on the shortest cut of this conversation (`cuts`) where it stops within
        the cut (having found a turn past the first `limit` characters), else on the whole conversation (a cut
        that fails to render or mask is passed over: only the whole conversation's errors count)."""
        if limit is None:
            return spans_of(self)[0]
        for part in self.cuts(limit):
            if part is self:
                return spans_of(self)[0]
            try:
                spans, stopped = spans_of(part)
            except ChatTemplateError:
                continue
            if stopped:
                return spans
        raise AssertionError("cuts() ends with the whole conversation")

    def cuts(self, limit: int):
        """Conversations of this one's first messages, growing (each about twice the one before), whose rendering
        equals this one's over its first `limit` characters; then this conversation itself. A template that
        renders a message differently depending on later ones (Step-3.5's drops the reasoning of turns before
        the last user message) shows it in the text, so a cut that differs there is passed over."""
        count, size = 0, 0
        while count < len(self.messages) and size < limit:  # about the messages the first `limit` characters hold
            message = self.messages[count]
            size += 16 + sum(len(str(message.get(key) or "")) for key in ("content", "tool_calls", *REASONING_FIELDS))
            count += 1
        count += 2
        while count < len(self.messages):
            try:
                part = Conversation(self._render_messages, self.origin, self.messages[:count], self.where)
            except ChatTemplateError:
                part = None
            if part is not None and len(part.text) >= limit and self.text.startswith(part.text[:limit]):
                yield part
            count *= 2
        yield self

    def located_spans(
        self,
        turns: list[int],
        ids: list[int],
        offsets: list[tuple[int, int]],
        end_of_turn: Callable[[], int],
        limit: int | None = None,
    ) -> tuple[list[tuple[int, int]], bool]:
        """Each turn's span, located by sentinels (module docstring): from the end of the generation prompt to
        the end-of-turn token inclusive (`end_of_turn()` gives its id; `ids`, `offsets`: the rendering's tokens).
        With `limit` (the characters `ids` cover, when they are not the whole rendering): the spans of the turns
        that start within it, and whether a turn starting past it was met (so every later one does too: each span
        starts past the end of the one before); a turn of `turns` this cut lacks is not met."""
        spans: list[tuple[int, int]] = []
        starts = [s for s, _ in offsets]
        for i in turns:
            if i >= len(self.messages):
                return spans, False
            if limit is not None and max(self.end_before(i), spans[-1][1] if spans else 0) >= limit:
                return spans, True
            at = f"{where_prefix(self.where)}assistant message {i}"
            first, last = self.region(i)
            if first is None and not _with_sentinels(self.messages, i)[1]:
                raise ChatTemplateError(f"{at} is empty (no content, reasoning or tool calls): nothing to train")
            if first is None:
                raise ChatTemplateError(f"{at}: the chat template renders none of its text, so it cannot be located")
            low = max(self.end_before(i), spans[-1][1] if spans else 0)
            if low > first:
                raise ChatTemplateError(f"{at}: cannot be told apart from the message before it in the rendering")
            start = self.reply_start(i, low, first, last)
            if start is None:
                raise ChatTemplateError(
                    f"{at}: the generation prompt the template emits before it is not found in front of its text"
                )
            eot = end_of_turn()
            k = bisect.bisect_left(starts, last)
            k = next((j for j in range(k, len(ids)) if ids[j] == eot), None)
            end = None if k is None else offsets[k][1]
            following = self.start_after(i)
            if end is None and limit is not None and (following is None or following >= limit):
                end = limit  # its end-of-turn token lies past the tokens kept: the span runs to their end
            if end is None or (following is not None and end > following):
                raise ChatTemplateError(f"{at}: no end-of-turn token (id {eot}) between its text and the next message")
            spans.append((start, end))
        return spans, False

    def reasoning_spans(self, turns: list[int], limit: int | None = None) -> tuple[list[tuple[int, int]], bool]:
        """Where the reasoning of each of `turns` lies in the rendering, sorted: for each piece of reasoning (the
        field, and a `<think>` block inline in the content or a text part), the text that changes when the
        piece alone is replaced by a sentinel. A piece the template does not render (dropped history) has
        none; a piece whose replacement changes anything else raises ChatTemplateError. With `limit`, as in
        `located_spans`: the turns from the first whose message before it reaches past `limit` on are left out
        (their reasoning renders after that message), and the flag says whether one was met."""
        spans: list[tuple[int, int]] = []
        for i in turns:
            if i >= len(self.messages):
                return sorted(spans), False
            if limit is not None and self.end_before(i) >= limit:
                return sorted(spans), True
            for replaced, sentinel in _reasoning_sentinels(self.messages, i):
                spans += self._rendered_as(replaced, sentinel, f"{where_prefix(self.where)}assistant message {i}")
        return sorted(spans), False

    def _rendered_as(self, replaced: list, sentinel: str, at: str) -> list[tuple[int, int]]:
        """The spans of this text that `replaced` (these messages with one piece of text replaced by
        `sentinel`) renders as the sentinel. Every occurrence must stand for the same text, and the renderings
        must agree everywhere else; that fixes the spans exactly (no search that could match elsewhere)."""
        other = self.render(replaced, False)
        n = other.count(sentinel)
        if n == 0:
            if other == self.text:
                return []  # the template leaves this reasoning out (e.g. a turn before the last user message)
            raise ChatTemplateError(f"{at}: its reasoning is not rendered as given, so it cannot be located")
        pieces = other.split(sentinel)
        grown = len(self.text) - (len(other) - n * len(sentinel))
        length = grown // n
        spans, pos, seen = [], 0, None
        for k, piece in enumerate(pieces):
            if grown < 0 or grown % n or self.text[pos : pos + len(piece)] != piece:
                raise ChatTemplateError(f"{at}: replacing its reasoning changes other text, so it cannot be located")
            pos += len(piece)
            if k < n:
                found = self.text[pos : pos + length]
                if seen is not None and found != seen:
                    raise ChatTemplateError(f"{at}: its reasoning is rendered differently in different places")
                seen = found
                if length:
                    spans.append((pos, pos + length))
                pos += length
        return spans

    def region(self, index: int) -> tuple[int | None, int | None]:
        """Where message `index`'s own text lies in the full rendering: (start, end) of the part that changes
        when its content, reasoning and tool-call names are replaced by sentinels; (None, None) when the
        template renders none of them."""
        if index not in self._regions:
            self._regions[index] = self._find_region(index)
        return self._regions[index]

    def _find_region(self, index: int) -> tuple[int | None, int | None]:
        replaced, sentinels = _with_sentinels(self.messages, index)
        if not sentinels:
            return None, None
        other = self.render(replaced, False)
        found = [(other.find(s), other.find(s) + len(s)) for s in sentinels if s in other]
        if not found:
            return None, None
        text = self.text
        prefix = common_prefix(text, other)
        suffix = common_suffix(text, other, min(len(text), len(other)) - prefix)
        # The differing part of `other` must hold every rendered sentinel, else the diff is not this message.
        if min(s for s, _ in found) < prefix or max(e for _, e in found) > len(other) - suffix:
            at = where_prefix(self.where)
            raise ChatTemplateError(f"{at}message {index}: its text cannot be located in the rendering")
        return prefix, len(text) - suffix

    def end_before(self, index: int) -> int:
        """A position inside the nearest earlier message's text that renders any (`point`), else 0."""
        for j in range(index - 1, -1, -1):
            at = self.point(j, end=True)
            if at is not None:
                return at
        return 0

    def start_after(self, index: int) -> int | None:
        """A position inside the next message's text that renders any (`point`), else None."""
        for j in range(index + 1, len(self.messages)):
            at = self.point(j, end=False)
            if at is not None:
                return at
        return None

    def point(self, index: int, end: bool) -> int | None:
        """A position inside message `index`'s own text in the rendering, for bounding its neighbours: where a
        sentinel inserted in the middle of its text appears, when inserting it changes nothing else (the message
        keeps its start and end, which templates test: Step-3.5's reads a user message wrapped in
        `<tool_response>` as a tool result). Else the end (`end`) or start of its region; None when the
        template renders none of its text."""
        if index not in self._points:
            self._points[index] = self._find_point(index)
        if self._points[index] is not None:
            return self._points[index]
        return self.region(index)[1 if end else 0]

    def _find_point(self, index: int) -> int | None:
        sentinel = f"\ue000step35point{uuid.uuid4().hex}\ue001"
        inserted = _with_inserted(self.messages, index, sentinel)
        if inserted is None:
            return None
        other = self.render(inserted, False)
        at = other.find(sentinel)
        if at < 0 or len(other) != len(self.text) + len(sentinel):
            return None
        if other[:at] != self.text[:at] or other[at + len(sentinel) :] != self.text[at:]:
            return None
        return at

    def reply_start(self, index: int, low: int, first: int, last: int) -> int | None:
        """Where the model's reply for message `index` starts: the end of the generation prompt rendered after
        the messages before it, searched as whole leading lines of it (all of it first), starting in
        text[low:first]. It may reach into the turn's text: a template that writes `<think>` only when a turn has
        reasoning puts the prompt's `<think>` inside what the sentinels change. An earlier turn whose reasoning
        the template dropped keeps only the header lines of a prompt that ends in `<think>`."""
        history = self.messages[:index]
        try:
            with_prompt, without = self.render(history, True), self.render(history, False)
        except ChatTemplateError:
            if history:
                raise
            # A conversation the assistant opens: templates that read messages[0] cannot render no messages.
            # The prompt after one user message stands in; it must still be found before the turn's text.
            history = [{"role": "user", "content": "Hi"}]
            with_prompt, without = self.render(history, True), self.render(history, False)
        prompt = with_prompt[common_prefix(with_prompt, without) :]
        if not prompt:
            return None
        cuts = [len(prompt)] + [k + 1 for k in range(len(prompt) - 2, -1, -1) if prompt[k] == "\n"]
        for k in cuts:
            found = self.text.rfind(prompt[:k], low, min(first - 1 + k, last))
            if found >= 0:
                return found + k
        return None


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n, block, i = min(len(a), len(b)), 4096, 0
    while i < n and a[i : i + block] == b[i : i + block]:  # C-speed comparisons, one pass over the text
        i += block
    lo, hi = min(i, n), min(i + block, n)
    while lo < hi:  # the first difference lies in a[i : i + block]: binary search for it
        mid = (lo + hi + 1) // 2
        if a[i:mid] == b[i:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_suffix(a: str, b: str, limit: int) -> int:
    """The length of the longest common suffix of `a` and `b`, at most `limit`."""
    n, block, i = min(len(a), len(b), limit), 4096, 0
    while i < n and a[len(a) - i - min(block, n - i) : len(a) - i] == b[len(b) - i - min(block, n - i) : len(b) - i]:
        i += min(block, n - i)
    lo, hi = i, min(i + block, n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid : len(a) - i] == b[len(b) - mid : len(b) - i]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _with_sentinels(messages: list, index: int) -> tuple[list, list[str]]:
    """A copy of `messages` whose message `index` has its content, reasoning and tool-call names replaced by
    unique sentinels (empty ones stay empty), and the sentinels used."""
    tag = uuid.uuid4().hex
    sentinels = []

    def sentinel(kind: str) -> str:
        sentinels.append(f"\ue000step35{kind}{len(sentinels)}x{tag}\ue001")
        return sentinels[-1]

    message = dict(messages[index])
    reasoning = [key for key in REASONING_FIELDS if message.get(key)]
    if reasoning:
        value = sentinel("reasoning")
        for key in reasoning:
            message[key] = value
    content = message.get("content")
    if isinstance(content, str) and content:
        message["content"] = sentinel("content")
    elif isinstance(content, list):
        message["content"] = [
            {**part, "text": sentinel("part")} if isinstance(part, dict) and part.get("text") else part
            for part in content
        ]
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            call = dict(call) if isinstance(call, dict) else call
            if isinstance(call, dict) and isinstance(call.get("function"), dict) and call["function"].get("name"):
                call["function"] = {**call["function"], "name": sentinel("tool")}
            elif isinstance(call, dict) and call.get("name"):
                call["name"] = sentinel("tool")
            calls.append(call)
        message["tool_calls"] = calls
    return [*messages[:index], message, *messages[index + 1 :]], sentinels


def _inline_reasoning(text: str) -> tuple[int, int] | None:
    """Where the reasoning of a `<think>...</think>` block inline in `text` lies, without the whitespace around it
    (as templates find it: before the first `</think>`, after the last `<think>` before that, or from the start
    when the generation prompt opened the block); None when there is none."""
    end = text.find("</think>")
    if end < 0:
        return None
    start = text.rfind("<think>", 0, end)
    start = 0 if start < 0 else start + len("<think>")
    inner = text[start:end]
    if not inner.strip():
        return None
    start += len(inner) - len(inner.lstrip())
    return start, start + len(inner.strip())


def _reasoning_sentinels(messages: list, index: int) -> list[tuple[list, str]]:
    """For each piece of reasoning of message `index` (its reasoning field under all the names given, a
    `<think>` block inline in its content or in one of its text parts): a copy of `messages` with that piece
    alone replaced by a unique sentinel, and the sentinel."""
    message = messages[index]
    copies = []

    def replaced(**changes) -> list:
        return [*messages[:index], {**message, **changes}, *messages[index + 1 :]]

    def sentinel() -> str:
        return f"\ue000step35thought{len(copies)}x{uuid.uuid4().hex}\ue001"

    fields = [key for key in REASONING_FIELDS if message.get(key)]
    if fields:
        value = sentinel()
        copies.append((replaced(**{key: value for key in fields}), value))
    content = message.get("content")
    if isinstance(content, str) and (found := _inline_reasoning(content)):
        value = sentinel()
        copies.append((replaced(content=content[: found[0]] + value + content[found[1] :]), value))
    for k, part in enumerate(content if isinstance(content, list) else []):
        text = part.get("text") if isinstance(part, dict) else None
        if isinstance(text, str) and (found := _inline_reasoning(text)):
            value = sentinel()
            parts = [*content[:k], {**part, "text": text[: found[0]] + value + text[found[1] :]}, *content[k + 1 :]]
            copies.append((replaced(content=parts), value))
    return copies


def subtract_spans(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` (sorted, disjoint) outside every one of `holes`."""
    out = []
    for a, b in spans:
        for h, e in holes:
            if e <= a or h >= b:
                continue
            if h > a:
                out.append((a, h))
            a = max(a, e)
        if a < b:
            out.append((a, b))
    return out


def _with_inserted(messages: list, index: int, sentinel: str) -> list | None:
    """A copy of `messages` with `sentinel` inserted in the middle of message `index`'s first non-empty text
    (content, a text part, reasoning, a tool-call name); None when it has none."""
    message = dict(messages[index])

    def middle(text: str) -> str:
        return text[: len(text) // 2] + sentinel + text[len(text) // 2 :]

    content = message.get("content")
    parts = content if isinstance(content, list) else []
    text_part = next((k for k, part in enumerate(parts) if isinstance(part, dict) and part.get("text")), None)
    reasoning = next((key for key in REASONING_FIELDS if isinstance(message.get(key), str) and message[key]), None)
    calls = message.get("tool_calls") or []
    call = next((k for k, c in enumerate(calls) if isinstance(c, dict) and isinstance(c.get("function"), dict)
                 and c["function"].get("name")), None)  # fmt: skip
    if isinstance(content, str) and content:
        message["content"] = middle(content)
    elif text_part is not None:
        parts = list(parts)
        parts[text_part] = {**parts[text_part], "text": middle(parts[text_part]["text"])}
        message["content"] = parts
    elif reasoning is not None:
        message[reasoning] = middle(message[reasoning])
    elif call is not None:
        calls = list(calls)
        function = calls[call]["function"]
        calls[call] = {**calls[call], "function": {**function, "name": middle(function["name"])}}
        message["tool_calls"] = calls
    else:
        return None
    return [*messages[:index], message, *messages[index + 1 :]]


def _strip_marks(marked: str, marks: tuple[str, str]) -> tuple[str, list[tuple[int, int]]]:
    """The text without generation markers, and the spans of the outermost marked blocks in it."""
    open_, close = marks
    pieces, spans, depth, start, pos, out_len = [], [], 0, 0, 0, 0
    while True:
        o, c = marked.find(open_, pos), marked.find(close, pos)
        if o < 0 and c < 0:
            break
        is_open = o >= 0 and (c < 0 or o < c)
        at = o if is_open else c
        pieces.append(marked[pos:at])
        out_len += at - pos
        if is_open:
            depth += 1
            if depth == 1:
                start = out_len
        else:
            depth -= 1
            if depth == 0 and out_len > start:
                spans.append((start, out_len))
        pos = at + len(open_ if is_open else close)
    pieces.append(marked[pos:])
    return "".join(pieces), spans


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token, whether any of its characters lies in one of `spans` (sorted, disjoint [start, end) character
    ranges). A token straddling a span border is therefore trained; so is an empty token inside a span (not
    one at a span's start: it holds no character of it)."""
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    if not (_ascending(starts) and _ascending(ends)):  # no tokenizer we know of does this; the plain rule then
        return [any(e > a and s < b for a, b in spans) for s, e in offsets]
    mask = [False] * len(offsets)
    for a, b in spans:  # the tokens overlapping [a, b): those ending after a and starting before b
        lo, hi = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        mask[lo:hi] = [True] * max(0, hi - lo)
    return mask


def _ascending(values: list[int]) -> bool:
    return all(map(operator.le, values, values[1:]))
