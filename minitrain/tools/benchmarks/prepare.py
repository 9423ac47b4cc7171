"""A corpus's preparation against the tokenizers library alone doing the same job: time and peak memory
(`scripts/bench_prepare.py` is its command line).

The corpus is real text found on the machine (Python sources of the running interpreter, Perl modules,
documentation and man pages), repeated until it holds the asked size with each repetition's lines shuffled per
file (so that no document repeats), laid out both as many files and as one file. Each run is a fresh process
tree, timed by the wall clock (its CPU seconds beside), its memory the peak of the RSS summed over its
processes:

  ideal      the tokenizers library alone (`ideal`): the same byte-level BPE trained on the same bounded sample
             (windows of 1 MiB evenly spaced over the corpus), then every file read in chunks of 8K characters cut at
             line ends and encoded with encode_batch_fast in batches of 8 MiB on all cores, the ids (an EOT after
             each file) written to one token file
  minitrain  `scripts/prepare_data.py data=files ...` into an empty cache dir: the same sample and BPE, the
             document split, shards, checksums, progress records and index

The ideal is written here against the tokenizers library, not with minitrain's code, so that it stays the job
done without minitrain. Importing this module imports neither torch nor minitrain's data package: the ideal's
process holds what the job needs and nothing else.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

import psutil

from ... import files

WINDOW, CHUNK, BATCH = 1 << 20, 1 << 13, 1 << 23  # CHUNK: minitrain's data.corpus.CHUNK_CHARS
EOT = "<|endoftext|>"
TIME_TARGET, MEMORY_TARGET_GB = 1.1, 2.0
KINDS = ("ideal", "minitrain")


# -- the corpus ---------------------------------------------------------------------------------------------------

def _text_sources() -> list[Path]:
    """Text files on this machine, sorted: Python sources on the interpreter's path, Perl modules, docs, man pages."""
    roots = {Path(sysconfig.get_paths()["stdlib"]), *(Path(p) for p in sys.path if "-packages" in p)}
    found = {p for root in roots if root.is_dir() for p in root.rglob("*.py")}
    for root, patterns in ((Path("/usr/share/perl"), ("*.pm", "*.pod")), (Path("/usr/share/perl5"), ("*.pm", "*.pod")),
                           (Path("/usr/share/doc"), ("*.txt", "*.md", "*.rst", "*.gz")),
                           (Path("/usr/share/man"), ("*.gz",))):
        if root.is_dir():
            found |= {p for pattern in patterns for p in root.rglob(pattern)}
    return sorted(p for p in found if p.is_file() and not p.is_symlink())


def _read_text(path: Path) -> str:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""
    return "" if b"\0" in raw[:8192] else raw.decode("utf-8", "replace")


def build_corpus(work: Path, gb: float) -> Path:
    """work/corpus-<gb>/many/<round>/<n>.txt and .../one.txt: the same text, as many files and as one (built
    once, kept for the next runs)."""
    folder = work / f"corpus-{gb:g}"
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "many").mkdir(parents=True)
    sources, target, written, rnd = _text_sources(), int(gb * 1e9), 0, 0
    print(f"building a {gb:g} GB corpus in {folder} from {len(sources)} text files", flush=True)
    with open(folder / "one.txt", "w", encoding="utf-8", newline="") as one:
        while written < target:
            (folder / "many" / f"{rnd:02d}").mkdir()
            for i, source in enumerate(sources):
                text = _read_text(source)
                if not text.strip():
                    continue
                if rnd:  # another document with the same words and lines: no repeats for the split or the BPE
                    lines = text.splitlines(keepends=True)
                    random.Random(f"{rnd}-{i}").shuffle(lines)
                    text = "".join(lines)
                (folder / "many" / f"{rnd:02d}" / f"{i:06d}.txt").write_text(text, encoding="utf-8", newline="")
                one.write(text)
                written += len(text.encode("utf-8"))
                if written >= target:
                    break
            rnd += 1
    (folder / "done").write_text(f"{written}\n")
    return folder


def corpus_paths(corpus: Path) -> dict[str, str]:
    """Each layout's glob."""
    return {"many": str(corpus / "many" / "**" / "*.txt"), "one": str(corpus / "one.txt")}


# -- the ideal: the tokenizers library alone ------------------------------------------------------------------------

