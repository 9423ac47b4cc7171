"""Corpus -> tokenizer -> token shards (prepared once, cached) -> batches of random windows.

    corpus.py    where the documents come from (local files, a hub dataset streamed) and which split each is in
    tokenizer.py a pretrained tokenizer (data.tokenizer=gpt2 or a directory), and the token between documents
    prepare.py   the tokenizer and the shards, built in a resumable, bounded-memory pass and cached
    shards.py    the shard files, their index and checks, and a split read back as one token stream
    batches.py   a step's windows, a pure function of (seed, step), prefetched to the device
"""

from .corpus import DataError, stdlib_files
from .prepare import cache_path, prepare_data
from .shards import TokenData, TokenStream
from .tokenizer import EOT

__all__ = ["Batches", "DeviceBatches", "DataError", "EOT", "TokenData", "TokenStream", "cache_path",
           "prepare_data", "stdlib_files"]


def __getattr__(name: str):
    """Batches and DeviceBatches, imported on first use: they need torch, which preparing data does not (its
    import alone takes seconds and a quarter GB)."""
    if name in ("Batches", "DeviceBatches"):
        from . import batches

        return getattr(batches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
