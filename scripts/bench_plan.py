"""The auto-fit against hand-picked settings, per model and global batch, on one GPU.

Each cell's plan (micro-batch, policy) against the alternatives a user would try that could beat it, every
point measured in a process of its own through the trainer's step (minitrain/tools/benchmarks/plan.py says
how). Prints the table (plan's choice, best alternative, the ratio, the measured peak against the budget)
and writes JSON to --out. A grid longer than one sitting goes on from an earlier run's JSON (`--measured`);
`--time-limit-s` starts no point after that many seconds.

    python scripts/bench_plan.py --models gpt2-124m gpt2-1.5b --batches 16 64 512 --out bench_plan.json
    python scripts/bench_plan.py --time-limit-s 470 --measured bench_plan.json --out bench_plan2.json
    python scripts/bench_plan.py --dry-run --device-memory-gb 150.1   # the points it would measure, on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 64, 512])
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="list the cells and points; measure nothing")
    ap.add_argument("--time-limit-s", type=float, help="start no point after this; the table shows what was measured")
    ap.add_argument("--measured", nargs="*", default=[], help="JSON of earlier runs: their points are not re-measured")
    ap.add_argument("--device-memory-gb", type=float, help="with --dry-run: the GPU's memory to plan against")
    ap.add_argument("--point", help=argparse.SUPPRESS)  # model:micro:policy, measured in this process
    ap.add_argument("--out", default="bench_plan.json")
    args = ap.parse_args()
    if args.point:
        model, micro, policy = args.point.split(":")
        print(json.dumps(plan.measure_point(model, int(micro), policy, args.warmup, args.steps, args.rounds)))
        return

    memory = int(args.device_memory_gb * 1e9) if args.dry_run else None
    cells = {(m, b): plan.cell_points(m, b, device_memory_bytes=memory) for m in args.models for b in args.batches}
    points = sorted({(m, *pt) for (m, _), (chosen, alts) in cells.items() for pt in [chosen, *alts]})
    for (m, b), (chosen, alts) in cells.items():
        print(f"{m:<10} B={b:<4} plan: micro {chosen[0]:>3} {chosen[1]:<9} alternatives: {alts}")
    print(f"{len(points)} points to measure")
    if args.dry_run:
        return

    budget_gb = bench.memory_budget_bytes() / 1e9
    measured = plan.earlier_points(args.measured)
    command = [sys.executable, __file__, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--point"]
    plan.measure_points(points, measured, command, args.time_limit_s)
    rows = plan.cell_rows(cells, measured, budget_gb)
    bench.write_results(args.out, {"points": [measured[p] | {"key": list(p)} for p in points], "cells": rows})
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  budget {budget_gb:.1f} GB")
    print("\n".join(plan.report(rows)))


if __name__ == "__main__":
    main()
