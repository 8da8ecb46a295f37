"""Long documents are tokenized in pieces: the same tokens as whole, exact resume inside them, bounded memory."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from step35.data import builtin_corpus_path, builtin_tokenizer_dir
from step35.data import tokenizer as tokenizer_module
from step35.data.sources import FileSource
from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer
from tests.helpers import make_word_tokenizer, resume_matches, write_jsonl

pytestmark = pytest.mark.heavy  # a child process measures memory; the resume reads with 2 workers

# The pre-tokenizer regex of Llama-3 / Qwen style byte-level BPE tokenizers (a `Split` before `ByteLevel`).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def builtin_text(cache: Path) -> str:
    """The built-in corpus (Python's documentation, 0.6 MB) as one long document: real prose and code."""
    with open(builtin_corpus_path(cache), encoding="utf-8") as f:
        return "\n\n".join(json.loads(line)["text"] for line in f)


def split_regex_tokenizer(folder: Path, cache: Path) -> TextTokenizer:
    """A byte-level BPE with the Llama-3 style Split pre-tokenizer, trained on the built-in corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(builtin_text(cache).split("\n\n"), trainer=trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return TextTokenizer.from_folder(folder, eos_token_id=0)


def test_pieces_give_the_whole_document_tokens_on_real_text(tmp_path, builtin_cache, recwarn):
    text = builtin_text(builtin_cache)
    tokenizers = {
        "gpt2-style": TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache)),
        "split-regex": split_regex_tokenizer(tmp_path / "split", builtin_cache),
    }
    for name, tok in tokenizers.items():
        whole = tok.encode(text)
        for piece_chars in (1000, 5000):  # 1000: 572 cuts, in prose, code and tables alike; none of them hard
            pieces = list(tok.pieces(text, piece_chars=piece_chars))
            assert len(pieces) > len(text) // (2 * piece_chars)
            assert [i for _, ids in pieces for i in ids] == whole, f"{name}, pieces of {piece_chars} characters"
        # Pieces of 100 characters: 5355 cuts, 23 of them hard (a table row of '=' and runs of spaces). Every
        # safe cut keeps the tokens; the hard ones are where the module docstring says tokens can differ.
        starts = [at for at, _ in tok.pieces(text, piece_chars=100)] + [len(text)]
        safe = [0] + [b for a, b in zip(starts, starts[1:-1]) if b - a < 200] + [len(text)]
        assert len(safe) > 5000
        assert [i for a, b in zip(safe, safe[1:]) for i in tok.encode(text[a:b])] == whole, name
    assert not [w for w in recwarn if "tokenizing at spaces" in str(w.message)]


def test_a_stretch_without_spaces_is_cut_hard_and_loses_no_text(builtin_cache):
    tok = TextTokenizer.from_folder(builtin_tokenizer_dir(cache_dir=builtin_cache))
    text = "start " + "x" * 5000 + " end of it " * 100
    pieces = list(tok.pieces(text, piece_chars=1000))
    assert pieces[1][0] == 2000  # no space between characters 1000 and 2000: cut at 2 * piece_chars
    assert tok.decode([i for _, ids in pieces for i in ids]) == text


def test_a_tokenizer_that_differs_in_pieces_is_warned_about(tmp_path):
    from tokenizers import Tokenizer, normalizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    # A SentencePiece-style normalizer prepends a marker to every text it sees, so to every piece.
    vocab = {"<eos>": 0, "<unk>": 1, "#": 2}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Prepend("# ")
    tokenizer.pre_tokenizer = WhitespaceSplit()
    (tmp_path / "t").mkdir()
    tokenizer.save(str(tmp_path / "t" / "tokenizer.json"))
    tok = TextTokenizer.from_folder(tmp_path / "t", eos_token_id=0)
    with pytest.warns(UserWarning, match="tokenizing at spaces gives other tokens"):
        list(tok.pieces("a b " * 100, piece_chars=50))


@pytest.mark.timeout(120)
def test_windows_and_resume_inside_long_documents(tmp_path, monkeypatch):
    tok = make_word_tokenizer(tmp_path / "tok")
    words = [f"w{k % 50}" for k in range(3000)]
    texts = [f"d{i} " + " ".join(words[: 400 + 700 * i]) for i in range(4)]  # 400 to 2500 words
    source = FileSource("long", [write_jsonl(tmp_path / "long.jsonl", texts)], shuffle=False)
    expected = [t for text in texts for t in tok.encode(text) + [0]]

    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 100)  # cuts every 20-40 words, inside windows too
    got = torch.cat([w["input_ids"] for w in TokenWindows([source], tok, seq_len=36, endless=False)]).tolist()
    assert got == expected[: len(got)] and len(expected) - len(got) < 37

    # Saves land mid-piece, and resumes re-tokenize from the saved piece on (DataLoader workers inherit the patch).
    states = resume_matches(lambda: TokenWindows([source], tok, seq_len=36), 50, save_at=[3, 11, 24], batch_size=3)
    pieces = [w["dataset_state"]["sources"][0]["piece"] for w in states[-1]["_snapshot"]["_worker_snapshots"].values()]
    assert any(p > 0 for p in pieces)  # a saved position inside a long document, past its first piece


CHILD = textwrap.dedent(
    """
    import json, sys
    from step35.data.sources import FileSource
    from step35.data.stream import TokenWindows
    from step35.data.tokenizer import TextTokenizer

    path, tokenizer, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stream = iter(TokenWindows([FileSource("s", [path])], TextTokenizer.from_folder(tokenizer), seq_len=255))
    windows = [next(stream)["input_ids"] for _ in range(count)]
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent through exec.
    peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak_mb": peak_kb / 1024}))
    """
)


def peak_rss_mb(path: Path, tokenizer: Path, windows: int) -> float:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(tokenizer), str(windows)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"]


@pytest.mark.timeout(300)
def test_a_50_mb_line_streams_in_bounded_memory(tmp_path, builtin_cache):
    """Whole, this line took 9.2 GB of tokenizer memory; in pieces the child stays within a few hundred MB of
    a child that streams the same number of windows from ordinary short documents."""
    tokenizer = builtin_tokenizer_dir(cache_dir=builtin_cache)
    text = builtin_text(builtin_cache).replace("\n", " ")
    long_line = (text * (50_000_000 // len(text) + 1))[:50_000_000]
    write_jsonl(tmp_path / "long.jsonl", [long_line])
    write_jsonl(tmp_path / "short.jsonl", text.split(". ") * 3)
    del long_line

    ordinary = peak_rss_mb(tmp_path / "short.jsonl", tokenizer, 2000)
    long = peak_rss_mb(tmp_path / "long.jsonl", tokenizer, 2000)
    print(f"peak RSS streaming 2000 windows: ordinary documents {ordinary:.0f} MB, one 50 MB line {long:.0f} MB")
    assert long < ordinary + 400, (ordinary, long)
