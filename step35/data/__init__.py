"""The data pipeline of step35: raw text streamed, tokenized on the fly and packed into token windows."""

from step35.data.builtin import builtin_corpus_path, builtin_tokenizer_dir
from step35.data.datamodule import Step35DataModule
from step35.data.spec import SourceSpec

__all__ = ["SourceSpec", "Step35DataModule", "builtin_corpus_path", "builtin_tokenizer_dir"]
