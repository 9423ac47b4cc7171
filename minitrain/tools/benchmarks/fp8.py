"""precision=fp8 against precision=bf16 (`scripts/bench_fp8.py` is the command line).

speed, on one GPU: per model, one `Trainer` per precision at the default global batch, resident side by side,
each planned within `memory_budget` of the GPU. Both run the checkpointing policy that bf16's plan picks on the
whole GPU (what a user gets) at the largest micro-batch with which both fit their share, so that fp8's ratio is
its float8 matmuls' and casts' and not a cheaper policy or a larger micro-batch bought with its smaller
activations. fp8 is built first, on an empty GPU: CUDA graphs allocate from one pool per process, which bf16's
graphs then reuse, so only fp8's peak memory is its own; it is set beside the memory model's prediction. Each
trainer's first compiled loss is checked against its own eager forward (benchmarks/step.py's start), then the
timed steps run in rounds that alternate the precisions (bench.alternating_rounds).

quality: train.py runs of a sweep over precision and seed (its job dirs), read from their metrics.jsonl: the
validation loss at each evaluated step, each run's relative gap to the first bf16 run of its seed, bf16's own
spread across seeds, skipped optimizer steps and whether every logged loss stayed finite. A noise control is one
more override swept beside bf16 (model.gelu=fused,torch: the same function, rounded by other kernels).
"""

from __future__ import annotations

import functools
import gc
import math
import tempfile
import time
import traceback
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import yaml

from minitrain.config import resolve
from minitrain.cli import compose_config
from minitrain.plan import make_plan
from minitrain.rundir import CONFIG_RECORD, METRICS, OVERRIDES_RECORD, RECORD
from minitrain.tools import bench, report
from minitrain.tools.benchmarks import step
from minitrain.trainer import Trainer

PRECISIONS = ("fp8", "bf16")  # build order: fp8 on the empty GPU, its memory its own
BASELINE = "bf16"
NOT_MEASURED = "not measured: over --time-limit-s"


def overrides(model: str, precision: str, out_dir: str, memory_budget: float, extra: Sequence[str]) -> list[str]:
    lr = step.LR.get(model, 6e-4)
    return [f"model={model}", f"precision={precision}", "logger.mode=disabled", f"trainer.out_dir={out_dir}",
            "trainer.max_steps=100000", "trainer.warmup_steps=10", f"trainer.lr={lr}", f"trainer.min_lr={lr / 10}",
            f"trainer.memory_budget={memory_budget}", *extra]


def shared_settings(model: str, memory_budget: float, extra: Sequence[str]) -> list[str]:
    """Overrides for both precisions: the checkpointing policy of bf16's plan on the whole GPU (the default
    trainer.memory_budget, as a user gets it), and the largest micro-batch with which each precision's plan fits
    that policy within `memory_budget` (both are resident). fp8 saves less than bf16 with no checkpointing but
    more under selective (its float8 copies beside the outputs selective keeps), so either may be the tighter.
    An explicit setting in `extra` wins: it comes later."""
    def plan(precision: str, *settings: str):
        cfg = resolve(compose_config(overrides(model, precision, ".", memory_budget, [*settings, *extra])))
        return make_plan(cfg, cfg.data.vocab_size, torch.device("cuda"))

    whole_gpu = plan(BASELINE, f"trainer.memory_budget={bench.default_memory_budget()}").checkpointing
    policy = [f"checkpointing={whole_gpu.policy.value}", f"checkpointing.every_k={whole_gpu.every_k}"]
    return [f"trainer.micro_batch={min(plan(p, *policy).micro_batch for p in PRECISIONS)}", *policy]


def row(model: str, precision: str, run: step.Run, checks: dict) -> dict:
    plan = run.trainer.plan
    return {"model": model, "precision": precision, "float8_linears": list(plan.float8_linears),
            "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum,
            "checkpointing": plan.checkpointing.policy.value, "predicted_peak_gb": plan.memory.peak / 1e9,
            **checks, **run.summary()}


