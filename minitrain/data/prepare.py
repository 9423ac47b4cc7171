"""Preparing a corpus once: the tokenizer, then both splits' token shards, kept in `data.cache_dir` and reused.

    1. the tokenizer: a byte-level BPE trained on a bounded sample of the corpus, or a pretrained one
    2. the corpus streamed in batches of documents, each batch encoded on all cores (the tokenizers library's
       encode_batch: threads of this process, so a killed preparation leaves no worker behind) and appended to
       its split's shards; memory holds two batches, whatever the corpus's size
    3. after each batch, a progress record (progress.json): where the corpus continues, each split's length.
       A preparation stopped at any moment (Ctrl-C, SIGKILL, a full disk) is continued by the next run from its
       last record, and its shards are bit for bit those of a preparation never stopped
    4. index.json, and the folder published by a rename: a reader sees a whole cache or none

The cache is keyed by the corpus (its files' paths and contents; a hub dataset's name, and a local copy's
contents) and the settings that change the tokens: a file rewritten in place, its size and times kept, is read
again. A lock on `<cache>.lock` makes concurrent ranks or sweep jobs build a cache once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .. import files
from ..config import DataConfig
from ..errors import error_reason
from .corpus import Batch, DataError, HubStream, LocalFiles, chunks, corpus_identity, open_corpus
from .shards import (FORMAT, INDEX, TOKENIZER, ShardWriter, TokenData, UnusableCache, open_cache, token_dtype,
                     vocab_size_of)
from .tokenizer import EOT, pretrained_tokenizer, tokenizer_identity

PROGRESS = "progress.json"
SPLITS = ("train", "val")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _print_to_stderr(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cfg: DataConfig) -> Path:
    """Where `cfg`'s cache lives: keyed by the corpus's contents and every setting that changes its tokens, their
    split or their shards (a model's block size changes none of them)."""
    trained = cfg.tokenizer == "train"
    tokenizer = ["train", cfg.vocab_size, cfg.tokenizer_sample_mb] if trained else tokenizer_identity(cfg.tokenizer)
    key = _digest(FORMAT, corpus_identity(cfg), tokenizer, cfg.val_fraction, cfg.shard_tokens)
    return Path(os.path.expanduser(cfg.cache_dir)) / f"{cfg.name}-{key}"


def prepare_data(cfg: DataConfig, block_size: Optional[int] = None, progress: bool = True,
                 notify: Optional[Callable[[str], None]] = None) -> TokenData:
    """The tokenizer and token shards of `cfg`, prepared once and cached; with `block_size`, each split must hold
    a window of it. `notify` receives the preparation's notes (default: stderr): an unusable cache rebuilt, an
    interrupted preparation continued, files that are not clean UTF-8."""
    notify = notify or _print_to_stderr
    final = cache_path(cfg)
    try:
        data = open_cache(final)
    except UnusableCache:
        data = _build_locked(cfg, final, progress, notify)
    for split, stream in (("train", data.train), ("val", data.val)):
        if block_size is not None and len(stream) < block_size + 1:
            raise DataError(f"the {cfg.name} corpus is too short: its {split} split has {len(stream)} tokens, "
                            f"fewer than one block of model.block_size={block_size} + 1 "
                            "(add text, or lower model.block_size / raise data.val_fraction)")
    return data


def _build_locked(cfg: DataConfig, final: Path, progress: bool, notify: Callable[[str], None]) -> TokenData:
    """Builds the cache at `final` under an exclusive lock on `<final>.lock`, released also when its holder dies.
    The build happens in `<final>.tmp` (kept, with its progress record, when it stops: the next build continues
    it) and is published by rename over an unusable cache (files.publish): a reader sees a whole cache or none."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = files.lock(final.with_name(final.name + ".lock"))  # waits for a build under way elsewhere
    except OSError as e:  # a path through a file, a directory this user cannot write
        raise DataError(f"data.cache_dir={cfg.cache_dir!r}: cannot keep the token cache there ({error_reason(e)}); "
                        "point data.cache_dir at a writable directory") from None
    try:
        try:
            return open_cache(final)  # another process built it while this one waited
        except UnusableCache as why:
            if final.exists():
                notify(f"data cache {final} is unusable ({why}); rebuilding it")
        tmp = final.with_name(final.name + ".tmp")
        _Preparation(cfg, tmp, progress, notify).run()
        for leftover in final.parent.glob(f"{final.name}{files.TEMP_MARK}*"):  # of a publication that crashed
            if files.is_temporary(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
        files.publish(tmp, final)
        (final / PROGRESS).unlink()  # kept until now: a stop before the rename continues from it
        return replace(open_cache(final), prepared=True)
    finally:
        lock.release()


def train_tokenizer(chunks, vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer, no unknown token) learned from the text `chunks`. The library's own
    progress bars stay off: they draw on a terminal only, over tqdm's (`_Preparation._train_tokenizer` has one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(chunks, trainer=trainer)
    return tok


def _counted(chunks: Iterator[str], bar, merging: str) -> Iterator[str]:
    """`chunks`, their UTF-8 bytes counted on `bar`; once they are all read, the bar says `merging`."""
    for chunk in chunks:
        bar.update(len(chunk.encode("utf-8", "surrogatepass")))
        yield chunk
    bar.total = bar.n  # the sample as read (a window leaves out the lines it cuts)
    bar.set_postfix_str(merging)


@contextmanager
def _clock_running(bar, interval_s: float = 0.5) -> Iterator[None]:
    """The bar redrawn every `interval_s` while the block runs, so that its clock keeps time through a phase that
    updates nothing (the tokenizers library computing merges, which releases the GIL)."""
    stop = threading.Event()

    def redraw():
        while not stop.wait(interval_s):
            bar.refresh()

    ticker = threading.Thread(target=redraw, name="progress-clock", daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join()


def _chunked(docs: list[tuple[str, int, bool]]) -> tuple[list[str], list[int]]:
    """The documents' chunks, and after which chunk each document ends."""
    pieces, ends = [], []
    for text, _, _ in docs:
        pieces.extend(chunks(text))
        ends.append(len(pieces))
    return pieces, ends


def token_ids(encodings, docs: list[tuple[str, int, bool]], ends: list[int], eot: int,
              dtype: np.dtype) -> tuple[dict[str, np.ndarray], int]:
    """Each split's tokens of the documents (text, bytes, is it validation), each ended by `eot`, from their
    chunks' encodings; and the token count of the last training document. The ids leave the encodings once, into
    one array that numpy cuts: no per-document Python lists."""
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=dtype, count=int(lengths.sum()))
    doc_ends = np.concatenate(([0], np.cumsum(lengths)))[ends]  # where each document's tokens end
    ids = np.insert(ids, doc_ends, eot)
    doc_tokens = np.diff(doc_ends, prepend=0) + 1  # with its EOT
    validation = np.fromiter((doc[2] for doc in docs), dtype=bool, count=len(docs))
    in_validation = np.repeat(validation, doc_tokens)
    last_train = int(doc_tokens[~validation][-1]) if not validation.all() else 0
    return {"train": ids[~in_validation], "val": ids[in_validation]}, last_train


