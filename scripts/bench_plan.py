"""The auto-fit against hand-picked settings, per model and global batch, on one GPU.

For each (model, global batch) cell the plan picks a micro-batch and a checkpointing policy
(`trainer.micro_batch=auto checkpointing=auto`). The hand-picked alternatives are those a user would try
that could beat it: the same policy at the next smaller micro-batch, the first policy of more recompute
(selective, then full) that allows a larger micro-batch, and no recompute if the plan chose some (a
policy that recomputes more at the same micro-batch can only be slower). Every (model, micro-batch,
policy) point is measured once, in a process of its own (so its peak memory is its own), through the
trainer's own step at two accumulated micro-batches: the forward + backward time of one micro-batch
and the optimizer's time, each from CUDA events without a sync in between. A cell's tokens/s is then its
global batch over `accumulation x micro-batch time + optimizer time`, the same arithmetic for the plan's
choice and for the alternatives. Prints the table (plan's choice, best alternative, the ratio, the
measured peak against the budget) and writes JSON to --out. A grid longer than one sitting goes on from
an earlier run's JSON (`--measured`); `--time-limit-s` starts no point after that many seconds.

    python scripts/bench_plan.py --models gpt2-124m gpt2-1.5b --batches 16 64 512 --out bench_plan.json
    python scripts/bench_plan.py --time-limit-s 470 --measured bench_plan.json --out bench_plan2.json
    python scripts/bench_plan.py --dry-run --device-memory-gb 150.1   # the points it would measure, on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minitrain import plan as planning  # noqa: E402
from minitrain.config import compose_config, resolve  # noqa: E402

NOT_MEASURED = "not measured: over --time-limit-s (pass this JSON to --measured to go on)"
POLICIES = ("none", "selective", "full")  # the ladder of recompute the alternatives walk
# Everything but the micro-batch and the policy as the defaults resolve them on a CUDA GPU, spelled out
# so a dry run on a CPU plans the same step.
FIXED = ["precision=bf16", "trainer.compile=true", "trainer.compile_mode=reduce-overhead", "loss=fused",
         "optimizer.impl=fused", "model.gelu=fused", "logger.mode=disabled", "trainer.sample_tokens=0"]


def overrides(model: str, batch: int, micro: str, policy: str) -> list[str]:
    return [f"model={model}", f"trainer.batch_size={batch}", f"trainer.micro_batch={micro}",
            f"checkpointing={policy}", *FIXED]


def plan_of(model: str, batch: int, micro: str = "auto", policy: str = "auto"):
    """The plan on this process's device (a dry run patches in the GPU's memory); None if it does not fit."""
    cfg = resolve(compose_config(overrides(model, batch, micro, policy) + ["trainer.out_dir=."]))
    try:
        return planning.make_plan(cfg, cfg.data.vocab_size, torch.device("cuda"))
    except planning.PlanError:
        return None


def largest_fitting(model: str, batch: int, policy: str, below: int | None = None) -> int | None:
    """The largest micro-batch dividing `batch` (below `below`, if given) whose step fits with `policy`."""
    for micro in range(min(batch, below - 1 if below else batch), 0, -1):
        if batch % micro == 0 and plan_of(model, batch, str(micro), policy) is not None:
            return micro
    return None


def cell_points(model: str, batch: int) -> tuple[tuple[int, str], list[tuple[int, str]]]:
    """The plan's (micro-batch, policy) for the cell, and the hand-picked alternatives that could beat it:
    the same policy at a smaller micro-batch, the first policy of more recompute that allows a larger one,
    and (if the plan recomputes) no recompute at the largest micro-batch that fits without."""
    chosen_plan = plan_of(model, batch)
    chosen = (chosen_plan.micro_batch, chosen_plan.checkpointing.policy.value)
    alternatives = []
    if smaller := largest_fitting(model, batch, chosen[1], below=chosen[0]):
        alternatives.append((smaller, chosen[1]))
    for more_recompute in POLICIES[POLICIES.index(chosen[1]) + 1:] if chosen[1] in POLICIES else ():
        micro = largest_fitting(model, batch, more_recompute)
        if micro and micro > chosen[0]:
            alternatives.append((micro, more_recompute))
            break
    if chosen[1] != "none" and (without := largest_fitting(model, batch, "none")):
        alternatives.append((without, "none"))
    return chosen, alternatives


def measure_point(model: str, micro: int, policy: str, warmup: int, steps: int, rounds: int) -> dict:
    """Run in its own process: build at 2 x micro (two accumulated micro-batches), warm up, then time
    `rounds` runs of `steps` steps; per round, the optimizer phase from its own events."""
    from minitrain.trainer import Trainer

    opt_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    class OptimizerEvents:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self):
            if self.name == "minitrain.optimizer":
                self.pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self.pair[0].record()

        def __exit__(self, *exc):
            if self.name == "minitrain.optimizer":
                self.pair[1].record()
                opt_events.append(self.pair)

    with tempfile.TemporaryDirectory() as out:
        torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(compose_config(overrides(model, 2 * micro, str(micro), policy) + [
            f"trainer.out_dir={out}", "trainer.max_steps=100000", "trainer.warmup_steps=10"]),
            progress=False, phase=OptimizerEvents)
        assert trainer.plan.grad_accum == 2
        step = 0
        for step in range(warmup):
            trainer.train_step(step)
        step_ms, opt_ms = [], []
        for _ in range(rounds):
            torch.cuda.synchronize()
            opt_events.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step += 1
                loss = trainer.train_step(step)
            end.record()
            torch.cuda.synchronize()
            step_ms.append(start.elapsed_time(end) / steps)
            opt_ms.append(statistics.median(a.elapsed_time(b) for a, b in opt_events))
        assert torch.isfinite(loss).item(), f"{model} micro {micro} {policy}: the loss is {loss.item()}"
        stats = torch.cuda.memory_stats()
        predicted, block_size = trainer.plan.memory.peak, trainer.model_cfg.block_size
        trainer.close()
    micro_ms = [(s - o) / 2 for s, o in zip(step_ms, opt_ms)]
    return {"model": model, "micro": micro, "policy": policy, "block_size": block_size,
            "micro_ms": statistics.median(micro_ms),
            "micro_ms_rounds": micro_ms, "optimizer_ms": statistics.median(opt_ms),
            "peak_reserved_gb": stats["reserved_bytes.all.peak"] / 1e9,
            "peak_allocated_gb": stats["allocated_bytes.all.peak"] / 1e9, "predicted_gb": predicted / 1e9}


def earlier_points(files: list[str]) -> dict[tuple, dict]:
    """The points an earlier run's JSON holds, by key, but those it left unmeasured: a grid longer than one
    run's time goes on where it stopped."""
    return {tuple(p["key"]): p for f in files for p in json.loads(Path(f).read_text())["points"]
            if p.get("error") != NOT_MEASURED}


