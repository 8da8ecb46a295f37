"""Chat templates bounded against resources (step35/data/chat_sandbox.py), and agent data rendered right.

Templates come with downloaded tokenizers. Before the limits, `{{ lipsum(10**7) }}`, `{{ (9**(9**9)) % 7 }}`
(which Jinja's optimizer folded while compiling), `{{ 'x' * 10**10 }}`, `indent(10**10)` and
`tojson(indent=10**9)` made `step35 generate --chat` hang and a fit grow to 6 GB until its watchdog ended it;
each is now refused within a fraction of a second, naming the template and the limit. Normal templates render
exactly as transformers renders them. Agent data: the default template renders `tools`, a template that reads
no `tools` is said (once per source) to drop them, and tool-call arguments given as a JSON string render as
the object. Content parts that are not text are bad records instead of silently empty text.
"""

from __future__ import annotations

import json
import re
import resource
import time
import warnings

import pytest

from step35.data import chat_sandbox
from step35.data.chat_messages import ChatTemplateError, check_messages
from step35.data.chat_template import ChatTemplate, DroppedToolsWarning
from step35.data.tokenizer import TextTokenizer
from tests.helpers import RecordAt

CONVERSATION = [
    {"role": "system", "content": "You are a careful helper."},
    {"role": "user", "content": "And the weather in Paris today?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 18}'},
    {"role": "assistant",
     "content": [{"type": "text", "text": "It is 18 degrees "}, {"type": "text", "text": "in Paris."}]},
]  # fmt: skip
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"name": "get_weather", "description": "Weather now", "parameters": PARAMETERS}
TOOLS = [{"type": "function", "function": WEATHER}]
CHATML = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for p in m.content -%}{{ p.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{{ '<tool_call>' + c.function.name + (c.function.arguments | tojson) }}"
    "{{ '</tool_call>' }}{%- endfor -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# Ordinary uses of the operators and filters the limits watch, at ordinary sizes.
ORDINARY = (
    "{{ '-' * 10 }}|{{ 3 * 'ab' }}|{{ [1, 2] * 2 }}|{{ 2 ** 10 }}|{{ 17 % 5 }}|{{ '%5d|%-4s|' % (42, 'x') }}"
    "{{ '%s'|format('f') }}|{{ 'a'|center(9) }}|{{ 'a\\nb'|indent(3, true) }}|{{ messages[1] | tojson(indent=2) }}"
    "|{{ '{:>6}'.format('r') }}|{{ 'ab'.ljust(5) }}|{{ 'a-b'.replace('-', '+') }}|{{ ', '.join(['x', 'y']) }}"
    "|{{ messages | map(attribute='role') | join('/') }}|{{ 'x' ~ 1 ~ none }}|{% for i in range(3) %}{{ i }}"
    "{% endfor %}|{% filter upper %}up{% endfilter %}|{{ range(5) | list | batch(2) | list }}"
)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ------------------------------------------------------------------------------------------ the limits


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "expression, limit",
    [
        ("lipsum(10**7)", r"lipsum\(10000000\) would make \d+ characters, over the limit of one rendering"),
        ("(9**(9**9)) % 7", r"9 \*\* 387420489 is an integer of about \d+ bits, over the limit of 65536 bits"),
        ("'x' * 10**10", r"str \* 10000000000 would make 10000000000 characters"),
        ("'x' | indent(10**10)", r"the indent filter's argument 10000000000 would make"),
        ("messages | tojson(indent=10**9)", r"tojson\(indent=1000000000\) would make"),
        ("messages | tojson(false, 10**9)", r"tojson\(indent=1000000000\) would make"),
    ],
)
def test_resource_blowups_are_refused_quickly_in_bounded_memory(expression, limit):
    """Each of these hung (or, for the folded power, hung while compiling) and grew without bound before: now a
    ChatTemplateError naming the template's origin and the limit, within seconds and 200 MB."""
    before, start = peak_rss_mb(), time.monotonic()
    template = ChatTemplate("{{ " + expression + " }}", "evil.jinja")
    with pytest.raises(ChatTemplateError, match=r"^chat template from evil\.jinja refused: " + limit):
        template.render(CONVERSATION)
    assert time.monotonic() - start < 5
    assert peak_rss_mb() - before < 200


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "source, limit",
    [
        ("{{ [1] * 10**10 }}", "list * 10000000000"),
        ("{{ '%10000000000d' % 1 }}", "the % operator: a width or precision of 10000000000"),
        ("{{ '%*d' % (10**10, 1) }}", "the % operator: a width or precision of 10000000000"),
        ("{{ '%10000000000s' | format('x') }}", "the format filter: a width or precision of 10000000000"),
        ("{{ '{:>10000000000}'.format(1) }}", "str.format: a width of 10000000000"),
        ("{{ 'x'.ljust(10**10) }}", "str.ljust(10000000000)"),
        ("{{ 'x' | center(10**10) }}", "the center filter's argument 10000000000"),
        ("{{ lipsum(10**5) }}", "lipsum(100000)"),
        ("{{ ('x' * 100000).replace('', 'y' * 100000) }}", "str.replace would make"),
        ("{{ [1] | batch(10**10, 'x') | list }}", "the batch filter's argument"),
        ("{{ ([('x' * 1000)] * 2000) }}", "list * 2000 would make"),
        ("{% set l = ['x' * 100000] %}{% set l = l + l + l + l %}{% set l = l + l + l + l %}{{ l | string }}",
         "the string filter's value would make"),
        ("{% set l = ['x' * 100000] %}{% set l = l + l + l + l %}{% set l = l + l + l + l %}{{ l }}",
         "the output would make"),
        ("{% set ns = namespace(a='x') %}{% for i in range(80) %}{% set ns.a = ns.a ~ ns.a %}{% endfor %}",
         "the ~ operator would make"),
        ("{% set ns = namespace(a='x') %}{% for i in range(80) %}{% set ns.a = ns.a + ns.a %}{% endfor %}",
         "the result of '+' would make"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "the output would make"),
        ("{% macro m() %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}{% set x = m() %}",
         "the output would make"),
        ("{% macro m(s) %}{{ m(s ~ s) }}{% endmacro %}{{ m('x') }}", "the ~ operator would make"),
    ],
)  # fmt: skip
def test_other_ways_to_grow_a_value_are_refused(source, limit):
    before, start = peak_rss_mb(), time.monotonic()
    with pytest.raises(ChatTemplateError, match=re.escape("chat template from evil.jinja refused: " + limit)):
        ChatTemplate(source, "evil.jinja").render(CONVERSATION)
    assert time.monotonic() - start < 10
    assert peak_rss_mb() - before < 300


