"""The agent rendering check (step35/data/agent_check.py) and the Step-3.5 tool-call parser it reads replies with
(step35/data/tool_calls.py).

The repository has no built-in agent records, so AGENT_RECORDS are written here: parallel calls, nested JSON
arguments (given as an object and as OpenAI's JSON string), strings with markup and quotes, a string that
spells a number under a `"type": "string"` schema, tool replies, reasoning as a field and inline. STEP3P5 is
step35's default template, which writes its tool calls in the step3p5 syntax (what a server for Step-3.5
reads); the planted templates break it in one way each, and the check must name what broke.
"""

from __future__ import annotations

import json
import logging

import pytest

from step35.data import Step35DataModule
from step35.data.agent_check import AgentRenderingWarning, check_agent_rendering
from step35.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from step35.data.tokenizer import TextTokenizer
from step35.data.tool_calls import ToolCallSyntaxError, parse_tool_calls, split_reasoning
from tests.helpers import SPECIAL, RecordAt, marked, plain, train_byte_bpe, write_jsonl

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "send_message", "parameters": {"type": "object", "properties": {
        "to": {"type": "string"}, "body": {"type": "string"}, "room": {"type": "string"}}}}},
]  # fmt: skip


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


FILTERS = {"since": {"year": 2024, "month": 3}, "sources": ["news", "blogs"], "strict": True, "limit": None}
MARKUP = '<b>Meeting</b> moved to "Room 4" & 5pm\nSee you <i>there</i>.'
AGENT_RECORDS = [
    {"tools": TOOLS, "messages": [  # parallel calls, two tool replies, reasoning on both assistant turns
        {"role": "user", "content": "Weather in Paris and Rome for the next days?"},
        {"role": "assistant", "reasoning_content": "Two cities: two calls.", "content": "",
         "tool_calls": [call("get_weather", {"location": "Paris", "days": 3}),
                        call("get_weather", {"location": "Rome", "unit": "celsius"})]},
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "tool", "content": '{"temp": 24}'},
        {"role": "assistant", "reasoning_content": "Both answered.", "content": "Paris 18, Rome 24."},
    ]},
    {"tools": TOOLS, "messages": [  # nested JSON, the arguments as OpenAI's JSON string
        {"role": "system", "content": "You search carefully."},
        {"role": "user", "content": 'Find "rain today" posts since March.'},
        {"role": "assistant", "content": "Searching.", "tool_calls": [
            call("search", json.dumps({"query": 'rain "today"', "filters": FILTERS, "tags": ["x", {"y": [1, 2.5]}]}))]},
        {"role": "tool", "content": "[]"},
        {"role": "assistant", "content": "Nothing found."},
    ]},
    {"tools": TOOLS, "messages": [  # markup and quotes in strings; a string that spells a number
        {"role": "user", "content": "Tell Ana the meeting moved."},
        {"role": "assistant", "reasoning": "Use send_message.", "content": "Sending it now.",
         "tool_calls": [call("send_message", {"to": "ana@example.com", "body": MARKUP, "room": "42"})]},
        {"role": "tool", "content": "sent"},
        {"role": "assistant", "content": "Done: <b>sent</b>."},
    ]},
    {"messages": [  # reasoning inline in the content, no tools
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "<think>\n6 x 7 = 42.\n</think>\nIt is 42."},
    ]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},  # not checked
]  # fmt: skip
AGENT = 4  # records of AGENT_RECORDS with tool calls or reasoning
WITH_CALLS = 3

# step35's default template, its tool calls written in the step3p5 syntax: a string VALUE as it is, anything
# else as JSON. The planted templates change one piece of it.
JSON_CALL = (
    "{{- '<tool_call>' + ({'name': function.name, 'arguments': function.arguments} | tojson) + '</tool_call>' -}}"
)
CALLS_LOOP = "{%- for call in message.tool_calls or [] -%}"
STEP3P5_VALUE = "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"


