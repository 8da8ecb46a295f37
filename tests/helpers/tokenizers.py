"""Tokenizers trained or written here: a byte-level BPE trained on the test's texts, and word-level tokenizer
folders whose tokens are whole words (<eos> WORD_EOS, <unk> 1, the words from 2), so that every token of a
test's data traces back to a word."""

from __future__ import annotations

from pathlib import Path


def train_byte_bpe(texts: list[str], special_tokens: list[str], folder, vocab_size: int = 400):
    """A byte-level BPE (tokenizers' Tokenizer) trained on `texts` here, saved as `folder`/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    return tokenizer


WORD_EOS = 0  # <eos> of the word-level tokenizers below (<unk> is 1, their words follow from 2)


def word_tokenizer_folder(folder: Path, words: list[str], chat_template: str | None = None) -> Path:
    """A tokenizer folder at `folder` whose tokens are whole words (split at whitespace): <eos> WORD_EOS,
    <unk> 1, then `words` in order; with `chat_template`, its chat_template.jinja."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<eos>": WORD_EOS, "<unk>": 1} | {w: i + 2 for i, w in enumerate(words)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    return folder
