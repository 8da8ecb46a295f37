"""Chat templates: rendering as transformers renders (step35/data/chat_template.py), and which tokens are trained
(chat_spans.py).

The templates here are written for these tests: a ChatML-style one that renders every turn the same way
whatever follows it, and three Step-3.5-style ones that drop the reasoning of turns before the last user
message (A: generation prompt `<|im_start|>assistant\\n`; B: it ends in `<think>\\n`; C: as B, but a
turn without reasoning gets no think block, as in the older released template). Each exists with and
without `{% generation %}` marks; the marked copy renders the same text. The reference masks are transformers'
`return_assistant_tokens_mask` on the marked copy and, for the ChatML template, per-prefix rendering.
"""

from __future__ import annotations

import json

import pytest

from step35.data.chat_messages import TRAIN_ON, ChatTemplateError, check_messages
from step35.data.chat_spans import token_mask
from step35.data.chat_template import ChatTemplate
from step35.data.tokenizer import TextTokenizer
from tests.helpers import CONVERSATION, SOURCES, SPECIAL, TOOLS, marked, plain, train_byte_bpe

# Parallel tool calls, their two results, a user message that is a tool result in disguise, a reply.
TOOL_ROUNDS = [
    *CONVERSATION[:4],
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]},
    {"role": "tool", "content": "Paris: 18"},
    {"role": "tool", "content": "Rome: 24"},
    {"role": "assistant", "content": "<think>\nBoth answered.\n</think>\nParis 18, Rome 24."},
    {"role": "user", "content": "<tool_response>Oslo: 9</tool_response>"},
    {"role": "assistant", "reasoning_content": "A third city came back.", "content": "And Oslo 9."},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(our TextTokenizer, transformers' PreTrainedTokenizerFast) over one byte-level BPE trained here."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tok = train_byte_bpe(
        [json.dumps(CONVERSATION), json.dumps(TOOLS), "The quick brown fox jumps over the lazy dog. " * 20],
        ["<|endoftext|>", *SPECIAL],
        folder,
    )
    ours = TextTokenizer.from_folder(folder, eos_token_id=tok.token_to_id("<|im_end|>"))
    theirs = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    return ours, theirs


