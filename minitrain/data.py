"""Corpus -> byte-level BPE tokenizer -> token memmap -> batches of random windows.

Everything before the batches is done once and cached under `data.cache_dir`, keyed by the corpus
and the tokenizer settings, so a second run (or every job of a sweep) starts training at once. Batches
are a pure function of (seed, step): resuming, changing grad_accum or adding ranks never changes which
windows a step sees.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import DataConfig, DataSource

EOT = "<|endoftext|>"
_FORMAT_VERSION = 1  # bump when the cached layout or tokenizer recipe changes


class DataError(ValueError):
    """The corpus cannot be used; the message says why and which setting to change."""


def stdlib_files() -> list[str]:
    """The running interpreter's own standard-library sources: real text on every machine."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f
                  and os.path.getsize(f) > 0)  # empty __init__.py files carry no text


def _local_files(cfg: DataConfig) -> list[str]:
    if cfg.source == DataSource.stdlib:
        files = stdlib_files()
        where = "the standard library"
    else:
        pattern = os.path.expanduser(cfg.paths)
        files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        where = f"data.paths={cfg.paths!r}"
    if not files:
        raise DataError(f"{where} matched no files")
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise DataError(f"{where}: {len(empty)} of {len(files)} files are empty: {shown}")
    return files


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def corpus_identity(cfg: DataConfig) -> str:
    """What the cache key knows of the corpus, found without reading it: local files by path, size and
    mtime (an edited file rebuilds the cache); a hub dataset by name, config, split and column."""
    if cfg.source == DataSource.hub:
        return _digest("hub", cfg.hub_name, cfg.hub_config, cfg.hub_split, cfg.text_column)
    return _digest("files", [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in _local_files(cfg)])


def load_corpus(cfg: DataConfig):
    """The corpus as a `datasets.Dataset` with one document per row in column `text`."""
    import datasets

    if cfg.source != DataSource.hub:
        return datasets.load_dataset("text", data_files=_local_files(cfg), sample_by="document", split="train",
                                     encoding_errors="replace")
    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split)
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
    pos = 0
    with tqdm(total=total, unit="tok", unit_scale=True, desc="writing tokens", disable=not progress) as bar:
        for batch in encoded.iter(batch_size=1024):
            flat = np.fromiter((t for ids in batch["ids"] for t in ids), dtype=dtype)
            mm[pos:pos + len(flat)] = flat
            pos += len(flat)
            bar.update(len(flat))
    mm.flush()
    n_val = max(1, int(total * cfg.val_fraction))
    return {"n_tokens": total, "n_val": n_val, "dtype": np.dtype(dtype).name, "n_docs": len(ds)}


def prepare_data(cfg: DataConfig, block_size: int, progress: bool = True) -> TokenData:
    """Tokenizer and token file for `cfg`, built once and cached; checks the corpus fits `block_size`."""
    from tokenizers import Tokenizer

    key = _digest(_FORMAT_VERSION, corpus_identity(cfg), cfg.vocab_size, cfg.val_fraction)
    final = Path(os.path.expanduser(cfg.cache_dir)) / f"{cfg.name}-{key}"
    if not (final / "meta.json").exists():  # the corpus is read only to build the cache
        ds = load_corpus(cfg)
        if len(ds) == 0:
            raise DataError(f"the {cfg.name} corpus has no documents")
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tokenizer = _train_tokenizer(ds, cfg.vocab_size, progress)
        tokenizer.save(str(tmp / "tokenizer.json"))
        meta = _write_tokens(ds, tokenizer, tmp, cfg, progress)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:  # atomic publish: a crash mid-build leaves only a .tmp dir, never a half cache
            os.replace(tmp, final)
        except OSError:  # another process published the same key first
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((final / "meta.json").read_text())
    tokens = np.memmap(final / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))
    data = TokenData(Tokenizer.from_file(str(final / "tokenizer.json")), tokens, meta["n_val"], final)
    for split, arr in (("train", data.train), ("val", data.val)):
        if len(arr) < block_size + 1:
            raise DataError(f"the {cfg.name} corpus is too short: its {split} split has {len(arr)} tokens, "
                            f"fewer than one block of model.block_size={block_size} + 1 "
                            "(add text, or lower model.block_size / raise data.val_fraction)")
    return data


class Batches:
    """Random windows of `block_size + 1` tokens; the windows of a step depend only on (seed, step)."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, device: torch.device):
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.device = seed, device

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def get(self, step: int, part: int = 0, n_parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B/n_parts, T) of slice `part` of step `step`'s global batch."""
        per = self.batch_size // n_parts
        starts = self.starts(step)[part * per:(part + 1) * per]
        T = self.block_size
        win = torch.from_numpy(np.stack([self.tokens[s:s + T + 1] for s in starts]).astype(np.int64))
        if self.device.type == "cuda":
            win = win.pin_memory().to(self.device, non_blocking=True)
        return win[:, :-1], win[:, 1:]
