"""Data-parallel scaling on one host: 1 GPU vs N GPUs under ddp and fsdp, through the trainer's own code
(minitrain/tools/benchmarks/distributed.py says how); torchrun starts each rank as this script's `--worker`.

    python scripts/bench_distributed.py --gpus 2 --out bench_distributed.json
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools.benchmarks import distributed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2-124m", "gpt2-1.5b"])
    modes = [m for m, _ in distributed.MODES]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    ap.add_argument("--steps", type=int, default=None,
                    help="default: per model (minitrain/tools/benchmarks/distributed.py's STEPS)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--fsdp-ablate", nargs="*", default=[], metavar="OVERRIDES",
                    help="more fsdp rows, each a quoted, space-separated set of overrides, e.g. "
                         "'distributed.fsdp_unit_blocks=1 distributed.reshard_after_forward=false'")
    ap.add_argument("--out", default="bench_distributed.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return distributed.worker(args.part, args.overrides)
    rows = distributed.run(Path(__file__).resolve(), args)
    print("\n".join(distributed.table(rows)))


if __name__ == "__main__":
    main()