def reference_mask(theirs, source: str, messages, tools=None) -> tuple[list[int], list[bool]]:
    out = theirs.apply_chat_template(
        messages, chat_template=source, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def trained_text(tok: TextTokenizer, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


# ------------------------------------------------------------------------------- equal to transformers


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_rendering_equals_transformers(tokenizers, name, tools):
    ours, theirs = tokenizers
    for source in (plain(name), marked(name)):
        expected = theirs.apply_chat_template(CONVERSATION, chat_template=source, tools=tools, tokenize=False)
        assert ChatTemplate(source, "test", eos_token="<|im_end|>").render(CONVERSATION, tools=tools) == expected
        prompt = theirs.apply_chat_template(
            CONVERSATION[:4], chat_template=source, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ChatTemplate(source, "test").render(CONVERSATION[:4], tools=tools, add_generation_prompt=True) == prompt
    assert ChatTemplate(plain(name), "t").render(CONVERSATION) == ChatTemplate(marked(name), "t").render(CONVERSATION)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_masks_equal_transformers_over_tool_rounds(tokenizers, name):
    """Parallel tool calls and a user message that the Step-style templates read as a tool result: replacing
    that message's text by a sentinel would change which turns keep their reasoning, so the turns around it
    are bounded by a sentinel inserted inside it instead (this raised before)."""
    ours, theirs = tokenizers
    expected = reference_mask(theirs, marked(name), TOOL_ROUNDS)
    assert ChatTemplate(plain(name), "test").encode(ours, TOOL_ROUNDS) == expected
    assert ChatTemplate(marked(name), "test").encode(ours, TOOL_ROUNDS) == expected
    text = trained_text(ours, *expected)
    assert "Rome" in text and "Paris 18, Rome 24.<|im_end|>" in text and "And Oslo 9.<|im_end|>" in text
    assert "Oslo: 9" not in text and "Rome: 24" not in text
    assert "Both answered." in text  # kept by all: the disguised tool result is no user message


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_masks_equal_transformers_on_the_marked_copy(tokenizers, name, tools):
    """Both our methods (sentinels on the plain template, generation marks on the marked copy) give
    transformers' mask token for token; for Step-style templates the mask misses the dropped reasoning."""
    ours, theirs = tokenizers
    expected_ids, expected_mask = reference_mask(theirs, marked(name), CONVERSATION, tools)
    assert sum(expected_mask) > 20
    for source in (plain(name), marked(name)):
        ids, mask = ChatTemplate(source, "test").encode(ours, CONVERSATION, tools=tools)
        assert ids == expected_ids
        assert mask == expected_mask, f"{name}: {trained_text(ours, ids, mask)!r}"
    text = trained_text(ours, expected_ids, expected_mask)
    assert "Four.<|im_end|>" in text and "get_weather" in text and "18 degrees and clear in Paris.<|im_end|>" in text
    for never in ("careful helper", "two plus two", "weather in Paris today", '"temp"', "<|im_start|>", "Tools:"):
        assert never not in text
    assert ("Add the two numbers." in ours.decode(expected_ids)) == (name == "chatml")  # Step-style ones drop it


def test_chatml_masks_equal_per_prefix_rendering(tokenizers):
    """For a template that does not rewrite history, each turn's trained tokens are those after the rendered
    prefix with its generation prompt, up to and including the next <|im_end|>."""
    ours, _ = tokenizers
    template = ChatTemplate(plain("chatml"), "test")
    ids, mask = template.encode(ours, CONVERSATION)
    end = ours.tokenizer.token_to_id("<|im_end|>")
    expected = [False] * len(ids)
    for i, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        start = len(template.prompt_ids(ours, CONVERSATION[:i]))
        assert ids[:start] == template.prompt_ids(ours, CONVERSATION[:i])  # a prefix, for this template
        stop = ids.index(end, start) + 1
        expected[start:stop] = [True] * (stop - start)
    assert mask == expected


def test_prefix_rendering_is_wrong_for_history_rewriting_templates(tokenizers):
    """Why per-prefix masks are not used: for Step-style templates the prompt rendered for the first
    assistant turn (its reasoning not yet dropped) is not a prefix of the whole conversation."""
    ours, _ = tokenizers
    for name in ("step-a", "step-b", "step-c"):
        template = ChatTemplate(plain(name), "test")
        prompt_then_reply = template.render(CONVERSATION[:3])
        assert "Add the two numbers." in prompt_then_reply
        assert not template.render(CONVERSATION).startswith(prompt_then_reply)
        assert template.encode(ours, CONVERSATION)  # and yet the sentinel method masks it


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_training_text_is_what_inference_renders(tokenizers, name):
    """The final turn's trained tokens follow exactly the ids inference starts from (prompt_ids of the
    conversation before it), and are the tokens of the reply the model would emit, end-of-turn included."""
    ours, _ = tokenizers
    for source in (plain(name), marked(name)):
        template = ChatTemplate(source, "test")
        for last in (2, 4, 6):  # every assistant turn, as the final one of a shorter conversation
            messages = CONVERSATION[: last + 1]
            prompt = template.prompt_ids(ours, messages[:-1])
            ids, mask = template.encode(ours, messages, train_on="last_assistant")
            trained = [k for k, m in enumerate(mask) if m]
            assert ids[: len(prompt)] == prompt
            assert trained == list(range(len(prompt), len(ids) - 1))  # all but the newline after <|im_end|>
            assert ours.decode(ids[trained[-1] :]) == "<|im_end|>\n"
    if name == "step-b":
        assert ours.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
        assert ours.decode(ids[trained[0] :]).startswith("The tool says 18.\n</think>\n")


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_train_on_variants(tokenizers, name):
    ours, theirs = tokenizers
    template = ChatTemplate(plain(name), "test")
    ids, every = template.encode(ours, CONVERSATION, train_on="assistant")
    ids_last, last = template.encode(ours, CONVERSATION, train_on="last_assistant")
    ids_all, everything = template.encode(ours, CONVERSATION, train_on="all")
    assert ids == ids_last == ids_all
    assert all(everything) and len(everything) == len(ids)
    assert 0 < sum(last) < sum(every)
    assert all(e for e, l in zip(every, last) if l)  # the last turn's tokens are a subset
    # The generation prompt of variants B and C holds the <think> opener, so the reply starts after it.
    opener = "" if name in ("step-b", "step-c") else "<think>\n"
    assert trained_text(ours, ids, last).startswith(opener + "The tool says 18.")
    assert trained_text(ours, ids, last).endswith("clear in Paris.<|im_end|>")
    assert template.encode(ours, CONVERSATION, train_on="last_assistant") == ChatTemplate(marked(name), "test").encode(
        ours, CONVERSATION, train_on="last_assistant"
    )
    with pytest.raises(ChatTemplateError, match=r"data.jsonl:9: train_on='user'; expected one of assistant"):
        template.encode(ours, CONVERSATION, train_on="user", where="data.jsonl:9")
    assert TRAIN_ON == ("assistant", "last_assistant", "all")


def test_end_of_turn_token(tokenizers, builtin_cache):
    """What `generate --chat` stops on: <|im_end|> for the ChatML-style and Step-style templates, EOS for ours."""
    from step35.data import builtin_tokenizer_dir

    ours, _ = tokenizers
    im_end = ours.tokenizer.token_to_id("<|im_end|>")
    assert {ChatTemplate(plain(name), "t").end_of_turn_id(ours) for name in SOURCES} == {im_end}
    builtin = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    assert ChatTemplate.default().end_of_turn_id(builtin) == builtin.eos_token_id == 0


def test_a_token_straddling_a_span_border_is_trained():
    spans = [(5, 10), (20, 22)]
    offsets = [(0, 5), (3, 6), (6, 9), (9, 12), (12, 20), (20, 20), (21, 21), (21, 30), (30, 31)]
    # (3, 6) and (9, 12) straddle the borders of the first span: trained. (20, 20) is empty at a span's start:
    # no character inside, not trained; (21, 21) is empty inside: trained (transformers does the same).
    assert token_mask(offsets, spans) == [False, True, True, True, False, False, True, True, False]


# ------------------------------------------------------------------------------------- default template


def test_default_template_with_the_builtin_tokenizer(builtin_cache):
    from transformers import PreTrainedTokenizerFast

    from step35.data import builtin_tokenizer_dir

    folder = builtin_tokenizer_dir(cache_dir=builtin_cache)
    ours = TextTokenizer.from_folder(folder)
    template = ChatTemplate.default()
    assert template.origin == "default" and template.has_generation_marks
    ids, mask = template.encode(ours, CONVERSATION)
    text = trained_text(ours, ids, mask)
    assert text.count("<|endoftext|>") == 3 and "Four." in text and "get_weather" in text
    assert "two plus two" not in text and "<|assistant|>" not in text and "careful helper" not in text
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>")
    assert (ids, mask) == reference_mask(theirs, template.source, CONVERSATION)
    prompt = template.prompt_ids(ours, CONVERSATION[:-1])
    last_ids, last = template.encode(ours, CONVERSATION, train_on="last_assistant")
    assert last_ids[: len(prompt)] == prompt and last.index(True) == len(prompt)
    assert last_ids[max(k for k, m in enumerate(last) if m)] == ours.eos_token_id
    content = [{"type": "text", "text": "hi"}, {"type": "image"}, {"type": "text", "text": "!"}]
    parts = [{"role": "user", "content": content}]
    assert template.render(parts, add_generation_prompt=True, eos_token="E") == "<|user|>\nhi!\n<|assistant|>\n"
    with pytest.raises(ChatTemplateError, match="the default chat template needs eos_token"):
        template.render(CONVERSATION)  # an assistant turn that never ends would teach the model not to stop


# ---------------------------------------------------------------------------------------------- loading


def test_from_folder(tmp_path):
    assert ChatTemplate.from_folder(tmp_path) is None
    config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<s>", "chat_template": "config {{ bos_token }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_folder(tmp_path)
    assert (template.origin, template.eos_token, template.bos_token) == ("tokenizer_config.json", "<|im_end|>", "<s>")
    assert template.render([{"role": "user", "content": "x"}]) == "config <s>"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "dflt"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_folder(tmp_path).source == "dflt"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="without a 'default' entry"):
        ChatTemplate.from_folder(tmp_path)
    ChatTemplate("file wins", "x").save(tmp_path)  # chat_template.jinja wins over tokenizer_config.json
    template = ChatTemplate.from_folder(tmp_path)
    assert (template.source, template.origin, template.eos_token) == ("file wins", "chat_template.jinja", "<|im_end|>")
    assert ChatTemplate.from_file(tmp_path / "chat_template.jinja").origin == str(tmp_path / "chat_template.jinja")
    with pytest.raises(ChatTemplateError, match="does not exist"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")


def test_rendering_features_as_transformers(tokenizers):
    """tojson keeps non-ASCII text and takes indent; strftime_now exists; loop controls work; extra variables
    and the special tokens reach the template."""
    _, theirs = tokenizers
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m | tojson(indent=1) }}{{ m.thinking or '' }}{% endfor %}{{ strftime_now('%Y') | length }}"
        "{{ enable_thinking }}"
    )
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "café <b>"},
                {"role": "assistant", "content": "ok", "reasoning_content": "r", "tool_calls": None}]  # fmt: skip
    ours = ChatTemplate(source, "t", bos_token="<s>").render(messages, enable_thinking=False)
    theirs.bos_token = "<s>"
    try:
        assert ours == theirs.apply_chat_template(messages, chat_template=source, tokenize=False, enable_thinking=False)
    finally:
        theirs.bos_token = None
    assert "café <b>" in ours and "4False" in ours and '"tool_calls"' not in ours


