"""Corpus preparation against the tokenizers library alone doing the same job: time and peak memory.

    python scripts/bench_prepare.py --gb 1 --work /tmp/bench-prepare --rounds 2 --out bench_prepare.json

Builds once, in --work, a corpus of real text found on this machine (Python sources of the running interpreter,
Perl modules, documentation and man pages), repeated until it holds --gb GB with each repetition's lines shuffled
per file (so no document repeats), laid out both as many files and as one file. For each layout, in alternating
order per round, each in a fresh process tree:

  ideal      the tokenizers library alone: the same byte-level BPE trained on the same bounded sample (windows of
             1 MiB evenly spaced over the corpus), then every file read in chunks of 64 KiB cut at line ends and
             encoded with encode_batch_fast in batches of 8 MiB on all cores, the ids (an EOT after each file)
             written to one token file
  minitrain  `scripts/prepare_data.py data=files ...` into an empty cache dir: the same sample and BPE, the
             document split, shards, checksums, progress records and index

Printed per run: wall time and the peak of the RSS summed over the run's processes (sampled every 50 ms); then
per layout the medians and minitrain/ideal ratios, against the targets (time <= 1.1x, peak < 2 GB, and after
each minitrain run the cache dir holding the published cache and its lock file only).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WINDOW, CHUNK, BATCH = 1 << 20, 1 << 16, 1 << 23
TIME_TARGET, MEMORY_TARGET_GB = 1.1, 2.0


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
    """work/corpus-<gb>/many/<round>/<n>.txt and .../one.txt: the same text, as many files and as one."""
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


# -- the ideal: the tokenizers library alone ------------------------------------------------------------------------

def _sample(files: list[str], sizes: list[int], sample_bytes: int):
    """Windows of WINDOW bytes evenly spaced over the corpus, whole lines (all of it if it is smaller)."""
    total = sum(sizes)
    if total <= sample_bytes:
        for path in files:
            yield from _chunks(path)
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
        text = text[:text.rfind("\n") + 1] or text
        while text:
            cut = text.rfind("\n", 0, CHUNK) + 1 if len(text) > CHUNK else len(text)
            yield text[:cut or CHUNK]
            text = text[cut or CHUNK:]


def _chunks(path: str):
    """A file's text in chunks of about CHUNK characters, cut after a newline."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        carry = ""
        while block := f.read(CHUNK):
            block = carry + block
            cut = block.rfind("\n") + 1 or len(block)
            carry = block[cut:]
            yield block[:cut]
        if carry:
            yield carry


def ideal(paths: str, out: Path, vocab_size: int, sample_mb: int) -> None:
    import glob
    from itertools import chain

    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(f for f in glob.glob(paths, recursive=True) if os.path.getsize(f))
    sizes = [os.path.getsize(f) for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_sample(files, sizes, sample_mb << 20), trainer=trainer)
    eot = tok.token_to_id("<|endoftext|>")
    batch, ends, chars = [], [], 0
    with open(out, "wb") as f:
        def flush():
            encodings = tok.encode_batch_fast(batch, add_special_tokens=False)
            ids = chain.from_iterable(chain(e.ids, [eot]) if end else e.ids for e, end in zip(encodings, ends))
            f.write(np.fromiter(ids, dtype=np.uint16).tobytes())
            batch.clear(), ends.clear()

        for path in files:
            for chunk in _chunks(path):
                if chars >= BATCH:  # before a chunk is added: a file's last chunk is still in the batch at its end
                    flush()
                    chars = 0
                batch.append(chunk), ends.append(False)
                chars += len(chunk)
            ends[-1] = True
        if batch:
            flush()


# -- measuring ------------------------------------------------------------------------------------------------------

def measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and the peak GB of RSS summed over the process and its children, sampled every 50 ms."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
        except psutil.Error:  # a process ended between the listing and the read
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return seconds, peak / 1e9


