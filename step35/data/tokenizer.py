"""A Hugging Face tokenizer folder loaded with the `tokenizers` library, plus the EOS id that separates documents."""

import json
from pathlib import Path
from typing import Any, Callable, Optional


class TextTokenizer:
    """Encodes one document to token ids, without special tokens; the stream appends `eos_token_id` itself."""

    def __init__(self, tokenizer: Any, eos_token_id: int, path: Path) -> None:
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer; picklable, so it travels to DataLoader workers
        self.eos_token_id = eos_token_id
        self.path = path
        if not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"EOS id {eos_token_id} is outside the vocabulary of {path} (size {self.vocab_size})")

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_id: Optional[int] = None) -> "TextTokenizer":
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


def eos_token_id_from(read: Callable[[str], dict], tokenizer: Any, where: str | Path) -> Optional[int]:
    """step35's one rule for a tokenizer's end-of-text id (the data stream's document separator, the id
    `step35 export` and `step35 generate` take as the tokenizer's EOS), first found wins:
      1. tokenizer_config.json "eos_token" (a string or {"content": ...}) looked up in the vocabulary;
      2. config.json, then generation_config.json, "eos_token_id" (the first entry if it is a list);
      3. special_tokens_map.json "eos_token", looked up.
    `read(name)` returns a file's JSON object ({} when the file is absent); `tokenizer` is a
    tokenizers.Tokenizer. None when no file names one; a ValueError naming the file when a named
    token is not in the vocabulary."""

    def token_id(token: Any, source: str) -> Optional[int]:
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
