"""Time to a target loss on one GPU: the GPT-2 recipe (model=gpt2-124m, AdamW) at its best trainer.lr of a sweep runs
--tokens; its final validation loss is the target; the modern recipe (model=gpt2-124m-modern optimizer=muon), over a
sweep of optimizer.muon.lr with the same budget as its ceiling (or its own, --modern-tokens, which its schedule decays
over), stops at its first evaluation at or below the target where it is known (--target, or the GPT-2 runs in
WORK/gpt2, which run first), and its run fastest to the target is timed to it. Prints both wall times (compile
excluded and included), the tokens and the ratio; writes the record (--out) and the runs' loss curves (--plot). Every
run is a `scripts/train.py` process (WORK/<recipe>/<lr>), deterministic, on the installed packages' sources by
default (--data; GPT-2's tokenizer: --data data=packages data.tokenizer=gpt2). `--compare RUN_DIR...` only reads
finished runs or runs stopped at their target (run dirs, or dirs of them), wherever they were made
(minitrain/tools/benchmarks/recipe.py says how the times are read).

    python scripts/bench_recipe.py --work runs/recipe --out recipe.json
    python scripts/bench_recipe.py --work runs/recipe --recipes gpt2        # one side per call: the modern side
    python scripts/bench_recipe.py --work runs/recipe --recipes modern      # reads its target from runs/recipe/gpt2
    python scripts/bench_recipe.py --compare runs/recipe/gpt2 runs/recipe/modern --out recipe.json
    python scripts/bench_recipe.py --work runs/recipe --ablate qk_norm position   # each undone alone, to the target
    python scripts/bench_recipe.py --ablate --compare runs/recipe --out ablate.json # the ablation's report alone
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import optimizer, recipe  # noqa: E402


def lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/bench_recipe", help="the runs' dirs go beneath: WORK/<recipe>/<lr>")
    ap.add_argument("--recipes", nargs="+", choices=list(recipe.RECIPES),
                    help="the sides to run (then --compare both sides' dirs); default: both")
    ap.add_argument("--tokens", type=int, default=196_608_000,
                    help="every run's budget (6000 steps of 32 x 1024: the GPT-2 recipe's run over 5 minutes on an H100)")
    ap.add_argument("--modern-tokens", type=int, metavar="TOKENS",
                    help="the modern runs' own budget, which their lr schedule decays over (default: --tokens)")
    ap.add_argument("--gpt2-lrs", type=lrs, default=[6e-4, 1.2e-3], help="trainer.lr of the GPT-2 recipe's runs")
    ap.add_argument("--modern-lrs", type=lrs, default=[0.01, 0.02], help="optimizer.muon.lr of the modern recipe's")
    ap.add_argument("--gpt2", nargs="+", default=list(recipe.RECIPES["gpt2"]), metavar="OVERRIDE",
                    help="the GPT-2 recipe's overrides")
    ap.add_argument("--modern", nargs="+", default=list(recipe.RECIPES["modern"]), metavar="OVERRIDE",
                    help="the modern recipe's overrides")
    ap.add_argument("--target", type=float, metavar="LOSS",
                    help="the validation loss the modern recipe's runs stop at (trainer.target_loss); default: the "
                         "GPT-2 recipe's best final one among its finished runs in WORK/gpt2, none there: no stop")
    ap.add_argument("--data", nargs="+", default=list(recipe.DATA), metavar="OVERRIDE", help="the corpus")
    ap.add_argument("--batch-size", type=int, default=32, help="trainer.batch_size of every run")
    ap.add_argument("--block-size", type=int, default=1024, help="model.block_size of every run")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (and log records)")
    ap.add_argument("--eval-batches", type=int, default=20, help="trainer.eval_batches")
    ap.add_argument("--extra", nargs="+", default=[], metavar="OVERRIDE", help="more overrides for every run")
    ap.add_argument("--ablate", nargs="*", choices=list(recipe.ABLATIONS), metavar="OPTION",
                    help="instead of the sides: the modern recipe with each option named undone alone (every one: "
                         f"{', '.join(recipe.ABLATIONS)}), in WORK/ablate/<option>/<lr>, its budget and target; then "
                         "every ablation in WORK against WORK/modern's runs (--ablate --compare WORK: that report "
                         "alone)")
    ap.add_argument("--compare", nargs="+", metavar="RUN_DIR",
                    help="compare these runs (finished, or stopped at their target) instead of running")
    ap.add_argument("--out", default="bench_recipe.json")
    ap.add_argument("--plot", help="the loss curves' PNG (default: --out's name with .png)")
    args = ap.parse_args(argv)
    if args.modern_tokens is None:
        args.modern_tokens = args.tokens
    for name in ("tokens", "modern_tokens", "batch_size", "block_size", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.target is not None and not (math.isfinite(args.target) and args.target > 0):
        ap.error(f"--target must be a validation loss > 0, got {args.target}")
    step_tokens = args.batch_size * args.block_size
    steps = {"gpt2": args.tokens // step_tokens, "modern": args.modern_tokens // step_tokens}
    for side, name in (("gpt2", "tokens"), ("modern", "modern_tokens")):
        if steps[side] < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} is less than one step of {args.batch_size} x "
                     f"{args.block_size}")
    if args.ablate is not None and args.recipes:
        ap.error("--ablate runs instead of --recipes: give one")
    if args.ablate is not None and args.compare and (args.ablate or len(args.compare) != 1):
        ap.error("--ablate --compare WORK reports the ablation runs made in WORK: no option, one dir")
    args.recipes = args.recipes or list(recipe.RECIPES)
    work = Path(args.compare[0] if args.ablate is not None and args.compare else args.work).resolve()
    gpt2_budget = steps["gpt2"] * step_tokens
    run_dirs = args.compare
    if not run_dirs:
        run_dirs = []
        lr_sweeps = {"gpt2": args.gpt2_lrs, "modern": args.modern_lrs}
        # (label, the side whose budget and target it runs, the side whose lr sweep it takes, overrides, its dirs)
        if args.ablate is None:  # the GPT-2 side first: its target
            groups = [(recipe.NAMES[side], side, side, args.gpt2 if side == "gpt2" else args.modern, work / side)
                      for side in sorted(set(args.recipes), key=list(recipe.RECIPES).index)]
        else:
            groups = [(f"{recipe.NAMES['modern']} with {recipe.ABLATIONS[name]}", "modern", recipe.ablation_side(name),
                       [*args.modern, recipe.ABLATIONS[name]], work / recipe.ABLATE_DIR / name)
                      for name in args.ablate or recipe.ABLATIONS]
        stop = None
        for label, budget_side, lr_side, overrides, where in groups:
            if budget_side == "modern":
                if stop is None:
                    try:
                        stop, said = recipe.modern_target(args.target, work / "gpt2", gpt2_budget)
                    except recipe.RecipeError as e:
                        ap.exit(2, f"error: {e}\n")
                    print(said, flush=True)
                overrides = [*overrides, *stop]
            for lr in lr_sweeps[lr_side]:
                run_dir = where / f"{lr:g}"
                cell = recipe.cell_overrides(overrides, recipe.LR_KEYS[lr_side], lr, steps[budget_side],
                                             args.batch_size, args.block_size, args.eval_every, args.eval_batches,
                                             args.data, args.extra)
                print(f"{label} {recipe.LR_KEYS[lr_side]}={lr:g}: {run_dir}", flush=True)
                try:
                    code = recipe.run_cell(run_dir, cell)
                except recipe.RecipeError as e:
                    ap.exit(2, f"error: {e}\n")
                if code:
                    print(f"  exit code {code}: see {run_dir}.log", flush=True)
                run_dirs.append(run_dir)
        if args.ablate is None and set(args.recipes) != set(recipe.RECIPES):
            return  # one side only: --compare both sides' dirs when the other has run
    if args.ablate is not None:
        try:
            result = recipe.ablation(work, recipe.known_target(args.target, work / "gpt2", gpt2_budget)[0])
        except recipe.RecipeError as e:
            ap.exit(2, f"error: {e}\n")
        print("\n".join(recipe.ablation_report(result)))
        bench.write_results(args.out, result)
        print(f"record {args.out}")
        return
    dirs = optimizer.quality_run_dirs(run_dirs)
    try:
        runs = [recipe.read_run(d) for d in dirs]
        result = recipe.compare(runs)
    except recipe.RecipeError as e:
        ap.exit(2, f"error: {'--compare: ' if args.compare else ''}{e}\n")
    print("\n".join(recipe.compare_report(runs, result)))
    bench.write_results(args.out, {**result, "runs": [{k: v for k, v in r.items() if k != "timed_s"} for r in runs]})
    plot = recipe.plot_curves(dirs, runs, Path(args.plot or Path(args.out).with_suffix(".png")))
    print(f"record {args.out}; " + (f"loss curves {plot}" if plot else "PNG skipped: matplotlib is not installed"))


if __name__ == "__main__":
    main()
