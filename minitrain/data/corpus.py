"""Where the text comes from, and how it is cut into documents: local files by glob (or the standard library), or
a Hugging Face dataset streamed row by row, never downloaded whole.

A document is a file or a row. One longer than DOC_CHARS is cut at line ends into documents of at most DOC_CHARS,
so that one huge file is many documents: each is split, encoded and ended by EOT on its own, in bounded memory.
Each document goes to validation or to training by a hash of its text (`is_validation`): the split never cuts a
document, does not depend on the order or number of the others, and so stays the same as the corpus grows
(and a duplicated document lands on one side only).
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import io
import logging
import os
import site
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..config import DataConfig, DataSource
from ..errors import error_reason
from ..hub import is_local

DOC_CHARS = 1 << 20
# Documents are encoded in chunks of at most this many characters: many chunks keep every core busy in one
# encode_batch call, and a short chunk encodes on less CPU than a long one (docs/benchmarks.md, Data preparation;
# likely its working memory in the tokenizer fitting the core's cache). A chunk ends where the byte-level
# pre-tokenizer splits the text anyway (before whitespace that follows a non-space character), so the chunks'
# tokens are the whole document's; only a stretch of half a chunk without such whitespace (a long base64 line)
# is cut at the limit.
CHUNK_CHARS = 1 << 13
# Characters per encode_batch call: its encodings hold ~100 bytes per token until they are written.
BATCH_CHARS = 1 << 23
# A corpus file whose head holds a NUL byte, or more than this share of bytes that are not UTF-8, is not text
# (a binary file, or text in another encoding the tokenizer would learn as replacement characters).
_SNIFF_BYTES = 8192
_MAX_UNDECODABLE_SHARE = 0.25


class DataError(ValueError):
    """The corpus cannot be used; the message says why and which setting to change."""


def is_validation(text: bytes, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split: its hash, read as a fraction of 2**64, falls below
    data.val_fraction. A function of the document's bytes alone."""
    h = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
    return h < val_fraction * 2**64


def cut(read: Callable[[int], str], limit: int) -> Iterator[str]:
    """The text `read(n)` returns, in consecutive pieces of at most `limit` characters, each ending before a line
    end where one is in its second half (`_line_end`); together they are the whole text."""
    carry = ""
    while True:
        block = carry + read(limit - len(carry))
        if len(block) < limit:  # the end of the text
            if block:
                yield block
            return
        end = _line_end(block)
        yield block[:end]
        carry = block[end:]


def chunks(text: str) -> Iterator[str]:
    """A document in the pieces it is encoded in: CHUNK_CHARS at most, tokenized as the whole would be."""
    return cut(io.StringIO(text).read, CHUNK_CHARS)


def _line_end(block: str) -> int:
    """Where to end a full block: before the last newline of its second half that follows a non-space character,
    else before such a space, else at its end. GPT-2's pre-tokenizer splits text between a non-space character
    and the whitespace after it whatever follows, so the two sides tokenize as they would together."""
    half = len(block) // 2
    for separator in ("\n", " "):
        pos = len(block)
        while (pos := block.rfind(separator, half, pos)) > half:
            if not block[pos - 1].isspace():
                return pos
    return len(block)


@dataclass
class Batch:
    """Consecutive documents (text, its UTF-8 bytes, is it validation), and where the corpus continues after them."""

    docs: list[tuple[str, int, bool]] = field(default_factory=list)
    cursor: dict[str, Any] = field(default_factory=dict)
    chars: int = 0


def _batched(docs: Iterator[tuple[str, int, int, bool]], val_fraction: float,
             state: Optional[Callable[[], Any]] = None) -> Iterator[Batch]:
    """Documents (text, index of their file or row, piece of it, is it the last piece) in batches of about
    BATCH_CHARS. With `state` (a stream's position, for resuming) a batch ends only where a row ends."""
    batch = Batch()
    for text, doc, piece, last in docs:
        data = text.encode("utf-8", "surrogatepass")
        batch.docs.append((text, len(data), is_validation(data, val_fraction)))
        batch.chars += len(text)
        if batch.chars >= BATCH_CHARS and (last or state is None):
            batch.cursor = {"doc": doc + 1, "piece": 0} if last else {"doc": doc, "piece": piece + 1}
            if state is not None:
                batch.cursor["state"] = state()
            yield batch
            batch = Batch()
    if batch.docs:
        batch.cursor = {"end": True}
        yield batch


