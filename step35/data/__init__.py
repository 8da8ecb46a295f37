"""The data pipeline of step35: raw text streamed, tokenized on the fly and packed into token windows.

`Step35DataModule` (Lightning's side) is imported when first named, so that what reads data without
training (export, generate, the chat template) does not import Lightning."""

from step35.data.builtin import builtin_corpus_path, builtin_tokenizer_dir
from step35.data.spec import SourceSpec

__all__ = ["SourceSpec", "Step35DataModule", "builtin_corpus_path", "builtin_tokenizer_dir"]


def __getattr__(name: str):
    if name == "Step35DataModule":
        from step35.data.datamodule import Step35DataModule

        return Step35DataModule
    raise AttributeError(f"module 'step35.data' has no attribute {name!r}")
