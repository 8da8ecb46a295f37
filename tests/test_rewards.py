"""Reward functions for online RL (step35/training/rewards.py): each built-in on planted completions whose right
score is written by hand (right, wrong, thinking stripped, plain and conversational, parallel tool calls, nested
JSON arguments, wrong types, unknown tools, missing arguments); loading built-ins and users' functions by import
path; the weighted total against a sum written out; and every refusal, whose one line must name the function or
the config entry.
"""

from __future__ import annotations

import functools
import math
import sys
import textwrap

import pytest
import torch

from step35.faults import is_refusal
from step35.training.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    RewardFunction,
    answer_text,
    exact_match,
    load_reward_functions,
    parse_tool_calls,
    regex_match,
    reward_names,
    score_completions,
    think_format,
    tool_call_valid,
)


def chat(text: str, **extra) -> list[dict]:
    """A completion in TRL's conversational form."""
    return [{"role": "assistant", "content": text, **extra}]


# ---------------------------------------------------------------------------------------------------------
# Answer text


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("  42 \n", "42"),
        ("<think>maybe 41</think> 42", "42"),
        ("<think>a</think>x<think>b</think>\n42", "42"),  # up to the last </think>
        ("reasoning the prompt opened</think>42", "42"),  # a generation prompt that ends in <think>
        ("  <think>still thinking at the token limit", ""),
        (chat("<think>hmm</think>42"), "42"),
        (chat("42", reasoning_content="the thinking, which is not the answer"), "42"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]}], "42"),
        (chat(None), ""),
    ],
)
def test_answer_text(completion, expected):
    assert answer_text(completion) == expected


# ---------------------------------------------------------------------------------------------------------
# exact_match, regex_match, math_match


def test_exact_match():
    completions = ["42", "<think>it is 41</think> 42 ", "<think>42</think>41", chat("<think>x</think>Paris"), "b", "x"]
    answers = ["42", "42", "42", " Paris", ["a", "b"], None]
    assert exact_match([""] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 1.0, None]
    assert exact_match([""], ["7"], answer=[7]) == [1.0]  # a number column


def test_regex_match():
    completions = ["The answer is 42", "42", "<think>the answer is 42</think>answer: 42", chat("ABC"), "x"]
    patterns = [r"\d+", r"\d+", r"answer: \d+", r"[a-z]+", None]
    assert regex_match([""] * 5, completions, answer_regex=patterns) == [0.0, 1.0, 1.0, 0.0, None]


def test_regex_match_refuses_a_missing_field_and_a_bad_pattern():
    with pytest.raises(RewardError, match=r"regex_match.*`answer_regex`"):
        regex_match(["p"], ["42"], answer=["42"])
    with pytest.raises(RewardError, match=r"regex_match: record 1's answer_regex '\('"):
        regex_match(["p", "p"], ["1", "2"], answer_regex=[r"\d", "("])


def test_builtins_name_themselves_without_their_field():
    for name, field in [("exact_match", "answer"), ("tool_call_valid", "tools")]:
        with pytest.raises(RewardError, match=rf"{name}: .*`{field}`"):
            BUILTIN_REWARDS[name](["p"], ["x"], completion_ids=[[1]])


def test_math_match_refused_at_load_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    with pytest.raises(RewardError) as caught:
        load_reward_functions(["exact_match", "math_match"], None)
    message = str(caught.value)
    assert "model.rl.reward_funcs[1]" in message and "pip install 'step35[math]'" in message
    assert "\n" not in message


def test_math_match_scores():
    pytest.importorskip("math_verify", reason="math-verify not installed (pip install 'step35[math]')")
    [function] = load_reward_functions(["math_match"], None)
    completions = [
        r"So the result is $\boxed{0.5}$",
        r"<think>it is $\frac{1}{2}$</think>The answer is $3$",  # right in the thinking only
        chat(r"<think>...</think>$\frac{2}{4}$"),
        "The answer is 42",
        "no number here",
        "x",
    ]
    answers = [r"\frac{1}{2}", r"\frac{1}{2}", r"$\frac{1}{2}$", ["41", "42"], "7", None]
    assert function.fn([""] * 6, completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 0.0, None]


# ---------------------------------------------------------------------------------------------------------
# think_format


