"""Reward functions for online RL (`model.objective: grpo`): loading them by name, calling them on a group of
completions, checking what they return, and combining them into one reward per completion. Pure Python (torch
only for the result tensors): nothing here knows the model, the tokenizer or Lightning.

The calling convention is TRL's, so that functions written for TRL work unchanged:
`f(prompts=..., completions=..., **fields) -> list[float | None]`, all by keyword (TRL's functions are often
`def f(completions, **kwargs)`: a positional call would hand them the prompts).
- prompts: the N prompts as the records give them: a str, or a list of chat messages.
- completions: the N completions: a str for a str prompt; for a chat prompt a list with one assistant message,
  `[{"role": "assistant", "content": text}]` (TRL's conversational form).
- fields: every other column of the records, each a list of N values (`answer`, `tools`, ...), and
  `completion_ids` (a list of lists of ints) and `truncated` (bools: the completion reached max_new_tokens).
A value is a float, or None for "not applicable" (a math reward on a coding record): None adds 0 to the total
and is kept apart in `RewardScores.applicable`, so that logging can average over the records it applies to.
NaN, infinities, bools and non-numbers are errors, as are results of another length: one line naming the
function (RewardError: said in one line by the CLI when it stops a run before its first step; during training
the run's failure report shows it with the traceback of the function's own frames).

`model.rl.reward_funcs` names each function: a built-in of BUILTIN_REWARDS, or an import path
`package.module:function` (or `package.module.function`); `model.rl.reward_weights` weighs them (default 1.0
each). Everything a name can get wrong (unknown, not importable, not callable, a missing optional package, bad
weights) is refused by `load_reward_functions` at start, before any rollout.

The built-ins score the answer text (`answer_text`: the completion without its thinking) against the record's
fields. A column the whole batch lacks (`answer`, `answer_regex`, `tools`) is an error; a record whose value is
None gets None, not applicable (HF datasets fill a key some records lack with None, and mixed-task data sets
are what None is for). Tool calls are read in the Step-3.5 syntax
`<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>` and, for chat
completions, from a message's `tool_calls` too.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The Step-3.5 tool-call parser is the data side's (it checks rendered agent turns with it); re-exported here.
from step35.data.tool_calls import ToolCallSyntaxError as ToolCallSyntaxError
from step35.data.tool_calls import parse_tool_calls as parse_tool_calls
from step35.data.tool_calls import parse_tool_calls_with_text


class RewardError(ValueError):
    """A reward function that cannot be loaded, or returned what cannot be a reward; the message names it."""

    step35_refusal = True  # said in one line, without a traceback (step35.faults)


@dataclass
class RewardFunction:
    """One reward function: `name` as `model.rl.reward_funcs` gives it, the callable, its weight in the total."""

    name: str
    fn: Callable[..., Sequence[float | None]]
    weight: float


@dataclass
class RewardScores:
    """The rewards of N completions under F functions: `per_function` [F, N] float64 (0 where not applicable),
    `applicable` [F, N] bool (False where a function returned None), `total` [N] float64 (sum of weight x value)."""

    per_function: torch.Tensor
    applicable: torch.Tensor
    total: torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Completion text


def _message_text(message: dict) -> str:
    """A chat message's `content`: a str, or the text of its text parts; its `reasoning_content` is not read."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if isinstance(part, dict) and part.get("type") == "text")


def _assistant_message(completion: Any) -> dict | None:
    """The (last) assistant message of a conversational completion; None for a str completion or none there."""
    if isinstance(completion, dict):
        return completion
    if isinstance(completion, (list, tuple)):
        assistants = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        return assistants[-1] if assistants else None
    return None


def completion_text(completion: Any) -> str:
    """The completion's text as generated: a str completion itself, else its assistant message's content."""
    if isinstance(completion, str):
        return completion
    message = _assistant_message(completion)
    return "" if message is None else _message_text(message)


def answer_text(completion: Any) -> str:
    """The completion's answer: its text without thinking, stripped. Everything up to the last `</think>` goes
    (a generation prompt that opens `<think>` itself leaves only the closing tag in the completion); a leading
    `<think>` that is never closed means the model never answered: ""."""
    text = completion_text(completion)
    end = text.rfind("</think>")
    if end >= 0:
        return text[end + len("</think>") :].strip()
    if text.lstrip().startswith("<think>"):
        return ""
    return text.strip()


# ---------------------------------------------------------------------------------------------------------
# Built-ins


def _column(fields: dict, name: str, function: str) -> list:
    """The records' `name` column; a batch without it is an error naming the reward function."""
    if name not in fields:
        raise RewardError(f"reward function {function}: the records have no `{name}` field, which it needs")
    return fields[name]


