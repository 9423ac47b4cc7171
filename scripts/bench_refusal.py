"""A mistyped setting's refusal (`python scripts/train.py trainer.no_such_key=1`) against `import torch` alone, in
alternating rounds on this machine (minitrain/tools/benchmarks/refusal.py says how).

    python scripts/bench_refusal.py --rounds 7 --out bench_refusal.json
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import refusal  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="runs of each command, taking turns")
    ap.add_argument("--repo", type=Path, default=refusal.REPO,
                    help="the checkout whose scripts/train.py is timed (another one: its figure before a change)")
    ap.add_argument("--out", type=Path, help="write every run's seconds and the medians as JSON")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    with tempfile.TemporaryDirectory() as cwd:  # where a refused run would leave a run dir, were it to make one
        result = refusal.measure(args.rounds, Path(cwd), args.repo.resolve())
    print("\n".join(refusal.report(result)))
    if args.out:
        bench.write_results(args.out, result)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
