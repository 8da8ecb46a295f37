"""Chat templates written for the tests (tests/test_chat_template.py): a ChatML-style one and three
Step-3.5-style ones (step-a, step-b, step-c), each with (`marked`) and without (`plain`) `{% generation %}`
marks, and a conversation with reasoning, a tool call and its result."""

from __future__ import annotations

# Written for the tests (tests/test_chat_template.py): a ChatML-style one that renders every turn the same way
# whatever follows it, and three Step-3.5-style ones that drop the reasoning of turns before the last user
# message (step-a: generation prompt `<|im_start|>assistant\n`; step-b: it ends in `<think>\n`; step-c: as
# step-b, but a turn without reasoning gets no think block), each with (`marked`) and without (`plain`)
# `{% generation %}` marks; and a conversation with reasoning, a tool call and its result.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# [[GEN]] / [[/GEN]] become the generation tags in the marked copy and vanish in the plain one; they sit
# between tags and expressions, never before a newline, so trim_blocks treats both copies alike.
TOOL_CALLS = (
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>\\n' + c.function.name + '\\n' + (c.function.arguments | tojson)"
    " + '\\n</tool_call>' }}{% endfor %}"
)
CHATML = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}[[GEN]]"
    "{%- if m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n' }}{%- endif -%}"
    "{{ m.content or '' }}" + TOOL_CALLS + "{{ '<|im_end|>' }}[[/GEN]]{{ '\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def step_style(think_in_prompt: bool, only_with_reasoning: bool = False) -> str:
    """A template that renders reasoning only for assistant turns after the last user message (variant A), and
    with `think_in_prompt` ends its generation prompt in `<think>\\n` (variant B). Reasoning comes from
    reasoning_content or from a `<think>...</think>` block at the start of the content. A user message wrapped in
    `<tool_response>` counts as a tool result, not as the last user message (so its content decides the
    rendering of other turns). With
    `only_with_reasoning` (variant C) a recent turn without reasoning gets no think block either, so the
    generation prompt's `<think>` is part of what the turn's reasoning decides."""
    opener = "{{ '<think>\\n' }}"
    return (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' and not (m.content.startswith('<tool_response>')"
        " and m.content.endswith('</tool_response>')) -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if messages[0].role == 'system' -%}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- set content = m.content or '' -%}{%- set reasoning = m.reasoning_content or '' -%}"
        "{%- if '</think>' in content -%}"
        "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
        "{%- endif -%}"
        "{%- set recent = loop.index0 > ns.last_user" + (" and reasoning" if only_with_reasoning else "") + " -%}"
        "{{ '<|im_start|>assistant\\n' }}"
        + ("{%- if recent -%}" + opener + "{%- endif -%}" if think_in_prompt else "")
        + "[[GEN]]{%- if recent -%}"
        + ("" if think_in_prompt else opener)
        + "{{ reasoning + '\\n</think>\\n' }}{%- endif -%}"
        "{{ content }}" + TOOL_CALLS + "{{ '<|im_end|>' }}[[/GEN]]{{ '\\n' }}"
        "{%- elif m.role == 'system' and loop.first -%}"
        "{%- elif m.role == 'tool' -%}"
        "{{ '<|im_start|>tool\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
        "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
        + (opener if think_in_prompt else "")
        + "{%- endif -%}"
    )


SOURCES = {"chatml": CHATML, "step-a": step_style(False), "step-b": step_style(True), "step-c": step_style(True, True)}


def plain(name: str) -> str:
    return SOURCES[name].replace("[[GEN]]", "").replace("[[/GEN]]", "")


def marked(name: str) -> str:
    return SOURCES[name].replace("[[GEN]]", "{% generation %}").replace("[[/GEN]]", "{% endgeneration %}")


CONVERSATION = [
    {"role": "system", "content": "You are a careful helper."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "reasoning_content": "Add the two numbers.", "content": "Four."},
    {"role": "user", "content": "And the weather in Paris today?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "I need the weather tool for this.",  # another name for reasoning_content
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp": 18, "sky": "clear"}'},
    {"role": "assistant", "content": "<think>\nThe tool says 18.\n</think>\nIt is 18 degrees and clear in Paris."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
