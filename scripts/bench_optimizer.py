"""Optimizer step on the GPU: ours (loop / foreach / fused) against torch's best recipes, on GPT-2-124M shapes
and on 4096 tensors of 4096 elements, each row checked against a reference update before it is timed, set
beside the device's copy bandwidth (minitrain/tools/benchmarks/optimizer.py says how).

    python scripts/bench_optimizer.py --out bench_optimizer.json
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import optimizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(optimizer.CASES), choices=list(optimizer.CASES))
    ap.add_argument("--out", default="bench_optimizer.json")
    args = ap.parse_args()
    copy_bw = bench.copy_bytes_per_s(torch.device("cuda")) / 1e12
    results = {case: optimizer.run_case(optimizer.CASES[case], copy_bw) for case in args.cases}
    targets = optimizer.check_targets(results, copy_bw) if set(results) == set(optimizer.CASES) else {}
    bench.write_results(args.out, {"copy_tb_s": copy_bw, "cases": results,
                                   "targets": {k: {"value": v, "met": ok} for k, (v, ok) in targets.items()}})
    print(f"\n{torch.cuda.get_device_name()}: device-to-device copy {copy_bw:.2f} TB/s")
    print("\n".join(optimizer.report(results, targets)))


if __name__ == "__main__":
    main()