def _pieces(read: Callable[[int], str], doc: int, skip: int = 0) -> Iterator[tuple[str, int, int, bool]]:
    """Document `doc`'s text cut into documents of at most DOC_CHARS: (text, doc, piece, is it the last), from
    piece `skip` on."""
    pieces = cut(read, DOC_CHARS)
    text, piece = next(pieces, None), 0
    while text is not None:
        following = next(pieces, None)
        if piece >= skip:
            yield text, doc, piece, following is None
        text, piece = following, piece + 1


# -- local files ------------------------------------------------------------------------------------------------

def stdlib_files() -> list[str]:
    """The running interpreter's own standard-library sources: real text on every machine."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f)


def packages_files() -> list[str]:
    """The .py sources of the packages installed for the running interpreter (its site directories, not
    PYTHONPATH's): a corpus of hundreds of MB on any machine with torch, no download."""
    roots = sorted({os.path.realpath(p) for p in (*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                                                  sysconfig.get_paths()["platlib"]) if os.path.isdir(p)})
    files = {os.path.realpath(f) for root in roots for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)}
    return sorted(f for f in files if os.path.isfile(f))


def _some(files: list[str]) -> str:
    return ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")


def local_files(cfg: DataConfig) -> list[str]:
    """The corpus's files, sorted, empty ones left out (they hold no document)."""
    if cfg.source == DataSource.stdlib:
        files, where = stdlib_files(), "the standard library"
    elif cfg.source == DataSource.packages:
        files, where = packages_files(), "the installed packages"
    else:
        pattern = os.path.expanduser(cfg.paths)
        files, where = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)), \
            f"data.paths={cfg.paths!r}"
    if not files:
        hint = (f"; it names a directory: give a glob of its files, e.g. data.paths='{cfg.paths.rstrip('/')}/**/*.txt'"
                if cfg.source == DataSource.files and os.path.isdir(os.path.expanduser(cfg.paths)) else "")
        raise DataError(f"{where} matched no files{hint}")
    text = [f for f in files if os.path.getsize(f) > 0]
    if not text:
        raise DataError(f"{where}: the corpus holds no text: all {len(files)} files are empty ({_some(files)})")
    return text


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


