"""precision=fp8 against precision=bf16 on one GPU: tokens/s and memory (`speed`), validation loss (`quality`).

speed: for each model, one trainer per precision, built through the public API (compose_config + Trainer) and
resident side by side, each planned within `--memory-budget` of the GPU (so both fit; the plan picks their
micro-batch and checkpointing there, for the default global batch unless `--batch`). Each is checked first (its
first compiled loss against its own eager forward), warmed up (compilation, CUDA graphs), its peak memory measured
net of what was resident before it, beside the memory model's prediction. Then timed rounds alternate the
precisions, so a drifting machine slows all alike: medians over rounds with their spread, and the ratio of the
medians to bf16's.

    python scripts/bench_fp8.py speed --models gpt2-1.5b gpt2-774m gpt2-124m --out bench_fp8.json

quality: run dirs of scripts/train.py runs that differ in precision only (one per precision and seed), read
from their metrics.jsonl: validation loss at each evaluated step, fp8's relative gap to bf16 of the same seed,
skipped optimizer steps and whether every loss stayed finite.

    python scripts/bench_fp8.py quality /tmp/fp8-quality/gpt2-124m/*
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minitrain import compile_check  # noqa: E402
from minitrain.config import compose_config  # noqa: E402
from minitrain.memory import GB  # noqa: E402
from minitrain.trainer import Trainer  # noqa: E402


class Run:
    """One precision's trainer, its steps numbered on (data and schedule continue), its timed rounds."""

    def __init__(self, model: str, precision: str, extra: list[str], out_dir: str):
        gc.collect()
        torch.cuda.empty_cache()
        self.base_reserved, self.base_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        self.trainer = Trainer(compose_config([f"model={model}", f"precision={precision}", "logger.mode=disabled",
                                               f"trainer.out_dir={out_dir}", "trainer.max_steps=100000",
                                               "trainer.warmup_steps=10", *extra]), progress=False)
        self.step, self.round_tokens_per_s, self.losses = 0, [], []

    def steps(self, n: int) -> None:
        self.losses += [self.trainer.train_step(s) for s in range(self.step, self.step + n)]
        self.step += n

    def check_and_warm_up(self, warmup: int) -> dict:
        """The first compiled loss against the eager forward's, then `warmup` steps, then 2 steps' peak memory."""
        t = self.trainer
        eager = float(compile_check.eager_loss(t._forward_loss, t.train_batches, 0, t.plan.grad_accum, t.dist))
        self.steps(warmup)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.steps(2)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        reserved = stats["reserved_bytes.all.peak"] - self.base_reserved
        return {"first_loss": float(self.losses[0]), "first_loss_eager": eager,
                "peak_reserved_gb": reserved / GB,
                "peak_allocated_gb": (stats["allocated_bytes.all.peak"] - self.base_allocated) / GB,
                "predicted_peak_gb": t.plan.memory.peak / GB, "predicted_over_reserved": t.plan.memory.peak / reserved}

    def timed(self, n: int) -> None:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.steps(n)
        end.record()
        torch.cuda.synchronize()
        tokens = self.trainer.plan.batch_size * self.trainer.plan.model.block_size * n
        self.round_tokens_per_s.append(tokens / (start.elapsed_time(end) / 1000))

    def row(self) -> dict:
        p = self.trainer.plan
        rates = self.round_tokens_per_s
        return {"precision": p.precision.name, "float8_linears": list(p.float8_linears), "micro_batch": p.micro_batch,
                "grad_accum": p.grad_accum, "checkpointing": p.checkpointing.policy.value,
                "compile_mode": p.compile_mode, "tokens_per_s_median": statistics.median(rates),
                "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates), "tokens_per_s_rounds": rates,
                "final_loss": float(self.losses[-1])}


