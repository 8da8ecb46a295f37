"""Conversations rendered with a chat template, and which of their tokens the loss trains.

Rendering follows transformers 5.x `apply_chat_template`, so that training sees the text inference engines
produce: a sandboxed Jinja environment (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks, the
`loopcontrols` extension and a `{% generation %}` tag), the globals `raise_exception` and `strftime_now`, a
`tojson` filter that keeps non-ASCII text, `tools` and `documents` passed as None when absent, keys whose value
is None dropped from messages, and the reasoning of a message (given as `reasoning_content`, `thinking` or
`reasoning`, first found wins) copied to `reasoning_content`, and to `thinking` unless the message has one.
The special tokens (`bos_token`, `eos_token`) come from the tokenizer folder. The rendered text is tokenized
WITHOUT adding special tokens: the template writes them. Tool calls' `arguments` given as a JSON string are
parsed first (`_parsed_arguments`). Unlike transformers', the environment is bounded against resources (time,
text size, integer size: RENDER_SECONDS and below), since templates come with downloaded tokenizers.

Which tokens are trained (`encode`): character spans of the rendered text, turned into a per-token mask by
the tokenizer's offsets. A token is trained when any of its characters lies in a span (the rule transformers
uses for `return_assistant_tokens_mask`), so a token straddling a span border is trained.

- A template with `{% generation %}...{% endgeneration %}` marks its spans itself: each block's output is the
  span. We find them by having the tag wrap its output in unique markers, then check that the text without
  the markers is exactly the ordinary rendering (so a template that post-processes a marked block fails loudly
  instead of giving wrong spans).
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
  located this way, `encode` raises `ChatTemplateError`; it never guesses.

With `train_reasoning=False` the reasoning of the trained turns is taken out of those spans. Each piece of a
turn's reasoning (the field, or a `<think>` block inline in the content, split off as templates split it: before
the first `</think>`, after the last `<think>`) is replaced alone by a sentinel; the rendering must then differ
only where the sentinel stands, and the text it stands for in the real rendering is the reasoning. The
`<think>`/`</think>` wrappers and the whitespace the template puts around the reasoning stay trained.
"""

from __future__ import annotations

import bisect
import functools
import json
import operator
import re
import time
import types
import uuid
import warnings
import weakref
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

TRAIN_ON = ("assistant", "last_assistant", "all")
ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_FILE = "chat_template.jinja"
# The tokenizer files a template and its special tokens are read from.
TEMPLATE_SOURCES = (TEMPLATE_FILE, "tokenizer_config.json", "special_tokens_map.json")