# A template with reasoning-effort levels, written here in the way of the Step-3.7 release's (whose text is not
# copied into the project): the level is a variable apply_chat_template passes on, default medium, rendered into
# the system header, and a high level opens the reply's think block in the generation prompt.
EFFORT_TEMPLATE = (
    "{%- set effort = reasoning_effort | default('medium') -%}"
    "{%- if effort not in ['low', 'medium', 'high'] -%}{{ raise_exception('unknown reasoning_effort ' ~ effort) }}"
    "{%- endif -%}"
    "<|im_start|>system\nReasoning effort: {{ effort }}<|im_end|>\n"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{%- else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if effort == 'high' %}<think>\n{% endif %}{% endif -%}"
)
EFFORT_CONVERSATION = [{"role": "user", "content": "What is the weather in Paris?"},
                       {"role": "assistant", "content": "It is 18 degrees and clear."}]  # fmt: skip


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_template_variables_render_as_transformers_passes_them(tokenizers, effort):
    """`with_variables` (data.chat_template_kwargs, generate's --chat_template_kwargs) renders as transformers'
    apply_chat_template(**kwargs): the text, the generation prompt, the tokens and their trained mask; the
    variables survive pickling (DataLoader workers); the levels render differently (the check can fail)."""
    import pickle

    ours_tok, theirs = tokenizers
    template = ChatTemplate(EFFORT_TEMPLATE, "t").with_variables(
        {"reasoning_effort": effort}, "data.chat_template_kwargs"
    )
    for prompt in (False, True):
        want = theirs.apply_chat_template(EFFORT_CONVERSATION, chat_template=EFFORT_TEMPLATE, tokenize=False,
                                          add_generation_prompt=prompt, reasoning_effort=effort)  # fmt: skip
        assert template.render(EFFORT_CONVERSATION, add_generation_prompt=prompt) == want
        assert pickle.loads(pickle.dumps(template)).render(EFFORT_CONVERSATION, add_generation_prompt=prompt) == want
    assert f"Reasoning effort: {effort}" in want
    out = theirs.apply_chat_template(EFFORT_CONVERSATION, chat_template=EFFORT_TEMPLATE, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True, reasoning_effort=effort)  # fmt: skip
    assert template.encode(ours_tok, EFFORT_CONVERSATION) == (
        list(out["input_ids"]),
        [bool(m) for m in out["assistant_masks"]],
    )
    default = ChatTemplate(EFFORT_TEMPLATE, "t").render(EFFORT_CONVERSATION)
    assert (default == template.render(EFFORT_CONVERSATION)) == (effort == "medium")


