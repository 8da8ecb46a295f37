"""Agent records through the chat template and back: does the text the model learns to write parse, on the
serving side, into the turn it was trained on?

Agent SFT records (assistant `tool_calls`, `tool` replies, `reasoning_content`, `tools` schemas) are rendered by
the run's chat template into the text the model learns to produce. A Step-3.5 server reads that text back
(tool_calls.py): the reasoning split at `</think>`, the content before the first `<tool_call>`, and the tool
calls in the step3p5 syntax `<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>`.
A template that writes calls as JSON, double-encodes an argument, drops a parallel call or mangles a string
teaches the model a form the server cannot read, and nothing else in training notices.

`check_agent_rendering` takes each record whose assistant turns carry tool calls or reasoning, renders it and
locates each assistant turn's reply as training locates its trained span (chat_spans.py: the template's
`{% generation %}` blocks, or the sentinel search from the end of the generation prompt), takes off the
end-of-turn token the server stops at, reads the reply back and compares it with the record's message:

- the same number of calls, the same names in order;
- arguments equal as JSON values (a string comes back as the same string, an object or array as the same
  structure; `1` is not `true`). Where the record's `tools` declare a parameter `"type": "string"`, its VALUE
  is read as the text it is, as schema-aware servers (vLLM's step3p5 parser) read it: a string rendered with
  `tojson` then comes back with its quotes;
- the content equal after stripping; the reasoning equal where the template renders it (a template may drop
  the reasoning of earlier turns: a reply without a think block is not compared).

Each difference is one line naming the record (`file:line` for a record read from a file, else its index), the
assistant message (its index in `messages`) and the call and argument. `check_agent_sources` runs the check on
the first records of a datamodule's conversation sources (`data.check_agent_rendering`).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from step35.data.chat_messages import (
    REASONING_FIELDS,
    ChatTemplateError,
    ImagesNotSupported,
    check_messages,
    prepare_messages,
)
from step35.data.chat_spans import Conversation
from step35.data.readers import BadRecord
from step35.data.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    THINK_CLOSE,
    ToolCallSyntaxError,
    parse_tool_calls_with_text,
    split_reasoning,
)

AGENT_CHECK_RECORDS = 200  # records read from the start of each source by data.check_agent_rendering
CONVERSATION_FORMATS = ("chat", "prompt_completion")  # source formats whose records can be conversations
_SHOWN = 80  # characters of a value quoted in a report line


class AgentRenderingWarning(UserWarning):
    """Agent records whose rendering a Step-3.5 server would not read back as the record (data.check_agent_rendering)."""


@dataclass
class AgentCheckReport:
    """`checked`: records with tool calls or reasoning that were rendered and read back; `failed`: one line per
    difference found; `records_failed`: how many records those lines name."""

    checked: int
    failed: list[str] = field(default_factory=list)
    records_failed: int = 0

    def summary(self, source: str, shown: int = 5) -> str:
        """The report in a few lines: the count, and the first `shown` differences."""
        if not self.checked:
            return f"agent rendering: no record of source {source!r} has tool calls or reasoning; nothing checked"
        if not self.failed:
            return f"agent rendering: {self.checked} records checked, all round-trip (source {source!r})"
        lines = "\n".join(f"  {line}" for line in self.failed[:shown])
        more = f"\n  ... and {len(self.failed) - shown} more" if len(self.failed) > shown else ""
        return (
            f"agent rendering: {self.records_failed} of {self.checked} records checked do not round-trip (source"
            f" {source!r}): the chat template renders them into text a Step-3.5 server reads back differently, so"
            f" the model would learn a form the server cannot read:\n{lines}{more}"
        )


@dataclass(frozen=True)
class _Reply:
    """An assistant turn as the record gives it, or as the server reads it back. `calls`: (name, arguments);
    read back, each argument is (value, its text as rendered)."""

    reasoning: str | None
    content: str
    calls: list[tuple[Any, Any]]


# ------------------------------------------------------------------------------------------------ the check


def check_agent_rendering(
    records: Iterable[Any], template: Any, tokenizer: Any, *, limit: int | None = None
) -> AgentCheckReport:
    """Render every record of `records` (the first `limit` of them; all when None) whose assistant turns carry
    tool calls or reasoning with `template` (a ChatTemplate) and `tokenizer` (a TextTokenizer), read each
    assistant turn back as a Step-3.5 server reads it, and report what does not round-trip. A record is a dict
    (`messages` and optional `tools`, or `prompt` and `completion` message lists), or a reader's record (with
    `value()` and `where()`, reported by its `where()`); others are passed over."""
    report = AgentCheckReport(0)
    for index, record in enumerate(itertools.islice(records, limit)):
        found = _conversation(record, index)
        if found is None or not _is_agent(found[1]):
            continue
        where, messages, tools = found
        report.checked += 1
        problems = _record_problems(template, tokenizer, messages, tools)
        report.failed += [f"{where}, {problem}" for problem in problems]
        report.records_failed += bool(problems)
    return report


def check_agent_sources(
    sources: Iterable[Any], template: Any, tokenizer: Any, limit: int = AGENT_CHECK_RECORDS
) -> list[tuple[str, AgentCheckReport]]:
    """(source name, report) for each conversation source (`CONVERSATION_FORMATS`) of `sources`, on its first
    `limit` records (those training keeps: the validation holdout is left out)."""
    from step35.data.bad_records import BadRecords
    from step35.data.resume import Cursor

    reports = []
    for source in sources:
        if source.format not in CONVERSATION_FORMATS:
            continue
        bad = BadRecords(source.name, strict=False)  # unused: reading a record whole raises nothing here
        documents = source.documents(Cursor(), 0, 1, bad, endless=False, read=lambda record: record)
        try:
            records = (record for _, _, record in documents)
            reports.append((source.name, check_agent_rendering(records, template, tokenizer, limit=limit)))
        finally:
            documents.close()
    return reports


def _conversation(record: Any, index: int) -> tuple[str, list, Any] | None:
    """(where, messages, tools) of a record that holds a conversation training would render, else None."""
    where = f"record {index}"
    if callable(getattr(record, "value", None)) and callable(getattr(record, "where", None)):
        where = record.where()
        try:
            record = record.value()
        except BadRecord:
            return None
    if not isinstance(record, dict):
        return None
    messages = record.get("messages")
    if messages is None and isinstance(record.get("prompt"), list) and isinstance(record.get("completion"), list):
        messages = record["prompt"] + record["completion"]
    try:
        check_messages(messages)  # a bad record is training's to skip and count (bad_records.py), not this check's
    except (ChatTemplateError, ImagesNotSupported):
        return None
    return where, messages, record.get("tools")


def _is_agent(messages: list) -> bool:
    """Whether an assistant message carries tool calls or reasoning (a field, or a `<think>` block in its text)."""
    return any(
        m.get("role") == "assistant"
        and (m.get("tool_calls") or any(m.get(k) for k in REASONING_FIELDS) or THINK_CLOSE in _text(m.get("content")))
        for m in messages
    )


def _record_problems(template: Any, tokenizer: Any, messages: list, tools: Any) -> list[str]:
    """The differences between the record's assistant turns and their rendered replies read back."""
    try:
        replies = _rendered_replies(template, tokenizer, messages, tools)
    except ChatTemplateError as error:
        return [f"cannot be rendered and located: {error}"]
    prepared = prepare_messages(messages)
    strings = _string_parameters(tools)
    problems = []
    for i, message in enumerate(prepared):
        if message.get("role") != "assistant":
            continue
        if i not in replies:
            problems.append(f"assistant message {i}: the template renders no reply for it")
            continue
        try:
            found = _read_back(replies[i])
        except ToolCallSyntaxError as error:
            problems.append(f"assistant message {i}: its tool calls do not parse in the step3p5 syntax: {error}")
            continue
        problems += [f"assistant message {i}: {p}" for p in _differences(_expected(message), found, strings)]
    return problems