def measure(model: str, memory_budget: float, warmup: int, rounds: int, steps: int, extra: Sequence[str]
            ) -> list[dict]:
    """Both precisions' rows for `model`: built in PRECISIONS' order, checked, warmed up, then timed in
    alternating rounds of `steps` steps."""
    settings = shared_settings(model, memory_budget, extra)
    runs, checks = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for precision in PRECISIONS:
                cfg = compose_config(overrides(model, precision, f"{tmp}/{precision}", memory_budget,
                                               [*settings, *extra]))
                graphed = any(r.trainer.plan.cuda_graphs for r in runs.values())
                runs[precision], checks[precision] = step.start_trainer(
                    functools.partial(Trainer, cfg, progress=False), warmup, graphed)
            timed = bench.alternating_rounds({p: r.one_step for p, r in runs.items()}, rounds, steps)
            for precision, run in runs.items():
                run.round_ms = timed[precision]
            return [row(model, precision, run, checks[precision]) for precision, run in runs.items()]
        finally:  # the trainers, their compiled steps and their graphs' pool go before the next model
            for run in runs.values():
                run.trainer.close()
            runs.clear()
            gc.collect()
            torch.cuda.empty_cache()
            torch.compiler.reset()


def measure_models(models: Sequence[str], time_limit_s: Optional[float], **how) -> Iterator[list[dict]]:
    """`measure`'s rows, model by model, each with the seconds its model took (building and compiling
    included); a model not started within `time_limit_s`, or one that failed, is a row that says so."""
    started = time.monotonic()
    for model in models:
        if time_limit_s is not None and time.monotonic() - started > time_limit_s:
            yield [{"model": model, "error": NOT_MEASURED}]
            continue
        began = time.monotonic()
        try:
            rows = measure(model, **how)
        except Exception as e:  # a plan that does not fit, an OOM: reported, the next model goes on
            traceback.print_exc()
            rows = [{"model": model, "error": f"{type(e).__name__}: {e}"[:300]}]
        yield [{**r, "model_s": time.monotonic() - began} for r in rows]


def _baseline(row: dict, rows: Sequence[dict]) -> Optional[dict]:
    """`row`'s model's bf16 row, if it was measured."""
    return next((r for r in rows if r["model"] == row["model"] and r.get("precision") == BASELINE
                 and "ms_per_round" in r), None)


def _ratio_line(row: dict, base: dict) -> str:
    """`row` against bf16 of its model: tokens/s round by round (the rounds alternate, so each ratio compares
    steps run side by side), its measured peak memory against its predicted one, and how far its losses stray
    from bf16's over the same steps (same init, same batches)."""
    ratio = bench.Spread.of(b / a for a, b in zip(row["ms_per_round"], base["ms_per_round"]))
    memory = (f"; peak reserved {row['peak_reserved_gb']:.2f} GB, predicted {row['predicted_peak_gb']:.2f} "
              f"({row['predicted_peak_gb'] / row['peak_reserved_gb']:.3f}x)") if row.get("peak_reserved_gb") else ""
    gap = max(abs(a - b) for a, b in zip(row["losses"], base["losses"]))
    return (f"{row['model']} {row['precision']}: {ratio.median:.3f}x bf16's tokens/s (rounds {ratio.low:.3f}-"
            f"{ratio.high:.3f}){memory}; max |loss gap| to bf16 over {len(row['losses'])} steps {gap:.4f}")


TABLE = (bench.Column("model", "model"), bench.Column("precision", "precision"),
         bench.Column("micro", lambda r: f"{r['micro_batch']} x {r['grad_accum']}" if "micro_batch" in r else None,
                      "s"),
         bench.Column("ckpt", "checkpointing"), bench.Column("tok/s", "tokens_per_s", ",.0f"),
         bench.Column("MFU", "mfu", ".1%"), bench.Column("peak resv GB", "peak_reserved_gb", ".2f"),
         bench.Column("predicted GB", "predicted_peak_gb", ".2f"),
         bench.Column("s", "model_s", ".0f"),
         bench.Column("float8 linears", lambda r: (", ".join(r["float8_linears"]) or "-") if "float8_linears" in r
                      else None))


def _note(row: dict) -> str:
    if "error" in row:
        return row["error"]
    if not step.passes_check(row):
        return f"first loss {row['first_loss']:.4f}, eager {row['first_loss_eager']:.4f}: FAILED"
    return "(memory: fp8's graph pool)" if row.get("peak_reserved_gb") is None else ""