def test_template_variables_the_template_does_not_take_are_refused_by_name():
    """A misspelt variable would render the template's default silently: refused, listing what the template
    reads; so are the renderer's own arguments and names that are no variable names."""
    template = ChatTemplate(EFFORT_TEMPLATE, "t")
    field = "data.chat_template_kwargs"
    for variables, message in [
        ({"reasoning_efort": "high"}, rf"{field}\.reasoning_efort: the chat template from t does not read a variable "
                                      r"of that name \(it reads: reasoning_effort\)"),
        ({"messages": []}, rf"{field}\.messages: set by step35 for every rendering"),
        ({"reasoning-effort": "high"}, r"'reasoning-effort' is not a template variable name"),
        ("high", rf"{field}: expected a mapping of template variables"),
    ]:  # fmt: skip
        with pytest.raises(ChatTemplateError, match=message):
            template.with_variables(variables, field)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "messages, message",
    [
        ({"role": "user"}, r"data.jsonl:3: 'messages' must be a list"),
        ([], r"data.jsonl:3: empty conversation"),
        (["hi"], r"data.jsonl:3: message 0 is a str, not an object"),
        ([{"content": "hi"}], r"data.jsonl:3: message 0 has no 'role'"),
        ([{"role": "bot", "content": "hi"}], r"data.jsonl:3: message 0 has unknown role 'bot'"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant"}],
            r"jsonl:3: message 1 \(assistant\) has no 'content'",
        ),
        ([{"role": "user", "content": 3}], r"data.jsonl:3: message 0 \(user\) has 'content' of type int"),
        ([{"role": "user", "content": "hi"}], r"data.jsonl:3: no assistant turn"),
        ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}], r"0 \(assistant\) has 'tool_calls' that"),
        ([{"role": "assistant", "content": "a", "thinking": ["x"]}], r"0 \(assistant\) has 'thinking' of type list"),
    ],
)
def test_bad_messages(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        check_messages(messages, "data.jsonl:3")


def test_assistant_tool_call_without_content_is_accepted():
    check_messages([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {}}]}], "x")