def _accepted(answer: Any) -> list[str]:
    """The accepted answers of a record's `answer` field (a str, a number or a list of them), stripped."""
    answers = answer if isinstance(answer, (list, tuple)) else [answer]
    return [str(a).strip() for a in answers]


def exact_match(prompts, completions, **fields) -> list[float | None]:
    """1.0 when the answer text equals the record's `answer` (or one of a list of them), else 0.0."""
    answers = _column(fields, "answer", "exact_match")
    return [
        None if answer is None else float(answer_text(c) in _accepted(answer))
        for c, answer in zip(completions, answers)
    ]


def regex_match(prompts, completions, **fields) -> list[float | None]:
    """1.0 when the record's `answer_regex` fullmatches the answer text, else 0.0."""
    patterns = _column(fields, "answer_regex", "regex_match")
    scores: list[float | None] = []
    for i, (completion, pattern) in enumerate(zip(completions, patterns)):
        if pattern is None:
            scores.append(None)
            continue
        try:
            compiled = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise RewardError(f"reward function regex_match: record {i}'s answer_regex {pattern!r}: {e}") from e
        scores.append(float(compiled.fullmatch(answer_text(completion)) is not None))
    return scores


def _parse_gold(answer: str) -> list:
    """math-verify's reading of a gold answer; a bare expression (`x^2+1`) is read as LaTeX math when it
    does not parse as it stands."""
    from math_verify import parse

    gold = parse(answer)
    return gold if gold else parse(f"${answer}$")


def math_match(prompts, completions, **fields) -> list[float | None]:
    """1.0 when math-verify finds the answer text equal to the record's `answer` (or one of them), else 0.0;
    None when no accepted answer parses (the record's answer is not math)."""
    from math_verify import parse, verify

    answers = _column(fields, "answer", "math_match")
    scores: list[float | None] = []
    for completion, answer in zip(completions, answers):
        golds = [] if answer is None else [g for g in map(_parse_gold, _accepted(answer)) if g]
        if not golds:
            scores.append(None)
            continue
        text = answer_text(completion)
        predicted = parse(text) if text else []
        scores.append(float(bool(predicted) and any(verify(gold, predicted) for gold in golds)))
    return scores


def think_format(prompts, completions, **fields) -> list[float]:
    """1.0 when the completion is one non-empty `<think>...</think>` block at its start (after optional
    whitespace) followed by a non-empty answer, else 0.0. A chat message's `reasoning_content` counts as
    that block (a parser split it off the content)."""
    return [float(_is_think_then_answer(_thinking_and_content(c))) for c in completions]


def complete(prompts, completions, **fields) -> list[float]:
    """1.0 when the completion ended by itself (a stop id before `max_new_tokens`: step35's rollouts pass the
    `truncated` column) with a non-empty answer, else 0.0: the check a quality gate makes for a missing EOS."""
    truncated = _column(fields, "truncated", "complete")
    return [float(not cut and bool(answer_text(c))) for c, cut in zip(completions, truncated)]


def _thinking_and_content(completion: Any) -> str:
    """The completion's text with its thinking in `<think>` tags, wherever the thinking was."""
    message = _assistant_message(completion)
    reasoning = message.get("reasoning_content") if message is not None else None
    text = completion_text(completion)
    return f"<think>{reasoning}</think>{text}" if reasoning else text


def _is_think_then_answer(text: str) -> bool:
    text = text.lstrip()
    if not text.startswith("<think>") or text.count("<think>") != 1 or text.count("</think>") != 1:
        return False
    thinking, answer = text[len("<think>") :].split("</think>")
    return bool(thinking.strip()) and bool(answer.strip())


# Tool calls ----------------------------------------------------------------------------------------------


def _structured_calls(completion: Any) -> list[tuple[str, dict[str, tuple[Any, str | None]]]]:
    """The `tool_calls` of a chat completion's message (OpenAI form; arguments a dict or a JSON string)."""
    message = _assistant_message(completion)
    calls = []
    for call in (message or {}).get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise ToolCallSyntaxError("tool_calls arguments that are not JSON") from e
        if not isinstance(arguments, dict):
            raise ToolCallSyntaxError("tool_calls arguments that are not an object")
        calls.append((function.get("name"), {k: (v, None) for k, v in arguments.items()}))
    return calls


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _has_type(value: Any, raw: str | None, schema: Any, where: str) -> bool:
    """Whether an argument fits its property's JSON `type` (a name or a list of names; none: anything). A
    string property takes a parameter's raw text as it stands (`<parameter=zip>02134</parameter>`)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    if types is None:
        return True
    for type_name in [types] if isinstance(types, str) else types:
        if type_name not in _JSON_TYPES:
            raise RewardError(
                f"reward function tool_call_valid: {where} has JSON type {type_name!r}, not one of {sorted(_JSON_TYPES)}"
            )
        if _JSON_TYPES[type_name](value) or (type_name == "string" and raw is not None):
            return True
    return False


def _tool_schemas(tools: Any, record: int) -> dict[str, dict]:
    """{name: parameters schema} of a record's `tools` (a list of OpenAI function schemas, or its JSON)."""
    if isinstance(tools, str):
        tools = json.loads(tools)
    schemas = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RewardError(
                f"reward function tool_call_valid: record {record}'s tools hold {tool!r}, not a function schema"
            )
        schemas[function["name"]] = function.get("parameters") or {}
    return schemas


