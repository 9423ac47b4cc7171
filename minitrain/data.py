"""Corpus -> byte-level BPE tokenizer -> token memmap -> batches of random windows.

Everything before the batches is done once and cached under `data.cache_dir`, keyed by the corpus
and the tokenizer settings, so a second run (or every job of a sweep) starts training at once; the cache is
checked against its own record at every start and rebuilt when it does not match. Batches are a pure
function of (seed, step): resuming, changing grad_accum or adding ranks never changes which windows a step
sees.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from . import files
from .config import DataConfig, DataSource, error_reason

EOT = "<|endoftext|>"
_FORMAT_VERSION = 1  # bump when the cached layout or tokenizer recipe changes
# The token file's checksum covers this many evenly spaced chunks: the whole file up to
# _CHECK_CHUNKS * _CHECK_CHUNK_BYTES, a fixed read beyond, so checking a multi-GB cache at every start stays cheap.
_CHECK_CHUNKS = 64
_CHECK_CHUNK_BYTES = 1 << 20
# A corpus file whose head holds a NUL byte, or more than this share of bytes that are not UTF-8, is not text
# (a binary file, or text in another encoding the tokenizer would learn as replacement characters).
_SNIFF_BYTES = 8192
_MAX_UNDECODABLE_SHARE = 0.25


class DataError(ValueError):
    """The corpus cannot be used; the message says why and which setting to change."""


def stdlib_files() -> list[str]:
    """The running interpreter's own standard-library sources: real text on every machine."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f
                  and os.path.getsize(f) > 0)  # empty __init__.py files carry no text


def _some(files: list[str]) -> str:
    return ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")


def _local_files(cfg: DataConfig) -> list[str]:
    if cfg.source == DataSource.stdlib:
        files = stdlib_files()
        where = "the standard library"
    else:
        pattern = os.path.expanduser(cfg.paths)
        files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        where = f"data.paths={cfg.paths!r}"
    if not files:
        hint = (f"; it names a directory: give a glob of its files, e.g. data.paths='{cfg.paths.rstrip('/')}/**/*.txt'"
                if cfg.source == DataSource.files and os.path.isdir(os.path.expanduser(cfg.paths)) else "")
        raise DataError(f"{where} matched no files{hint}")
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        raise DataError(f"{where}: {len(empty)} of {len(files)} files are empty: {_some(empty)}")
    return files


