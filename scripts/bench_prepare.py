"""Corpus preparation against the tokenizers library alone doing the same job: time and peak memory, per layout
(many files, one file), in alternating order per round (minitrain/tools/benchmarks/prepare.py says how).

    python scripts/bench_prepare.py --gb 1 --work /tmp/bench-prepare --rounds 2 --out bench_prepare.json

Each run's output goes to WORK/ideal.log or WORK/minitrain.log; --rounds 0 builds the corpus (kept in WORK for the
next runs) and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minitrain.tools.benchmarks import prepare  # noqa: E402  (imports no torch: the ideal's process runs it)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (1e9 bytes)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-prepare"), help="corpus, caches and outputs")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each kind per layout, alternating their order (0: build the corpus only)")
    ap.add_argument("--layouts", default="many,one", help="many (one file per document), one (a single file)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--sample-mb", type=int, default=64, help="the tokenizer's training sample "
                                                              "(data.tokenizer_sample_mb)")
    ap.add_argument("--out", type=Path, help="write the runs and the summary as JSON")
    ap.add_argument("--ideal", nargs=2, metavar=("GLOB", "OUT"), help=argparse.SUPPRESS)  # one ideal run
    args = ap.parse_args()
    if args.rounds < 0:
        ap.error(f"--rounds {args.rounds}: give 0 (build the corpus only) or more")
    return args


def commands(args: argparse.Namespace, paths: str) -> dict[str, list[str]]:
    return {"ideal": [sys.executable, __file__, "--ideal", paths, str(args.work / "ideal-tokens.bin"),
                      "--vocab-size", str(args.vocab_size), "--sample-mb", str(args.sample_mb)],
            "minitrain": [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "data=files",
                          f"data.paths={paths}", f"data.cache_dir={args.work / 'cache'}",
                          f"data.vocab_size={args.vocab_size}", f"data.tokenizer_sample_mb={args.sample_mb}"]}


def main() -> int:
    args = parse()
    if args.ideal:
        prepare.ideal(args.ideal[0], Path(args.ideal[1]), args.vocab_size, args.sample_mb)
        return 0
    corpus = prepare.build_corpus(args.work, args.gb)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the caller's after the repo
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": path}
    print(f"corpus: {int((corpus / 'done').read_text()) / 1e9:.2f} GB, {os.cpu_count()} cores", flush=True)
    if not args.rounds:
        return 0
    runs, summaries = [], {}
    for layout in args.layouts.split(","):
        cmds = commands(args, prepare.corpus_paths(corpus)[layout])
        for rnd in range(args.rounds):
            for kind in prepare.KINDS[:: 1 if rnd % 2 == 0 else -1]:
                shutil.rmtree(args.work / "cache", ignore_errors=True)
                (args.work / "ideal-tokens.bin").unlink(missing_ok=True)
                seconds, cpu, peak = prepare.measured(cmds[kind], env, args.work / f"{kind}.log")
                extra = prepare.leftovers(args.work / "cache") if kind == "minitrain" else []
                runs.append({"layout": layout, "round": rnd, "kind": kind, "seconds": seconds, "cpu_seconds": cpu,
                             "peak_gb": peak, "leftovers": extra})
                print(f"{layout:4} round {rnd} {kind:9} {seconds:7.1f} s  CPU {cpu:7.1f} s  peak {peak:5.2f} GB"
                      + (f"  LEFT BEHIND: {extra}" if extra else ""), flush=True)
        s = summaries[layout] = prepare.summary(runs, layout)
        print(f"{layout}: minitrain {s['minitrain']['seconds']['median']:.1f} s / ideal "
              f"{s['ideal']['seconds']['median']:.1f} s = {s['time_ratio']:.3f}x (target <= {prepare.TIME_TARGET}x; "
              f"CPU time {s['cpu_ratio']:.3f}x); "
              f"peak {s['minitrain']['peak_gb']['high']:.2f} GB (ideal {s['ideal']['peak_gb']['high']:.2f} GB; "
              f"target < {prepare.MEMORY_TARGET_GB} GB): {'met' if s['met'] else 'MISSED'}", flush=True)
    if args.out:
        from minitrain.tools import bench

        bench.write_results(args.out, {"gb": args.gb, "cores": os.cpu_count(), "runs": runs, "summary": summaries})
    return 0 if all(s["met"] for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
