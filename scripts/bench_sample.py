"""Decode tokens/s of minitrain's sampler beside transformers' generate: same weights, same dtype (bf16), greedy,
after an fp32 check that both give the same greedy tokens; minitrain/tools/benchmarks/sample.py says how.

    python scripts/bench_sample.py --models gpt2-124m --out bench_sample_124m.json
    python scripts/bench_sample.py --models gpt2-1.5b --out bench_sample_15b.json
    python scripts/bench_sample.py --device cpu --models tiny --check-model tiny --batches 1 --new-tokens 4 --rounds 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-124m", "gpt2-1.5b"], choices=list(sample.SHAPES))
    ap.add_argument("--init-from", nargs="*", default=None, help="per model: a Hugging Face name or directory "
                    "(e.g. gpt2 gpt2-xl) instead of random weights")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-model", default="gpt2-124m", choices=list(sample.SHAPES),
                    help="the shape (random weights) of the fp32 greedy check run before any timing")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a smoke run of the script (--models tiny --check-model tiny)")
    ap.add_argument("--out", default="bench_sample.json")
    args = ap.parse_args()
    if args.init_from and len(args.init_from) != len(args.models):
        ap.error(f"--init-from takes one source per model: {len(args.models)} models, {len(args.init_from)} sources")
    started, device = time.perf_counter(), torch.device(args.device)
    try:
        rows = sample.run(args.models, args.batches, args.prompt_len, args.new_tokens, args.rounds, args.check_model,
                          device, args.init_from)
    except sample.DecodeMismatch as e:
        sys.exit(str(e))
    skips = sample.cudagraph_skips()
    print(f"cudagraph skips: {skips}; {time.perf_counter() - started:.0f} s in all")
    bench.write_results(args.out, {**sample.environment(device), "cudagraph_skips": skips, "rows": rows})


if __name__ == "__main__":
    main()
