"""Token shards: each split's token stream cut into files of `shard_tokens` tokens (the last holds the rest), an
index.json recording each shard's size, checksum and largest id, and the stream read back as one sequence.

Shards are of fixed size so that the shard holding stream position p is p // shard_tokens: a reader needs no
table, and the cut falls wherever it falls, also inside a document. A shard boundary therefore means nothing to
the text, and windows cross it (`TokenStream.read`): the batches are those of one long file, the same whatever
the shard size, and no window start is lost at each boundary.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from .corpus import DataError

INDEX, TOKENIZER = "index.json", "tokenizer.json"
FORMAT = 2  # of index.json and the shards; bump when either changes
# A shard's checksum covers this many evenly spaced chunks: the whole shard up to _CHECK_CHUNKS *
# _CHECK_CHUNK_BYTES, a fixed read of a larger one, so checking a multi-GB cache at every start stays cheap.
_CHECK_CHUNKS = 16
_CHECK_CHUNK_BYTES = 1 << 18
_SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id below `vocab_size`."""
    for dtype in (np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise DataError(f"the tokenizer's ids reach {vocab_size - 1}, more than uint32 shards hold; "
                    "use a tokenizer with fewer than 2**32 ids")


def shard_checksum(path: Path) -> str:
    """sha256 of `_CHECK_CHUNKS` evenly spaced chunks of `_CHECK_CHUNK_BYTES`, the first at the start and the last
    at the end: every byte of a shard of up to `_CHECK_CHUNKS` chunks, a fixed read of a larger one. The price of a
    check cheap enough for every start: the bytes between the chunks of a large shard are not covered (its size
    is checked on its own, and every batch's ids against the vocabulary)."""
    size = path.stat().st_size
    n_chunks = max(1, min(_CHECK_CHUNKS, -(-size // _CHECK_CHUNK_BYTES)))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(n_chunks):
            f.seek(i * (size - _CHECK_CHUNK_BYTES) // (n_chunks - 1) if n_chunks > 1 else 0)
            digest.update(f.read(_CHECK_CHUNK_BYTES))
    return digest.hexdigest()


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class ShardWriter:
    """Appends one split's tokens to its shards in `folder`. `state()` is what a resumed preparation needs to
    continue exactly: the stream's length and the finished shards' records; a new writer given it cuts the
    files back to that length (anything written after it, by a run that was stopped, is dropped)."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 state: Optional[dict[str, Any]] = None):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.tokens, self.shards = 0, []
        self._file, self._max = None, 0
        state = state or {"tokens": 0, "shards": []}
        self.shards = list(state["shards"])
        self.truncate(state["tokens"])

    def state(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "shards": list(self.shards)}

    def append(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._file is None:
                self._file = open(self.folder / shard_name(self.split, len(self.shards)), "ab")
            room = self.shard_tokens - self.tokens % self.shard_tokens
            part, ids = ids[:room], ids[room:]
            self._file.write(part.tobytes())
            self._max = max(self._max, int(part.max()))
            self.tokens += len(part)
            if self.tokens % self.shard_tokens == 0:
                self._close_shard()

    def sync(self) -> None:
        """The tokens appended so far are on disk (before a progress record says so)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def finish(self) -> list[dict[str, Any]]:
        """Every shard's record, the last (partial) one closed too."""
        if self.tokens % self.shard_tokens:
            if self._file is None:  # the partial shard of a preparation resumed after its last token
                self._file = open(self.folder / shard_name(self.split, len(self.shards)), "ab")
            self._close_shard()
        return self.shards

    def _close_shard(self) -> None:
        self.sync()
        self._file.close()
        path = Path(self._file.name)
        self.shards.append({"file": path.name, "tokens": path.stat().st_size // self.dtype.itemsize,
                            "checksum": shard_checksum(path), "max_token": self._max})
        self._file, self._max = None, 0

    def truncate(self, n: int) -> None:
        """Cut the stream back to its first `n` tokens: later shards removed, the one holding token n cut."""
        if self._file is not None:
            self._file.close()
            self._file = None
        kept, rest = divmod(n, self.shard_tokens)
        self.shards, self.tokens = self.shards[:kept], n
        for path in self.folder.glob(f"{self.split}-*.bin"):
            index = int(path.stem.split("-")[1])
            if index > kept or (index == kept and rest == 0):
                path.unlink()
        self._max = 0
        if rest:
            path = self.folder / shard_name(self.split, kept)
            os.truncate(path, rest * self.dtype.itemsize)
            self._max = int(np.fromfile(path, dtype=self.dtype).max())

    def tail(self, n: int) -> np.ndarray:
        """The stream's last `n` tokens (of the shards on disk)."""
        self.sync()
        out = np.empty(n, dtype=self.dtype)
        TokenStream([np.memmap(self.folder / shard_name(self.split, i), dtype=self.dtype, mode="r")
                     for i in range((self.tokens - 1) // self.shard_tokens + 1)]).read(self.tokens - n, out)
        return out


class TokenStream:
    """One split's tokens: its shards read as one sequence (all but the last hold the same number of tokens)."""

    def __init__(self, shards: Sequence[np.ndarray], dtype: Optional[np.dtype] = None):
        """`dtype`: the tokens', where there may be no shard to read it from (an empty split)."""
        self.dtype = np.dtype(dtype) if dtype is not None else shards[0].dtype
        self.shards = [s for s in shards if len(s)]
        self.shard_tokens = len(self.shards[0]) if self.shards else 1
        self.length = sum(len(s) for s in self.shards)

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, out: np.ndarray) -> None:
        """Fill `out` with the tokens from `start` on, across shard boundaries."""
        filled = 0
        while filled < len(out):
            shard, offset = divmod(start + filled, self.shard_tokens)
            piece = self.shards[shard][offset:offset + len(out) - filled]
            out[filled:filled + len(piece)] = piece
            filled += len(piece)

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, _ = span.indices(self.length)
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        self.read(start, out)
        return out


@dataclass
class TokenData:
    """The tokenised corpus: the tokenizer and each split's token stream, from the cache at `path`."""

    tokenizer: Any  # tokenizers.Tokenizer
    train: TokenStream
    val: TokenStream
    path: Path
    vocab_size: int  # every id is below it
    prepared: bool = False  # whether this call tokenized the corpus (False: the cache was there already)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def vocab_size_of(tokenizer) -> int:
    """One more than the tokenizer's largest id (its ids need not be dense)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


class UnusableCache(DataError):
    """A published cache that does not match its own record; the message says what is wrong."""


def _read_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads((path / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise UnusableCache(f"{INDEX} is unreadable: {e}") from None
    if not isinstance(index, dict):
        raise UnusableCache(f"{INDEX} is unreadable: not a JSON object")
    if index.get("format") != FORMAT:
        raise UnusableCache(f"{INDEX} is of format {index.get('format')}, not {FORMAT}: written by another minitrain")
    return index


def _open_split(path: Path, split: str, index: dict[str, Any], dtype: np.dtype, vocab_size: int) -> TokenStream:
    """A split's shards as memmaps, each checked against its record: size, checksum, largest id."""
    record, shard_tokens = index["splits"][split], int(index["shard_tokens"])
    shards = []
    for i, shard in enumerate(record["shards"]):
        file = path / shard["file"]
        expected = (shard_tokens if i < len(record["shards"]) - 1 else int(shard["tokens"])) * dtype.itemsize
        try:
            size = file.stat().st_size
        except OSError as e:
            raise UnusableCache(f"{shard['file']} is unreadable: {e}") from None
        if size != expected:
            raise UnusableCache(f"{shard['file']} holds {size} bytes, {INDEX} records {expected}")
        if shard_checksum(file) != shard["checksum"]:
            raise UnusableCache(f"{shard['file']} does not match its checksum in {INDEX}")
        if shard["max_token"] >= vocab_size:
            raise UnusableCache(f"{shard['file']}'s largest token id {shard['max_token']} is outside the "
                                f"tokenizer's {vocab_size} ids")
        shards.append(np.memmap(file, dtype=dtype, mode="r", shape=(size // dtype.itemsize,)))
    stream = TokenStream(shards, dtype)
    if len(stream) != record["tokens"]:
        raise UnusableCache(f"the {split} shards hold {len(stream)} tokens, {INDEX} records {record['tokens']}")
    return stream


def open_cache(path: Path) -> TokenData:
    """The cache at `path`, checked against its index.json before anything reads it: a truncated or rewritten
    shard would otherwise fail as an mmap error at start, or as an out-of-range embedding index mid-run."""
    from tokenizers import Tokenizer

    if not path.is_dir():
        raise UnusableCache("it does not exist")
    index = _read_index(path)
    try:
        tokenizer_json = (path / TOKENIZER).read_bytes()
        tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    except Exception as e:  # tokenizers reports malformed JSON as a bare Exception
        raise UnusableCache(f"{TOKENIZER} is unreadable: {e}") from None
    try:
        if hashlib.sha256(tokenizer_json).hexdigest() != index["tokenizer_checksum"]:
            raise UnusableCache(f"{TOKENIZER} does not match its checksum in {INDEX}")
        vocab_size, dtype = vocab_size_of(tokenizer), np.dtype(index["dtype"])
        if dtype != token_dtype(vocab_size):
            raise UnusableCache(f"its {dtype} shards do not fit the tokenizer's {vocab_size} ids")
        train, val = (_open_split(path, split, index, dtype, vocab_size) for split in _SPLITS)
    except UnusableCache:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field missing or of the wrong type
        raise UnusableCache(f"{INDEX} is unreadable: {type(e).__name__}: {e}") from None
    return TokenData(tokenizer, train, val, path, vocab_size)
