"""LM-head loss forward+backward on the GPU: naive, naive compiled, Liger, torch's F.linear_cross_entropy,
ours (default and low_memory), each checked against an fp32 reference before it is timed, beside the bare
matmuls of a fused loss's two schedules (minitrain/tools/benchmarks/cross_entropy.py says how).

    python scripts/bench_cross_entropy.py [--out bench_cross_entropy.json] [--chunk-mib 32 64 256]
                                          [--shapes 16384x768x50304 8192x2048x128256]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import cross_entropy as ce  # noqa: E402


def parse_shape(text):
    try:
        n, h, v = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes NxHxV (e.g. 16384x768x50304), got {text!r}") from None
    return n, h, v


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_cross_entropy.json")
    parser.add_argument("--chunk-mib", type=int, nargs="*", default=[],
                        help="extra 'ours' rows with these logit workspace budgets (the 'ours' row uses the default)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=ce.SHAPES,
                        help="NxHxV shapes (default: " + " ".join("x".join(map(str, s)) for s in ce.SHAPES) + ")")
    args = parser.parse_args()

    impls = ce.implementations(args.chunk_mib)
    if impls["liger"] is None:
        print("note: liger-kernel not installed, its rows are skipped")
    if impls["torch-lce"] is None:
        print(f"note: torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13), its rows are skipped")
    results = []
    for n, h, v in args.shapes:
        torch.compiler.reset()  # each shape gets its own static graph, not a guard-failure recompile
        inputs = ce.make_inputs(n, h, v, "cuda")
        reference = ce.fp32_reference(*inputs)
        for name, fn in impls.items():
            results.append(ce.measure_row(name, fn, inputs, reference))
            print(json.dumps(results[-1]), flush=True)
        for n_gemms in (3, 4):
            results.append(ce.measure_matmul_floor(*inputs[:2], n_gemms))
            print(json.dumps(results[-1]), flush=True)
        del inputs, reference
        torch.cuda.empty_cache()
    bench.write_results(args.out, {"results": results})
    print()
    print("\n".join(ce.report(results)))


if __name__ == "__main__":
    main()
