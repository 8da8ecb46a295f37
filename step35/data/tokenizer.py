"""A Hugging Face tokenizer folder loaded with the `tokenizers` library, plus the EOS id that separates documents.

Long documents are tokenized in pieces (`TextTokenizer.pieces`): `tokenizers` holds a few hundred bytes per
character while it encodes (a 50 MB line peaked at 9.2 GB), so a book-sized document is cut into pieces of
about `PIECE_CHARS` characters and only one piece's tokens exist at a time.

Where a piece may end: right before a single space that has a non-space on both sides (`word| next`). The
pre-tokenizers of byte-level BPE tokenizers (GPT-2's regex, the Llama-3 / Qwen style `Split` regex followed by
`ByteLevel`) start a new pre-token at such a space, and BPE never merges across pre-tokens, so the pieces'
tokens, concatenated, are the whole document's tokens (tests/test_data_long_documents.py checks this on real
text for both styles). Where they can differ: a stretch of `PIECE_CHARS` characters without such a space
(minified code, base64, unspaced CJK text) is cut inside, and the tokens around that cut may differ; so may
a tokenizer whose normalizer or pre-tokenizer works across spaces (a SentencePiece-style normalizer that
prepends "▁" to the text prepends it to every piece). The first long document checks the tokenizer on a probe
text and warns once if pieces differ there.
"""

import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PIECE_CHARS = 1 << 18  # a piece holds 256 to 512 Ki characters: 40 to 80 MB of tokenizer memory (~160 B/char)
_CUT = re.compile(r"(?<=\S) (?=\S)")  # a single space between two non-spaces: a new pre-token starts there