def _file_chunks(path: str) -> Iterator[str]:
    """A file's text in chunks of about CHUNK characters, each cut after a newline where it holds one."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        carry = ""
        while block := f.read(CHUNK):
            block = carry + block
            cut = block.rfind("\n") + 1 or len(block)
            carry = block[cut:]
            yield block[:cut]
        if carry:
            yield carry


def _text_chunks(text: str) -> Iterator[str]:
    while text:
        cut = text.rfind("\n", 0, CHUNK) + 1 if len(text) > CHUNK else len(text)
        yield text[:cut or CHUNK]
        text = text[cut or CHUNK:]


def _sample(files: list[str], sizes: list[int], sample_bytes: int) -> Iterator[str]:
    """Windows of WINDOW bytes evenly spaced over the corpus, whole lines (all of it if it is smaller)."""
    total = sum(sizes)
    if total <= sample_bytes:
        for path in files:
            yield from _file_chunks(path)
        return
    offsets, acc = [], 0
    for size in sizes:
        offsets.append(acc)
        acc += size
    n = max(1, sample_bytes // WINDOW)
    for i in range(n):
        at = i * total // n
        f = bisect.bisect_right(offsets, at) - 1
        with open(files[f], "rb") as fh:
            fh.seek(at - offsets[f])
            text = fh.read(WINDOW).decode("utf-8", "replace")
        if at > offsets[f]:
            text = text[text.find("\n") + 1:]
        yield from _text_chunks(text[:text.rfind("\n") + 1] or text)


def ideal(paths: str, out: Path, vocab_size: int, sample_mb: int) -> None:
    """The job done with the tokenizers library alone: the BPE, then every file's ids (an EOT after each) in
    `out` as uint16, encoded in batches of BATCH characters."""
    from itertools import chain

    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(f for f in glob.glob(paths, recursive=True) if os.path.getsize(f))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_sample(files, [os.path.getsize(f) for f in files], sample_mb << 20), trainer=trainer)
    eot = tok.token_to_id(EOT)
    batch, ends, chars = [], [], 0
    with open(out, "wb") as f:
        def flush():
            encodings = tok.encode_batch_fast(batch, add_special_tokens=False)
            ids = chain.from_iterable(chain(e.ids, [eot]) if end else e.ids for e, end in zip(encodings, ends))
            f.write(np.fromiter(ids, dtype=np.uint16).tobytes())
            batch.clear(), ends.clear()

        for path in files:
            for chunk in _file_chunks(path):
                if chars >= BATCH:  # before a chunk is added: a file's last chunk is still in the batch at its end
                    flush()
                    chars = 0
                batch.append(chunk), ends.append(False)
                chars += len(chunk)
            ends[-1] = True
        if batch:
            flush()


# -- measuring ------------------------------------------------------------------------------------------------------

def measured(cmd: list[str], env: dict, log: Path) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user and system, of the process's threads: neither side forks workers) and the
    peak GB of RSS summed over the process and its children, sampled every 50 ms; its output (progress bars,
    notes) goes to `log`, whose end is shown if it fails. On a machine shared with other work the wall time
    grows with the others' load, the CPU time hardly."""
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    root, peak, ended = psutil.Process(proc.pid), 0, 0
    while not ended:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
        except psutil.Error:  # a process ended between the listing and the read
            pass
        time.sleep(0.05)
        ended, status, usage = os.wait4(proc.pid, os.WNOHANG)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}; the end of {log}:\n"
                         + log.read_text(errors="replace")[-2000:])
    return seconds, usage.ru_utime + usage.ru_stime, peak / 1e9


def leftovers(cache: Path) -> list[str]:
    """What the cache dir holds besides the published cache (its tokenizer, index and shards) and its lock file."""
    extra = []
    for entry in cache.iterdir():
        if entry.name.endswith(".lock"):
            continue
        if not entry.is_dir() or entry.name.endswith(".tmp") or files.is_temporary(entry):
            extra.append(entry.name)
        else:
            extra += [f"{entry.name}/{p.name}" for p in entry.iterdir()
                      if p.name not in ("index.json", "tokenizer.json") and p.suffix != ".bin"]
    return extra


def summary(runs: list[dict], layout: str) -> dict:
    """A layout's medians (with the lowest and highest run) per kind, minitrain's wall and CPU time over the
    ideal's, and whether the targets are met: wall time <= TIME_TARGET x, peak < MEMORY_TARGET_GB, nothing left
    behind."""
    from minitrain.tools.bench import Spread

    mine = [r for r in runs if r["layout"] == layout]
    out = {kind: {key: Spread.of(r[key] for r in mine if r["kind"] == kind).__dict__
                  for key in ("seconds", "cpu_seconds", "peak_gb")} for kind in KINDS}
    out["time_ratio"] = out["minitrain"]["seconds"]["median"] / out["ideal"]["seconds"]["median"]
    out["cpu_ratio"] = out["minitrain"]["cpu_seconds"]["median"] / out["ideal"]["cpu_seconds"]["median"]
    out["met"] = (out["time_ratio"] <= TIME_TARGET and out["minitrain"]["peak_gb"]["high"] < MEMORY_TARGET_GB
                  and not any(r["leftovers"] for r in mine))
    return out