@pytest.mark.timeout(60)
def test_a_rendering_has_a_time_limit(monkeypatch):
    """Nested loops that output nothing make no text to count: the deadline, checked at each loop item, ends them."""
    monkeypatch.setattr(chat_sandbox, "RENDER_SECONDS", 0.5)
    start = time.monotonic()
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"evil\.jinja refused: it ran over the 0\.5 s time limit"):
        ChatTemplate(source, "evil.jinja").render(CONVERSATION)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_the_generate_path_and_records_name_the_limit(builtin_cache):
    """`generate --chat` starts from prompt_ids and training from encode: both refuse, naming the record."""
    from step35.data import builtin_tokenizer_dir

    tok = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    template = ChatTemplate("{{ 'x' * 10**10 }}{{ eos_token }}", "tokenizer_config.json")
    with pytest.raises(ChatTemplateError, match=r"^chat template from tokenizer_config\.json refused: str \* 10"):
        template.prompt_ids(tok, CONVERSATION[:2])
    with pytest.raises(ChatTemplateError, match=r"^data\.jsonl:3: chat template from tokenizer_config\.json refused"):
        template.encode(tok, CONVERSATION, where="data.jsonl:3")


def test_no_constant_folding_at_compile_time():
    """Jinja's optimizer folded `9 ** (9 ** 9)` while compiling (before any rendering limit could apply); it is
    off, intercepted operators and our filters are never folded, and compiling such a template is instant."""
    assert chat_sandbox.jinja_environment().optimized is False
    start = time.monotonic()
    for source in ("{{ (9**(9**9)) % 7 }}", "{{ 'x' | indent(10**10) }}", "{{ ('x' * 10**10) | length }}"):
        ChatTemplate(source, "evil.jinja")._template()
    assert time.monotonic() - start < 2