class LocalFiles:
    """Local files, read in corpus order (sorted paths), each cut into documents of at most DOC_CHARS."""

    def __init__(self, cfg: DataConfig, notify: Callable[[str], None]):
        self.cfg, self.files = cfg, local_files(cfg)
        if cfg.source == DataSource.files:  # .py sources are known text (the stdlib's test data holds other encodings)
            _require_text(self.files, cfg, notify)
        self.sizes = [os.path.getsize(f) for f in self.files]
        self.total_bytes = sum(self.sizes)

    def _documents(self, cursor: dict[str, Any]) -> Iterator[tuple[str, int, int, bool]]:
        for doc in range(cursor["doc"], len(self.files)):
            with open(self.files[doc], encoding="utf-8", errors="replace", newline="") as f:
                yield from _pieces(f.read, doc, cursor["piece"] if doc == cursor["doc"] else 0)

    def batches(self, cursor: dict[str, Any]) -> Iterator[Batch]:
        return _batched(self._documents(cursor), self.cfg.val_fraction)

    def sample(self, max_bytes: int) -> Iterator[str]:
        """What the tokenizer learns from: the whole corpus up to `max_bytes`, else windows of DOC_CHARS bytes
        evenly spaced over it (whole lines), so a large corpus is sampled throughout, not only its first files."""
        if self.total_bytes <= max_bytes:
            for text, *_ in self._documents({"doc": 0, "piece": 0}):
                yield from chunks(text)
            return
        starts = [0]
        for size in self.sizes:
            starts.append(starts[-1] + size)
        n = max(1, max_bytes // DOC_CHARS)
        for i in range(n):
            offset = i * self.total_bytes // n
            doc = bisect.bisect_right(starts, offset) - 1
            yield from self._window(doc, offset - starts[doc])

    def _window(self, doc: int, skip: int) -> Iterator[str]:
        """DOC_CHARS bytes from byte `skip` of file `doc` on, going on into the next files where one ends first
        (a corpus of files smaller than a window is sampled as fully as one big file); the line the window starts
        inside and the one it ends inside are left out."""
        left, first = DOC_CHARS, doc
        while left > 0 and doc < len(self.files):
            with open(self.files[doc], "rb") as f:
                f.seek(skip)
                data = f.read(left)
            left -= len(data)
            text = data.decode("utf-8", "replace")
            if skip > 0:
                text = text[text.find("\n") + 1:]
            if left == 0:  # the window ends inside this file (a window inside one line keeps it)
                text = text[:text.rfind("\n") + 1] or (text if doc == first else "")
            yield from chunks(text)
            doc, skip = doc + 1, 0


# -- a hub dataset, streamed ------------------------------------------------------------------------------------

@contextmanager
def hub_quietly() -> Iterator[None]:
    """The huggingface_hub library's warnings held back during a call to the hub: offline, each of its five
    retries logs a line (twice under Hydra) before the one error of ours that says what to do."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class HubStream:
    """A Hugging Face dataset's split, streamed: rows arrive as they are read, nothing is downloaded first and no
    arrow cache is written (the datasets library's own files go to `scratch`). A hub name needs network; a local
    directory in its place (a copy of the dataset's files) does not."""

    def __init__(self, cfg: DataConfig, scratch: Path):
        import datasets

        self.cfg, self.total_bytes = cfg, None
        try:
            with hub_quietly():
                self.ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, streaming=True,
                                                cache_dir=str(scratch))
        except Exception as e:  # no network, a wrong name, config or split: the library's messages are long
            raise DataError(
                f"data.hub_name={cfg.hub_name!r} (config {cfg.hub_config!r}, split {cfg.hub_split!r}) could not be "
                f"opened ({error_reason(e)}). A hub dataset is streamed from the hub and needs network; offline, "
                "point data.hub_name at a local copy of its files (a directory), or use data=files "
                "data.paths='DIR/**/*.txt' for plain text files") from None

    def _rows(self, start: int) -> Iterator[tuple[str, int, int, bool]]:
        for row, record in enumerate(self.ds, start):
            if self.cfg.text_column not in record:
                raise DataError(f"data.text_column={self.cfg.text_column!r} is not a column of "
                                f"{self.cfg.hub_name}; its columns: {sorted(record)}")
            text = record[self.cfg.text_column]
            if not isinstance(text, str):
                raise DataError(f"data.text_column={self.cfg.text_column!r} of {self.cfg.hub_name} holds "
                                f"{type(text).__name__}, not text; name its text column")
            yield from _pieces(io.StringIO(text).read, row)

    def batches(self, cursor: dict[str, Any]) -> Iterator[Batch]:
        if cursor.get("state") is not None:
            self.ds.load_state_dict(cursor["state"])
        return _batched(self._rows(cursor["doc"]), self.cfg.val_fraction, self.ds.state_dict)

    def sample(self, max_bytes: int) -> Iterator[str]:
        """The stream's first `max_bytes` (its length is not known ahead)."""
        seen = 0
        for text, *_ in self._rows(0):
            yield from chunks(text)
            seen += len(text)
            if seen >= max_bytes:
                return


def open_corpus(cfg: DataConfig, notify: Callable[[str], None], scratch: Path) -> LocalFiles | HubStream:
    return HubStream(cfg, scratch) if cfg.source == DataSource.hub else LocalFiles(cfg, notify)


def contents_digest(files: list) -> str:
    """One digest of the files' paths and bytes, in their order: a file rewritten in place to the same size, its
    times set back, still changes it. Reading the bytes costs about a second per GB (docs/benchmarks.md, Data
    preparation), small beside tokenizing them."""
    digest, buffer = hashlib.sha256(), bytearray(1 << 20)
    for path in files:
        file_digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                file_digest.update(memoryview(buffer)[:n])
        digest.update(f"{path}\0{file_digest.hexdigest()}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _copy_files(folder: Path) -> list[str]:
    """A hub dataset's local copy: its files, sorted, hidden ones left out as the datasets library leaves them (a
    git clone's .git/ holds the data again)."""
    return sorted(str(f) for f in folder.rglob("*")
                  if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts))


def corpus_identity(cfg: DataConfig) -> list:
    """The corpus as the cache key knows it: local files, or a hub dataset's local copy, by their contents; a hub
    dataset by its name (it is not even opened)."""
    if cfg.source == DataSource.hub:
        copy = contents_digest(_copy_files(Path(cfg.hub_name).expanduser())) if is_local(cfg.hub_name) else None
        return ["hub", cfg.hub_name, cfg.hub_config, cfg.hub_split, cfg.text_column, copy]
    return ["files", contents_digest(local_files(cfg))]
