"""The auto-fit against hand-picked settings, per model and global batch, on one GPU (`scripts/bench_plan.py`
is its command line).

For each (model, global batch) cell the plan picks a micro-batch and a checkpointing policy
(`trainer.micro_batch=auto checkpointing=auto`). The hand-picked alternatives are those a user would try
that could beat it: the same policy at the next smaller micro-batch, the first policy of more recompute
(selective, then full) that allows a larger micro-batch, and no recompute if the plan chose some (a policy
that recomputes more at the same micro-batch can only be slower). Every (model, micro-batch, policy) point
is measured once, in a process of its own (so its peak memory is its own), through the trainer's own step at
two accumulated micro-batches: the forward + backward time of one micro-batch and the optimizer's time, each
from CUDA events without a sync in between. A cell's tokens/s is then its global batch over
`accumulation x micro-batch time + optimizer time`, the same arithmetic for the plan's choice and for the
alternatives.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional, Sequence

import torch

from minitrain import plan as planning
from minitrain.config import resolve
from minitrain.cli import compose_config
from minitrain.tools import bench

NOT_MEASURED = "not measured: over --time-limit-s (pass this JSON to --measured to go on)"
POLICIES = ("none", "selective", "full")  # the ladder of recompute the alternatives walk
# Everything but the micro-batch and the policy as the defaults resolve them on a CUDA GPU, spelled out
# so a dry run on a CPU plans the same step.
FIXED = ["precision=bf16", "trainer.compile=true", "trainer.compile_mode=reduce-overhead", "loss=fused",
         "optimizer.impl=fused", "model.gelu=fused", "logger.mode=disabled", "trainer.sample_tokens=0"]
Point = tuple[int, str]  # (micro-batch, policy)


def overrides(model: str, batch: int, micro: str, policy: str) -> list[str]:
    return [f"model={model}", f"trainer.batch_size={batch}", f"trainer.micro_batch={micro}",
            f"checkpointing={policy}", *FIXED]


def plan_of(model: str, batch: int, micro: str = "auto", policy: str = "auto",
            device_memory_bytes: Optional[int] = None) -> Optional[planning.Plan]:
    """The plan on a CUDA GPU of `device_memory_bytes` (None: this process's GPU); None if it does not fit."""
    cfg = resolve(compose_config(overrides(model, batch, micro, policy) + ["trainer.out_dir=."]))
    try:
        return planning.make_plan(cfg, cfg.data.vocab_size, torch.device("cuda"),
                                  device_memory_bytes=device_memory_bytes)
    except planning.PlanError:
        return None


def largest_fitting(model: str, batch: int, policy: str, below: Optional[int] = None,
                    device_memory_bytes: Optional[int] = None) -> Optional[int]:
    """The largest micro-batch dividing `batch` (below `below`, if given) whose step fits with `policy`."""
    for micro in range(min(batch, below - 1 if below else batch), 0, -1):
        if batch % micro == 0 and plan_of(model, batch, str(micro), policy, device_memory_bytes) is not None:
            return micro
    return None


def cell_points(model: str, batch: int, device_memory_bytes: Optional[int] = None) -> tuple[Point, list[Point]]:
    """The plan's (micro-batch, policy) for the cell, and the hand-picked alternatives that could beat it:
    the same policy at a smaller micro-batch, the first policy of more recompute that allows a larger one,
    and (if the plan recomputes) no recompute at the largest micro-batch that fits without."""
    memory = device_memory_bytes
    chosen_plan = plan_of(model, batch, device_memory_bytes=memory)
    chosen = (chosen_plan.micro_batch, chosen_plan.checkpointing.policy.value)
    alternatives = []
    if smaller := largest_fitting(model, batch, chosen[1], below=chosen[0], device_memory_bytes=memory):
        alternatives.append((smaller, chosen[1]))
    for more_recompute in POLICIES[POLICIES.index(chosen[1]) + 1:] if chosen[1] in POLICIES else ():
        micro = largest_fitting(model, batch, more_recompute, device_memory_bytes=memory)
        if micro and micro > chosen[0]:
            alternatives.append((micro, more_recompute))
            break
    if chosen[1] != "none" and (without := largest_fitting(model, batch, "none", device_memory_bytes=memory)):
        alternatives.append((without, "none"))
    return chosen, alternatives


def optimizer_events(pairs: list) -> Callable[[str], ContextManager]:
    """The trainer's phase hook (`Trainer(phase=...)`): CUDA events around each optimizer phase, appended to
    `pairs`; the other phases run as they are."""
    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        if name != "minitrain.optimizer":
            yield
            return
        pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pair[0].record()
        yield
        pair[1].record()
        pairs.append(pair)

    return phase


def measure_point(model: str, micro: int, policy: str, warmup: int, steps: int, rounds: int) -> dict:
    """Run in its own process: build at 2 x micro (two accumulated micro-batches), warm up, then time
    `rounds` runs of `steps` steps; per round, the optimizer phase from its own events."""
    from minitrain.trainer import Trainer

    opt_events: list = []
    with tempfile.TemporaryDirectory() as out:
        torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(compose_config(overrides(model, 2 * micro, str(micro), policy) + [
            f"trainer.out_dir={out}", "trainer.max_steps=100000", "trainer.warmup_steps=10"]),
            progress=False, phase=optimizer_events(opt_events))
        assert trainer.plan.grad_accum == 2
        numbers, losses = itertools.count(), []
        for _ in range(warmup):
            trainer.train_step(next(numbers))
        step_ms, opt_ms = [], []
        for _ in range(rounds):
            opt_events.clear()
            step_ms.append(bench.event_ms(lambda: losses.append(trainer.train_step(next(numbers))), steps))
            opt_ms.append(statistics.median(a.elapsed_time(b) for a, b in opt_events))
        assert torch.isfinite(losses[-1]).item(), f"{model} micro {micro} {policy}: the loss is {losses[-1].item()}"
        stats = torch.cuda.memory_stats()
        predicted, block_size = trainer.plan.memory.peak, trainer.plan.model.block_size
        trainer.close()
    micro_ms = [(s - o) / 2 for s, o in zip(step_ms, opt_ms)]
    return {"model": model, "micro": micro, "policy": policy, "block_size": block_size,
            "micro_ms": statistics.median(micro_ms), "micro_ms_rounds": micro_ms,
            "optimizer_ms": statistics.median(opt_ms), "peak_reserved_gb": stats["reserved_bytes.all.peak"] / 1e9,
            "peak_allocated_gb": stats["allocated_bytes.all.peak"] / 1e9, "predicted_gb": predicted / 1e9}


def earlier_points(files: Sequence[str]) -> dict[tuple, dict]:
    """The points an earlier run's JSON holds, by key, but those it left unmeasured: a grid longer than one
    run's time goes on where it stopped."""
    return {tuple(p["key"]): p for f in files for p in json.loads(Path(f).read_text())["points"]
            if p.get("error") != NOT_MEASURED}


def measure_points(points: Sequence[tuple], measured: dict[tuple, dict], command: Sequence[str],
                   time_limit_s: Optional[float]) -> None:
    """Each point not in `measured` into it: `command` + "model:micro:policy" in a process of its own, or
    NOT_MEASURED once `time_limit_s` has passed; a point whose process fails is recorded with its error."""
    started = time.monotonic()
    for model, micro, policy in points:
        if (model, micro, policy) in measured:
            continue
        if time_limit_s and time.monotonic() - started > time_limit_s:
            measured[model, micro, policy] = {"error": NOT_MEASURED}
            continue
        done = subprocess.run([*command, f"{model}:{micro}:{policy}"], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{model} micro {micro} {policy}: failed\n{done.stderr[-2000:]}", flush=True)
            measured[model, micro, policy] = {"error": done.stderr.strip().splitlines()[-1:]}
            continue
        measured[model, micro, policy] = point = json.loads(lines[-1])
        rounds = bench.Spread.of(point["micro_ms_rounds"])
        print(f"{model:<10} micro {micro:>3} {policy:<9} {point['micro_ms']:8.2f} ms/micro-batch "
              f"(rounds {rounds.low:.2f}-{rounds.high:.2f}), optimizer {point['optimizer_ms']:.2f} ms, peak "
              f"reserved {point['peak_reserved_gb']:.1f} GB (predicted {point['predicted_gb']:.1f})", flush=True)


def tokens_per_s(point: dict, batch: int) -> float:
    accum = batch // point["micro"]
    return batch * point["block_size"] / ((accum * point["micro_ms"] + point["optimizer_ms"]) / 1e3)


def cell_rows(cells: dict[tuple, tuple[Point, list[Point]]], measured: dict[tuple, dict],
              budget_gb: float) -> list[dict]:
    """Per cell: the plan's choice and the best measured option, their tokens/s and ratio, and the choice's
    peak against the budget."""
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
    return rows


def _point_name(point: Optional[Point]) -> Optional[str]:
    return None if point is None else f"{point[0]} {point[1]}"


TABLE = (bench.Column("model", "model"), bench.Column("B", "batch", "d"),
         bench.Column("plan", lambda r: _point_name(r["chosen"])), bench.Column("tok/s", "chosen_tokens_per_s", ",.0f"),
         bench.Column("best hand-picked", lambda r: _point_name(r.get("best"))),
         bench.Column("tok/s", "best_tokens_per_s", ",.0f"), bench.Column("ratio", "ratio", ".3f"),
         bench.Column("peak GB", "peak_reserved_gb", ".1f"), bench.Column("pred GB", "predicted_gb", ".1f"))


def report(rows: list[dict]) -> list[str]:
    """The cells' table; a row over the budget, or unmeasured, says so after its columns."""
    def note(r: dict) -> str:
        return str(r["error"]) if "error" in r else "" if r["fits"] else "OVER BUDGET"

    return bench.table(rows, TABLE, note=note)
