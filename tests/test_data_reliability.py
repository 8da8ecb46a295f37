"""Issue 42 (reliability round 4), the data slice: a chat template's own size buys no rendering budget and is
capped; a deeply nested JSON record is a bad record named by file:line in every format that parses JSON; a
preference pair whose replies are identical, as given or once cut to the window, is a bad record."""

from __future__ import annotations

import json
import re

import pytest

from step35.data.chat_messages import ChatTemplateError
from step35.data.chat_template import TEMPLATE_MAX_CHARS, ChatTemplate
from step35.data.sft import resolve_template

CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
# Outputs 2,000,000 characters: over the budget of a two-message rendering (1 MiB + 100 x its input), well
# under the budget the old rule gave a template with a 900 KB comment (1 MiB + 100 x 900 KB).
LOOP = "{% for i in range(2000) %}{{ 'y' * 1000 }}{% endfor %}"


# ---------------------------------------------------------------------------- item 1: the template's size


def test_a_huge_comment_buys_no_rendering_budget():
    """The budget was 1 MiB + 100 x (template + input): a 50 MB comment bought a 5 GB string (a fit reached
    4.2 GB before its watchdog). Now the budget counts what is rendered only."""
    comment = "{# " + "c" * (900 * 1024) + " #}"
    with pytest.raises(ChatTemplateError, match=r"^chat template from padded\.jinja refused: the output would make"):
        ChatTemplate(comment + LOOP, "padded.jinja").render(CONVERSATION)


def test_ordinary_templates_still_render_with_a_comment():
    comment = "{# " + "c" * (900 * 1024) + " #}"
    source = comment + "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert ChatTemplate(source, "padded.jinja").render(CONVERSATION) == "user: Hi\nassistant: Hello.\n"


def over_cap_template() -> str:
    return "{# " + "c" * TEMPLATE_MAX_CHARS + " #}{{ messages[0].content }}"


def test_a_template_over_the_cap_is_refused_naming_its_source(tmp_path):
    source = over_cap_template()
    cap = f"{len(source)} characters, over step35's cap of {TEMPLATE_MAX_CHARS} for a chat template"
    (tmp_path / "chat_template.jinja").write_text(source)
    with pytest.raises(ChatTemplateError, match=re.escape(f"{tmp_path / 'chat_template.jinja'}: {cap}")):
        ChatTemplate.from_folder(tmp_path)

    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with pytest.raises(ChatTemplateError, match=re.escape(f"{tmp_path / 'tokenizer_config.json'} (its chat_template")):
        ChatTemplate.from_folder(tmp_path)

    override = tmp_path / "override.jinja"
    override.write_text(source)
    with pytest.raises(ChatTemplateError, match=re.escape(f"data.chat_template: chat template from {override}: {cap}")):
        resolve_template(tmp_path, str(override))


def test_a_template_at_the_cap_is_accepted():
    source = "{{ messages[0].content }}"
    source += "{# " + "c" * (TEMPLATE_MAX_CHARS - len(source) - 6) + " #}"
    assert len(source) == TEMPLATE_MAX_CHARS
    assert ChatTemplate(source, "big.jinja").render(CONVERSATION) == "Hi"