def tokens_per_s(point: dict, batch: int) -> float:
    accum = batch // point["micro"]
    return batch * point["block_size"] / ((accum * point["micro_ms"] + point["optimizer_ms"]) / 1e3)


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
        print(json.dumps(measure_point(model, int(micro), policy, args.warmup, args.steps, args.rounds)))
        return

    patches = []
    if args.dry_run:
        memory = int(args.device_memory_gb * 1e9)
        patches = [mock.patch.object(planning, "device_memory", lambda device: memory),
                   mock.patch("torch.cuda.get_device_name", lambda device=None: "dry run")]
    for p in patches:
        p.start()
    cells = {(m, b): cell_points(m, b) for m in args.models for b in args.batches}
    for p in patches:
        p.stop()
    points = sorted({(m, *pt) for (m, _), (chosen, alts) in cells.items() for pt in [chosen, *alts]})
    for (m, b), (chosen, alts) in cells.items():
        print(f"{m:<10} B={b:<4} plan: micro {chosen[0]:>3} {chosen[1]:<9} alternatives: {alts}")
    print(f"{len(points)} points to measure")
    if args.dry_run:
        return

    budget_gb = 0.9 * torch.cuda.get_device_properties(0).total_memory / 1e9
    measured = earlier_points(args.measured)
    started = time.monotonic()
    for model, micro, policy in points:
        if (model, micro, policy) in measured:
            continue
        if args.time_limit_s and time.monotonic() - started > args.time_limit_s:
            measured[model, micro, policy] = {"error": NOT_MEASURED}
            continue
        cmd = [sys.executable, __file__, "--point", f"{model}:{micro}:{policy}", "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--rounds", str(args.rounds)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{model} micro {micro} {policy}: failed\n{done.stderr[-2000:]}", flush=True)
            measured[model, micro, policy] = {"error": done.stderr.strip().splitlines()[-1:]}
            continue
        measured[model, micro, policy] = point = json.loads(lines[-1])
        print(f"{model:<10} micro {micro:>3} {policy:<9} {point['micro_ms']:8.2f} ms/micro-batch "
              f"(rounds {min(point['micro_ms_rounds']):.2f}-{max(point['micro_ms_rounds']):.2f}), optimizer "
              f"{point['optimizer_ms']:.2f} ms, peak reserved {point['peak_reserved_gb']:.1f} GB "
              f"(predicted {point['predicted_gb']:.1f})", flush=True)

    rows = []
    for (model, batch), (chosen, alts) in cells.items():
        ours = measured[(model, *chosen)]
        options = {pt: measured[(model, *pt)] for pt in [chosen, *alts] if "error" not in measured[(model, *pt)]}
        if "error" in ours or not options:
            rows.append({"model": model, "batch": batch, "chosen": chosen, "error": ours.get("error")})
            continue
        rates = {pt: tokens_per_s(p, batch) for pt, p in options.items()}
        best = max(rates, key=rates.get)
        rows.append({"model": model, "batch": batch, "chosen": chosen, "chosen_tokens_per_s": rates[chosen],
                     "best": best, "best_tokens_per_s": rates[best], "ratio": rates[chosen] / rates[best],
                     "rates": {f"{m}:{p}": r for (m, p), r in rates.items()},
                     "peak_reserved_gb": ours["peak_reserved_gb"], "predicted_gb": ours["predicted_gb"],
                     "budget_gb": budget_gb, "fits": ours["peak_reserved_gb"] <= budget_gb})
    Path(args.out).write_text(json.dumps({"points": [measured[p] | {"key": list(p)} for p in points],
                                          "cells": rows}, indent=1))
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  budget {budget_gb:.1f} GB (90%)")
    print(f"{'model':<10} {'B':>4} {'plan':<16} {'tok/s':>9} {'best hand-picked':<16} {'tok/s':>9} {'ratio':>6} "
          f"{'peak':>7} {'pred':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10} {r['batch']:>4} {r['chosen']} {r['error']}")
            continue
        name = lambda pt: f"{pt[0]} {pt[1]}"  # noqa: E731
        print(f"{r['model']:<10} {r['batch']:>4} {name(r['chosen']):<16} {r['chosen_tokens_per_s']:>9,.0f} "
              f"{name(r['best']):<16} {r['best_tokens_per_s']:>9,.0f} {r['ratio']:>6.3f} "
              f"{r['peak_reserved_gb']:>6.1f}G {r['predicted_gb']:>6.1f}G{'' if r['fits'] else '  OVER BUDGET'}")


if __name__ == "__main__":
    main()
