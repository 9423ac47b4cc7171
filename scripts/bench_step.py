"""The assembled training step, two recipes side by side on one GPU, through the trainer's own code.

reference (plain PyTorch: fp32 params under bf16 autocast, F.gelu, F.cross_entropy, torch's fused AdamW,
torch.compile) against minitrain (bf16 params + fp32 masters, the fused GELU, loss and AdamW, CUDA graphs);
each recipe's first loss is checked against its own eager forward before it is timed, and the timed steps
run in rounds that alternate the recipes. minitrain/tools/benchmarks/step.py says how. Prints ms/step,
tokens/s, MFU, peak memory and the loss after the timed steps, and writes JSON to --out.

    python scripts/bench_step.py --models gpt2-124m --out bench_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench, profile  # noqa: E402
from minitrain.tools.benchmarks import step  # noqa: E402

PROBE_FLAG = "--probe"  # model:recipe:batch and overrides, run in this process (step.probe_fits' child)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-124m", "gpt2-1.5b"])
    ap.add_argument("--batch", nargs="+", default=["16", "auto"],
                    help="global batch per model; auto: each recipe at the largest batch whose step runs within "
                         "90%% of the GPU (measured, in processes of their own, from the memory model's guess)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4,
                    help="the timed steps in rounds alternating the recipes, all resident, so the machine's drift "
                         "(clocks, heat) falls on all; 1 (always with --batch auto): one after the other, each alone")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--minitrain-extra", nargs="*", default=[], help="extra overrides for the minitrain recipe")
    ap.add_argument("--reference-extra", nargs="*", default=[],
                    help="extra overrides for every reference row (e.g. checkpointing=full where it needs it)")
    ap.add_argument("--ablate", nargs="*", default=[],
                    help="also time minitrain with each of these override sets (e.g. 'model.gelu=torch'), "
                         "interleaved with the two recipes")
    ap.add_argument("--reference-compiled", action=argparse.BooleanOptionalAction, default=True,
                    help="time the reference compiled (the default); --no-reference-compiled where that is known to "
                         "fail the first-loss check (gpt2-1.5b), to spare its compile and its probes")
    ap.add_argument("--reference-eager", action="store_true",
                    help="also time the reference uncompiled: the baseline where its compiled first loss fails "
                         "the check")
    ap.add_argument("--reference-graphs", action="store_true",
                    help="also time the reference with CUDA graphs (compile_mode=reduce-overhead); ratios are then "
                         "against the faster of the two reference rows")
    ap.add_argument("--big-checkpointing", default="none",
                    help="minitrain's policy for gpt2-774m and gpt2-1.5b (full: their largest batches with --batch auto)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 4 steady-state steps of each recipe: kernels beside their floors, idle, host syncs")
    ap.add_argument("--val", action="store_true",
                    help="also each recipe's validation loss after its steps (with --steps 200: the loss curves compared)")
    ap.add_argument("--out", default="bench_step.json")
    return ap.parse_args(argv)


def comparison(args: argparse.Namespace) -> step.Comparison:
    return step.Comparison(
        compiled=not args.no_compile, minitrain_extra=tuple(args.minitrain_extra),
        reference_extra=tuple(args.reference_extra), reference_compiled=args.reference_compiled,
        reference_graphs=args.reference_graphs, reference_eager=args.reference_eager, ablate=tuple(args.ablate),
        big_checkpointing=args.big_checkpointing, warmup=args.warmup, steps=args.steps, rounds=args.rounds,
        profile=args.profile, val=args.val)


def main() -> None:
    if sys.argv[1:2] == [PROBE_FLAG]:
        print(json.dumps(step.probe(sys.argv[2], sys.argv[3:])))
        return
    args = parse_args()
    how, results = comparison(args), []
    for model, batch in zip(args.models, args.batch):
        rows = step.measure(model, batch, how, probe_command=[sys.executable, __file__, PROBE_FLAG])
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "profile")}), flush=True)
            if "profile" in row:
                print("\n".join(f"  {line}" for line in profile.format_profile(row["profile"], row["ms_per_step"])))
        results += rows
    bench.write_results(args.out, {"rows": results})
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"steps={args.steps} after {args.warmup} warm-up")
    print("\n".join(step.report(results, args.models)))


if __name__ == "__main__":
    main()