def test_jinja_errors_name_the_record(tokenizers):
    ours, _ = tokenizers
    raising = ChatTemplate(
        "{% for m in messages %}{{ raise_exception('no tools') if m.role == 'tool' }}{% endfor %}", "t"
    )
    with pytest.raises(ChatTemplateError, match=r"^chats.jsonl:12: chat template from t failed to render: .*no tools"):
        raising.encode(ours, CONVERSATION, where="chats.jsonl:12")
    broken = ChatTemplate("{% for m in messages %}{{ m.content }", "tokenizer_config.json")
    message = r"chats.jsonl:4: chat template from tokenizer_config.json does not parse \(line 1\)"
    with pytest.raises(ChatTemplateError, match=message):
        broken.render(CONVERSATION, where="chats.jsonl:4")
    typed = ChatTemplate("{{ messages[0].content + 1 }}", "t")
    with pytest.raises(ChatTemplateError, match=r"chats.jsonl:5: .*TypeError"):
        typed.render(CONVERSATION, where="chats.jsonl:5")


def test_unlocatable_turns_raise(tokenizers):
    """A template without marks that renders no assistant text, or ends replies without a special token, or
    whose generation prompt is not what it renders before a turn, cannot be masked: an error, never a guess."""
    ours, _ = tokenizers
    silent = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.role != 'assistant' }}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "t",
    )  # fmt: skip
    with pytest.raises(ChatTemplateError, match=r"r.jsonl:1: assistant message 2: the chat template renders none of"):
        silent.encode(ours, CONVERSATION, where="r.jsonl:1")
    no_end = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}", "t")  # fmt: skip
    with pytest.raises(ChatTemplateError, match=r"r.jsonl:2: chat template from t: no special token follows"):
        no_end.encode(ours, CONVERSATION, where="r.jsonl:2")
    other_prompt = ChatTemplate(plain("chatml").replace("{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
                                                        "{{ '<|im_start|>model\\n' }}{%- endif -%}"), "t")  # fmt: skip
    with pytest.raises(ChatTemplateError, match=r"assistant message 2: the generation prompt .* not found"):
        other_prompt.encode(ours, CONVERSATION, where="r.jsonl:3")


def test_marked_block_changed_after_the_block_raises(tokenizers):
    ours, _ = tokenizers
    source = (
        "{% for m in messages %}{% set body %}{% generation %} {{ m.content }}{% endgeneration %}{% endset %}"
        "<|im_start|>{{ body | trim }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match=r"x:1: .*output is changed after the block"):
        ChatTemplate(source, "t").encode(ours, CONVERSATION, where="x:1")


def test_marked_template_without_a_block_for_the_turn_raises(tokenizers):
    ours, _ = tokenizers
    source = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
        "{% if false %}{% generation %}{% endgeneration %}{% endif %}{% endfor %}"
    )
    with pytest.raises(
        ChatTemplateError, match=r"x:2: chat template from t renders no \{% generation %\} block .*es 2"
    ):
        ChatTemplate(source, "t").encode(ours, CONVERSATION, where="x:2")