def speed_report(rows: Sequence[dict]) -> list[str]:
    """The table, then per model fp8's line against bf16 (`_ratio_line`)."""
    lines = bench.table(rows, TABLE, note=_note)
    for r in rows:
        base = _baseline(r, rows) if r.get("precision") != BASELINE and "ms_per_round" in r else None
        if base is not None:
            lines.append(_ratio_line(r, base))
    return lines


# -- quality ---------------------------------------------------------------------------------------------------------
def read_run(run_dir: Path) -> dict:
    """A run's precision, seed and command-line overrides, its validation loss by step, the optimizer steps it
    skipped, whether every logged loss was finite (the logger writes a non-finite one as null) and its last logged
    step."""
    run_dir = Path(run_dir)
    steps = report.read_step_records(run_dir / METRICS)
    config = yaml.safe_load((run_dir / RECORD / CONFIG_RECORD).read_text())
    losses = [r[k] for r in steps for k in ("train/loss", "val/loss") if k in r]
    return {"dir": str(run_dir), "precision": report.read_plan(run_dir / METRICS)["precision"],
            "seed": config["trainer"]["seed"],
            "overrides": yaml.safe_load((run_dir / RECORD / OVERRIDES_RECORD).read_text()) or [],
            "val": {r["step"]: r["val/loss"] for r in steps if r.get("val/loss") is not None},
            "skipped": max((r.get("amp/skipped_steps", 0) for r in steps), default=0),
            "finite": all(x is not None and math.isfinite(x) for x in losses),
            "last_step": max((r["step"] for r in steps), default=0)}


def relative_gaps(run: dict, base: dict) -> dict[int, float]:
    """`run`'s validation loss over `base`'s, less 1, at each step both evaluated."""
    return {s: run["val"][s] / base["val"][s] - 1 for s in sorted(run["val"].keys() & base["val"].keys())}


def quality_report(runs: Sequence[dict]) -> list[str]:
    """Per run its validation losses; per other run its gap to the first bf16 run of its seed at every shared step;
    per label the final gaps over seeds; bf16's final losses' spread over seeds (the noise a gap is set beside).
    A run's label: its precision and those of its overrides that not every run shares (seed and precision left
    out), so that a noise control (bf16 twice, model.gelu=fused,torch) sets a second bf16 run beside the first."""
    shared = set.intersection(*(set(run["overrides"]) for run in runs)) if runs else set()

    def label(run: dict) -> str:
        own = [o for o in run["overrides"] if o not in shared and o.split("=")[0] not in ("precision", "trainer.seed")]
        return " ".join([run["precision"], *own])

    by_seed: dict[int, list[dict]] = {}
    for run in runs:
        by_seed.setdefault(run["seed"], []).append(run)
    bases = {seed: next((run for run in cells if run["precision"] == BASELINE), None)
             for seed, cells in by_seed.items()}
    lines, final_gaps = [], {}
    for seed, cells in sorted(by_seed.items()):
        base = bases[seed]
        for run in cells:
            lines.append(f"seed {seed} {label(run)}: {run['last_step']} steps, {run['skipped']:g} skipped, "
                         f"{'finite' if run['finite'] else 'NON-FINITE LOSS'} | val "
                         + " ".join(f"{s}:{v:.4f}" for s, v in sorted(run["val"].items())))
            gaps = relative_gaps(run, base) if base is not None and run is not base else {}
            if gaps:
                final_gaps.setdefault(label(run), []).append(gaps[max(gaps)])
                lines.append(f"  vs {label(base)}: " + " ".join(f"{s}:{g:+.2%}" for s, g in gaps.items())
                             + f" (largest |gap| {max(map(abs, gaps.values())):.2%})")
    for name, gaps in sorted(final_gaps.items()):
        lines.append(f"{name}: final validation loss against bf16's of the same seed: "
                     + ", ".join(f"{g:+.2%}" for g in gaps))
    finals = [base["val"][max(base["val"])] for base in bases.values() if base is not None and base["val"]]
    if len(finals) > 1:
        lines.append(f"bf16's final validation loss over {len(finals)} seeds: {min(finals):.4f}-{max(finals):.4f} "
                     f"({max(finals) / min(finals) - 1:.2%} apart)")
    return lines