def xml_calls(value: str) -> str:
    return (
        "{{- '<tool_call>\\n<function=' + function.name + '>\\n' -}}"
        "{%- if function.arguments is string -%}{{- function.arguments + '\\n' -}}{%- endif -%}"
        "{%- for name, value in (function.arguments if function.arguments is mapping else {}).items() -%}"
        "{{- '<parameter=' + name + '>\\n' -}}" + value + "{{- '\\n</parameter>\\n' -}}"
        "{%- endfor -%}"
        "{{- '</function>\\n</tool_call>' -}}"
    )


XML_CALL = xml_calls(STEP3P5_VALUE)
assert XML_CALL in DEFAULT_TEMPLATE and CALLS_LOOP in DEFAULT_TEMPLATE
STEP3P5 = DEFAULT_TEMPLATE  # step35's default writes the step3p5 form
# The Hermes form (JSON inside <tool_call>), which a step3p5 parser does not read.
JSON_FORM = DEFAULT_TEMPLATE.replace(XML_CALL, JSON_CALL)
DOUBLE_ENCODED = DEFAULT_TEMPLATE.replace(
    XML_CALL, xml_calls("{%- set text = value if value is string else value | tojson -%}{{- text | tojson -}}")
)
DROPS_SECOND = STEP3P5.replace(CALLS_LOOP, "{%- for call in (message.tool_calls or [])[:1] -%}")
ESCAPES_MARKUP = DEFAULT_TEMPLATE.replace(
    XML_CALL, xml_calls(STEP3P5_VALUE.replace("{{- value -}}", "{{- value | e -}}"))
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE folder, EOS <|endoftext|>, with the Step-style special tokens."""
    folder = tmp_path_factory.mktemp("agent-tokenizer")
    train_byte_bpe([json.dumps(AGENT_RECORDS), "The quick brown fox. " * 20], ["<|endoftext|>", *SPECIAL], folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return TextTokenizer.from_folder(tokenizer_dir)


def check(source: str, tok, records=AGENT_RECORDS):
    return check_agent_rendering(records, ChatTemplate(source, "test"), tok)


# ------------------------------------------------------------------------------------------------ the parser


def tool_call(name: str, *parameters: str) -> str:
    return f"<tool_call>\n<function={name}>\n{''.join(parameters)}</function>\n</tool_call>"


def test_parser_reads_parallel_calls_nested_json_markup_and_layout_whitespace():
    text = (
        "Checking both.\n"
        + tool_call("get_weather", "<parameter=location>\nParis\n</parameter>\n", "<parameter=days>\n3\n</parameter>\n")
        + "\n"
        + tool_call(" search ", '<parameter=filters>\n{"since": {"year": 2024}, "n": [1, null, true]}\n</parameter>\n')
        + tool_call("send", f"<parameter=body>\n{MARKUP}\n</parameter>\n", "<parameter=quote>\n\"'hi'\"\n</parameter>")
        + "<tool_call><function=now></function></tool_call>"  # no layout at all, no parameters
        + tool_call("pad", "<parameter=a>\n\n  Paris  \n\n</parameter>\n", "<parameter=b>\n\n 7 \n\n</parameter>\n")
    )
    assert parse_tool_calls(text) == [
        ("get_weather", {"location": "Paris", "days": 3}),
        ("search", {"filters": {"since": {"year": 2024}, "n": [1, None, True]}}),
        ("send", {"body": MARKUP, "quote": "'hi'"}),  # a VALUE that is a JSON string is that string
        ("now", {}),
        ("pad", {"a": "\n  Paris  \n", "b": 7}),  # one newline either side is layout; JSON allows whitespace
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",  # never closed
        "</tool_call>" + tool_call("f"),  # closed before opened
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  # no </function>
        tool_call("f", "<parameter=a>1</parameter>oops"),  # text outside the parameters
        tool_call("f", "<parameter=a>1</parameter><parameter=a>2</parameter>"),  # an argument twice
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',  # JSON, not the step3p5 syntax
        "<tool_call>f(a=1)</tool_call>",
    ],
)
def test_parser_refuses_malformed_calls(text):
    with pytest.raises(ToolCallSyntaxError):
        parse_tool_calls(text)
    assert issubclass(ToolCallSyntaxError, ValueError)


def test_split_reasoning():
    assert split_reasoning("<think>\nplan\n</think>\nanswer") == ("\nplan\n", "\nanswer")
    assert split_reasoning("plan\n</think>\nanswer") == ("plan\n", "\nanswer")  # the prompt opened <think>
    assert split_reasoning("\n<think>still thinking") == ("still thinking", "")  # never closed: all reasoning
    assert split_reasoning("just an answer") == (None, "just an answer")
    assert split_reasoning("a</think>b</think>c") == ("a", "b</think>c")  # the first </think> ends it


def test_rewards_reads_tool_calls_with_the_data_parser():
    from step35.training import rewards

    assert rewards.parse_tool_calls is parse_tool_calls and rewards.ToolCallSyntaxError is ToolCallSyntaxError


# ------------------------------------------------------------------------------------------------- the check


def test_a_step3p5_template_round_trips_every_agent_record(tok):
    report = check(STEP3P5, tok)
    assert (report.checked, report.failed, report.records_failed) == (AGENT, [], 0)
    unmarked = ChatTemplate(STEP3P5.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", ""), "test")
    assert not unmarked.has_generation_marks  # turns located by sentinels instead: the same verdict
    assert check_agent_rendering(AGENT_RECORDS, unmarked, tok).failed == []


def test_the_default_template_round_trips_every_agent_record(tok):
    """step35's DEFAULT_TEMPLATE writes tool calls in the step3p5 form: every record reads back as given. The
    Hermes form it wrote before (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) is what a step3p5
    parser cannot read: each record with calls fails, saying so; the others pass."""
    report = check_agent_rendering(AGENT_RECORDS, ChatTemplate.default(), tok)
    assert report.checked == AGENT and report.failed == []
    hermes = check(JSON_FORM, tok, AGENT_RECORDS)
    assert hermes.records_failed == WITH_CALLS
    assert [line.split(",")[0] for line in hermes.failed] == ["record 0", "record 1", "record 2"]
    assert all("writes each call as JSON inside <tool_call>" in line for line in hermes.failed)


@pytest.mark.parametrize("name", ["step-a", "step-b", "step-c"])
def test_step_style_templates_round_trip_reasoning(tok, name):
    """The test templates' reasoning (dropped for turns before the last user message; step-b and step-c open
    `<think>` in the generation prompt, so the reply starts inside the thinking): read back as given."""
    records = [AGENT_RECORDS[3], {"messages": AGENT_RECORDS[0]["messages"][:1] + [AGENT_RECORDS[0]["messages"][4]]}]
    for source in (plain(name), marked(name)):
        assert check(source, tok, records).failed == []
    renamed = [{"messages": [*records[1]["messages"][:1], {**records[1]["messages"][1], "content": "Rome 24."}]}]
    assert check(plain(name), tok, renamed).failed == []


def test_double_encoded_arguments_are_named(tok):
    report = check(DOUBLE_ENCODED, tok, [RecordAt(r, f"agent.jsonl:{i + 1}") for i, r in enumerate(AGENT_RECORDS)])
    assert report.records_failed == WITH_CALLS
    lines = {line.split(": rendered")[0]: line for line in report.failed}
    assert len(lines) == len(report.failed) == 10  # every argument of every call, each named once
    assert all(line.endswith("(double-encoded)") for line in report.failed)
    at = "agent.jsonl:1, assistant message 1: tool call 1 of 2 `get_weather` argument"
    assert lines[f"{at} `location`"] == (
        f"""{at} `location`: rendered '"Paris"' reads back as "\\"Paris\\"" (as text: its tools schema says string),"""
        ' the record has "Paris" (double-encoded)'
    )
    assert (
        lines[f"{at} `days`"] == f"""{at} `days`: rendered '"3"' reads back as "3", the record has 3 (double-encoded)"""
    )
    filters = lines["agent.jsonl:2, assistant message 2: tool call 1 of 1 `search` argument `filters`"]
    assert filters.startswith(
        """agent.jsonl:2, assistant message 2: tool call 1 of 1 `search` argument `filters`: rendered '"{\\\\"since"""
    )