def _call_is_valid(name: str, arguments: dict[str, tuple[Any, str | None]], schemas: dict[str, dict]) -> bool:
    """A known tool, every required argument, no unknown ones (unless the schema allows them), right types."""
    if name not in schemas:
        return False
    parameters = schemas[name]
    if any(required not in arguments for required in parameters.get("required") or []):
        return False
    properties = parameters.get("properties")
    if properties is None:
        return True
    extra_allowed = parameters.get("additionalProperties") not in (None, False)
    for argument, (value, raw) in arguments.items():
        if argument not in properties:
            if not extra_allowed:
                return False
        elif not _has_type(value, raw, properties[argument], f"tool {name}'s parameter {argument}"):
            return False
    return True


def tool_call_valid(prompts, completions, **fields) -> list[float | None]:
    """1.0 when the answer holds at least one tool call and every call fits the record's `tools`, else 0.0."""
    all_tools = _column(fields, "tools", "tool_call_valid")
    scores: list[float | None] = []
    for i, (completion, tools) in enumerate(zip(completions, all_tools)):
        if tools is None:
            scores.append(None)
            continue
        schemas = _tool_schemas(tools, i)
        try:
            calls = parse_tool_calls_with_text(answer_text(completion)) + _structured_calls(completion)
        except ToolCallSyntaxError:
            scores.append(0.0)
            continue
        scores.append(float(bool(calls) and all(_call_is_valid(n, a, schemas) for n, a in calls)))
    return scores


BUILTIN_REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "exact_match": exact_match,
    "regex_match": regex_match,
    "math_match": math_match,
    "tool_call_valid": tool_call_valid,
    "think_format": think_format,
    "complete": complete,
}

# Built-ins that need an optional package: {name: (module, distribution, how to install)}.
_BUILTIN_PACKAGES = {"math_match": ("math_verify", "math-verify", "pip install 'step35[math]'")}


# ---------------------------------------------------------------------------------------------------------
# Loading


