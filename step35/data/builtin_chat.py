"""A conversation set that needs no download: questions and answers made from the built-in corpus's text.

Every document of the built-in corpus (builtin.py: the pydoc topics of Python's language reference and the
docstrings of the stdlib modules) has a subject (a topic's title, e.g. 'The "for" statement', or a module's
name) and paragraphs. Each becomes conversations whose answers are that document's own sentences:

  * a question about the subject, answered by the first paragraph;
  * the same with a system prompt, and a follow-up turn answered by the second paragraph (multi-turn);
  * a rephrased question answered by the first sentence alone.

The questions come from a few fixed phrasings, so a model that learns the mapping from a subject to its
text lowers its loss on the answers; the prompts themselves carry little to learn. About 450 conversations,
0.3 MB. Written once, atomically, as jsonl of {"messages": [...]} under the same cache as the corpus.

The built-in preference pairs (`builtin_preference_pairs`, for `data.format: preference` with no files) are
made from these conversations, with no model and no randomness: each conversation's last assistant turn is
the chosen reply, the prompt is everything before it (so a multi-turn conversation's first answer is context),
and the rejected reply is the same turn of another conversation of the same kind (one question form, same
turn count), half the list away, about another subject: a fluent answer to the wrong question.
"""

import json
import platform
import re
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from step35.data.builtin import cache_root, module_docstring, write_atomically

SYSTEM_PROMPT = "You answer questions about Python from its documentation, in its own words."
MAX_ANSWER_CHARS = 420  # an answer stops at the last sentence end before this (the tiny job's windows are short)
_UNDERLINE = re.compile(r"^[*=\-~^]{3,}$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def builtin_conversations() -> list[dict]:
    """The conversations, in a fixed order (topics by name, then modules by file name)."""
    from pydoc_data.topics import topics

    subjects = []
    for name in sorted(topics):
        title, paragraphs = _split_topic(topics[name])
        title = title or name
        subjects.append((title[0].lower() + title[1:] if title.startswith("The ") else title, paragraphs, "topic"))
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        docstring = module_docstring(file)
        if docstring and len(docstring) > 200:
            subjects.append((f"the {file.stem} module", _paragraphs(docstring), "module"))
    conversations = []
    for subject, paragraphs, kind in subjects:
        if not paragraphs:
            continue
        conversations.extend(_conversations_about(subject, paragraphs, kind))
    return conversations


def _conversations_about(subject: str, paragraphs: list[str], kind: str) -> list[dict]:
    first = _answer(paragraphs[0])
    ask = f"What does the documentation say about {subject}?" if kind == "topic" else f"What is {subject} for?"
    found = [
        {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": first}]},
        {"messages": [{"role": "user", "content": f"In one sentence: {subject}?"},
                      {"role": "assistant", "content": _first_sentence(first)}]},
    ]  # fmt: skip
    if len(paragraphs) > 1:
        found.append({"messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Tell me about {subject}."},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": _answer(paragraphs[1])},
        ]})  # fmt: skip
    return found


def _split_topic(text: str) -> tuple[str | None, list[str]]:
    """(title, paragraphs) of a pydoc topic: a title line underlined with `*` or `=`, then paragraphs."""
    lines = text.strip("\n").splitlines()
    if len(lines) > 1 and _UNDERLINE.match(lines[1].strip()):
        return lines[0].strip(), _paragraphs("\n".join(lines[2:]))
    return None, _paragraphs(text)


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs, each on one line: blocks separated by blank lines, without indented blocks
    (grammar rules, code examples) and without section headings (underlined lines)."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or lines[0].startswith((" ", "\t")) or any(_UNDERLINE.match(line.strip()) for line in lines):
            continue
        paragraph = " ".join(line.strip() for line in lines)
        if len(paragraph) >= 40:
            found.append(paragraph)
    return found


def _answer(paragraph: str) -> str:
    """The paragraph up to the last sentence end within MAX_ANSWER_CHARS (or cut there, when none is)."""
    if len(paragraph) <= MAX_ANSWER_CHARS:
        return paragraph
    ends = [m.start() for m in _SENTENCE_END.finditer(paragraph, 0, MAX_ANSWER_CHARS)]
    return paragraph[: ends[-1]] if ends else paragraph[:MAX_ANSWER_CHARS]


def _first_sentence(text: str) -> str:
    found = _SENTENCE_END.search(text)
    return text[: found.start()] if found else text


def builtin_preference_pairs() -> list[dict]:
    """The preference pairs, conversational: {"prompt": [...], "chosen": [reply], "rejected": [reply]}, in
    the order of `builtin_conversations`."""
    conversations = [c["messages"] for c in builtin_conversations()]
    kinds: dict[tuple, list[int]] = {}  # one question form: turn count, first role, the question's start
    for i, messages in enumerate(conversations):
        kinds.setdefault((len(messages), messages[0]["role"], messages[-2]["content"][:8]), []).append(i)
    pairs = []
    for members in kinds.values():
        for k, i in enumerate(members):
            chosen = conversations[i][-1]
            others = members[k + len(members) // 2 :] + members[: k + len(members) // 2]
            rejected = next((conversations[j][-1] for j in others if conversations[j][-1] != chosen), None)
            if rejected is not None:
                pairs.append((i, {"prompt": conversations[i][:-1], "chosen": [chosen], "rejected": [rejected]}))
    return [pair for _, pair in sorted(pairs, key=lambda item: item[0])]


def builtin_jsonl(name: str, records: Callable[[], list[dict]], cache_dir: str | Path | None = None) -> Path:
    """`records()` as jsonl in the cache (one record per line), written on first use. Keyed by interpreter
    version, like the corpus: the text comes from the interpreter's own stdlib."""
    path = cache_root(cache_dir) / f"{name}-{sys.implementation.name}-{platform.python_version()}.jsonl"
    if not path.exists():
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records())
        write_atomically(path, lines.encode("utf-8"))
    return path


def builtin_preference_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in preference pairs as jsonl (one record per line), written on first use."""
    return builtin_jsonl("preference", builtin_preference_pairs, cache_dir)


def builtin_chat_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in conversations as jsonl (one {"messages": [...]} per line), written on first use."""
    return builtin_jsonl("chat", builtin_conversations, cache_dir)
