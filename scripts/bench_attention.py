"""SDPA's attention backends side by side, per shape: causal forward + backward on the GPU, each checked first
against fp32 (minitrain/tools/benchmarks/attention.py says how).

    python scripts/bench_attention.py --shapes 16x12x1024x64 8x25x1024x64 --out bench_attention.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=attention.SHAPES, help="batch x heads x seq_len x head_dim")
    ap.add_argument("--out", default="bench_attention.json")
    args = ap.parse_args()
    rows = [row for shape in args.shapes for row in attention.measure_shape(shape)]
    bench.write_results(args.out, {"rows": rows})
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  causal, bf16, forward + backward")
    print("\n".join(attention.report(rows)))


if __name__ == "__main__":
    main()