# ------------------------------------------------------------------------------- normal templates unchanged


@pytest.fixture(scope="module")
def theirs(builtin_cache):
    from transformers import PreTrainedTokenizerFast

    from step35.data import builtin_tokenizer_dir

    folder = builtin_tokenizer_dir(cache_dir=builtin_cache)
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>")


@pytest.mark.parametrize("name", ["default", "chatml", "ordinary"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_normal_templates_render_as_transformers_renders_them(theirs, name, tools):
    """The bounded environment renders byte for byte what transformers' (unbounded) one renders: the default
    template, a ChatML-style one, and ordinary uses of every operator and filter the limits watch."""
    source = {"default": ChatTemplate.default().source, "chatml": CHATML, "ordinary": ORDINARY}[name]
    for prompt in (False, True):
        expected = theirs.apply_chat_template(
            CONVERSATION, chat_template=source, tools=tools, tokenize=False, add_generation_prompt=prompt
        )
        got = ChatTemplate(source, "t", eos_token="<|endoftext|>").render(
            CONVERSATION, tools=tools, add_generation_prompt=prompt
        )
        assert got == expected


def test_limits_scale_with_the_input():
    """A long conversation may render long: the text limit is RENDER_TEXT_FLOOR + RENDER_TEXT_PER_INPUT x the
    input's size, so a 3 MB message renders (as text, and repeated by a template that writes it twice)."""
    long = [{"role": "user", "content": "w" * 3_000_000}, {"role": "assistant", "content": "ok"}]
    text = ChatTemplate("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}", "t").render(long)
    assert len(text) == 6_000_004
    assert ChatTemplate.default().render(long, eos_token="E").count("w") == 3_000_000


# ----------------------------------------------------------------------------------------------- agent data


def test_the_default_template_renders_tools(builtin_cache):
    """The function schemas come first, one JSON per line under `<|tools|>`; they are never trained."""
    from step35.data import builtin_tokenizer_dir

    template = ChatTemplate.default()
    assert template.uses_tools
    text = template.render(CONVERSATION[1:3], tools=TOOLS, eos_token="</s>")
    assert text.startswith("<|tools|>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n<|user|>\n")
    assert "<|tools|>" not in template.render(CONVERSATION[1:3], eos_token="</s>")
    tok = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    ids, mask = template.encode(tok, CONVERSATION, tools=TOOLS)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "get_weather" in trained and "Weather now" not in trained and "Weather now" in tok.decode(ids)


@pytest.mark.parametrize("source", [ChatTemplate.default().source, CHATML], ids=["default", "chatml"])
def test_string_arguments_render_as_the_object(source):
    """OpenAI-style `arguments` (a JSON string) render as the object they hold, not encoded a second time by
    tojson; a string that holds no JSON object is kept as it is. The caller's messages are not changed."""

    def with_arguments(arguments):
        call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [CONVERSATION[1], {**CONVERSATION[2], "tool_calls": [call]}]

    template = ChatTemplate(source, "t", eos_token="</s>")
    as_object = template.render(with_arguments({"city": "Paris"}))
    given = with_arguments('{"city": "Paris"}')
    assert template.render(given) == as_object and "Paris" in as_object
    assert given[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert "Paris, please" in template.render(with_arguments("Paris, please"))
    assert "[1, 2]" in template.render(with_arguments("[1, 2]"))  # JSON, but not an object: kept as text
    flat = [CONVERSATION[1], {"role": "assistant", "tool_calls": [{"name": "f", "arguments": '{"a": 1}'}]}]
    rendered = ChatTemplate.default().render(flat, eos_token="</s>")  # the step3p5 form, the object's fields
    assert "<function=f>\n<parameter=a>\n1\n</parameter>" in rendered


def test_dropped_tools_are_warned_once_per_source(tmp_path, builtin_cache):
    """A template that reads no `tools` leaves the schemas out: said once per source (each source's encoder),
    naming the first record, and not at all for a template that renders them or records without tools."""
    from step35.data import builtin_tokenizer_dir
    from step35.data.sources import FileSource
    from step35.data.stream import TokenWindows

    tok = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    plain = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}", "plain.jinja",
        eos_token="<|endoftext|>",
    )  # fmt: skip
    assert not plain.uses_tools
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    record = {"messages": messages, "tools": TOOLS}

    def source(name: str, records: list) -> FileSource:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        found = FileSource(name, [path], whole_records=True, shuffle=False)
        found.format = "chat"
        return found

    sources = [source("a", [record] * 3), source("b", [record] * 3), source("c", [{"messages": messages}] * 3)]

    def dropped(template: ChatTemplate) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(TokenWindows(sources, tok, seq_len=64, endless=False, template=template))
        return sorted(str(w.message) for w in caught if issubclass(w.category, DroppedToolsWarning))

    said = dropped(plain)
    assert [m.split(": ")[0] for m in said] == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'b.jsonl'}:1"], said
    assert dropped(ChatTemplate.default().with_tokens(eos_token="<|endoftext|>")) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain.check_tools(TOOLS)
        plain.check_tools(TOOLS)
    assert len(caught) == 1 and "plain.jinja does not render them" in str(caught[0].message)