def speed(args) -> None:
    extra = [f"trainer.memory_budget={args.memory_budget}", *([f"trainer.batch_size={args.batch}"] if args.batch
                                                              else []), *args.extra]
    results = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as out:
            runs = {p: Run(model, p, extra, f"{out}/{p}") for p in args.precisions}
            checks = {p: run.check_and_warm_up(args.warmup) for p, run in runs.items()}
            for _ in range(args.rounds):
                for run in runs.values():
                    run.timed(args.steps)
            rows = [{"model": model, **run.row(), **checks[p]} for p, run in runs.items()]
            for run in runs.values():
                run.trainer.close()
            del runs
            torch._dynamo.reset()  # the compiled steps and their CUDA graphs' pools go before the next model
        base = next((r for r in rows if r["precision"] == "bf16"), rows[0])
        for r in rows:
            r["vs_bf16"] = r["tokens_per_s_median"] / base["tokens_per_s_median"]
            r["first_loss_agrees"] = compile_check.agrees(r["first_loss"], r["first_loss_eager"])
            print(f"{model:10} {r['precision']:12} micro {r['micro_batch']:>3} x {r['grad_accum']} "
                  f"{r['checkpointing']:9} {r['tokens_per_s_median'] / 1e3:8.1f}k tokens/s "
                  f"({r['tokens_per_s_min'] / 1e3:.1f}-{r['tokens_per_s_max'] / 1e3:.1f}k) {r['vs_bf16']:.3f}x bf16 | "
                  f"peak reserved {r['peak_reserved_gb']:.2f} GB, predicted {r['predicted_peak_gb']:.2f} "
                  f"({r['predicted_over_reserved']:.3f}) | first loss {r['first_loss']:.4f} vs eager "
                  f"{r['first_loss_eager']:.4f}{'' if r['first_loss_agrees'] else ' MISMATCH'} | float8: "
                  f"{', '.join(r['float8_linears']) or '-'}", flush=True)
        results += rows
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "args": vars(args) | {"func": None}, "rows": results}, indent=1))


def read_run(run_dir: Path) -> dict:
    """A run's plan (its first record), validation losses by step, skipped steps, and whether every loss was finite."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = records[0]["plan"]
    steps = [r for r in records[1:] if "step" in r]
    losses = [r[k] for r in steps for k in ("train/loss", "val/loss") if k in r]
    return {"dir": str(run_dir), "precision": plan["precision"], "seed": read_seed(run_dir),
            "val": {r["step"]: r["val/loss"] for r in steps if r.get("val/loss") is not None},
            "skipped": max((r.get("amp/skipped_steps", 0) for r in steps), default=0),
            "finite": all(x is not None and math.isfinite(x) for x in losses),
            "last_step": max((r["step"] for r in steps), default=0)}


def read_seed(run_dir: Path) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(run_dir / ".hydra" / "config.yaml").trainer.seed)


def quality(args) -> None:
    runs = [read_run(Path(d)) for d in args.run_dirs]
    by_seed = {}
    for run in runs:
        by_seed.setdefault(run["seed"], {})[run["precision"]] = run
    gaps = {}
    for seed, cells in sorted(by_seed.items()):
        base = cells.get("bf16")
        for precision, run in sorted(cells.items()):
            print(f"seed {seed} {precision:12} steps {run['last_step']}, skipped {run['skipped']:g}, "
                  f"{'finite' if run['finite'] else 'NON-FINITE LOSS'} | val " +
                  " ".join(f"{step}:{loss:.4f}" for step, loss in sorted(run["val"].items())))
            if base is None or run is base:
                continue
            shared = sorted(run["val"].keys() & base["val"].keys())
            rel = [run["val"][s] / base["val"][s] - 1 for s in shared]
            gaps.setdefault(precision, []).append(rel[-1] if rel else float("nan"))
            print(f"  vs bf16: " + " ".join(f"{s}:{r:+.2%}" for s, r in zip(shared, rel)))
    for precision, last in gaps.items():
        print(f"{precision}: final validation loss vs bf16 over {len(last)} seed(s): "
              + ", ".join(f"{g:+.2%}" for g in last) + f" (worst {max(last, key=abs):+.2%})")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "final_gaps": gaps}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    s = sub.add_parser("speed", help="tokens/s and memory, precisions in alternating rounds")
    s.add_argument("--models", nargs="+", default=["gpt2-1.5b", "gpt2-774m", "gpt2-124m"])
    s.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    s.add_argument("--batch", type=int, default=None, help="global batch (default: the config's)")
    s.add_argument("--memory-budget", type=float, default=0.45,
                   help="each trainer's trainer.memory_budget: the share of the GPU its plan may fill")
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--steps", type=int, default=8, help="timed steps per round")
    s.add_argument("--warmup", type=int, default=4)
    s.add_argument("--extra", nargs="*", default=[], help="more overrides for every trainer")
    s.add_argument("--out")
    s.set_defaults(func=speed)
    q = sub.add_parser("quality", help="validation losses of runs that differ in precision")
    q.add_argument("run_dirs", nargs="+")
    q.add_argument("--out")
    q.set_defaults(func=quality)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