# ------------------------------------------------------------------------------- rendered replies, read back


def _rendered_replies(template: Any, tokenizer: Any, messages: list, tools: Any) -> dict[int, str]:
    """{assistant message index: its reply as rendered}: from the start of its trained span to the end of its
    last one (chat_spans.py locates them as training does), without the end-of-turn token."""
    extra = template._tokens(tokenizer, {})  # the EOS a template without its own gets, as training renders
    conversation = Conversation(functools.partial(template.render, tools=tools, **extra), template.origin, messages, "")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if template.has_generation_marks:
        spans = conversation.marked_spans(turns)
        # A turn's blocks start past the text of the message before it (as marked_spans bounds the last turn's).
        bounds = [_end_of_message_before(conversation, i) for i in turns] + [len(conversation.text) + 1]
        ranges = {}
        for i, low, high in zip(turns, bounds, bounds[1:]):
            own = [span for span in spans if low <= span[0] < high]
            if own:
                ranges[i] = (own[0][0], own[-1][1])
    else:
        encoding = tokenizer.tokenizer.encode(conversation.text, add_special_tokens=False)
        end_of_turn = functools.partial(template.end_of_turn_id, tokenizer, tools=tools)
        spans, _ = conversation.located_spans(turns, encoding.ids, encoding.offsets, end_of_turn)
        ranges = dict(zip(turns, spans))
    stops = _stop_texts(template, tokenizer, extra.get("eos_token"), tools)
    return {i: _without_stops(conversation.text[start:end], stops) for i, (start, end) in ranges.items()}


