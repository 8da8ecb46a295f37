"""One rule for a tokenizer's end-of-text id: the data stream (TextTokenizer.from_folder) and the
checkpoint's tokenizer record (run_tokenizer.special_ids, used by export and generate) read the same
id from the same files, whichever file names it."""

import json
from pathlib import Path

import pytest

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.training import run_tokenizer
from step35.data.tokenizer import TextTokenizer

VOCAB = {"<eos>": 0, "<unk>": 1, "<s>": 2, "w3": 3, "w4": 4, "w5": 5}


def word_tokenizer(folder: Path, **files: dict) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True)
    Tokenizer(WordLevel(VOCAB, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


# (files, the EOS id both readers give): each case is decided by a different step of the rule.
CASES = [
    ({"tokenizer_config": {"eos_token": "<eos>"}, "special_tokens_map": {"eos_token": "w5"}}, 0),
    ({"tokenizer_config": {"eos_token": {"content": "w3", "special": True}}}, 3),
    ({"generation_config": {"eos_token_id": [4, 0]}, "special_tokens_map": {"eos_token": "w5"}}, 4),
    ({"special_tokens_map": {"eos_token": {"content": "w5"}}}, 5),
]


@pytest.mark.parametrize("files, eos", CASES)
def test_data_and_checkpoint_read_the_same_eos(tmp_path, files, eos):
    folder = word_tokenizer(tmp_path / "tok", **files)
    assert TextTokenizer.from_folder(folder).eos_token_id == eos
    assert run_tokenizer.special_ids(run_tokenizer.folder_files(folder), folder).eos == eos


def test_no_eos_and_an_unknown_eos_token(tmp_path):
    folder = word_tokenizer(tmp_path / "none", tokenizer_config={"bos_token": "<s>"})
    ids = run_tokenizer.special_ids(run_tokenizer.folder_files(folder), folder)
    assert (ids.bos, ids.eos, ids.pad) == (2, None, None)
    with pytest.raises(ValueError, match="cannot tell the EOS token"):
        TextTokenizer.from_folder(folder)
    folder = word_tokenizer(tmp_path / "bad", tokenizer_config={"eos_token": "<end>"})
    with pytest.raises(
        CheckpointError, match=r"tokenizer_config.json: eos_token '<end>' is not in the tokenizer's vocabulary"
    ):
        run_tokenizer.special_ids(run_tokenizer.folder_files(folder), folder)
    with pytest.raises(ValueError, match="eos_token '<end>' is not in"):
        TextTokenizer.from_folder(folder)
