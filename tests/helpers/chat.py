"""Conversations traceable word by word (the chat and preference data tests): the word-level chat tokenizer
(CHAT_WORDS) with its generation-marked template, and a FileSource of whole chat records."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.tokenizers import WORD_EOS, word_tokenizer_folder

# Conversations traceable word by word (the chat data tests): a conversation renders as `<role> <words>` per
# turn, an assistant turn as `assistant <words> <eos>` with the words and the EOS trained.
CHAT_ROLES = ["system", "user", "assistant", "tool"]
CHAT_WORDS = CHAT_ROLES + [f"c{i}" for i in range(400)] + [f"w{i}" for i in range(50)]
CHAT_IDS = {"<eos>": WORD_EOS, "<unk>": 1} | {w: i + 2 for i, w in enumerate(CHAT_WORDS)}
# Generation marks around the trained part: the assistant's words and the EOS that ends its turn.
CHAT_WORD_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}assistant {% generation %}{{ m.content }} {{ eos_token }}"
    "{% endgeneration %} {% else %}{{ m.role }} {{ m.content }} {% endif %}{% endfor %}"
)


def make_chat_tokenizer(folder: Path, template: bool = False) -> Path:
    """The tokenizer folder of CHAT_WORDS at `folder`, with CHAT_WORD_TEMPLATE as its chat template when `template`."""
    return word_tokenizer_folder(folder, CHAT_WORDS, CHAT_WORD_TEMPLATE if template else None)


def chat_source(name: str, files: list[Path], **kwargs):
    """A FileSource of whole chat records."""
    from step35.data.sources import FileSource

    source = FileSource(name, files, whole_records=True, **kwargs)
    source.format = "chat"
    return source