def test_template_pickles_for_dataloader_workers(tokenizers):
    import pickle

    ours, _ = tokenizers
    template = ChatTemplate(plain("step-a"), "tokenizer_config.json", bos_token="<s>", eos_token="<|im_end|>")
    expected = template.encode(ours, CONVERSATION)  # compiled and probed: neither travels
    copy = pickle.loads(pickle.dumps(template))
    assert (copy.source, copy.origin, copy.bos_token, copy.eos_token) == (
        template.source, "tokenizer_config.json", "<s>", "<|im_end|>"
    )  # fmt: skip
    assert copy.encode(ours, CONVERSATION) == expected


def test_text_diff_and_mask_helpers_on_random_input():
    """The block-wise common prefix/suffix and the bisecting token mask against their one-line definitions."""
    import random

    from step35.data.chat_spans import common_prefix, common_suffix

    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([0, 1, 5, 4095, 4096, 4097, 9000])
        a = "".join(rng.choice("ab") for _ in range(n))
        b = list(a)
        for _ in range(rng.randint(0, 2) if n else 0):
            b[rng.randrange(n)] = "c"
        b = "".join(b) + "x" * rng.randint(0, 2)
        a, b = (a, b) if rng.random() < 0.5 else (b, a)
        prefix = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        suffix = next((k for k, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y), min(len(a), len(b)))
        limit = rng.randint(0, min(len(a), len(b)))
        assert (common_prefix(a, b), common_suffix(a, b, limit)) == (prefix, min(suffix, limit))
    for _ in range(500):
        offsets, pos = [], 0
        for _ in range(rng.randint(0, 30)):
            start = pos + rng.randint(0, 1)
            offsets.append((start, start + rng.randint(0, 3)))
            pos = offsets[-1][1] if rng.random() < 0.8 else start
        spans, pos = [], 0
        for _ in range(rng.randint(0, 4)):
            start = pos + rng.randint(0, 5)
            spans.append((start, start + rng.randint(1, 6)))
            pos = spans[-1][1]
        assert token_mask(offsets, spans) == [any(e > a and s < b for a, b in spans) for s, e in offsets]