def test_a_dropped_parallel_call_is_named(tok):
    report = check(DROPS_SECOND, tok)
    assert report.failed == [
        "record 0, assistant message 1: tool call 2 of 2 `get_weather` is not rendered (only 1 come back)"
    ]


def test_escaped_markup_is_named(tok):
    """A template that HTML-escapes VALUEs mangles every string with markup or quotes."""
    report = check(ESCAPES_MARKUP, tok)
    assert [line.split(": rendered ")[0] for line in report.failed] == [
        "record 1, assistant message 2: tool call 1 of 1 `search` argument `query`",
        "record 2, assistant message 1: tool call 1 of 1 `send_message` argument `body`",
    ]
    assert "rendered 'rain &#34;today&#34;' reads back as \"rain &#34;today&#34;\"" in report.failed[0]
    assert "rendered '&lt;b&gt;Meeting&lt;/b&gt; moved to &#34;Room 4&#34; &amp; 5pm" in report.failed[1]


def test_an_unclosed_think_block_is_named_and_bad_records_are_passed_over(tok):
    """A template that never closes `<think>`: the server reads the whole reply as reasoning. Records that are
    no conversation training would render (bad records: training skips and counts them) are not checked."""
    think_close = "'\\n</think>\\n'"
    assert think_close in STEP3P5
    unclosed = ChatTemplate(STEP3P5.replace(think_close, "'\\n'"), "test")
    bad = ["not a record", {"messages": [{"role": "user", "content": "no reply"}]}, {"text": "plain"}]
    reasoned = {"messages": [AGENT_RECORDS[0]["messages"][0], AGENT_RECORDS[0]["messages"][4]]}
    report = check_agent_rendering([*bad, reasoned], unclosed, tok)
    assert report.checked == 1 and report.failed == [
        "record 3, assistant message 1: reasoning comes back as 'Both answered.\\nParis 18, Rome 24.', the record"
        " has 'Both answered.'",
        "record 3, assistant message 1: content comes back as '', the record has 'Paris 18, Rome 24.'",
    ]