# Our template for tokenizers without one (the built-in tokenizer knows no chat tokens, so the headers are
# plain text it encodes byte by byte). Every assistant turn ends with the tokenizer's EOS, inside the
# generation block, so the model learns to stop; the generation prompt is the assistant header. The function
# schemas of `tools`, when given, come first: a `<|tools|>` block with one schema per line, as JSON.
DEFAULT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content or [] -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if eos_token is not defined -%}{{ raise_exception('the default chat template needs eos_token') }}{%- endif -%}
{%- if tools -%}
{{- '<|tools|>\\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|assistant|>\\n' -}}
{%- generation -%}
{%- if message.reasoning_content -%}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n' -}}{%- endif -%}
{{- text(message.content) -}}
{%- for call in message.tool_calls or [] -%}
{%- set function = call.function or call -%}
{{- '\\n' if (not loop.first or text(message.content)) else '' -}}
{{- '<tool_call>' + ({'name': function.name, 'arguments': function.arguments} | tojson) + '</tool_call>' -}}
{%- endfor -%}
{{- eos_token -}}
{%- endgeneration -%}
{{- '\\n' -}}
{%- else -%}
{{- '<|' + message.role + '|>\\n' + text(message.content) + '\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"""


class ChatTemplateError(ValueError):
    """A conversation or chat template that cannot be rendered or masked; the message names where."""


class DroppedToolsWarning(UserWarning):
    """Records carry `tools` that the chat template does not render (`ChatTemplate.check_tools`)."""


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def check_train_choice(train_on: Any, train_reasoning: Any, where: str = "") -> None:
    """The one rule for `train_on` and `train_reasoning`, wherever they are given (the DataModule's options,
    an SftEncoder, ChatTemplate.encode); `where` names the place (`data`, a record's file and line)."""
    if train_on not in TRAIN_ON:
        raise ChatTemplateError(f"{_at(where)}train_on={train_on!r}; expected one of {', '.join(TRAIN_ON)}")
    if not isinstance(train_reasoning, bool):
        raise ChatTemplateError(f"{_at(where)}train_reasoning={train_reasoning!r}; expected true or false")


def check_messages(messages: Any, where: str = "", *, require_assistant: bool = True) -> None:
    """Raise ChatTemplateError naming `where` (e.g. "data.jsonl:3") unless `messages` is a non-empty list of
    {role, content} objects with known roles and, when `require_assistant`, at least one assistant turn.
    Content is text or a non-empty list of text parts (`_check_parts`); an assistant turn may leave it out (or
    give None or []) when it carries `tool_calls`, which must be a list of objects; reasoning, under any of its
    names, must be text."""
    at = _at(where)
    if not isinstance(messages, list):
        kind = type(messages).__name__
        raise ChatTemplateError(f"{at}'messages' must be a list of {{role, content}} objects, got {kind}")
    if not messages:
        raise ChatTemplateError(f"{at}empty conversation ('messages' is [])")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise ChatTemplateError(f"{at}message {i} is a {kind}, not an object with role and content")
        if "role" not in message:
            raise ChatTemplateError(f"{at}message {i} has no 'role' (keys: {sorted(message)})")
        role = message["role"]
        if role not in ROLES:
            raise ChatTemplateError(f"{at}message {i} has unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"{at}message {i} ({role}) has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(
                f"{at}message {i} ({role}) has 'content' of type {type(content).__name__};"
                " expected text or a list of parts"
            )
        if isinstance(content, list):
            calling = role == "assistant" and bool(message.get("tool_calls"))
            _check_parts(content, f"{at}message {i} ({role})", allow_empty=calling)
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ChatTemplateError(f"{at}message {i} ({role}) has 'tool_calls' that are not a list of objects")
        for key in REASONING_FIELDS:
            if message.get(key) is not None and not isinstance(message[key], str):
                kind = type(message[key]).__name__
                raise ChatTemplateError(f"{at}message {i} ({role}) has '{key}' of type {kind}; expected text")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise ChatTemplateError(f"{at}no assistant turn, so nothing to train on (roles: {roles})")


def _check_parts(parts: list, at: str, *, allow_empty: bool) -> None:
    """Content given as parts must be {type: "text", text: ...} objects: a text model cannot train on an image
    or audio part, and templates render such parts (and an empty list) as no text at all, silently; refusing
    them makes the record a bad record, counted and skipped (or refused under data.strict)."""
    if not parts and not allow_empty:
        raise ChatTemplateError(f"{at} has 'content' [] (no parts): give its text, or leave the message out")
    for k, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{at}: content part {k} is a {type(part).__name__}, not a {{type, text}} object")
        kind = part.get("type")
        if kind != "text":
            raise ChatTemplateError(
                f"{at}: content part {k} has type {kind!r}; only text parts can be trained on (drop or describe"
                " non-text parts such as images in text)"
            )
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{at}: content part {k} (text) has no 'text' string")


# ----------------------------------------------------------------------------------------------- Jinja


# While `_render` runs with marks on, the `generation` tag wraps its output in this pair of strings.
_MARKS: ContextVar[Optional[tuple[str, str]]] = ContextVar("step35_generation_marks", default=None)


# Resource limits of one rendering. Templates come with downloaded tokenizers, so a template must not be able
# to hang a run or fill its memory (`lipsum(10**7)`, `'x' * 10**10`, `indent(10**10)`, ...). Text, lists and
# the total output are bounded by RENDER_TEXT_FLOOR + RENDER_TEXT_PER_INPUT x the size of the input (the
# template's source, the messages, tools and variables, as text); integers by RENDER_INT_BITS bits; a
# rendering by RENDER_SECONDS of wall-clock time. A template over a limit is refused with a ChatTemplateError.
RENDER_SECONDS = 10.0
RENDER_TEXT_FLOOR = 1 << 20
RENDER_TEXT_PER_INPUT = 100
RENDER_INT_BITS = 1 << 16
# Filters whose integer arguments size what they make (widths, counts): refused over the text limit.
_SIZING_FILTERS = ("indent", "center", "batch", "slice", "wordwrap", "truncate")
# str methods whose integer arguments are widths.
_SIZING_METHODS = ("ljust", "rjust", "center", "zfill", "expandtabs")
# Filters that turn their whole value into text (a list's repr, JSON, ...): its text size is checked first.
_TEXT_FILTERS = ("string", "pprint", "tojson", "urlencode", "xmlattr", "escape", "e", "forceescape", "join")
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?")
_FORMAT_FIELD = re.compile(r"\{[^{}]*\}")


class _LimitHit(Exception):
    """A rendering went over one of its limits; `_render` turns it into a ChatTemplateError naming the template."""


class _Budget:
    """The limits of one rendering (see RENDER_SECONDS): a deadline, a text size, and the output emitted so far.
    `bounds` remembers the text size of the containers already measured (and holds them, so that their ids
    stay theirs), so that a conversation passed to many filters is measured once."""

    def __init__(self, input_size: int):
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.max_chars = RENDER_TEXT_FLOOR + RENDER_TEXT_PER_INPUT * input_size
        self.input_size = input_size
        self.emitted = 0
        self.bounds: dict[int, tuple[Any, int]] = {}

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitHit(f"it ran over the {RENDER_SECONDS:g} s time limit of one rendering")

    def over(self, what: str, size: int, unit: str = "characters") -> _LimitHit:
        return _LimitHit(
            f"{what} would make {size} {unit}, over the limit of one rendering ({self.max_chars}: {RENDER_TEXT_FLOOR}"
            f" + {RENDER_TEXT_PER_INPUT} x the input's {self.input_size} characters)"
        )

    def check_size(self, size: int, what: str, unit: str = "characters") -> None:
        if size > self.max_chars:
            raise self.over(what, size, unit)

    def check_text(self, value: Any, what: str) -> None:
        """`value` as text (str() of it, or its JSON) stays within the text limit."""
        self.check_size(self.text_size(value), what)

    def check_result(self, value: Any, what: str) -> None:
        """A value a template made: a text, list or mapping within the text limit, an integer within its bits."""
        kind = type(value)
        if kind is int:
            if value.bit_length() > RENDER_INT_BITS:
                raise _LimitHit(f"{what} is an integer of {value.bit_length()} bits, over the limit of"
                                f" {RENDER_INT_BITS} bits")
        elif kind in _SIZED and len(value) > self.max_chars:
            raise self.over(what, len(value), "characters" if kind is str else "items")

    def text_size(self, value: Any, indent: int = 0) -> int:
        """An upper bound (up to the quoting of odd characters) on the length of `value` as text or JSON, with
        `indent` characters of indentation per level; it stops counting past the text limit."""
        memo = self.bounds if not indent else {}
        return _text_size(value, self.max_chars, memo, indent, 0)


def _text_size(value: Any, limit: int, memo: dict, indent: int, depth: int) -> int:
    if isinstance(value, str):
        return len(value) + (2 if depth else 0)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, float):
        return 25
    namespace = _namespace_attrs(value)
    if namespace is not None:
        value = namespace
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return 64
    key = id(value) if not indent else (id(value), depth)
    if key in memo:
        return memo[key][1]
    per_item = 2 + (1 + (depth + 1) * indent if indent else 0)
    total = 2 + (1 + depth * indent if indent else 0)
    items = value.items() if isinstance(value, dict) else ((None, item) for item in value)
    for name, item in items:
        total += per_item + _text_size(item, limit, memo, indent, depth + 1)
        if name is not None:
            total += 2 + _text_size(name, limit, memo, indent, depth + 1)
        if total > limit:
            break
    memo[key] = (value, total)
    return total


def _namespace_attrs(value: Any) -> Optional[dict]:
    """The attributes of a Jinja `namespace()` (whose text shows them), else None."""
    attrs = getattr(type(value), "__name__", "") == "Namespace" and getattr(value, "_Namespace__attrs", None)
    return attrs if isinstance(attrs, dict) else None


_SIZED = frozenset((str, bytes, list, tuple, dict, set))
_BUDGET: ContextVar[Optional[_Budget]] = ContextVar("step35_render_budget", default=None)


def _input_size(values: Any) -> int:
    """The size of a rendering's input as text (its JSON, at C speed; else the slower upper bound)."""
    try:
        return len(json.dumps(values, ensure_ascii=False, default=repr))
    except (TypeError, ValueError):
        return _text_size(values, 1 << 62, {}, 0, 0)


def _check_printf(budget: _Budget, template: str, args: Any, what: str) -> None:
    """`template % args` (the `%` operator, the `format` filter) stays within the text limit: no width or
    precision over it, written or given by `*`, and no argument whose text is over it."""
    starred = False
    for width, precision in _PRINTF_SPEC.findall(template):
        for number in (width, precision):
            starred = starred or number == "*"
            if number.isdigit():
                budget.check_size(int(number), f"{what}: a width or precision of {number}")
    values = args if isinstance(args, (tuple, list)) else (args,)
    for value in values:
        if starred and isinstance(value, int) and not isinstance(value, bool):
            budget.check_size(abs(value), f"{what}: a width or precision of {value}")
    budget.check_size(len(template) + budget.text_size(args), what)


def _check_format(budget: _Budget, template: str, args: tuple, kwargs: dict) -> None:
    """`template.format(...)` stays within the text limit: no width in a field over it, no argument over it."""
    for field in _FORMAT_FIELD.findall(template):
        for number in re.findall(r"\d+", field.partition(":")[2]):
            budget.check_size(int(number), f"str.format: a width of {number}")
    if re.search(r"\{[^{}]*\{", template):  # a width given as an argument
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                budget.check_size(abs(value), f"str.format: a width of {value}")
    budget.check_size(len(template) + budget.text_size(args) + budget.text_size(kwargs), "str.format")


def _check_binop(budget: _Budget, operator_: str, left: Any, right: Any) -> None:
    """Refuse, before computing it, an operation whose result would be over the limits: repetition of a text or
    list, a power of integers, printf-style formatting."""
    if operator_ == "*":
        for sequence, times in ((left, right), (right, left)):
            if isinstance(sequence, (str, list, tuple)) and isinstance(times, int) and times > 0:
                size = max(len(sequence), budget.text_size(sequence) if not isinstance(sequence, str) else 0)
                budget.check_size(size * times, f"{type(sequence).__name__} * {times}")
    elif operator_ == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = right * left.bit_length()
            if bits > RENDER_INT_BITS:
                raise _LimitHit(f"{left} ** {right} is an integer of about {bits} bits, over the limit of"
                                f" {RENDER_INT_BITS} bits")
    elif operator_ == "%" and isinstance(left, str):
        _check_printf(budget, left, right, "the % operator")


def _check_call(budget: _Budget, function: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, before calling it, a str method that would make a text over the limit."""
    kind = type(function)
    if kind is types.FunctionType:  # a macro is not; the sandbox's wrapper of str.format and format_map is
        function = getattr(function, "__wrapped__", None)
        kind = type(function)
    if kind is not types.BuiltinMethodType or type(function.__self__) is not str:
        return
    owner, name = function.__self__, function.__name__
    numbers = [v for v in (*args, *kwargs.values()) if isinstance(v, int) and not isinstance(v, bool)]
    if name in _SIZING_METHODS:
        for number in numbers:
            budget.check_size(abs(number) * (owner.count("\t") if name == "expandtabs" else 1), f"str.{name}({number})")
    elif name in ("format", "format_map"):
        _check_format(budget, owner, args, kwargs)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        count = owner.count(old) if old else len(owner) + 1
        budget.check_size(len(owner) + count * len(new), "str.replace")
    elif name == "join" and isinstance(args[0] if args else None, (list, tuple)):
        budget.check_size(budget.text_size(args[0]) + len(args[0]) * len(owner), "str.join")


def _check_filter(budget: _Budget, name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, before running it, a filter that would make a text over the limit (see _SIZING_FILTERS)."""
    if name in _SIZING_FILTERS:
        for number in (*args, *kwargs.values()):
            if isinstance(number, int) and not isinstance(number, bool):
                budget.check_size(abs(number), f"the {name} filter's argument {number}")
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width
        if isinstance(width, int):
            lines = str(value).count("\n") + 1 if isinstance(value, str) else 1
            budget.check_size(budget.text_size(value) + lines * abs(width), f"indent({width})")
    elif name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)  # tojson(value, ensure_ascii, indent)
        indent = len(indent) if isinstance(indent, str) else indent
        if isinstance(indent, int) and not isinstance(indent, bool) and indent > 0:
            budget.check_size(indent, f"tojson(indent={indent})")
            budget.check_size(budget.text_size(value, indent), f"tojson(indent={indent})")
    elif name == "format" and isinstance(value, str):
        _check_printf(budget, value, args or kwargs, "the format filter")
    elif name == "replace" and isinstance(value, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = value.count(args[0]) if args[0] else len(value) + 1
        budget.check_size(len(value) + count * len(args[1]), "the replace filter")
    if name in _TEXT_FILTERS:
        budget.check_text(value, f"the {name} filter's value")
    if name == "join" and isinstance(value, (list, tuple)):
        separator = args[0] if args else kwargs.get("d", "")
        budget.check_size(budget.text_size(value) + len(value) * len(str(separator)), "the join filter")


def _bounded_filter(name: str, function: Callable):
    """`function` (a Jinja filter) with the rendering's limits checked before and after it. It takes the
    context, which also keeps Jinja from running it at compile time on constant arguments."""
    from jinja2 import pass_context

    passed = getattr(getattr(function, "jinja_pass_arg", None), "name", None)

    @pass_context
    def bounded(context, value, *args, **kwargs):
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
            _check_filter(budget, name, value, args, kwargs)
        if passed is None:
            result = function(value, *args, **kwargs)
        else:
            first = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}
            result = function(first[passed], value, *args, **kwargs)
        if budget is not None:
            budget.check_result(result, f"the {name} filter's result")
        return result

    return bounded


def _emit(context, value: Any) -> Any:
    """A `{{ ... }}` output (routed here by `_bounded_tree`, also inside macros and blocks, so that no buffer grows
    unseen), counted against the rendering's output limit; a value that is not text is measured before Jinja
    turns it into text. Literal text is counted per loop iteration instead (`_loop`)."""
    budget = _BUDGET.get()
    if budget is not None:
        if type(value) is str:
            budget.emitted += len(value)
        else:
            budget.emitted += budget.text_size(value)
        if budget.emitted > budget.max_chars:
            raise budget.over("the output", budget.emitted)
    return value


def _concat(context, *values: Any) -> str:
    """The `~` operator, with its result checked against the text limit before it is made."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()
        budget.check_size(sum(budget.text_size(value) for value in values), "the ~ operator")
    return "".join(map(str, values))


def _loop(context, iterable: Any, literal_size: int):
    """The items of a `{% for %}` loop, checking the rendering's deadline at each (nested loops that print
    nothing would otherwise run unchecked) and counting the `literal_size` characters of literal text its body
    can output per iteration (`_literal_size`)."""
    budget = _BUDGET.get()
    if budget is None:
        yield from iterable
        return
    for item in iterable:
        budget.tick()
        budget.emitted += literal_size
        if budget.emitted > budget.max_chars:
            raise budget.over("the output", budget.emitted)
        yield item


def _literal_size(node) -> int:
    """The most literal text (template text and constants) one pass over `node` outputs: every branch counted;
    not in macro definitions (a macro's output is counted where it is output) nor in the bodies of nested loops
    (which count their own)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Macro):
        return 0
    if isinstance(node, nodes.Output):
        return sum(len(child.data) if isinstance(child, nodes.TemplateData) else len(str(child.value))
                   for child in node.nodes if isinstance(child, (nodes.TemplateData, nodes.Const)))  # fmt: skip
    if isinstance(node, nodes.For):
        return sum(_literal_size(child) for child in node.else_)
    return sum(_literal_size(child) for child in node.iter_child_nodes())


def _bounded_tree(tree):
    """The parsed template with each output of an expression, each `{% filter %}` block, each `~` and each loop
    routed through `_emit`, `_concat` and `_loop`, which count against the rendering's limits. They are called
    as filters: the one call Jinja makes directly, without the sandbox's dispatch (they take the context, so
    Jinja never runs them at compile time). Literal text is left as it is (Jinja writes it as a constant) and
    counted per loop iteration: outside loops, it is bounded by the template's size."""
    from jinja2 import nodes

    def call(name: str, value, args: list, lineno: int):
        return nodes.Filter(value, name, args, [], None, None, lineno=lineno)

    for loop in list(tree.find_all(nodes.For)):
        size = sum(_literal_size(child) for child in loop.body)
        loop.iter = call("step35_loop", loop.iter, [nodes.Const(size)], loop.lineno)
    literal = (nodes.TemplateData, nodes.Const)
    for output in list(tree.find_all(nodes.Output)):
        output.nodes = [
            child if isinstance(child, literal) else call("step35_emit", child, [], child.lineno)
            for child in output.nodes
        ]
    for block in list(tree.find_all(nodes.FilterBlock)):
        block.filter = call("step35_emit", block.filter, [], block.lineno)
    for concat in list(tree.find_all(nodes.Concat)):
        concat.nodes = [call("step35_concat", concat.nodes[0], concat.nodes[1:], concat.lineno)]
    return tree


def _environment():
    """A Jinja environment configured as transformers configures its own for chat templates, with the rendering
    limits (RENDER_SECONDS, ...) enforced in its operators, calls, filters, outputs and loops, and no constant
    folding at compile time (which would compute `9 ** (9 ** 9)` while compiling, before any limit applies)."""
    import jinja2
    from jinja2 import nodes, pass_context
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import generate_lorem_ipsum

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: output unchanged, wrapped in markers while we track spans."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_output"), [], [], body).set_lineno(lineno)

        def _output(self, caller):
            text = caller()
            marks = _MARKS.get()
            return text if marks is None else marks[0] + text + marks[1]

    class Sandbox(ImmutableSandboxedEnvironment):
        """Every arithmetic operator and call checked against the rendering's limits (an intercepted operator is
        also never folded at compile time)."""

        intercepted_binops = frozenset(("+", "*", "%", "**"))  # those that can grow a value

        def call_binop(self, context, operator_, left, right):
            budget = _BUDGET.get()
            if budget is None:
                return self.binop_table[operator_](left, right)
            if operator_ == "+":  # the common case, kept fast: a sum is at most twice the limit before its check
                result = left + right
                if type(result) is str:
                    if len(result) > budget.max_chars:
                        raise budget.over("the result of '+'", len(result))
                    return result
            else:
                _check_binop(budget, operator_, left, right)
                result = self.binop_table[operator_](left, right)
            budget.check_result(result, f"the result of {operator_!r}")
            return result

        def call(self, context, function, /, *args, **kwargs):
            budget = _BUDGET.get()
            if budget is not None:
                budget.tick()
                _check_call(budget, function, args, kwargs)
            result = super().call(context, function, *args, **kwargs)
            if budget is not None and "caller" in kwargs and type(result) is str:
                budget.emitted += len(result)  # a {% call %} block (e.g. {% generation %}) outputs what it returns
            if budget is not None:
                budget.check_result(result, f"the result of {getattr(function, '__name__', 'a call')}")
            return result

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML, which a chat template must not do.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def lipsum(n=5, html=True, min=20, max=100):
        budget = _BUDGET.get()
        if budget is not None and isinstance(n, int) and isinstance(max, int):
            budget.check_size(abs(n) * abs(max) * 12, f"lipsum({n})")  # at most `max` words of about 12 characters
        return generate_lorem_ipsum(n, html, min, max)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], optimized=False)
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, function) for name, function in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["lipsum"] = lipsum
    for name, function in (("step35_emit", _emit), ("step35_concat", _concat), ("step35_loop", _loop)):
        env.filters[name] = pass_context(function)
    return env


