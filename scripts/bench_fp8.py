"""precision=fp8 against precision=bf16: tokens/s and memory on one GPU (`speed`), validation loss of a sweep's runs
over precision and seed (`quality`); minitrain/tools/benchmarks/fp8.py says how.

    python scripts/bench_fp8.py speed --models gpt2-1.5b --out bench_fp8_15b.json
    python scripts/bench_fp8.py speed --models gpt2-774m gpt2-124m --time-limit-s 300 --out bench_fp8_sizes.json
    python scripts/bench_fp8.py quality runs/multirun/2026-12-03/10-00-00/*   # a sweep's job dirs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench, report  # noqa: E402
from minitrain.tools.benchmarks import fp8  # noqa: E402


def speed(args) -> None:
    rows = []
    for model_rows in fp8.measure_models(args.models, args.time_limit_s, memory_budget=args.memory_budget,
                                         warmup=args.warmup, rounds=args.rounds, steps=args.steps, extra=args.extra):
        rows += model_rows
        bench.write_results(args.out, {"rows": rows})  # after each model: a run cut short keeps what it measured
        print("\n".join(fp8.speed_report(model_rows)), flush=True)
    if len(args.models) > 1:
        print("\n".join(fp8.speed_report(rows)))


def quality(args) -> None:
    runs = [fp8.read_run(Path(d)) for d in args.run_dirs if report.is_run_dir(Path(d))]
    print("\n".join(fp8.quality_report(runs)))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    s = sub.add_parser("speed", help="tokens/s and memory, the precisions in alternating rounds")
    s.add_argument("--models", nargs="+", default=["gpt2-1.5b"])
    s.add_argument("--memory-budget", type=float, default=0.47,
                   help="each trainer's trainer.memory_budget: both are resident on the GPU, so the two together "
                        "under 1 (0.47 fits gpt2-1.5b's bf16 step at micro-batch 16 on an H200, by the memory model)")
    s.add_argument("--warmup", type=int, default=3, help="steps before the memory and the timed rounds")
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--steps", type=int, default=4, help="steps per precision and round")
    s.add_argument("--time-limit-s", type=float, help="start no model after this many seconds")
    s.add_argument("--extra", nargs="*", default=[], help="overrides for both precisions (after the shared plan's)")
    s.add_argument("--out", default="bench_fp8.json")
    s.set_defaults(func=speed)
    q = sub.add_parser("quality", help="validation losses of a sweep's runs, each beside bf16 of its seed")
    q.add_argument("run_dirs", nargs="+", help="run dirs (others, e.g. a sweep's multirun.yaml, are passed over)")
    q.add_argument("--out")
    q.set_defaults(func=quality)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