def test_think_format():
    completions = [
        "<think>a plan</think>42",
        "\n <think>a plan</think>\n42",  # whitespace before the block
        "42",  # no thinking
        "<think> </think>42",  # empty thinking
        "<think>a plan</think>  \n",  # no answer
        "<think>a</think>b<think>c</think>d",  # two blocks
        "<think>a<think>b</think>c",  # two openings
        "42<think>a plan</think>43",  # not at the start
        "<think>a plan",  # never closed
        chat("<think>a plan</think>42"),
        chat("42", reasoning_content="a plan"),  # thinking split off by a parser
    ]
    assert think_format([""] * 11, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------------------
# tool_call_valid

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "at": {"type": ["number", "null"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array"}},
                "required": ["query"],
                "additionalProperties": True,
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},  # no properties
]


def call(name: str, **arguments: str) -> str:
    """A tool call in the Step-3.5 syntax, laid out as the chat template writes it."""
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def test_parse_tool_calls_reads_json_values_and_text():
    text = "I will look.\n" + call("search", query="rain in Paris", filters='{"since": {"year": 2024}, "n": [1, 2]}')
    text += call("get_weather", city="Paris", days="3", at="null")
    assert parse_tool_calls(text) == [
        ("search", {"query": "rain in Paris", "filters": {"since": {"year": 2024}, "n": [1, 2]}}),
        ("get_weather", {"city": "Paris", "days": 3, "at": None}),
    ]
    assert parse_tool_calls("<tool_call><function=now></function></tool_call>") == [("now", {})]


TOOL_CASES = [
    (call("get_weather", city="Paris"), 1.0),
    (call("get_weather", city="Paris", days="3", metric="true", at="1.5") + call("now"), 1.0),  # parallel calls
    (call("search", query="x", filters='{"a": {"b": [1, {"c": null}]}}', tags='["x"]'), 1.0),  # nested JSON
    (call("search", query="x", page="2"), 1.0),  # additionalProperties: true
    (call("now", anything="1"), 1.0),  # a schema without properties takes any argument
    (call("get_weather", city="02134"), 1.0),  # text that is not JSON: a string
    (call("get_weather", city="12"), 1.0),  # JSON that is a number, for a string property: its text is a string
    (call("get_weather", city="Paris", days="3.0"), 1.0),  # an integral number is an integer (JSON Schema)
    ("<think>no tool needed</think>" + call("get_weather", city="Paris"), 1.0),
    (chat("<think>let me call</think>" + call("get_weather", city="Paris")), 1.0),
    (chat("", tool_calls=[{"type": "function", "function": {"name": "search", "arguments": '{"query": "a"}'}}]), 1.0),
    (call("get_weather", city="Paris", days="three"), 0.0),  # wrong type: integer
    (call("get_weather", city="Paris", days="2.5"), 0.0),  # wrong type: integer
    (call("get_weather", city="Paris", metric="1"), 0.0),  # wrong type: boolean
    (call("search", query="x", filters="[1]"), 0.0),  # wrong type: object
    (call("get_weather", city="Paris", at='"noon"'), 0.0),  # neither number nor null
    (call("get_weather", city="Paris") + call("book_flight", to="Paris"), 0.0),  # one unknown tool
    (call("get_weather", days="3"), 0.0),  # missing required
    (call("get_weather", city="Paris", country="FR"), 0.0),  # unknown parameter
    ("It is sunny in Paris.", 0.0),  # no call
    ("<think>" + call("get_weather", city="Paris") + "</think>It is sunny.", 0.0),  # a call in the thinking only
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", 0.0),  # unclosed
    (
        call("get_weather", city="Paris") + "<tool_call>\n<function=now>\n</function>",
        0.0,
    ),  # a good one, an unclosed one
    ("<tool_call><function=get_weather><parameter=city>Paris</parameter>oops</function></tool_call>", 0.0),
    ("<tool_call>get_weather(city='Paris')</tool_call>", 0.0),  # not the syntax
    (call("get_weather", city="Paris").replace("</parameter>", "</parameter><parameter=city>Rome</parameter>"), 0.0),
]


@pytest.mark.parametrize("completion, expected", TOOL_CASES)
def test_tool_call_valid(completion, expected):
    assert tool_call_valid(["p"], [completion], tools=[TOOLS]) == [expected]


def test_tool_call_valid_reads_tools_as_json_and_skips_records_without_tools():
    import json

    completions = [call("now"), call("now"), call("now")]
    assert tool_call_valid([""] * 3, completions, tools=[json.dumps(TOOLS), None, []]) == [1.0, None, 0.0]
    with pytest.raises(RewardError, match="tool_call_valid: tool get_weather's parameter city has JSON type 'text'"):
        bad = [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"properties": {"city": {"type": "text"}}}},
            }
        ]
        tool_call_valid([""], [call("get_weather", city="x")], tools=[bad])


