"""Does torch.compile compute the same step as eager? The first step's loss and every parameter's gradient of
one recipe, eager against compiled, for a list of model variants (minitrain/tools/benchmarks/compile_vs_eager.py).
Prints one line per variant and writes JSON to --out.

    python scripts/compile_vs_eager.py --model gpt2-1.5b --batch 8 --variants "model.n_layer=4" \\
        "model.n_layer=4 model.n_embd=1024 model.n_head=16"
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import compile_vs_eager, step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--recipe", choices=sorted(step.RECIPES), default="reference")
    ap.add_argument("--variants", nargs="+", default=[""], help="space-separated overrides per variant ('': the model)")
    ap.add_argument("--out", default="compile_vs_eager.json")
    args = ap.parse_args()
    rows = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as out_dir:
            rows.append(compile_vs_eager.compare(args.model, args.batch, args.recipe, variant.split(), out_dir))
        print(compile_vs_eager.describe(rows[-1], variant), flush=True)
    bench.write_results(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
