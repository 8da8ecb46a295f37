"""An assistant's output read back as a Step-3.5 server reads it: the reasoning split off at `</think>`, and the tool
calls in the Step-3.5 (`step3p5`) syntax

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

(several calls one after another; one newline either side of a VALUE belongs to the layout). A VALUE is the JSON
it spells, else its text: `3` is a number, `{"a": 1}` an object, `Paris` and `<b>"hi"</b>` strings. Servers
that know the request's tool schemas (vLLM's step3p5 parser) keep a VALUE as text where the schema declares a
string; `parse_tool_calls_with_text` gives each VALUE's text for that reading (data/agent_check.py uses it).

Pure Python, no step35 imports: the data side (agent_check.py) and the reward functions (training/rewards.py)
read with the same parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>(.*?)</parameter>", re.DOTALL)


class ToolCallSyntaxError(ValueError):
    """Text that opens a tool call but does not follow the Step-3.5 tool-call syntax."""


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(the reasoning, the rest) of an assistant's output, as reasoning parsers split it: the reasoning is what
    stands before the first `</think>` (after a `<think>` there, when the output opens one: what precedes that
    `<think>` is dropped); an output without `<think>` that still closes one started inside the thinking (the
    generation prompt opened `<think>`). An output that opens `<think>` and never closes it is all reasoning;
    one with neither tag has no reasoning (None). Neither part is stripped."""
    head, closed, rest = text.partition(THINK_CLOSE)
    if closed:
        return head.rpartition(THINK_OPEN)[2], rest
    before, opened, after = text.partition(THINK_OPEN)
    if opened and not before.strip():
        return after, ""
    return None, text


def _parameter_value(raw: str) -> Any:
    """A parameter's VALUE: the JSON it spells, else the text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw
    except RecursionError:  # JSON nested past Python's recursion limit: read as the text it is
        return raw


def _parse_call(body: str) -> tuple[str, dict[str, tuple[Any, str]]]:
    """One `<function=NAME>...</function>` body: the name and {argument: (value, text)}."""
    function = _FUNCTION.fullmatch(body)
    if function is None:
        raise ToolCallSyntaxError(f"a tool call without one <function=NAME>...</function>: {body.strip()[:60]!r}")
    name, rest = function.group(1).strip(), function.group(2)
    arguments: dict[str, tuple[Any, str]] = {}
    position = 0
    while (parameter := _PARAMETER.match(rest, position)) is not None:
        argument = parameter.group(1).strip()
        raw = parameter.group(2).removeprefix("\n").removesuffix("\n")
        if argument in arguments:
            raise ToolCallSyntaxError(f"tool call {name}: parameter {argument} given twice")
        arguments[argument] = (_parameter_value(raw), raw)
        position = parameter.end()
    if rest[position:].strip():
        raise ToolCallSyntaxError(f"tool call {name}: text outside the parameters: {rest[position:].strip()[:40]!r}")
    return name, arguments


def parse_tool_calls_with_text(text: str) -> list[tuple[str, dict[str, tuple[Any, str]]]]:
    """As `parse_tool_calls`, with each argument as (value, its text as written, less one newline either side)."""
    bodies = _TOOL_CALL.findall(text)
    if text.count(CALL_OPEN) != len(bodies) or text.count(CALL_CLOSE) != len(bodies):
        raise ToolCallSyntaxError(f"an unclosed or unopened {CALL_OPEN}")
    return [_parse_call(body) for body in bodies]


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of `text` in the Step-3.5 syntax, as (name, {argument: value}); a VALUE is the JSON it
    spells, else its text. Raises ToolCallSyntaxError on a call that does not follow the syntax."""
    return [
        (name, {k: value for k, (value, _) in arguments.items()})
        for name, arguments in parse_tool_calls_with_text(text)
    ]