def _undecodable_share(path: str) -> float:
    """The share of the file's head that is not UTF-8 (1 for a head holding a NUL byte: binary)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return 1.0
    return (len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))) / max(len(head), 1)


def _require_text(files: list[str], cfg: DataConfig, notify: Callable[[str], None]) -> None:
    """A binary file matched by the glob would otherwise be tokenised as noise without a word; text with stray
    bytes is read, each as a replacement character, and said so (a file in another encoding looks like that)."""
    shares = {f: _undecodable_share(f) for f in files}
    binary = [f for f, share in shares.items() if share > _MAX_UNDECODABLE_SHARE]
    if binary:
        raise DataError(f"data.paths={cfg.paths!r}: {len(binary)} of {len(files)} files are not UTF-8 text: "
                        f"{_some(binary)} (narrow data.paths to text files)")
    stray = [f for f, share in shares.items() if share > 0]
    if stray:
        notify(f"data.paths={cfg.paths!r}: {len(stray)} of {len(files)} files hold bytes that are not UTF-8, read "
               f"as U+FFFD: {_some(stray)} (a file in another encoding: convert it, e.g. "
               "iconv -f latin1 -t utf-8)")


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def corpus_identity(cfg: DataConfig) -> str:
    """What the cache key knows of the corpus, found without reading it: local files by path, size and
    mtime (an edited file rebuilds the cache); a hub dataset by name, config, split and column."""
    if cfg.source == DataSource.hub:
        return _digest("hub", cfg.hub_name, cfg.hub_config, cfg.hub_split, cfg.text_column)
    return _digest("files", [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in _local_files(cfg)])


def _hf_cache_dir(cfg: DataConfig) -> Path:
    """Where the datasets library keeps its copies of the corpus: inside `data.cache_dir`, not the home directory."""
    return Path(os.path.expanduser(cfg.cache_dir)) / "hf-datasets"


def load_corpus(cfg: DataConfig, notify: Optional[Callable[[str], None]] = None):
    """The corpus as a `datasets.Dataset` with one document per row in column `text`; `notify` receives the line
    naming files with bytes that are not UTF-8."""
    import datasets

    cache_dir = str(_hf_cache_dir(cfg))
    if cfg.source != DataSource.hub:
        files = _local_files(cfg)
        if cfg.source == DataSource.files:  # the stdlib is known text, with other encodings in its test data
            _require_text(files, cfg, notify or _print_to_stderr)
        return datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                     encoding_errors="replace", cache_dir=cache_dir,  # its bar, not "Downloading"
                                     download_config=datasets.DownloadConfig(download_desc="checking local files"))
    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, cache_dir=cache_dir)
    except Exception as e:  # the hub's errors are long; say which setting to look at first
        raise DataError(f"data.hub_name={cfg.hub_name!r} (config {cfg.hub_config!r}, split "
                        f"{cfg.hub_split!r}) could not be loaded: {e}") from e
    if cfg.text_column not in ds.column_names:
        raise DataError(f"data.text_column={cfg.text_column!r} is not a column of {cfg.hub_name}; "
                        f"columns: {ds.column_names}")
    return ds.select_columns([cfg.text_column]).rename_column(cfg.text_column, "text") \
        if cfg.text_column != "text" else ds.select_columns(["text"])


def _train_tokenizer(ds, vocab_size: int, progress: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    batches = (ds[i:i + 256]["text"] for i in range(0, len(ds), 256))
    tok.train_from_iterator(batches, trainer=trainer, length=len(ds))
    return tok


@dataclass
class TokenData:
    """The tokenised corpus: one memmap, the last `n_val` tokens held out for validation."""

    tokenizer: "object"  # tokenizers.Tokenizer
    tokens: np.ndarray
    n_val: int
    path: Path

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: len(self.tokens) - self.n_val]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[len(self.tokens) - self.n_val:]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def _write_tokens(ds, tokenizer, out: Path, cfg: DataConfig, progress: bool) -> dict:
    from tqdm.auto import tqdm

    eot = tokenizer.token_to_id(EOT)

    def encode(batch):
        ids = [e.ids + [eot] for e in tokenizer.encode_batch(batch["text"])]
        return {"ids": ids, "n": [len(x) for x in ids]}

    # Shuffle documents so the held-out tail is a sample of the corpus, not its last files.
    ds = ds.shuffle(seed=0)
    encoded = ds.map(encode, batched=True, num_proc=min(cfg.num_proc, max(1, len(ds))),
                     remove_columns=ds.column_names, desc="tokenizing")
    total = int(np.asarray(encoded.with_format("numpy")["n"], dtype=np.int64).sum())
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    mm = np.memmap(out / "tokens.bin", dtype=dtype, mode="w+", shape=(total,))
    pos, max_token = 0, 0
    with tqdm(total=total, unit="tok", unit_scale=True, desc="writing tokens", disable=not progress) as bar:
        for batch in encoded.iter(batch_size=1024):
            flat = np.fromiter((t for ids in batch["ids"] for t in ids), dtype=dtype)
            mm[pos:pos + len(flat)] = flat
            pos += len(flat)
            max_token = max(max_token, int(flat.max()))
            bar.update(len(flat))
    mm.flush()
    del mm
    n_val = max(1, int(total * cfg.val_fraction))
    return {"n_tokens": total, "n_val": n_val, "dtype": np.dtype(dtype).name, "n_docs": len(ds),
            "max_token": max_token, "checksum": _tokens_checksum(out / "tokens.bin")}


def _tokens_checksum(path: Path) -> str:
    """sha256 of `_CHECK_CHUNKS` evenly spaced chunks of `_CHECK_CHUNK_BYTES`, the first at the start and the last
    at the end: every byte of a file of up to `_CHECK_CHUNKS` chunks, a fixed read of a larger one. The price of
    a check cheap enough for every start: the bytes between the chunks of a large file are not covered (its
    size is checked on its own)."""
    size = path.stat().st_size
    n_chunks = max(1, min(_CHECK_CHUNKS, -(-size // _CHECK_CHUNK_BYTES)))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(n_chunks):
            f.seek(i * (size - _CHECK_CHUNK_BYTES) // (n_chunks - 1) if n_chunks > 1 else 0)
            digest.update(f.read(_CHECK_CHUNK_BYTES))
    return digest.hexdigest()


# What meta.json must record for the cache to be checked; a cache without them predates the check.
_META_FIELDS = ("n_tokens", "n_val", "dtype", "max_token", "checksum", "tokenizer_checksum")


class _UnusableCache(DataError):
    """A published cache that does not match its own record; the message says what is wrong."""


def _open_cache(path: Path) -> TokenData:
    """The cache at `path`, checked against its meta.json before anything reads it: a truncated or rewritten
    token file would otherwise fail as an mmap error at start, or as an out-of-range embedding index mid-run."""
    from tokenizers import Tokenizer

    if not path.is_dir():
        raise _UnusableCache("it does not exist")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise _UnusableCache(f"meta.json is unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise _UnusableCache("meta.json is unreadable: not a JSON object")
    missing = [field for field in _META_FIELDS if field not in meta]
    if missing:
        raise _UnusableCache(f"meta.json has no {', '.join(missing)}: written by an older minitrain")
    try:
        tokenizer_json = (path / "tokenizer.json").read_bytes()
        tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    except Exception as e:  # tokenizers reports malformed JSON as a bare Exception
        raise _UnusableCache(f"tokenizer.json is unreadable: {e}") from None
    if hashlib.sha256(tokenizer_json).hexdigest() != meta["tokenizer_checksum"]:
        raise _UnusableCache("tokenizer.json does not match its checksum in meta.json")
    if meta["max_token"] >= tokenizer.get_vocab_size():
        raise _UnusableCache(f"its largest token id {meta['max_token']} is outside the tokenizer's "
                             f"{tokenizer.get_vocab_size()} ids")
    tokens_path = path / "tokens.bin"
    try:
        dtype, n_tokens, n_val = np.dtype(meta["dtype"]), int(meta["n_tokens"]), int(meta["n_val"])
    except (TypeError, ValueError) as e:
        raise _UnusableCache(f"meta.json is unreadable: {e}") from None
    if not 0 < n_val < n_tokens:
        raise _UnusableCache(f"meta.json is unreadable: n_val={n_val} for n_tokens={n_tokens}")
    try:
        size = tokens_path.stat().st_size
    except OSError as e:
        raise _UnusableCache(f"tokens.bin is unreadable: {e}") from None
    if size != n_tokens * dtype.itemsize:
        raise _UnusableCache(f"tokens.bin holds {size} bytes, meta.json records {n_tokens * dtype.itemsize}")
    if _tokens_checksum(tokens_path) != meta["checksum"]:
        raise _UnusableCache("tokens.bin does not match its checksum in meta.json")
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(n_tokens,))
    return TokenData(tokenizer, tokens, n_val, path)


def _build_cache(cfg: DataConfig, final: Path, progress: bool, notify: Callable[[str], None]) -> TokenData:
    """Builds the cache at `final` under an exclusive lock on `<final>.lock`, so that concurrent ranks or sweep
    jobs build it once. It is published by renaming a complete `<final>.tmp` (a crash mid-build leaves only that)
    over it (files.publish): a reader sees a whole cache or none, never a half-replaced one."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = files.lock(final.with_name(final.name + ".lock"))  # waits for a build under way elsewhere
    except OSError as e:  # a path through a file, a directory this user cannot write
        raise DataError(f"data.cache_dir={cfg.cache_dir!r}: cannot keep the token cache there ({error_reason(e)}); "
                        "point data.cache_dir at a writable directory") from None
    try:
        try:
            return _open_cache(final)  # another process built it while this one waited
        except _UnusableCache as why:
            if final.exists():
                notify(f"data cache {final} is unusable ({why}); rebuilding it")
        ds = load_corpus(cfg, notify)  # the corpus is read only to build the cache
        if len(ds) == 0:
            raise DataError(f"the {cfg.name} corpus has no documents")
        for leftover in final.parent.glob(f"{final.name}.tmp*"):  # of a build that crashed
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir()
        if cfg.tokenizer == "train":
            tokenizer = _train_tokenizer(ds, cfg.vocab_size, progress)
        else:
            from .tokenizer import pretrained_tokenizer

            tokenizer = pretrained_tokenizer(cfg.tokenizer)
        tokenizer.save(str(tmp / "tokenizer.json"))
        meta = _write_tokens(ds, tokenizer, tmp, cfg, progress)
        meta["tokenizer_checksum"] = hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()
        files.atomic_write(tmp / "meta.json", json.dumps(meta, indent=1))
        files.publish(tmp, final)
        return _open_cache(final)
    finally:
        lock.release()


