import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network from tests
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    """A cache folder holding the built-in corpus and tokenizer, built once per test session."""
    from step35.data import builtin_corpus_path, builtin_tokenizer_dir

    path = tmp_path_factory.mktemp("step35-cache")
    builtin_corpus_path(cache_dir=path)
    builtin_tokenizer_dir(cache_dir=path)
    return path