# ---------------------------------------------------------------------------------------------------------
# Loading

USER_MODULE = """
def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

def only_completions(completions, **kwargs):  # TRL style: called by keyword
    return [float(len(ids)) for ids in kwargs["completion_ids"]]

class Holder:
    @staticmethod
    def half(prompts, completions, **kwargs):
        return [0.5] * len(completions)

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scores.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.scores"
    for name in ("my_rewards_pkg.scores", "my_rewards_pkg"):
        sys.modules.pop(name, None)


def test_load_by_builtin_name_and_import_path(user_module):
    names = [
        "exact_match",
        f"{user_module}:length_reward",
        f"{user_module}.only_completions",
        f"{user_module}:Holder.half",
    ]
    functions = load_reward_functions(names, [1.0, 0.5, -2, 3])
    assert [f.name for f in functions] == names
    assert [f.weight for f in functions] == [1.0, 0.5, -2.0, 3.0]
    assert functions[0].fn is exact_match
    assert functions[1].fn.__module__ == user_module and functions[1].fn.__name__ == "length_reward"
    assert reward_names(functions) == ["exact_match", "length_reward", "only_completions", "half"]
    scores = score_completions(
        functions, ["p", "q"], ["42", "abc"], {"answer": ["42", "x"], "completion_ids": [[1, 2], [3]]}
    )
    assert scores.per_function.tolist() == [[1.0, 0.0], [2.0, 3.0], [2.0, 1.0], [0.5, 0.5]]


def test_weights_default_to_one():
    assert [f.weight for f in load_reward_functions(["exact_match", "think_format"], None)] == [1.0, 1.0]


def test_reward_names_number_repeats():
    def f(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    functions = [
        RewardFunction("exact_match", exact_match, 1.0),
        RewardFunction("exact_match", exact_match, 1.0),
        RewardFunction("a.b:f", f, 1.0),
        RewardFunction("c.d:f", f, 1.0),
        RewardFunction("e:g", functools.partial(f), 1.0),
    ]
    assert reward_names(functions) == ["exact_match", "exact_match_2", "f", "f_2", "f_3"]


@pytest.mark.parametrize(
    "names, weights, message",
    [
        ([], None, r"model\.rl\.reward_funcs: \[\]: online RL needs at least one reward function"),
        (["exact_match", "exact_mach"], None, r"model\.rl\.reward_funcs\[1\]: 'exact_mach' is neither a built-in"),
        (["mypkg_not_there.rewards:f"], None, r"model\.rl\.reward_funcs\[0\]: .*No module named 'mypkg_not_there'"),
        (["{mod}:no_such"], None, r"reward_funcs\[0\]: .*has no attribute 'no_such'"),
        (["{mod}.NOT_CALLABLE"], None, r"reward_funcs\[0\]: '.*NOT_CALLABLE' is a int, not a callable"),
        (["exact_match", "think_format"], [1.0], r"model\.rl\.reward_weights: 1 weights for 2 reward functions"),
        (["exact_match"], [math.inf], r"model\.rl\.reward_weights\[0\]: inf is not a finite number"),
        (["exact_match"], [float("nan")], r"model\.rl\.reward_weights\[0\]: nan is not a finite number"),
        (["exact_match"], [True], r"model\.rl\.reward_weights\[0\]: True is not a finite number"),
    ],
)
def test_load_refusals(user_module, names, weights, message):
    with pytest.raises(RewardError, match=message) as caught:
        load_reward_functions([n.format(mod=user_module) for n in names], weights)
    assert "\n" not in str(caught.value) and is_refusal(caught.value) and isinstance(caught.value, ValueError)


def test_load_names_the_field_given():
    with pytest.raises(RewardError, match=r"^model\.rl\.eval\.reward_funcs\[0\]"):
        load_reward_functions(["nope"], None, field="model.rl.eval")


# ---------------------------------------------------------------------------------------------------------
# Scoring


def constant(values):
    def reward(prompts, completions, **kwargs):
        return values

    return reward


def test_total_is_the_weighted_sum():
    a, b, c = [0.5, None, -1.0, 2.0], [1, 2, 3, 4], [None, None, 0.25, 1e3]
    functions = [
        RewardFunction("a", constant(a), 2.0),
        RewardFunction("b", constant(b), -0.5),
        RewardFunction("c", constant(c), 0.1),
    ]
    scores = score_completions(functions, ["p"] * 4, ["x"] * 4, {})
    by_hand = [2.0 * 0.5 - 0.5 * 1, -0.5 * 2, 2.0 * -1.0 - 0.5 * 3 + 0.1 * 0.25, 2.0 * 2.0 - 0.5 * 4 + 0.1 * 1e3]
    assert scores.total.dtype == torch.float64 and scores.total.shape == (4,)
    torch.testing.assert_close(scores.total, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert scores.applicable.tolist() == [[True, False, True, True], [True] * 4, [False, False, True, True]]
    assert scores.per_function.dtype == torch.float64
    assert scores.per_function.tolist() == [[0.5, 0.0, -1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.25, 1e3]]


def test_functions_get_every_field_by_keyword_and_their_own_lists():
    seen = {}

    def spy(**kwargs):
        seen.update({key: list(values) for key, values in kwargs.items()})
        kwargs["completions"].clear()  # edits its arguments: the next function must not see it
        return [0.0, 0.0]

    prompts = ["a", [{"role": "user", "content": "b"}]]
    completions = ["x", chat("y")]
    fields = {"answer": ["x", "y"], "tools": [None, TOOLS], "completion_ids": [[5], [6, 7]]}
    functions = [RewardFunction("spy", spy, 1.0), RewardFunction("exact_match", exact_match, 1.0)]
    scores = score_completions(functions, prompts, completions, fields)
    assert seen == {"prompts": prompts, "completions": ["x", chat("y")], **fields}
    assert completions == ["x", chat("y")]
    assert scores.per_function.tolist() == [[0.0, 0.0], [1.0, 1.0]]  # exact_match still saw both completions


def raising(prompts, completions, **kwargs):
    raise KeyError("answer")


@pytest.mark.parametrize(
    "fn, message",
    [
        (raising, r"^reward function mine raised KeyError: 'answer'$"),
        (constant([1.0, 2.0]), r"^reward function mine returned the wrong number of rewards: expected 3 got 2$"),
        (constant([1.0, math.nan, 0.0]), r"^reward function mine returned nan at index 1"),
        (constant([1.0, 0.0, -math.inf]), r"^reward function mine returned -inf at index 2"),
        (constant([1.0, "1.0", 0.0]), r"^reward function mine returned '1\.0' \(str\) at index 1, not a number"),
        (constant([True, 1.0, 0.0]), r"^reward function mine returned True \(bool\) at index 0, not a number"),
        (constant(torch.ones(3)), r"^reward function mine returned a Tensor, not a list of rewards$"),
        (constant(None), r"^reward function mine returned a NoneType, not a list of rewards$"),
    ],
)
def test_score_refusals_name_the_function(fn, message):
    functions = [RewardFunction("exact_match", exact_match, 1.0), RewardFunction("mine", fn, 1.0)]
    with pytest.raises(RewardError, match=message) as caught:
        score_completions(functions, ["p"] * 3, ["1", "2", "3"], {"answer": ["1", "2", "3"]})
    assert "\n" not in str(caught.value) and is_refusal(caught.value)
    if fn is raising:
        assert isinstance(caught.value.__cause__, KeyError)


def test_score_passes_on_a_builtins_own_refusal():
    with pytest.raises(RewardError, match=r"^reward function exact_match: the records have no `answer` field"):
        score_completions(load_reward_functions(["exact_match"], None), ["p"], ["1"], {"completion_ids": [[1]]})


def test_score_refuses_a_batch_that_does_not_line_up():
    functions = load_reward_functions(["think_format"], None)
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        score_completions(functions, ["p", "q"], ["x"], {})
    with pytest.raises(ValueError, match="field 'answer' has 2 values for 1 completions"):
        score_completions(functions, ["p"], ["x"], {"answer": ["1", "2"]})