def _prepare(messages: list) -> list[dict]:
    """What transformers does to messages before rendering: drop None values, alias the reasoning names; and
    tool calls' `arguments` given as a JSON string (OpenAI's format) parsed (`_parsed_arguments`)."""
    prepared = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            # `thinking` only where the message lacks it (gpt-oss templates read it), `reasoning_content` always
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_parsed_arguments(call) for call in message["tool_calls"]]
        prepared.append(message)
    return prepared


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose `arguments` (under `function`, or at its top level) is a string holding a JSON object,
    with that object instead: templates write arguments with `tojson`, which would encode the string a second
    time (`"{\\"city\\": ..."`) and render the same call differently from one whose arguments are an object. A
    string that does not hold a JSON object stays as it is."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        parsed = _json_object(function["arguments"])
        if parsed is not None:
            call = {**call, "function": {**function, "arguments": parsed}}
    if isinstance(call.get("arguments"), str):
        parsed = _json_object(call["arguments"])
        if parsed is not None:
            call = {**call, "arguments": parsed}
    return call


def _json_object(text: str) -> Optional[dict]:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _special_token(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(data: bytes | None, file: Path) -> dict:
    """The JSON object in `data` (the contents of `file`, which errors name), {} when absent or not an object."""
    if data is None:
        return {}
    try:
        content = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{file}: not valid JSON ({e})") from None
    return content if isinstance(content, dict) else {}


# ------------------------------------------------------------------------------------------- the template


class ChatTemplate:
    """A Jinja chat template (`source`), where it came from (`origin`), and the special tokens it is given."""

    def __init__(self, source: str, origin: str, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"chat template from {origin}: empty or not text")
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled = None
        self._marked: Optional[bool] = None
        self._uses_tools: Optional[bool] = None
        self._tools_warned: set = set()  # the sources told that this template drops their `tools`
        self._end_of_turn: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> end-of-turn id

    def __getstate__(self) -> dict:
        # A compiled Jinja template does not pickle; DataLoader workers compile their own on first use.
        return {"source": self.source, "origin": self.origin, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["source"], state["origin"], bos_token=state["bos_token"], eos_token=state["eos_token"])

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} characters)"

    @property
    def has_generation_marks(self) -> bool:
        """Whether the template marks its trained text with `{% generation %}` (checked by parsing, not by regex)."""
        if self._marked is None:
            from jinja2 import nodes

            self._template()  # a syntax error is reported as such
            ast = _environment().parse(self.source)
            self._marked = any(_is_generation(node) for node in ast.find_all(nodes.CallBlock))
        return self._marked

    @property
    def uses_tools(self) -> bool:
        """Whether the template reads the `tools` variable (the function schemas of agent data), by parsing."""
        if self._uses_tools is None:
            from jinja2 import nodes

            self._template()  # a syntax error is reported as such
            ast = _environment().parse(self.source)
            self._uses_tools = any(n.name == "tools" and n.ctx == "load" for n in ast.find_all(nodes.Name))
        return self._uses_tools

    def check_tools(self, tools: Any, where: str = "", *, source: Any = None) -> None:
        """Warn, once per `source` (anything hashable: the SftEncoder of a data source passes itself; None: once
        per template), when records carry `tools` that this template leaves out of the text (it does not read
        `tools`), so the model is trained on tool calls without the schemas they answer to. `where` names the
        first such record."""
        if not tools or self.uses_tools or source in self._tools_warned:
            return
        self._tools_warned.add(source)
        warnings.warn(
            f"{_at(where)}the records carry 'tools' (function schemas), but the chat template from {self.origin}"
            " does not render them, so they are left out of the training text (said once per source); use a"
            " template that renders tools (step35's default does) or drop 'tools' from the data",
            DroppedToolsWarning,
            stacklevel=2,
        )

    # ------------------------------------------------------------------------------------ loading

    @classmethod
    def from_folder(cls, folder: str | Path) -> Optional["ChatTemplate"]:
        """The template of a tokenizer or model folder, or None when it has none (see `from_files`)."""
        folder = Path(folder).expanduser()
        return cls.from_files({name: (folder / name).read_bytes() for name in TEMPLATE_SOURCES
                               if (folder / name).is_file()}, folder)

    @classmethod
    def from_files(cls, files: dict[str, bytes], folder: str | Path) -> Optional["ChatTemplate"]:
        """The template held by a tokenizer's files (`files`: name -> contents, e.g. those a checkpoint
        records; `folder` names where they come from in errors), or None when they hold none.

        `chat_template.jinja` wins over `chat_template` in `tokenizer_config.json` (as in transformers); the
        latter may be a string or a list of {name, template}, of which "default" is taken. BOS and EOS tokens
        come from tokenizer_config.json, else special_tokens_map.json.
        """
        folder = Path(folder)
        config = _read_json(files.get("tokenizer_config.json"), folder / "tokenizer_config.json")
        special = _read_json(files.get("special_tokens_map.json"), folder / "special_tokens_map.json")
        tokens = {
            name: _special_token(config.get(name)) or _special_token(special.get(name))
            for name in ("bos_token", "eos_token")
        }
        if TEMPLATE_FILE in files:
            return cls(files[TEMPLATE_FILE].decode("utf-8"), TEMPLATE_FILE, **tokens)
        template = config.get("chat_template")
        if template is None:
            return None
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ChatTemplateError(
                    f"{folder / 'tokenizer_config.json'}: chat_template is a list without a 'default' entry"
                    f" (names: {sorted(map(str, named))})"
                )
            template = named["default"]
        if not isinstance(template, str):
            kind = type(template).__name__
            raise ChatTemplateError(f"{folder / 'tokenizer_config.json'}: chat_template is a {kind}, not text")
        return cls(template, "tokenizer_config.json", **tokens)

    @classmethod
    def from_file(cls, path: str | Path) -> "ChatTemplate":
        """A template file (a `.jinja` override); its special tokens come from a tokenizer folder via `with_tokens`."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ChatTemplateError(f"chat template file {str(path)!r} does not exist")
        return cls(path.read_text(encoding="utf-8"), str(path))

    @classmethod
    def default(cls) -> "ChatTemplate":
        """step35's own small template for tokenizers that ship none (headers `<|user|>`, `<|assistant|>` in
        plain text; each assistant turn ends with `eos_token`; marked with `{% generation %}`)."""
        return cls(DEFAULT_TEMPLATE, "default")

    def with_tokens(self, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None) -> "ChatTemplate":
        """A copy whose missing bos/eos tokens are filled from these (e.g. a tokenizer folder's)."""
        return ChatTemplate(
            self.source, self.origin, bos_token=self.bos_token or bos_token, eos_token=self.eos_token or eos_token
        )

    def save(self, folder: str | Path) -> Path:
        """Write the template as `folder/chat_template.jinja` (where transformers and `from_folder` look first)."""
        path = Path(folder) / TEMPLATE_FILE
        path.write_text(self.source, encoding="utf-8")
        return path

    # ---------------------------------------------------------------------------------- rendering

    def _template(self, where: str = ""):
        if self._compiled is None:
            import jinja2

            try:
                env = _environment()
                tree = _bounded_tree(env.parse(self.source))
                tree.set_environment(env)
                self._compiled = env.from_string(tree)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(
                    f"{_at(where)}chat template from {self.origin} does not parse (line {e.lineno}): {e.message}"
                ) from None
        return self._compiled

    def _render(self, messages: list, *, where: str, add_generation_prompt: bool, tools, extra: dict) -> str:
        # A special token the tokenizer lacks stays undefined, as transformers leaves it out of its arguments.
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        kwargs = {**{key: value for key, value in tokens.items() if value is not None}, **extra}
        try:
            compiled, prepared = self._template(where), _prepare(messages)
            # The limits of this rendering scale with its input (RENDER_TEXT_PER_INPUT).
            token = _BUDGET.set(_Budget(len(self.source) + _input_size([prepared, tools, kwargs])))
            try:
                return compiled.render(
                    messages=prepared,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
            finally:
                _BUDGET.reset(token)
        except _LimitHit as e:
            raise ChatTemplateError(f"{_at(where)}chat template from {self.origin} refused: {e}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # a Jinja TemplateError, or a Python error a template expression raised
            raise ChatTemplateError(
                f"{_at(where)}chat template from {self.origin} failed to render: {type(e).__name__}: {e}"
            ) from None

    def render(self, messages: list, *, add_generation_prompt: bool = False, tools: Optional[list] = None,
               where: str = "", **extra) -> str:
        """The conversation as text, as transformers' apply_chat_template(tokenize=False) renders it.
        `extra` reaches the template as variables (e.g. enable_thinking, bos_token, eos_token)."""
        return self._render(
            messages, where=where, add_generation_prompt=add_generation_prompt, tools=tools, extra=extra
        )

    def prompt_ids(self, tokenizer, messages: list, *, tools: Optional[list] = None, where: str = "",
                   **extra) -> list[int]:
        """The token ids inference starts from: the conversation so far plus the generation prompt."""
        check_messages(messages, where, require_assistant=False)
        extra = self._tokens(tokenizer, extra)
        text = self.render(messages, add_generation_prompt=True, tools=tools, where=where, **extra)
        return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

    def _tokens(self, tokenizer, extra: dict) -> dict:
        """`extra`, with eos_token filled from the tokenizer's EOS id when neither the template nor the caller
        gave one."""
        if self.eos_token is None and "eos_token" not in extra and getattr(tokenizer, "eos_token_id", None) is not None:
            return {**extra, "eos_token": tokenizer.tokenizer.id_to_token(tokenizer.eos_token_id)}
        return extra

    # ------------------------------------------------------------------------------------ masking

    def encode(self, tokenizer, messages: list, *, train_on: str = "assistant", train_reasoning: bool = True,
               tools: Optional[list] = None, where: str = "", **extra) -> tuple[list[int], list[bool]]:
        """(token ids of the whole rendered conversation, per token whether its loss is trained).

        `train_on`: "assistant" every assistant turn, "last_assistant" the final one, "all" every token. A
        trained turn covers what the model emits after the generation prompt: the reasoning as the template
        renders it, the content, tool calls and the end-of-turn token. With `train_reasoning` false, the
        reasoning text of the trained assistant turns (of every assistant turn for "all") is left out, as the
        template renders it (a field or a `<think>` block inline in the content); the `<think>`/`</think>`
        wrappers around it stay trained, so the model still learns to open and close the block. A token holding
        both reasoning and other trained text stays trained. The caller shifts the mask to labels.
        """
        ids, mask, _ = self.encode_prefix(
            tokenizer, messages, None, train_on=train_on, train_reasoning=train_reasoning, tools=tools, where=where,
            **extra,
        )  # fmt: skip
        return ids, mask

    def encode_prefix(self, tokenizer, messages: list, max_tokens: Optional[int], *, train_on: str = "assistant",
                      train_reasoning: bool = True, tools: Optional[list] = None, where: str = "",
                      **extra) -> tuple[list[int], list[bool], Optional[int]]:
        """As `encode`, for the first `max_tokens` tokens only (all when None): (their ids, their mask, how many
        tokens the whole conversation has, or None when it has more than `max_tokens` and was not tokenized
        whole to count them). A packer that keeps a window of a longer conversation needs no more,
        and this keeps a conversation's cost bounded by the window, not by its length:

        - Tokens: a rendering over `2 * PIECE_CHARS` characters is tokenized in pieces cut as the text stream
          cuts documents (tokenizer.py, with the same caveats on where piece tokens can differ), only until
          `max_tokens` tokens are there. (A 20 MB assistant message took 5.1 GB and 31 s tokenized whole.)
        - Spans: only the turns that can reach the kept tokens are located, on the shortest cut of the
          conversation (its first messages) whose rendering equals the whole rendering over the kept tokens'
          characters (`_Conversation.cuts`), so locating costs renderings of the cut, not of the whole (which made
          masking quadratic in turns without `{% generation %}` marks). Turns are located in order and each
          span starts past the end of the one before, so once a turn is known to start past the kept characters
          every later one does too: the mask of the kept tokens is the one the whole conversation gives. A turn
          past the kept tokens is not located, so a fault in it (one that would make `encode` raise) is not seen.
        """
        check_train_choice(train_on, train_reasoning, where)
        check_messages(messages, where)
        conversation = _Conversation(self, messages, tools, where, self._tokens(tokenizer, extra))
        ids, offsets, total = _tokenize_prefix(tokenizer, conversation.text, max_tokens)
        limit = None if total == len(ids) else (offsets[-1][1] if offsets else 0)  # the characters of the kept tokens
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "all":
            if train_reasoning:
                return ids, [True] * len(ids), total
            spans = [(0, len(conversation.text))]
        else:
            if train_on == "last_assistant":
                turns = turns[-1:]
            if self.has_generation_marks:
                spans = conversation.marked_spans(turns)
            else:
                end_of_turn = functools.partial(self.end_of_turn_id, tokenizer, tools=tools, where=where, **extra)
                spans = conversation.in_window(
                    limit, lambda part: part.located_spans(turns, ids, offsets, end_of_turn, limit)
                )  # fmt: skip
        if not train_reasoning:
            spans = _subtract(spans, conversation.in_window(limit, lambda part: part.reasoning_spans(turns, limit)))
        return ids, token_mask(offsets, spans), total

    def end_of_turn_id(self, tokenizer, *, tools: Optional[list] = None, where: str = "", **extra) -> int:
        """The token the template ends an assistant reply with (where `generate --chat` stops): the first special
        token (added as special, or the tokenizer's EOS) after the reply in a probe conversation of one user
        and one assistant message. Cached per tokenizer; a ChatTemplateError when no special token follows."""
        if tokenizer not in self._end_of_turn:
            sentinel = "step35probe" + uuid.uuid4().hex
            probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": sentinel}]
            text = self._render(
                probe, where=f"{_at(where)}probe conversation", add_generation_prompt=False, tools=tools,
                extra=self._tokens(tokenizer, extra),
            )  # fmt: skip
            encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
            special = _special_ids(tokenizer)
            after = text.find(sentinel) + len(sentinel) if sentinel in text else None
            found = None if after is None else next(
                (t for (s, _), t in zip(encoding.offsets, encoding.ids) if s >= after and t in special), None
            )
            if found is None:
                raise ChatTemplateError(
                    f"{_at(where)}chat template from {self.origin}: no special token follows an assistant reply, so"
                    " the end of a turn cannot be told; add {% generation %} marks to the template"
                )
            self._end_of_turn[tokenizer] = found
        return self._end_of_turn[tokenizer]


class _Conversation:
    """One conversation being masked: its full rendering and, cached, where each message lies in it."""

    def __init__(self, template: ChatTemplate, messages: list, tools, where: str, extra: dict):
        self.template, self.messages, self.tools, self.where, self.extra = template, messages, tools, where, extra
        self.text = self.render(messages, False)
        self._regions: dict[int, tuple[Optional[int], Optional[int]]] = {}
        self._points: dict[int, Optional[int]] = {}

    def render(self, messages: list, add_generation_prompt: bool, where: Optional[str] = None) -> str:
        return self.template._render(
            messages, where=self.where if where is None else where, add_generation_prompt=add_generation_prompt,
            tools=self.tools, extra=self.extra,
        )

    def marked_spans(self, turns: list[int]) -> list[tuple[int, int]]:
        """The spans of the template's `{% generation %}` blocks (outermost ones) that belong to `turns`."""
        tag = uuid.uuid4().hex
        marks = (f"\ue000open-{tag}\ue001", f"\ue000close-{tag}\ue001")
        token = _MARKS.set(marks)
        try:
            marked = self.render(self.messages, False)
        finally:
            _MARKS.reset(token)
        plain, spans = _strip_marks(marked, marks)
        if plain != self.text:
            raise ChatTemplateError(
                f"{_at(self.where)}chat template from {self.template.origin}: a {{% generation %}} block's output is"
                " changed after the block (e.g. captured by {% set %} and filtered), so its spans cannot be located"
            )
        if turns[0] != min(i for i, m in enumerate(self.messages) if m["role"] == "assistant"):
            # Only the last turn is trained: its blocks are those after the end of the message before it (its
            # whole text: an assistant message before it may have several blocks, e.g. content and tool calls).
            after = next((end for j in range(turns[0] - 1, -1, -1) if (end := self.region(j)[1]) is not None), 0)
            spans = [span for span in spans if span[0] >= after]
        if not spans:
            raise ChatTemplateError(
                f"{_at(self.where)}chat template from {self.template.origin} renders no {{% generation %}} block for"
                f" the trained assistant turns (messages {', '.join(map(str, turns))})"
            )
        return spans

    def in_window(self, limit: Optional[int], spans_of: Callable[["_Conversation"], tuple[list, bool]]) -> list:
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
                part = _Conversation(self.template, self.messages[:count], self.tools, self.where, self.extra)
            except ChatTemplateError:
                part = None
            if part is not None and len(part.text) >= limit and self.text.startswith(part.text[:limit]):
                yield part
            count *= 2
        yield self

    def located_spans(self, turns: list[int], ids: list[int], offsets: list[tuple[int, int]],
                      end_of_turn: Callable[[], int], limit: Optional[int] = None) -> tuple[list[tuple[int, int]], bool]:
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
            at = f"{_at(self.where)}assistant message {i}"
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

    def reasoning_spans(self, turns: list[int], limit: Optional[int] = None) -> tuple[list[tuple[int, int]], bool]:
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
                spans += self._rendered_as(replaced, sentinel, f"{_at(self.where)}assistant message {i}")
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

    def region(self, index: int) -> tuple[Optional[int], Optional[int]]:
        """Where message `index`'s own text lies in the full rendering: (start, end) of the part that changes
        when its content, reasoning and tool-call names are replaced by sentinels; (None, None) when the
        template renders none of them."""
        if index not in self._regions:
            self._regions[index] = self._find_region(index)
        return self._regions[index]

    def _find_region(self, index: int) -> tuple[Optional[int], Optional[int]]:
        replaced, sentinels = _with_sentinels(self.messages, index)
        if not sentinels:
            return None, None
        other = self.render(replaced, False)
        found = [(other.find(s), other.find(s) + len(s)) for s in sentinels if s in other]
        if not found:
            return None, None
        text = self.text
        prefix = _common_prefix(text, other)
        suffix = _common_suffix(text, other, min(len(text), len(other)) - prefix)
        # The differing part of `other` must hold every rendered sentinel, else the diff is not this message.
        if min(s for s, _ in found) < prefix or max(e for _, e in found) > len(other) - suffix:
            raise ChatTemplateError(f"{_at(self.where)}message {index}: its text cannot be located in the rendering")
        return prefix, len(text) - suffix

    def end_before(self, index: int) -> int:
        """A position inside the nearest earlier message's text that renders any (`point`), else 0."""
        for j in range(index - 1, -1, -1):
            at = self.point(j, end=True)
            if at is not None:
                return at
        return 0

    def start_after(self, index: int) -> Optional[int]:
        """A position inside the next message's text that renders any (`point`), else None."""
        for j in range(index + 1, len(self.messages)):
            at = self.point(j, end=False)
            if at is not None:
                return at
        return None

    def point(self, index: int, end: bool) -> Optional[int]:
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

    def _find_point(self, index: int) -> Optional[int]:
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

    def reply_start(self, index: int, low: int, first: int, last: int) -> Optional[int]:
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
        prompt = with_prompt[_common_prefix(with_prompt, without):]
        if not prompt:
            return None
        cuts = [len(prompt)] + [k + 1 for k in range(len(prompt) - 2, -1, -1) if prompt[k] == "\n"]
        for k in cuts:
            found = self.text.rfind(prompt[:k], low, min(first - 1 + k, last))
            if found >= 0:
                return found + k
        return None


def _is_generation(node) -> bool:
    call = getattr(node.call, "node", None)
    return type(call).__name__ == "ExtensionAttribute" and call.name == "_output"


def _tokenize_prefix(tokenizer, text: str, max_tokens: Optional[int]) -> tuple[list[int], list[tuple[int, int]],
                                                                              Optional[int]]:
    """(ids, character offsets, how many tokens `text` has: None when not all were tokenized) of the first
    `max_tokens` tokens of `text` (all when None). A text over `2 * PIECE_CHARS` characters is tokenized in pieces (`cut_after`), only
    as far as needed, so the tokenizer's memory is a piece's (tokenizer.py), however long the text; a few tokens
    past `max_tokens` are tokenized too, so that a hard cut's tokens are never kept."""
    from step35.data.tokenizer import PIECE_CHARS, cut_after

    if max_tokens is None or len(text) <= 2 * PIECE_CHARS:
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets  # each read of these builds a fresh Python list
        start = len(text)
    else:
        ids, offsets, start = [], [], 0
        tokenizer._check_piecewise_exact()  # warns once if this tokenizer gives other tokens in pieces
        while start < len(text) and len(ids) <= max_tokens + _PIECE_MARGIN:
            end = cut_after(text, start, PIECE_CHARS)
            encoding = tokenizer.tokenizer.encode(text[start:end], add_special_tokens=False)
            ids += encoding.ids
            offsets += [(a + start, b + start) for a, b in encoding.offsets]
            start = end
    total = len(ids) if start >= len(text) else None
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, offsets, total
    return ids[:max_tokens], offsets[:max_tokens], total


_PIECE_MARGIN = 64  # tokens tokenized past the ones kept, so that a piece's last (maybe cut) tokens are not kept


def _special_ids(tokenizer) -> set[int]:
    ids = {i for i, added in tokenizer.tokenizer.get_added_tokens_decoder().items() if added.special}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _common_prefix(a: str, b: str) -> int:
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


def _common_suffix(a: str, b: str, limit: int) -> int:
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
    return [*messages[:index], message, *messages[index + 1:]], sentinels


def _inline_reasoning(text: str) -> Optional[tuple[int, int]]:
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


def _subtract(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
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


def _with_inserted(messages: list, index: int, sentinel: str) -> Optional[list]:
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