def test_generation_block_inside_a_macro(tokenizers):
    """Spans come from markers in the output, so a `{% generation %}` block inside a macro (whose output Jinja
    buffers) is located right; counting the characters emitted so far, as transformers does, is not enough
    there (in transformers 5.24 the last reply of this conversation gets no span)."""
    ours, _ = tokenizers
    source = (
        "{% macro reply(m) %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% endmacro %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{{ reply(m) }}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    )
    ids, mask = ChatTemplate(source, "t").encode(ours, CONVERSATION)
    segments, current = [], []
    for token, trained in zip([*ids, None], [*mask, False]):
        if trained:
            current.append(token)
        elif current:
            segments.append(ours.decode(current))
            current = []
    assert segments == [
        "Four.<|im_end|>",
        "<|im_end|>",
        "<think>\nThe tool says 18.\n</think>\nIt is 18 degrees and clear in Paris.<|im_end|>",
    ]


def test_content_given_as_parts(tokenizers):
    """Content as a list of {type: text} parts, rendered by a macro as the released Step-3.5 template does:
    the sentinel method puts its sentinels into the parts and agrees with transformers on the marked copy."""
    ours, theirs = tokenizers
    source = (
        "{% macro text(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
        "{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}[[GEN]]"
        "{{ text(m.content) }}{{ '<|im_end|>' }}[[/GEN]]{% else %}{{ text(m.content) + '<|im_end|>' }}{% endif %}"
        "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    parts = [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at "}, {"type": "text", "text": "this."},  # (an image part is refused)
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}, {"type": "text", "text": " Asleep."}]},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": [{"type": "text", "text": "You are welcome."}]},
    ]  # fmt: skip
    marked_source = source.replace("[[GEN]]", "{% generation %}").replace("[[/GEN]]", "{% endgeneration %}")
    expected = reference_mask(theirs, marked_source, parts)
    plain_source = source.replace("[[GEN]]", "").replace("[[/GEN]]", "")
    assert ChatTemplate(plain_source, "t").encode(ours, parts) == expected
    assert trained_text(ours, *expected) == "A cat. Asleep.<|im_end|>You are welcome.<|im_end|>"


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_conversation_shapes(tokenizers, name):
    """A trailing user message, two assistant messages in a row, and a conversation the assistant opens (the
    Step-style templates cannot render an empty history: the prompt after a user message stands in) all give
    transformers' mask; an empty assistant reply is refused by name."""
    ours, theirs = tokenizers
    shapes = [
        [*CONVERSATION[1:3], {"role": "user", "content": "More?"}],
        [*CONVERSATION[1:3], {"role": "assistant", "content": "Also five."}],
        [{"role": "assistant", "content": "Ask me."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes?"}],
    ]  # fmt: skip
    for messages in shapes:
        assert ChatTemplate(plain(name), "t").encode(ours, messages) == reference_mask(theirs, marked(name), messages)
    empty = [CONVERSATION[1], {"role": "assistant", "content": ""}]
    with pytest.raises(ChatTemplateError, match=r"e.jsonl:7: assistant message 1 is empty \(no content, reasoning"):
        ChatTemplate(plain(name), "t").encode(ours, empty, where="e.jsonl:7")


def test_last_assistant_with_several_blocks_per_turn(tokenizers):
    """A marked template with one block for the content and one for the tool calls: with last_assistant, an
    assistant message right before the last one keeps both of its blocks out of the mask."""
    ours, _ = tokenizers
    source = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{% endgeneration %}"
        "{% generation %}{% for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + '</tool_call>' }}"
        "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
    messages = [
        CONVERSATION[1],
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "assistant", "content": "Four."},
    ]
    ids, mask = ChatTemplate(source, "t").encode(ours, messages, train_on="last_assistant")
    assert trained_text(ours, ids, mask) == "Four.<|im_end|>"
    ids, mask = ChatTemplate(source, "t").encode(ours, messages)
    assert trained_text(ours, ids, mask) == "Let me look.<tool_call>get_weather</tool_call><|im_end|>Four.<|im_end|>"


# ------------------------------------------------------------------------------------ train_reasoning=False


def reasoning_outside(name: str) -> str:
    """The marked copy of template `name` with the reasoning text itself rendered outside the generation blocks
    (its `<think>`/`</think>` wrappers inside): transformers' mask on it is the independent reference for
    train_reasoning=False. It renders the same text as the template."""
    source = SOURCES[name]
    if name == "chatml":
        old = "[[GEN]]{%- if m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n' }}"
        old += "{%- endif -%}"
        new = (
            "{%- if m.reasoning_content -%}[[GEN]]{{ '<think>\\n' }}[[/GEN]]{{ m.reasoning_content }}"
            "[[GEN]]{{ '\\n</think>\\n' }}[[/GEN]]{%- endif -%}[[GEN]]"
        )
    else:
        opener = "" if name in ("step-b", "step-c") else "{{ '<think>\\n' }}"
        old = "[[GEN]]{%- if recent -%}" + opener + "{{ reasoning + '\\n</think>\\n' }}{%- endif -%}"
        new = (
            "{%- if recent -%}" + ("[[GEN]]" + opener + "[[/GEN]]" if opener else "")
            + "{{ reasoning }}[[GEN]]{{ '\\n</think>\\n' }}[[/GEN]]{%- endif -%}[[GEN]]"
        )  # fmt: skip
    assert source.count(old) == 1
    return source.replace(old, new).replace("[[GEN]]", "{% generation %}").replace("[[/GEN]]", "{% endgeneration %}")


def as_fields(messages: list) -> list:
    """`messages` with a `<think>` block at the start of an assistant content moved to reasoning_content."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and content.startswith("<think>\n"):
            reasoning, content = content[len("<think>\n") :].split("\n</think>\n", 1)
            m = {**m, "reasoning_content": reasoning, "content": content}
        out.append(m)
    return out


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("messages", [CONVERSATION, TOOL_ROUNDS], ids=["conversation", "tool-rounds"])
def test_untrained_reasoning_equals_transformers_with_reasoning_outside_the_blocks(tokenizers, name, messages):
    """train_reasoning=False, on the plain template (sentinels) and the marked one (generation marks), gives
    transformers' mask on a copy that renders the reasoning outside its generation blocks; reasoning given as
    a field (under two names) and inline in the content (whose reference is the same conversation with the
    block moved to a field: it renders the same text)."""
    ours, theirs = tokenizers
    expected_ids, reference = reference_mask(theirs, reasoning_outside(name), as_fields(messages))
    last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    start = len(ChatTemplate(plain(name), "t").prompt_ids(ours, messages[:last]))  # the final turn's reply
    for train_on in ("assistant", "last_assistant"):
        expected_mask = [m and (train_on == "assistant" or k >= start) for k, m in enumerate(reference)]
        for source in (plain(name), marked(name)):
            template = ChatTemplate(source, "test")
            ids, mask = template.encode(ours, messages, train_on=train_on, train_reasoning=False)
            assert ids == expected_ids
            assert mask == expected_mask, f"{name} {train_on}: {trained_text(ours, ids, mask)!r}"
    _, with_reasoning = ChatTemplate(plain(name), "test").encode(ours, messages)
    text, full = trained_text(ours, expected_ids, reference), trained_text(ours, expected_ids, with_reasoning)
    thoughts = ("Add the two numbers.", "I need the weather", "The tool says 18.", "Both answered.", "A third city")
    assert not any(t in text for t in thoughts) and any(t in full for t in thoughts)
    assert "</think>" in text and text.count("<|im_end|>") == full.count("<|im_end|>")
    assert ("get_weather" in text) and ("Paris 18, Rome 24." in text or "18 degrees and clear" in text)


@pytest.mark.parametrize("name", ["chatml", "step-b"])
def test_untrained_reasoning_with_train_on_all_and_in_text_parts(tokenizers, name):
    """With train_on="all" only the reasoning's tokens are untrained: exactly the tokens an assistant mask loses
    to train_reasoning=False. A `<think>` block inside a text part counts as reasoning too."""
    ours, _ = tokenizers
    template = ChatTemplate(plain(name), "test")
    ids, every = template.encode(ours, CONVERSATION, train_on="all", train_reasoning=False)
    _, assistant = template.encode(ours, CONVERSATION)
    _, thoughtless = template.encode(ours, CONVERSATION, train_reasoning=False)
    assert [not m for m in every] == [a and not t for a, t in zip(assistant, thoughtless)]
    assert 0 < every.count(False) < len(ids)

    parts = [*CONVERSATION[:6], {"role": "assistant", "content": "x"}]
    parts[6] = {**CONVERSATION[6], "content": [{"type": "text", "text": CONVERSATION[6]["content"]}]}
    flat = "{% for m in messages %}{% generation %}{% if m.content is string %}{{ m.content }}{% else %}"
    flat += "{{ m.content[0].text }}{% endif %}<|im_end|>{% endgeneration %}{% endfor %}"  # renders parts verbatim
    _, mask = ChatTemplate(flat, "test").encode(ours, parts, train_on="last_assistant", train_reasoning=False)
    _, kept = ChatTemplate(flat, "test").encode(ours, parts, train_on="last_assistant")
    full_ids = ours.tokenizer.encode(ChatTemplate(flat, "t").render(parts), add_special_tokens=False).ids
    assert "The tool says 18." in trained_text(ours, full_ids, kept)
    assert trained_text(ours, full_ids, mask).startswith("<think>\n\n</think>\nIt is 18 degrees")


def test_untrained_reasoning_errors(tokenizers):
    ours, _ = tokenizers
    template = ChatTemplate(plain("chatml"), "test")
    with pytest.raises(ChatTemplateError, match=r"data.jsonl:4: train_reasoning='no'; expected true or false"):
        template.encode(ours, CONVERSATION, train_reasoning="no", where="data.jsonl:4")
    # A template that renders something the reasoning decides besides the reasoning: located by no rule, so an error.
    counted = plain("chatml").replace(
        "m.reasoning_content + '\\n</think>\\n'",
        "m.reasoning_content + '\\n</think>' + (m.reasoning_content | length | string)",
    )
    with pytest.raises(ChatTemplateError, match=r"r.jsonl:2: assistant message 2: replacing its reasoning changes"):
        ChatTemplate(counted, "test").encode(ours, CONVERSATION, train_reasoning=False, where="r.jsonl:2")
    assert ChatTemplate(counted, "test").encode(ours, CONVERSATION)  # trained reasoning needs no location
