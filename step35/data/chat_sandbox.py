"""The Jinja environment chat templates render in: configured as transformers 5.x configures its own, and
bounded against resources, since templates come with downloaded tokenizers.

As transformers' `apply_chat_template`: an `ImmutableSandboxedEnvironment` with trim_blocks, lstrip_blocks, the
`loopcontrols` extension and a `{% generation %}` tag, the globals `raise_exception` and `strftime_now`, and a
`tojson` filter that keeps non-ASCII text. Unlike transformers', a rendering inside `render_limits` is bounded in
time, text size and integer size (RENDER_SECONDS and below): operators, calls, filters, outputs and loops are
checked before they make a value over a limit, and a template over one raises RenderLimitHit. The
`{% generation %}` tag outputs its body unchanged, wrapped in markers inside `generation_marks`.
"""

from __future__ import annotations

import json
import re
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

# While `generation_marks` is in force, the `generation` tag wraps its output in this pair of strings.
_MARKS: ContextVar[tuple[str, str] | None] = ContextVar("step35_generation_marks", default=None)


# Resource limits of one rendering. Templates come with downloaded tokenizers, so a template must not be able
# to hang a run or fill its memory (`lipsum(10**7)`, `'x' * 10**10`, `indent(10**10)`, ...). Text, lists and
# the total output are bounded by RENDER_TEXT_FLOOR + RENDER_TEXT_PER_INPUT x the size of the input (the
# messages, tools and variables, as text: not the template's source, whose size chat_template.py caps, so that
# a huge comment buys no budget); integers by RENDER_INT_BITS bits; a rendering by RENDER_SECONDS of
# wall-clock time. A template over a limit raises RenderLimitHit.
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


class RenderLimitHit(Exception):
    """A rendering went over one of its limits; `ChatTemplate` turns it into a ChatTemplateError naming the
    template."""


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
            raise RenderLimitHit(f"it ran over the {RENDER_SECONDS:g} s time limit of one rendering")

    def over(self, what: str, size: int, unit: str = "characters") -> RenderLimitHit:
        return RenderLimitHit(
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
                raise RenderLimitHit(
                    f"{what} is an integer of {value.bit_length()} bits, over the limit of {RENDER_INT_BITS} bits"
                )
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


def _namespace_attrs(value: Any) -> dict | None:
    """The attributes of a Jinja `namespace()` (whose text shows them), else None."""
    attrs = getattr(type(value), "__name__", "") == "Namespace" and getattr(value, "_Namespace__attrs", None)
    return attrs if isinstance(attrs, dict) else None


_SIZED = frozenset((str, bytes, list, tuple, dict, set))
_BUDGET: ContextVar[_Budget | None] = ContextVar("step35_render_budget", default=None)


def input_size(values: Any) -> int:
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
                raise RenderLimitHit(
                    f"{left} ** {right} is an integer of about {bits} bits, over the limit of {RENDER_INT_BITS} bits"
                )
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
    """A `{{ ... }}` output (routed here by `bounded_tree`, also inside macros and blocks, so that no buffer grows
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


def bounded_tree(tree):
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


def _generation_extension():
    """The `{% generation %}...{% endgeneration %}` tag: its body output unchanged, wrapped in markers while
    `generation_marks` is in force."""
    from jinja2 import nodes
    from jinja2.ext import Extension

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

    return Generation


def _sandbox_class():
    """transformers' ImmutableSandboxedEnvironment, with every arithmetic operator and call checked against the
    rendering's limits."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    return Sandbox


# The globals and filter a chat template finds, as transformers gives them; named as templates call them (a
# limit hit in one names it).
def raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML, which a chat template must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def lipsum(n=5, html=True, min=20, max=100):
    from jinja2.utils import generate_lorem_ipsum

    budget = _BUDGET.get()
    if budget is not None and isinstance(n, int) and isinstance(max, int):
        budget.check_size(abs(n) * abs(max) * 12, f"lipsum({n})")  # at most `max` words of about 12 characters
    return generate_lorem_ipsum(n, html, min, max)


def jinja_environment():
    """A Jinja environment configured as transformers configures its own for chat templates, with the rendering
    limits (RENDER_SECONDS, ...) enforced in its operators, calls, filters, outputs and loops, and no constant
    folding at compile time (which would compute `9 ** (9 ** 9)` while compiling, before any limit applies)."""
    from jinja2 import pass_context
    from jinja2.ext import loopcontrols

    Sandbox = _sandbox_class()
    env = Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols], optimized=False
    )
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, function) for name, function in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["lipsum"] = lipsum
    for name, function in (("step35_emit", _emit), ("step35_concat", _concat), ("step35_loop", _loop)):
        env.filters[name] = pass_context(function)
    return env


@contextmanager
def render_limits(size: int) -> Iterator[None]:
    """The limits of one rendering in force while the block runs, scaled by `size`, the size of its input as
    text (RENDER_TEXT_PER_INPUT; `input_size`). Outside such a block the environment renders unbounded."""
    token = _BUDGET.set(_Budget(size))
    try:
        yield
    finally:
        _BUDGET.reset(token)


@contextmanager
def generation_marks(marks: tuple[str, str]) -> Iterator[None]:
    """While the block runs, each `{% generation %}` block's output is wrapped in `marks` (open, close), which
    is how the trained spans of a marked template are found (chat_spans.py)."""
    token = _MARKS.set(marks)
    try:
        yield
    finally:
        _MARKS.reset(token)


def is_generation_block(node) -> bool:
    """Whether a parsed `CallBlock` node is a `{% generation %}` block (the call of the tag's `_output`)."""
    call = getattr(node.call, "node", None)
    return type(call).__name__ == "ExtensionAttribute" and call.name == "_output"