def _print_to_stderr(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


def prepare_data(cfg: DataConfig, block_size: int, progress: bool = True,
                 notify: Optional[Callable[[str], None]] = None) -> TokenData:
    """Tokenizer and token file for `cfg`, built once and cached; checks the corpus fits `block_size`.
    `notify` receives the build's notes (default: stderr): an unusable cache rebuilt, files that are not clean
    UTF-8."""
    tokenizer = [] if cfg.tokenizer == "train" else [cfg.tokenizer]  # a trained one's caches keep their keys
    key = _digest(_FORMAT_VERSION, corpus_identity(cfg), cfg.vocab_size, cfg.val_fraction, *tokenizer)
    final = Path(os.path.expanduser(cfg.cache_dir)) / f"{cfg.name}-{key}"
    try:
        data = _open_cache(final)
    except _UnusableCache:
        data = _build_cache(cfg, final, progress, notify or _print_to_stderr)
    for split, arr in (("train", data.train), ("val", data.val)):
        if len(arr) < block_size + 1:
            raise DataError(f"the {cfg.name} corpus is too short: its {split} split has {len(arr)} tokens, "
                            f"fewer than one block of model.block_size={block_size} + 1 "
                            "(add text, or lower model.block_size / raise data.val_fraction)")
    return data


class Batches:
    """Random windows of `block_size + 1` tokens; the windows of a step depend only on (seed, step).

    With `vocab_size`, every window is checked on the host to hold ids below it: the cache's checksum
    covers a large token file only in part, and an id out of range would otherwise fail as an embedding
    index error mid-run (a device-side assert on CUDA) or, below the model's padded vocabulary, not at all."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, device: torch.device,
                 vocab_size: Optional[int] = None, cache_path: Optional[Path] = None):
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.device, self.vocab_size, self.cache_path = seed, device, vocab_size, cache_path

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def host_windows(self, step: int, part: int = 0, n_parts: int = 1) -> torch.Tensor:
        """Windows (B/n_parts, T+1) of slice `part` of step `step`'s global batch, int64 on the host; in pinned
        memory when the batches go to CUDA, so that the copy to the device is asynchronous (from pageable memory
        it would make the host wait)."""
        per = self.batch_size // n_parts
        starts = self.starts(step)[part * per:(part + 1) * per]
        win = torch.empty((len(starts), self.block_size + 1), dtype=torch.int64,
                          pin_memory=self.device.type == "cuda")
        ids = win.numpy()
        ids[:] = self.tokens[starts[:, None] + np.arange(self.block_size + 1)]
        if self.vocab_size is not None and (largest := int(ids.max())) >= self.vocab_size:
            raise DataError(f"the batch of step {step} holds token id {largest}, outside the tokenizer's "
                            f"{self.vocab_size} ids: the token cache {self.cache_path} is corrupt (its checksum "
                            "covers a large file only in part); delete it to have it rebuilt")
        return win

    def get(self, step: int, part: int = 0, n_parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B/n_parts, T) of slice `part` of step `step`'s global batch."""
        win = self.host_windows(step, part, n_parts)
        if self.device.type == "cuda":
            win = win.to(self.device, non_blocking=True)
        return win[:, :-1], win[:, 1:]


class DeviceBatches(Batches):
    """`Batches` with the next request's windows prepared while the current step runs: on CUDA they are gathered
    into pinned memory and copied on a side stream, so the step's launches wait neither for the host's gather
    nor for a copy on the compute stream, and nothing makes the host wait for the device.

    The caller asks in a predictable order: for each step, the aligned run of `grad_accum` parts of its rank
    (part rank*grad_accum + 0 .. grad_accum-1 of n_parts), then the next step. A request that is not the
    predicted one (the first after a resume, an eval pass, another split) is built on the spot: the result is
    the same, so the batches stay a pure function of (seed, step). On the CPU the same order is kept, without
    a copy. The next request's gather runs inside `get`, before it returns: it overlaps the device's work
    whenever the host is ahead of the device, which it is at every step but the one after a log step's sync.

    Pinned buffers come from torch's caching host allocator, which hands a buffer out again only once the copy
    recorded on it has completed (an event query, never a wait): the ring of host buffers the prefetch needs,
    without the host synchronising with the device."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, device: torch.device,
                 grad_accum: int = 1, vocab_size: Optional[int] = None, cache_path: Optional[Path] = None):
        super().__init__(tokens, block_size, batch_size, seed, device, vocab_size, cache_path)
        self.grad_accum = grad_accum
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: Optional[tuple] = None  # (request, windows, copy-done event) of the predicted request

    def get(self, step: int, part: int = 0, n_parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        request = (step, part, n_parts)
        staged = self._next if self._next is not None and self._next[0] == request else self._stage(request)
        _, win, copied = staged
        if copied is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(copied)
            win.record_stream(consumer)  # its memory is not handed out again before the step has read it
        self._next = self._stage(self._following(request))
        return win[:, :-1], win[:, 1:]

    def _following(self, request: tuple[int, int, int]) -> tuple[int, int, int]:
        step, part, n_parts = request
        if (part + 1) % self.grad_accum:
            return step, part + 1, n_parts
        return step + 1, part + 1 - self.grad_accum, n_parts

    def _stage(self, request: tuple[int, int, int]) -> tuple:
        win = self.host_windows(*request)
        if self.copy_stream is None:
            return request, win, None
        with torch.cuda.stream(self.copy_stream):
            win = win.to(self.device, non_blocking=True)
        return request, win, self.copy_stream.record_event()