# ------------------------------------------------------------------------------------- non-text content parts


@pytest.mark.parametrize(
    "content, message",
    [
        ([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}],
         r"^data\.jsonl:3: message 0 \(user\): content part 0 has type 'input_audio'; only text parts"),
        ([{"type": "text", "text": "look"}, {"type": "audio"}], r"message 0 \(user\): content part 1 has type 'audio'"),
        ([], r"^data\.jsonl:3: message 0 \(user\) has 'content' \[\] \(no parts\)"),
        (["look"], r"content part 0 is a str, not a \{type, text\} object"),
        ([{"type": "text"}], r"content part 0 \(text\) has no 'text' string"),
    ],
)  # fmt: skip
def test_content_parts_that_are_not_text_are_refused(builtin_cache, content, message):
    """They rendered as empty text, even under data.strict; now the record is bad (skipped and counted, or
    refused when strict), named with its file and line. (Images stop the run instead: the test below.)"""
    from step35.data import builtin_tokenizer_dir

    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "A cat."}]
    with pytest.raises(ChatTemplateError, match=message):
        check_messages(messages, "data.jsonl:3")
    tok = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate.default().encode(tok, messages, where="data.jsonl:3")


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
        {"type": "image"},
        {"type": "input_image", "image_url": "https://x/cat.png"},
        {"type": "video"},
    ],
    ids=lambda part: part["type"],
)
def test_image_parts_stop_the_run_naming_the_record(builtin_cache, part):
    """An image (or video) part is no bad record to skip: chat records and preference pairs alike raise
    ImagesNotSupported naming the file and line, which no reader takes for a bad record (not a ValueError)."""
    from step35.data import builtin_tokenizer_dir
    from step35.data.chat_messages import ImagesNotSupported
    from step35.data.preference import PreferenceEncoder
    from step35.data.sft import SftEncoder

    assert not issubclass(ImagesNotSupported, ValueError)
    user = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}
    said = (
        rf"^data\.jsonl:3: message 0 \(user\): content part 1 is an image \('{part['type']}'\), and this run reads "
        r"no images \(no data\.images"
    )
    with pytest.raises(ImagesNotSupported, match=said):
        check_messages([user, {"role": "assistant", "content": "A cat."}], "data.jsonl:3")
    tok = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    template = ChatTemplate.default().with_tokens(eos_token="<|endoftext|>")
    with pytest.raises(ImagesNotSupported, match=said):
        SftEncoder("chat", tok, template)(RecordAt({"messages": [user, {"role": "assistant", "content": "A cat."}]}))
    with pytest.raises(ImagesNotSupported, match=said):
        PreferenceEncoder(tok, template)(RecordAt({"prompt": [user], "chosen": "A cat.", "rejected": "A dog."}))
    text = {"role": "user", "content": [{"type": "text", "text": "What is this?"}]}  # text parts: trained as before
    example = SftEncoder("chat", tok, template)(
        RecordAt({"messages": [text, {"role": "assistant", "content": "A cat."}]})
    )
    assert any(example.trained)


def test_text_parts_and_tool_calls_without_content_are_accepted():
    calling = {"role": "assistant", "content": [], "tool_calls": [{"function": {"name": "f"}}]}
    check_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}, calling], "x")