class TextTokenizer:
    """Encodes one document to token ids, without special tokens; the stream appends `eos_token_id` itself."""

    def __init__(self, tokenizer: Any, eos_token_id: int, path: Path) -> None:
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer; picklable, so it travels to DataLoader workers
        self.eos_token_id = eos_token_id
        self.path = path
        self._piecewise_checked = False
        if not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"EOS id {eos_token_id} is outside the vocabulary of {path} (size {self.vocab_size})")

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_id: int | None = None) -> "TextTokenizer":
        """Load `folder/tokenizer.json` (or a tokenizer.json path); EOS from `eos_token_id` or the folder's files.

        The EOS rule, first match wins:
          1. the explicit `eos_token_id`;
          2. `tokenizer_config.json` "eos_token" (a string or {"content": ...}) looked up in the vocabulary;
          3. `config.json`, then `generation_config.json`, "eos_token_id" (the first entry if it is a list);
          4. `special_tokens_map.json` "eos_token".
        The tokenizer's own config says what the tokenizer calls EOS; the model configs say what the model
        was trained to end documents with, which is the same id for every released model we know of.
        """
        from tokenizers import Tokenizer

        path = Path(folder).expanduser()
        file = path if path.is_file() else path / "tokenizer.json"
        if not file.is_file():
            found = sorted(p.name for p in path.iterdir()) if path.is_dir() else None
            raise FileNotFoundError(
                f"tokenizer {str(path)!r}: no tokenizer.json there"
                + (f" (the folder holds {found})" if found is not None else " (no such folder)")
                + "; expected a Hugging Face tokenizer folder with tokenizer.json"
            )
        tokenizer = Tokenizer.from_file(str(file))
        # Some released tokenizer.json files switch truncation or padding on; either would silently cut documents.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        if eos_token_id is None:
            eos_token_id = find_eos_token_id(file.parent, tokenizer)
        return cls(tokenizer, eos_token_id, file.parent)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # No special tokens: a BOS or template added here would be a token the packing test cannot account for.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def pieces(self, text: str, start: int = 0, piece_chars: int | None = None) -> Iterator[tuple[int, list[int]]]:
        """(where the piece starts in `text`, its ids) for the pieces of `text` from character `start` on.

        `start` must be 0 or a piece start yielded before: the cuts depend only on where a piece starts, so a
        resume that starts at a saved piece gets the same pieces. A text of at most `2 * piece_chars` characters is one
        piece, tokenized whole (`encode`). The module docstring says where cuts go and when tokens can differ.
        """
        limit = piece_chars or PIECE_CHARS
        while True:
            end = cut_after(text, start, limit)
            if end < len(text) or start > 0:
                self.check_piecewise_exact()
            yield start, self.encode(text[start:end])
            if end >= len(text):
                return
            start = end

    def check_piecewise_exact(self) -> None:
        """Warn once if this tokenizer gives other tokens in pieces than whole on a probe text (e.g. a
        SentencePiece-style normalizer that prepends "▁" to every piece): long documents then differ slightly."""
        if self._piecewise_checked:
            return
        self._piecewise_checked = True
        probe = "Hello world. It's 2026, aren't we? x=f(a, b)  # done\n\tA second line; numbers 12345 and émigrés."
        whole = self.encode(probe)
        cuts = [0, *(m.start() for m in _CUT.finditer(probe)), len(probe)]
        pieces = [i for a, b in zip(cuts, cuts[1:]) for i in self.encode(probe[a:b])]
        if pieces != whole:
            warnings.warn(
                f"tokenizer {self.path}: tokenizing at spaces gives other tokens than tokenizing whole; documents"
                f" over {2 * PIECE_CHARS} characters are tokenized in pieces (to bound memory), so their tokens can"
                " differ slightly at the piece borders",
                stacklevel=3,
            )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def find_eos_token_id(folder: Path, tokenizer: Any) -> int:
    """The EOS id of a tokenizer folder by the rule of `eos_token_id_from`; an error naming the folder
    when none of its files names one."""

    def read(name: str) -> dict:
        file = folder / name
        if not file.is_file():
            return {}
        with open(file, encoding="utf-8") as f:
            content = json.load(f)
        return content if isinstance(content, dict) else {}

    found = eos_token_id_from(read, tokenizer, folder)
    if found is None:
        raise ValueError(
            f"tokenizer {str(folder)!r}: cannot tell the EOS token (no eos_token in tokenizer_config.json or"
            " special_tokens_map.json, no eos_token_id in config.json or generation_config.json); pass eos_token_id"
        )
    return found


def eos_token_id_from(read: Callable[[str], dict], tokenizer: Any, where: str | Path) -> int | None:
    """step35's one rule for a tokenizer's end-of-text id (the data stream's document separator, the id
    `step35 export` and `step35 generate` take as the tokenizer's EOS), first found wins:
      1. tokenizer_config.json "eos_token" (a string or {"content": ...}) looked up in the vocabulary;
      2. config.json, then generation_config.json, "eos_token_id" (the first entry if it is a list);
      3. special_tokens_map.json "eos_token", looked up.
    `read(name)` returns a file's JSON object ({} when the file is absent); `tokenizer` is a
    tokenizers.Tokenizer. None when no file names one; a ValueError naming the file when a named
    token is not in the vocabulary."""

    def token_id(token: Any, source: str) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{Path(where) / source}: eos_token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    found = token_id(read("tokenizer_config.json").get("eos_token"), "tokenizer_config.json")
    if found is not None:
        return found
    for name in ("config.json", "generation_config.json"):
        value = read(name).get("eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    return token_id(read("special_tokens_map.json").get("eos_token"), "special_tokens_map.json")


def cut_after(text: str, start: int, piece_chars: int) -> int:
    """Where the piece of `text` starting at `start` ends: the first safe cut (see the module docstring) at
    least `piece_chars` characters on, else a hard cut `2 * piece_chars` on; `len(text)` when the rest fits."""
    if len(text) - start <= 2 * piece_chars:
        return len(text)
    found = _CUT.search(text, start + piece_chars, start + 2 * piece_chars)
    return found.start() if found is not None else start + 2 * piece_chars