def test_a_string_spelling_a_number_needs_its_string_schema(tok):
    """`"42"` rendered as the text 42 reads back as the number unless the tools declare the parameter a string."""
    record = AGENT_RECORDS[2]
    untyped = [{**record, "tools": None}]
    lines = check(STEP3P5, tok, untyped).failed
    assert lines == ["record 0, assistant message 1: tool call 1 of 1 `send_message` argument `room`: rendered '42'"
                     ' reads back as 42, the record has "42"']  # fmt: skip
    assert check(STEP3P5, tok, [record]).failed == []


# ----------------------------------------------------------------------------------------------- the fit option


def test_datamodule_warns_with_the_count_of_records_that_do_not_round_trip(tmp_path, tokenizer_dir, caplog):
    write_jsonl(tmp_path / "agent.jsonl", AGENT_RECORDS)
    for name, source in (("bad", DOUBLE_ENCODED), ("good", STEP3P5)):
        (tmp_path / f"{name}.jinja").write_text(source)

    def setup(template: str, check: bool = True) -> Step35DataModule:
        dm = Step35DataModule(
            files=str(tmp_path / "agent.jsonl"), tokenizer=str(tokenizer_dir), format="chat", seq_len=64,
            val_batches=0, chat_template=str(tmp_path / f"{template}.jinja"), check_agent_rendering=check,
            max_dropped_share=1.0,  # (3 of the 5 records do not fit 64 tokens: that is not what this tests)
        )  # fmt: skip
        dm.setup()
        return dm

    with pytest.warns(AgentRenderingWarning) as warned:
        setup("bad")
    (message,) = [str(w.message) for w in warned if w.category is AgentRenderingWarning]
    assert message.startswith(f"agent rendering: {WITH_CALLS} of {AGENT} records checked do not round-trip")
    assert f"{tmp_path / 'agent.jsonl'}:2, assistant message 2: tool call 1 of 1 `search` argument" in message
    assert len(message.splitlines()) == 1 + 5 + 1  # the count, the first 5 differences, how many more
    with caplog.at_level(logging.INFO):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", AgentRenderingWarning)
            setup("good")
            setup("bad", check=False)
    assert f"agent rendering: {AGENT} records checked, all round-trip" in caplog.text