def leftovers(cache: Path) -> list[str]:
    """What the cache dir holds besides the published cache and its lock file."""
    extra = []
    for entry in cache.iterdir():
        if entry.name.endswith(".lock"):
            continue
        if not entry.is_dir() or entry.name.endswith((".tmp", ".old")):
            extra.append(entry.name)
        else:
            extra += [f"{entry.name}/{p.name}" for p in entry.iterdir()
                      if p.name not in ("index.json", "tokenizer.json") and p.suffix != ".bin"]
    return extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (1e9 bytes)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-prepare"), help="corpus, caches and outputs")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each kind per layout, alternating their order")
    ap.add_argument("--layouts", default="many,one", help="many (one file per document), one (a single file)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--sample-mb", type=int, default=64,
                    help="the tokenizer's training sample (data.tokenizer_sample_mb)")
    ap.add_argument("--out", type=Path, help="write the runs and the summary as JSON")
    ap.add_argument("--ideal", nargs=2, metavar=("GLOB", "OUT"), help=argparse.SUPPRESS)  # one ideal run
    args = ap.parse_args()
    if args.ideal:
        ideal(args.ideal[0], Path(args.ideal[1]), args.vocab_size, args.sample_mb)
        return 0
    corpus = build_corpus(args.work, args.gb)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": str(REPO)}
    paths = {"many": str(corpus / "many" / "**" / "*.txt"), "one": str(corpus / "one.txt")}
    print(f"corpus: {int((corpus / 'done').read_text()) / 1e9:.2f} GB, {os.cpu_count()} cores", flush=True)
    runs, summary, ok = [], {}, True
    for layout in args.layouts.split(","):
        cache, out = args.work / "cache", args.work / "ideal-tokens.bin"
        commands = {
            "ideal": [sys.executable, __file__, "--ideal", paths[layout], str(out),
                      "--vocab-size", str(args.vocab_size), "--sample-mb", str(args.sample_mb)],
            "minitrain": [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "data=files",
                          f"data.paths={paths[layout]}", f"data.cache_dir={cache}",
                          f"data.vocab_size={args.vocab_size}", f"data.tokenizer_sample_mb={args.sample_mb}"]}
        for rnd in range(args.rounds):
            for kind in (("ideal", "minitrain") if rnd % 2 == 0 else ("minitrain", "ideal")):
                shutil.rmtree(cache, ignore_errors=True)
                out.unlink(missing_ok=True)
                seconds, peak = measured(commands[kind], env)
                extra = leftovers(cache) if kind == "minitrain" else []
                ok &= not extra
                runs.append({"layout": layout, "round": rnd, "kind": kind, "seconds": seconds, "peak_gb": peak,
                             "leftovers": extra})
                print(f"{layout:4} round {rnd} {kind:9} {seconds:7.1f} s  peak {peak:5.2f} GB"
                      + (f"  LEFT BEHIND: {extra}" if extra else ""), flush=True)
        med = {kind: {key: statistics.median(r[key] for r in runs if r["layout"] == layout and r["kind"] == kind)
                      for key in ("seconds", "peak_gb")} for kind in ("ideal", "minitrain")}
        ratio = med["minitrain"]["seconds"] / med["ideal"]["seconds"]
        summary[layout] = {**med, "time_ratio": ratio}
        met = ratio <= TIME_TARGET and med["minitrain"]["peak_gb"] < MEMORY_TARGET_GB
        ok &= met
        print(f"{layout}: minitrain {med['minitrain']['seconds']:.1f} s / ideal {med['ideal']['seconds']:.1f} s = "
              f"{ratio:.3f}x (target <= {TIME_TARGET}x); peak {med['minitrain']['peak_gb']:.2f} GB (ideal "
              f"{med['ideal']['peak_gb']:.2f} GB; target < {MEMORY_TARGET_GB} GB): {'met' if met else 'MISSED'}",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gb": args.gb, "cores": os.cpu_count(), "runs": runs, "summary": summary},
                                       indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
