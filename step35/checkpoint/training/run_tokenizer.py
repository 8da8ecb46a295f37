"""The tokenizer a run trained with, carried inside every training checkpoint.

The data module resolves its tokenizer at setup (data.tokenizer, the HF checkpoint folder's own, or
the built-in BPE trained into a cache folder). A path alone would not survive a cleaned cache or a
checkpoint copied to another machine, so the module stores the folder's tokenizer files themselves
(a few MB at most) under `keys.TOKENIZER` (`step35_tokenizer`), with the EOS id the data stream put
between documents. `step35 export` writes them next to the weights; `step35 generate` encodes with them.

The EOS id is read by the data stream's own rule (step35/data/tokenizer.py); bos and pad ids the way
`transformers.AutoTokenizer` reads them: the token strings of tokenizer_config.json (else
special_tokens_map.json) looked up in tokenizer.json's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.folder import own_files
from step35.checkpoint.training import keys

# What a Hugging Face tokenizer folder may hold (fast and slow tokenizers, chat templates) plus the
# generation config, which names the same special ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def folder_files(folder: str | Path) -> dict[str, bytes]:
    """The TOKENIZER_FILES at the top of `folder`, looked up by name (the folder may be named by a
    checkpoint from elsewhere: nothing else of it is read); a folder without tokenizer.json is refused,
    and so is one whose tokenizer file links outside it (`own_files`): these bytes are recorded in every
    checkpoint and published by every export, and leaving one file out would change the tokenizer."""
    folder = Path(folder).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder}: no tokenizer.json there (expected a Hugging Face tokenizer folder)")
    files, outside = own_files(folder, TOKENIZER_FILES)
    if outside:
        name, target = next(iter(outside.items()))
        raise CheckpointError(
            f"{folder / name}: a link to {target}, outside the tokenizer folder {folder}: refused (the tokenizer "
            "files are copied into checkpoints and exports); put a copy of the file there instead of the link"
        )
    return {name: file.read_bytes() for name, file in files.items()}


def record(folder: str | Path, eos_token_id: int) -> dict[str, Any]:
    """What a checkpoint holds under `keys.TOKENIZER`: where the tokenizer was, its files, the run's EOS id."""
    return {
        "source": str(Path(folder).expanduser().resolve()),
        "eos_token_id": int(eos_token_id),
        "files": folder_files(folder),
    }


def read_record(value: Any, where: str | Path) -> dict[str, Any]:
    """A checkpoint's record, checked for shape (it came from a file)."""
    ok = (
        isinstance(value, dict)
        and isinstance(value.get("files"), dict)
        and isinstance(value.get("source"), str)
        and all(isinstance(k, str) and isinstance(v, bytes) for k, v in value["files"].items())
        and "tokenizer.json" in value["files"]
        and isinstance(value.get("eos_token_id"), int)
    )
    if not ok:
        raise CheckpointError(
            f"{where}: {keys.TOKENIZER} is malformed (expected files with tokenizer.json, an "
            "eos_token_id and its source folder); pass the tokenizer folder explicitly"
        )
    unknown = sorted(set(value["files"]) - set(TOKENIZER_FILES))
    if unknown:
        raise CheckpointError(f"{where}: {keys.TOKENIZER} holds files that are no tokenizer files: {unknown}")
    return value


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    pad: int | None


def special_ids(files: dict[str, bytes], where: str | Path = "tokenizer") -> SpecialIds:
    """bos/eos/pad ids of a tokenizer's files. EOS by step35's one rule (`step35.data.tokenizer.
    eos_token_id_from`, the one the data stream separates documents with); bos and pad as AutoTokenizer
    reports them: tokenizer_config.json's token strings (else special_tokens_map.json's) looked up in
    the vocabulary. None where no file names the token."""
    from tokenizers import Tokenizer

    from step35.data.tokenizer import eos_token_id_from

    tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))

    def read(name: str) -> dict:
        if name not in files:
            return {}
        try:
            content = json.loads(files[name])
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{where}/{name}: not valid JSON ({e})") from None
        return content if isinstance(content, dict) else {}

    try:
        found = {"eos": eos_token_id_from(read, tokenizer, where)}
    except CheckpointError:
        raise
    except ValueError as e:  # a named token outside the vocabulary
        raise CheckpointError(str(e)) from None
    config, special_map = read("tokenizer_config.json"), read("special_tokens_map.json")
    for kind in ("bos", "pad"):
        token = config.get(f"{kind}_token", special_map.get(f"{kind}_token"))
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            found[kind] = None
            continue
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{where}: {kind}_token {token!r} is not in the vocabulary of tokenizer.json")
        found[kind] = token_id
    return SpecialIds(**found)