def encoded(batches: Iterator[Batch], tokenizer, eot: int, dtype: np.dtype) -> Iterator[tuple[Batch, dict, int]]:
    """Each batch with its token ids (`token_ids`). A batch is encoded on all cores (encode_batch, which releases
    the GIL) in a thread while the previous one is turned into ids and written and the next one is read: the
    Python work hides behind the tokenizer's, and memory holds two batches' encodings at most."""
    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:
        pending = None
        for batch in batches:
            pieces, ends = _chunked(batch.docs)
            submitted = batch, ends, encoder.submit(tokenizer.encode_batch_fast, pieces, add_special_tokens=False)
            if pending is not None:
                yield pending[0], *token_ids(pending[2].result(), pending[0].docs, pending[1], eot, dtype)
            pending = submitted
        if pending is not None:
            yield pending[0], *token_ids(pending[2].result(), pending[0].docs, pending[1], eot, dtype)


def _fresh_state() -> dict[str, Any]:
    return {"format": FORMAT, "cursor": {"doc": 0, "piece": 0}, "done": False, "bytes": 0,
            "documents": {"train": 0, "val": 0}, "splits": {"train": None, "val": None}, "last_train_doc": 0}


class _Preparation:
    """One build of a cache in `folder`: from the start, or from the progress record of one that was stopped."""

    def __init__(self, cfg: DataConfig, folder: Path, progress: bool, notify: Callable[[str], None]):
        self.cfg, self.folder, self.progress, self.notify = cfg, folder, progress, notify

    def run(self) -> None:
        state = self._resume_or_start()
        corpus = open_corpus(self.cfg, self.notify, self.folder / "hf")
        tokenizer = self._tokenizer(corpus)
        dtype, eot = token_dtype(vocab_size_of(tokenizer)), tokenizer.token_to_id(EOT)  # pretrained_tokenizer refuses one without it
        writers = {split: ShardWriter(self.folder, split, dtype, self.cfg.shard_tokens, state["splits"][split])
                   for split in SPLITS}
        try:
            if not state["done"]:
                self._record(state, writers)  # the tokenizer is kept: a stop from here on is continued
                self._tokenize(corpus, tokenizer, eot, dtype, writers, state)
            self._ensure_validation(writers, state)
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            raise DataError(f"the disk holding {self.folder} is full ({error_reason(e)}): the shards of the "
                            f"{state['bytes'] / 1e6:,.0f} MB tokenized so far are kept there; free some space and "
                            "run the same command again to continue from them") from None
        except KeyboardInterrupt:
            self.notify(f"data: preparation stopped; the shards of the {state['bytes'] / 1e6:,.0f} MB tokenized so "
                        f"far are kept in {self.folder}, and the next run with these data settings continues them")
            raise
        self._write_index(writers, state)

    def _resume_or_start(self) -> dict[str, Any]:
        try:
            state = json.loads((self.folder / PROGRESS).read_text())
            if state.get("format") == FORMAT and (self.folder / TOKENIZER).is_file():
                self.notify(f"data: continuing the preparation stopped in {self.folder} "
                            f"({state['bytes'] / 1e6:,.0f} MB tokenized)")
                return state
        except (OSError, ValueError):  # none, or a folder of another format
            pass
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir()
        return _fresh_state()

    def _tokenizer(self, corpus: LocalFiles | HubStream):
        """The tokenizer, saved first: a continued preparation reads it back instead of training it again."""
        from tokenizers import Tokenizer

        path = self.folder / TOKENIZER
        if not path.is_file():
            if self.cfg.tokenizer == "train":
                self.notify(f"data: training a {self.cfg.vocab_size}-token BPE on up to "
                            f"{self.cfg.tokenizer_sample_mb} MB of the {self.cfg.name} corpus")
                tokenizer = self._train_tokenizer(corpus)
            else:
                tokenizer = pretrained_tokenizer(self.cfg.tokenizer)
            files.atomic_write(path, tokenizer.to_str(pretty=True))
        return Tokenizer.from_file(str(path))

    def _train_tokenizer(self, corpus: LocalFiles | HubStream):
        """The BPE learned from the corpus's sample, under a bar like the tokenizing one: the sample's bytes as the
        library reads them, then its merges being computed (a few seconds to tens), the bar's clock running."""
        from tqdm.auto import tqdm

        budget = self.cfg.tokenizer_sample_mb << 20
        with tqdm(total=min(corpus.total_bytes or budget, budget), unit="B", unit_scale=True, desc="tokenizer",
                  disable=not self.progress, dynamic_ncols=True) as bar, _clock_running(bar):
            merging = f"computing the merges of {self.cfg.vocab_size:,} tokens"
            return train_tokenizer(_counted(corpus.sample(budget), bar, merging), self.cfg.vocab_size)

    def _record(self, state: dict[str, Any], writers: Optional[dict[str, ShardWriter]] = None) -> None:
        """The progress record, once the tokens it counts are on disk."""
        if writers is not None:
            for writer in writers.values():
                writer.sync()
            state["splits"] = {split: writer.state() for split, writer in writers.items()}
        files.atomic_write(self.folder / PROGRESS, json.dumps(state))

    def _tokenize(self, corpus, tokenizer, eot: int, dtype: np.dtype, writers: dict[str, ShardWriter],
                  state: dict[str, Any]) -> None:
        from tqdm.auto import tqdm

        started, tokens = time.monotonic(), 0
        with tqdm(total=corpus.total_bytes, initial=state["bytes"], unit="B", unit_scale=True, desc="tokenizing",
                  disable=not self.progress, dynamic_ncols=True) as bar:
            for batch, ids, last_train in encoded(corpus.batches(state["cursor"]), tokenizer, eot, dtype):
                for split, writer in writers.items():
                    if len(ids[split]):
                        writer.append(ids[split])
                n_val, n_bytes = sum(doc[2] for doc in batch.docs), sum(doc[1] for doc in batch.docs)
                state["documents"]["val"] += n_val
                state["documents"]["train"] += len(batch.docs) - n_val
                state["last_train_doc"] = last_train or state["last_train_doc"]
                state["bytes"] += n_bytes
                state["cursor"], state["done"] = batch.cursor, "end" in batch.cursor
                self._record(state, writers)
                tokens += sum(map(len, ids.values()))
                bar.update(n_bytes)
                bar.set_postfix_str(f"{tokens / (time.monotonic() - started):,.0f} tok/s")
        state["done"] = True
        self._record(state, writers)

    def _ensure_validation(self, writers: dict[str, ShardWriter], state: dict[str, Any]) -> None:
        """A corpus so small that no document's hash fell into validation gives its last training document to
        validation (the one such document that can move without rewriting the stream: it ends it)."""
        train, val = writers["train"], writers["val"]
        if val.tokens or not train.tokens:
            return
        moved = train.tail(state["last_train_doc"])
        val.append(moved)
        val.sync()
        # Recorded before the training stream is cut: a stop in between is continued from this record.
        kept = train.tokens - len(moved)
        state["splits"] = {"train": {"tokens": kept, "shards": train.shards[:kept // self.cfg.shard_tokens]},
                           "val": val.state()}
        state["documents"] = {"train": state["documents"]["train"] - 1, "val": 1}
        self._record(state)
        train.truncate(kept)

    def _write_index(self, writers: dict[str, ShardWriter], state: dict[str, Any]) -> None:
        if not any(writer.tokens for writer in writers.values()):
            shutil.rmtree(self.folder, ignore_errors=True)
            raise DataError(f"the {self.cfg.name} corpus holds no text: every document is empty; check data.paths, "
                            "or data.hub_name and data.text_column")
        splits = {split: {"tokens": writer.tokens, "shards": writer.finish()} for split, writer in writers.items()}
        index = {"format": FORMAT, "dtype": writers["train"].dtype.name, "shard_tokens": self.cfg.shard_tokens,
                 "tokenizer": self.cfg.tokenizer,
                 "tokenizer_checksum": hashlib.sha256((self.folder / TOKENIZER).read_bytes()).hexdigest(),
                 "bytes": state["bytes"], "documents": state["documents"], "splits": splits}
        files.atomic_write(self.folder / INDEX, json.dumps(index, indent=1))
        shutil.rmtree(self.folder / "hf", ignore_errors=True)
