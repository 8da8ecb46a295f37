"""The built-in conversation set (step35/data/builtin_chat.py): made offline from the built-in corpus."""

import json

import pytest

from step35.data.builtin import builtin_documents
from step35.data.builtin_chat import builtin_chat_path, builtin_conversations


@pytest.mark.heavy  # the whole built-in conversation set
def test_conversations_are_well_formed_and_answer_from_the_corpus(tmp_path):
    conversations = builtin_conversations()
    assert len(conversations) > 300
    corpus = " ".join(" ".join(line.strip() for line in doc.splitlines()) for doc in builtin_documents())
    multi_turn = 0
    for conversation in conversations:
        messages = conversation["messages"]
        roles = [m["role"] for m in messages]
        assert roles[-1] == "assistant" and set(roles) <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) and m["content"] for m in messages)
        multi_turn += roles.count("assistant") > 1
        for m in messages:
            if m["role"] == "assistant":  # every answer is the documentation's own text
                assert " ".join(m["content"].split()) in " ".join(corpus.split()), m["content"]
    assert multi_turn > 100

    path = builtin_chat_path(tmp_path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == conversations
    assert builtin_chat_path(tmp_path) == path and path.stat().st_mode & 0o777 == 0o644