def _end_of_message_before(conversation: Conversation, index: int) -> int:
    """Where the text of the nearest message before `index` that renders any ends (0 when none does)."""
    return next((end for j in range(index - 1, -1, -1) if (end := conversation.region(j)[1]) is not None), 0)


def _stop_texts(template: Any, tokenizer: Any, eos_token: str | None, tools: Any) -> set[str]:
    """The texts a reply ends with that the server stops at and does not return: the EOS, the end-of-turn token."""
    stops = {text for text in (eos_token, template.eos_token) if text}
    try:
        end_of_turn = template.end_of_turn_id(tokenizer, tools=tools)
    except ChatTemplateError:  # no special token ends a reply: the EOS alone
        return stops
    return stops | {tokenizer.tokenizer.decode([end_of_turn], skip_special_tokens=False)} - {""}


def _without_stops(reply: str, stops: set[str]) -> str:
    while True:
        reply = reply.rstrip()
        stop = next((s for s in stops if reply.endswith(s)), None)
        if stop is None:
            return reply
        reply = reply[: -len(stop)]


def _read_back(reply: str) -> _Reply:
    """The reply as a Step-3.5 server reads it: reasoning, content (before the first call), calls."""
    reasoning, rest = split_reasoning(reply)
    first = rest.find(CALL_OPEN)
    if first < 0:
        return _Reply(reasoning, rest, [])
    try:
        calls = parse_tool_calls_with_text(rest)
    except ToolCallSyntaxError as error:
        raise ToolCallSyntaxError(_json_calls_hint(rest) or str(error)) from None
    outside = "".join(piece.split(CALL_CLOSE)[-1] for piece in rest[first:].split(CALL_OPEN)).strip()
    if outside:
        raise ToolCallSyntaxError(f"text between or after the tool calls, which the server drops: {_shown(outside)}")
    return _Reply(reasoning, rest[:first], calls)


def _json_calls_hint(text: str) -> str | None:
    """Say so when the calls are JSON objects inside <tool_call> (the Hermes form), not the step3p5 syntax."""
    body = text.partition(CALL_OPEN)[2].partition(CALL_CLOSE)[0].strip()
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and "name" in value):
        return None
    return (
        f"the template writes each call as JSON inside {CALL_OPEN} ({_shown(body)}), which the step3p5 parser does"
        " not read: it expects <function=NAME><parameter=ARG>VALUE</parameter>...</function>"
    )


# ------------------------------------------------------------------------------------------------ comparing