def _import_function(path: str) -> Any:
    """The object at an import path `package.module:function` (or `package.module.function`, split at the
    last dot); ImportError when the module does not import, AttributeError when it has no such name."""
    module_name, separator, attribute = path.partition(":")
    if not separator:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ImportError(f"{path!r} is not an import path `package.module:function`")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise AttributeError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def _check_builtin_package(name: str, where: str) -> None:
    """Refuse a built-in whose optional package is not installed, saying how to install it."""
    if name not in _BUILTIN_PACKAGES:
        return
    module, distribution, install = _BUILTIN_PACKAGES[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise RewardError(f"{where}: {name} needs the package {distribution} ({e}): {install}") from None


def _load_one(name: Any, where: str) -> Callable:
    """The callable `name` stands for (a built-in or an import path); one line naming `where` otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise RewardError(f"{where}: {name!r} is not a reward function name (a built-in or `package.module:function`)")
    if name in BUILTIN_REWARDS:
        _check_builtin_package(name, where)
        return BUILTIN_REWARDS[name]
    if "." not in name and ":" not in name:
        raise RewardError(
            f"{where}: {name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an import path"
            " `package.module:function`"
        )
    try:
        fn = _import_function(name)
    except Exception as e:  # a user's module may fail to import in any way: its error is the message
        raise RewardError(f"{where}: cannot import {name!r}: {type(e).__name__}: {_one_line(e)}") from None
    if not callable(fn):
        raise RewardError(f"{where}: {name!r} is a {type(fn).__name__}, not a callable")
    return fn


def _check_weights(weights: Any, count: int, field: str) -> list[float]:
    """The weights as floats (all 1.0 when None); one line naming `field.reward_weights` otherwise."""
    if weights is None:
        return [1.0] * count
    where = f"{field}.reward_weights"
    if not isinstance(weights, (list, tuple)):
        raise RewardError(f"{where}: a list of {count} numbers, one per reward function, got {weights!r}")
    if len(weights) != count:
        raise RewardError(f"{where}: {len(weights)} weights for {count} reward functions ({field}.reward_funcs)")
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise RewardError(f"{where}[{i}]: {weight!r} is not a finite number")
    return [float(w) for w in weights]


def load_reward_functions(
    names: list[str], weights: list[float] | None, field: str = "model.rl"
) -> list[RewardFunction]:
    """The reward functions `field.reward_funcs` names, with `field.reward_weights` (None: 1.0 each). Refuses,
    in one line naming the entry, what could only fail later: no functions, a name neither built-in nor
    importable, an object that is not callable, a missing optional package, weights that do not fit."""
    if not isinstance(names, (list, tuple)) or not names:
        raise RewardError(
            f"{field}.reward_funcs: {names!r}: online RL needs at least one reward function, a list of built-in"
            f" names ({', '.join(BUILTIN_REWARDS)}) or import paths `package.module:function`"
        )
    functions = [_load_one(name, f"{field}.reward_funcs[{i}]") for i, name in enumerate(names)]
    checked = _check_weights(weights, len(names), field)
    return [RewardFunction(name, fn, weight) for name, fn, weight in zip(names, functions, checked)]


def reward_names(functions: Sequence[RewardFunction]) -> list[str]:
    """Short names for logging: a built-in's name, else the function's `__name__`; repeats get `_2`, `_3`."""
    names: list[str] = []
    for function in functions:
        base = function.name if function.name in BUILTIN_REWARDS else _callable_name(function.fn)
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def _callable_name(fn: Callable) -> str:
    """A callable's `__name__`; for one without (a partial, an instance), its (wrapped) type's name."""
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", None) or type(inner).__name__


# ---------------------------------------------------------------------------------------------------------
# Scoring


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or "(no message)"


def _call(function: RewardFunction, prompts: list, completions: list, fields: dict[str, list]) -> list[float | None]:
    """`function`'s rewards for the N completions, checked: a list of N finite numbers or None."""
    who = f"reward function {function.name}"
    try:  # fresh lists: a function that edits its arguments does not change what the next one sees
        values = function.fn(
            prompts=list(prompts), completions=list(completions), **{k: list(v) for k, v in fields.items()}
        )
    except RewardError:  # the built-ins' own refusals name themselves (a missing field, a bad schema)
        raise
    except Exception as e:  # whatever a user's function raises is said in one line, chained for the debugger
        raise RewardError(f"{who} raised {type(e).__name__}: {_one_line(e)}") from e
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{who} returned a {type(values).__name__}, not a list of rewards")
    if len(values) != len(completions):
        raise RewardError(f"{who} returned the wrong number of rewards: expected {len(completions)} got {len(values)}")
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"{who} returned {value!r} ({type(value).__name__}) at index {i}, not a number or None")
        if not math.isfinite(value):
            raise RewardError(f"{who} returned {value} at index {i}: rewards must be finite (None: not applicable)")
    return list(values)


def _check_batch(prompts: Sequence, completions: Sequence, fields: dict[str, Sequence]) -> None:
    """The caller's side of the contract: N prompts, N completions, N values per field, no clashing names."""
    if len(prompts) != len(completions):
        raise ValueError(f"score_completions: {len(prompts)} prompts for {len(completions)} completions")
    for key, values in fields.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"score_completions: a field named {key!r} would hide the reward functions' argument")
        if len(values) != len(completions):
            raise ValueError(
                f"score_completions: field {key!r} has {len(values)} values for {len(completions)} completions"
            )


def score_completions(
    functions: Sequence[RewardFunction], prompts: Sequence, completions: Sequence, fields: dict[str, Sequence]
) -> RewardScores:
    """Every function's rewards for the N completions and their weighted total (None counts 0 in the total and
    False in `applicable`). `fields`: the records' other columns and `completion_ids`, each N values. Raises
    RewardError, naming the function, when one raises or returns what is not N finite numbers or None."""
    if not functions:
        raise ValueError("score_completions: no reward functions")
    _check_batch(prompts, completions, fields)
    results = [_call(function, prompts, completions, fields) for function in functions]
    applicable = torch.tensor([[v is not None for v in values] for values in results], dtype=torch.bool)
    per_function = torch.tensor(
        [[0.0 if v is None else float(v) for v in values] for values in results], dtype=torch.float64
    ).reshape(len(functions), len(completions))
    weights = torch.tensor([f.weight for f in functions], dtype=torch.float64)
    total = (weights[:, None] * per_function).sum(dim=0)
    return RewardScores(per_function, applicable.reshape(len(functions), len(completions)), total)
