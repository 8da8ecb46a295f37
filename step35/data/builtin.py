"""A corpus and tokenizer that need no download: text that ships with Python itself.

Documents: every entry of the stdlib's `pydoc_data.topics.topics` (the language reference pages `help()` shows),
then the module docstrings (over 200 characters) of the top-level stdlib modules, read from the source so that
no module is imported (some have side effects, e.g. `antigravity`). About 160 documents, 0.6 MB.

Tokenizer: byte-level BPE trained on that corpus with the `tokenizers` library, saved as a Hugging Face
tokenizer folder with step35's default chat template (`chat_template.jinja`, see chat_template.py), so that runs on it
record the template in their checkpoints and exports, and `step35 generate --chat` finds it. Ids: 0 is `<|endoftext|>` (EOS, the document separator); 1..256 are the 256 byte symbols;
the rest are merges. It trains in well under a second. With `image_tokens` (runs with data.images), Step-3.7's six
image tokens (images.ImageTokens: `<im_patch>` first) are added as special tokens right after the merges: a
vocab_size of 1000 puts `<im_patch>` at 1000, the `tiny-vl` preset's image_token_id.

Both are cached under `cache_dir`, else `$STEP35_CACHE`, else `~/.cache/step35`, and written atomically
(temp file or folder, then rename) so processes racing on first use never see a half-written file.
"""

import ast
import hashlib
import inspect
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import tokenize
from pathlib import Path

from step35.data.chat_template import TEMPLATE_FILE, ChatTemplate

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # EOS + 256 byte symbols: every string stays encodable


def cache_root(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir or os.environ.get("STEP35_CACHE") or Path.home() / ".cache" / "step35").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def builtin_documents() -> list[str]:
    """The corpus's documents, in a fixed order (topics by name, then modules by file name)."""
    from pydoc_data.topics import topics

    documents = [topics[name] for name in sorted(topics)]
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        docstring = module_docstring(file)
        if docstring and len(docstring) > 200:
            documents.append(docstring)
    return documents


def module_docstring(file: Path) -> str | None:
    """What `ast.get_docstring` returns, from the file's first tokens: parsing whole modules is 30x slower."""
    try:
        with tokenize.open(file) as f:
            for token in tokenize.generate_tokens(f.readline):
                if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                    continue
                if token.type != tokenize.STRING:
                    return None
                value = ast.literal_eval(token.string)
                return inspect.cleandoc(value) if isinstance(value, str) else None
    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError, ValueError):
        return None
    return None


def builtin_corpus_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in corpus as jsonl (one {"text": ...} per line), written on first use."""
    # Keyed by interpreter version because the text comes from the interpreter's own stdlib.
    path = cache_root(cache_dir) / f"corpus-{sys.implementation.name}-{platform.python_version()}.jsonl"
    if not path.exists():
        lines = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in builtin_documents())
        write_atomically(path, lines.encode("utf-8"))
    return path


def builtin_tokenizer_dir(
    vocab_size: int = 1024, cache_dir: str | Path | None = None, image_tokens: bool = False
) -> Path:
    """A tokenizer folder (tokenizer.json, tokenizer_config.json, special_tokens_map.json) trained on first use.

    `vocab_size` is an upper bound: BPE stops early when the corpus has no more pairs to merge.
    Cached by vocab size and a hash of the corpus, so a changed corpus gets a fresh tokenizer.
    `image_tokens`: Step-3.7's image tokens added after the merges (module docstring).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"builtin_vocab_size must be at least {MIN_VOCAB_SIZE} (EOS + 256 bytes), got {vocab_size}")
    corpus = builtin_corpus_path(cache_dir)
    corpus_hash = hashlib.sha256(corpus.read_bytes()).hexdigest()[:16]
    folder = cache_root(cache_dir) / f"tokenizer-bpe{vocab_size}{'-images' if image_tokens else ''}-{corpus_hash}"
    if (folder / "tokenizer.json").is_file():
        _add_chat_template(folder)  # folders cached before the template existed get it now
        return folder

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # listed first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if image_tokens:
        from step35.data.images import ImageTokens

        tokenizer.add_special_tokens(list(vars(ImageTokens()).values()))

    def fill(staging: Path) -> None:
        tokenizer.save(str(staging / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "model_max_length": 1 << 30}
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS_TOKEN}, indent=2) + "\n")
        ChatTemplate.default().save(staging)

    write_folder_once(folder, "tokenizer.json", fill)
    return folder


def write_folder_once(folder: Path, done: str, fill) -> None:
    """Make `folder` by `fill(staging)` in a private sibling, then rename it into place, so that no process sees
    it half-written; `done` names the file whose presence says the folder is complete. When another process
    finished first, its folder (the same content) is kept."""
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        fill(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / done).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _add_chat_template(folder: Path) -> None:
    """Give a cached tokenizer folder step35's default chat template, if it lacks one."""
    if not (folder / TEMPLATE_FILE).is_file():
        write_atomically(folder / TEMPLATE_FILE, ChatTemplate.default().source.encode("utf-8"))


def write_atomically(path: Path, content: bytes) -> None:
    fd, staging = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(staging, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