def _text(content: Any) -> str:
    """A message's content as text: a str, or its text parts joined."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(p.get("text") or "" for p in parts if isinstance(p, dict) and p.get("type") == "text")


def _expected(message: dict) -> _Reply:
    """A prepared assistant message as the reply it stands for: reasoning (the field, or a `<think>` block in
    its content), content, and calls as (name, arguments)."""
    content, reasoning = _text(message.get("content")), message.get("reasoning_content")
    if reasoning is None and THINK_CLOSE in content:
        reasoning, content = split_reasoning(content)
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or call
        calls.append((function.get("name"), function.get("arguments") or {}))
    return _Reply(reasoning, content, calls)


def _differences(expected: _Reply, found: _Reply, strings: dict[str, set[str]]) -> list[str]:
    problems = []
    if found.reasoning is not None and found.reasoning.strip() != (expected.reasoning or "").strip():
        problems.append(
            f"reasoning comes back as {_shown(found.reasoning.strip())}, the record has"
            f" {_shown((expected.reasoning or '').strip())}"
        )
    if found.content.strip() != expected.content.strip():
        problems.append(
            f"content comes back as {_shown(found.content.strip())}, the record has {_shown(expected.content.strip())}"
        )
    return problems + _call_differences(expected.calls, found.calls, strings)


def _call_differences(expected: list, found: list, strings: dict[str, set[str]]) -> list[str]:
    """Calls compared in order: count, names, then each argument."""
    n, problems = len(expected), []
    for k, ((name, arguments), (found_name, found_arguments)) in enumerate(zip(expected, found)):
        at = f"tool call {k + 1} of {n} `{name}`"
        if found_name != name:
            problems.append(f"{at}: its name comes back as `{found_name}`")
        elif not isinstance(arguments, dict):
            problems.append(f"{at}: the record's arguments are not a JSON object: {_shown(arguments)}")
        else:
            problems += _argument_differences(at, arguments, found_arguments, strings.get(name, set()))
    problems += [
        f"tool call {k + 1} of {n} `{expected[k][0]}` is not rendered (only {len(found)} come back)"
        for k in range(len(found), n)
    ]
    if len(found) > n:
        problems.append(f"{len(found)} tool calls come back, the record has {n}")
    return problems


def _argument_differences(at: str, arguments: dict, found: dict, strings: set[str]) -> list[str]:
    problems = [f"{at} argument `{a}` is not rendered" for a in arguments if a not in found]
    problems += [f"{at} argument `{a}` comes back, the record has none" for a in found if a not in arguments]
    for argument, expected in arguments.items():
        if argument not in found:
            continue
        value, text = found[argument]
        as_text = argument in strings and isinstance(expected, str)
        value = text if as_text else value  # a schema-aware server keeps a declared string's text as it stands
        if _same_json(expected, value):
            continue
        how = " (as text: its tools schema says string)" if as_text else ""
        problems.append(
            f"{at} argument `{argument}`: rendered {_shown(text)} reads back as {_json(value)}{how}, the record has"
            f" {_json(expected)}{' (double-encoded)' if _double_encoded(value, expected) else ''}"
        )
    return problems


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: numbers by value, but a bool only equals a bool; containers element by element."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _double_encoded(value: Any, expected: Any) -> bool:
    """Whether `value` is the JSON text of `expected` (encoded once more than the record's value)."""
    if not isinstance(value, str):
        return False
    try:
        return _same_json(json.loads(value), expected)
    except (ValueError, RecursionError):
        return False


def _string_parameters(tools: Any) -> dict[str, set[str]]:
    """{tool name: its parameters declared `"type": "string"`} from a record's `tools` (a list, or its JSON)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            return {}
    strings: dict[str, set[str]] = {}
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict) and isinstance(function.get("name"), str):
            strings[function["name"]] = {
                k for k, schema in properties.items() if isinstance(schema, dict) and schema.get("type") == "string"
            }
    return strings


def _json(value: Any) -> str:
    """`value` as JSON text for a report line, cut to about _SHOWN characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _shown(value: Any) -> str:
    """Text as written (`value`, or its JSON) quoted for a report line (repr), cut to about _SHOWN characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return repr(text) if len(text) <= _SHOWN else repr(text[:_SHOWN]) + "..."
