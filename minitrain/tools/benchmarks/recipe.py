"""Time to a target loss: GPT-2's recipe against the modern one, on one GPU and one corpus (`scripts/bench_recipe.py`
is its command line).

The GPT-2 recipe (`model=gpt2-124m`, AdamW, the project's defaults) runs a fixed number of tokens at each lr of a
small sweep of trainer.lr; the lowest final validation loss among them is the target. The modern recipe
(`model=gpt2-124m-modern optimizer=muon`) runs at each lr of a sweep of optimizer.muon.lr with the same number of
tokens as its ceiling, and where the target is known when it starts (given, or set by the GPT-2 runs already made)
stops at its first evaluation at or below it (trainer.target_loss): the comparison needs no step past that one. Its
best run is the one reaching the target in the least wall time (compile excluded), timed to its first evaluation at
or below the target; where none reaches it, the lowest final loss says by how much it misses. A modern run counts
when it finished its budget or stopped at its target (runs made without one ran their budget: both compare alike);
one stopped otherwise (a crash, a stop request) does not, nor does a GPT-2 run short of its budget. Every run is a
`scripts/train.py` process of its own, deterministic, with the same batch and context, evaluated (and logged) every
`eval_every` steps; the comparison reads only the runs' records, so it can be run again anywhere on runs made
elsewhere.

The ablation (`ablation`, bench_recipe.py --ablate) runs the modern recipe with one of its choices undone (ABLATIONS)
at its budget and target, and sets each option's best run beside the modern recipe's best: final loss, time to the
target, step time.

Wall time to a step, from the run's metrics.jsonl: each log interval's mean step time (perf/step_ms) times its
steps, from the end of the process's warm-up steps (minitrain.loop's UNTIMED_STEPS_*: the compile and CUDA-graph
recording), evaluations and checkpoint saves left out. "Compile excluded" counts the warm-up steps at the mean time
of the timed ones (the run as if its step had been compiled beforehand); "compile included" adds their measured wall
time (perf/warmup_s) instead.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

import yaml

from minitrain.loop import TARGET_REACHED, UNTIMED_STEPS_COMPILED, UNTIMED_STEPS_EAGER
from minitrain.model_config import GPT2_BLOCK, as_setting
from minitrain.rundir import CONFIG_RECORD, METRICS, RECORD
from minitrain.tools import report
from minitrain.tools.benchmarks.optimizer import final_loss, quality_run_dirs, read_quality_run, steps_to_reach

TRAIN = Path(__file__).resolve().parents[3] / "scripts" / "train.py"
# Each recipe's overrides and the key its lr sweep sets. The comparison tells the sides apart by optimizer: AdamW's
# runs are the GPT-2 recipe, Muon's the modern one.
RECIPES = {"gpt2": ("model=gpt2-124m",), "modern": ("model=gpt2-124m-modern", "optimizer=muon")}
LR_KEYS = {"gpt2": "trainer.lr", "modern": "optimizer.muon.lr"}
SIDES = {"adamw": "gpt2", "muon": "modern"}
NAMES = {"gpt2": "GPT-2 recipe", "modern": "modern recipe"}
# The corpus every GPU machine has without network (the installed packages' .py sources), the model's vocabulary
# sized to its BPE (4096 ids); GPT-2's tokenizer instead: data=packages data.tokenizer=gpt2.
DATA = ("data=packages", "model.vocab_size=null")
# The modern recipe's choices, each undone alone by one override after the recipe's own (bench_recipe.py --ablate,
# runs in WORK/ablate/<name>/<lr>): the block's options back to GPT-2's (GPT2_BLOCK), the zero-initialised
# projections, the bias-free linears, and Muon (AdamW for every weight, at the GPT-2 recipe's lrs).
ABLATIONS = {**{key: f"model.{key}={as_setting(value)}" for key, value in GPT2_BLOCK.items()},
             "zero_init_proj": "model.zero_init_proj=false", "bias": "model.bias=true", "optimizer": "optimizer=adamw"}
ABLATE_DIR = "ablate"


def ablation_side(name: str) -> str:
    """The recipe whose lr sweep (and lr key) an ablation's runs take: AdamW's without Muon, else Muon's."""
    return "gpt2" if name == "optimizer" else "modern"


class RecipeError(ValueError):
    """Runs that cannot be compared (the message says which and why)."""


def cell_overrides(overrides, lr_key: str, lr: float, steps: int, batch_size: int, block_size: int,
                   eval_every: int, eval_batches: int, data, extra) -> list[str]:
    """A run's command line: its recipe at one lr, the shared budget and cadence. The log cadence is the evaluation's,
    so that every evaluated step's time is in a log record; one checkpoint, at the end."""
    return [*overrides, f"{lr_key}={lr:g}", *data, f"trainer.batch_size={batch_size}",
            f"model.block_size={block_size}", f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}",
            f"trainer.log_every={eval_every}", f"trainer.eval_batches={eval_batches}", f"trainer.save_every={steps}",
            "trainer.deterministic=true", "trainer.sample_tokens=0", *extra]


def run_cell(run_dir: Path, overrides: list[str]) -> int:
    """`python scripts/train.py OVERRIDES hydra.run.dir=RUN_DIR`, its console in RUN_DIR.log; its exit code."""
    if report.is_run_dir(run_dir):
        raise RecipeError(f"--work: {run_dir} already holds a run; give another --work, or --compare it")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.log", "w") as log:
        return subprocess.run([sys.executable, str(TRAIN), *overrides, f"hydra.run.dir={run_dir}"], stdout=log,
                              stderr=subprocess.STDOUT).returncode


def timed_seconds(records: list[dict], untimed_steps: int) -> dict[int, float]:
    """At each log step with a rate, the wall time of the steps timed so far: each interval's mean step time times
    its steps, counted from the end of the warm-up (a log record at an earlier step has no rate)."""
    seconds, total, previous = {}, 0.0, untimed_steps
    for r in records:
        if "perf/step_ms" in r:
            total += r["perf/step_ms"] / 1e3 * (r["step"] - previous)
            seconds[r["step"]], previous = total, r["step"]
    return seconds


def read_run(run_dir) -> dict:
    """A run's side (by its optimizer), lr, validation losses, planned budget, whether it finished it or stopped at
    its target (its last record marked: minitrain.loop.TARGET_REACHED), and the wall times to its log steps."""
    run_dir = Path(run_dir)
    run = read_quality_run(run_dir)
    config = yaml.safe_load((run_dir / RECORD / CONFIG_RECORD).read_text())
    records = report.read_step_records(run_dir / METRICS)
    compiled = report.read_plan(run_dir / METRICS).get("compile_mode", "eager") != "eager"
    untimed = UNTIMED_STEPS_COMPILED if compiled else UNTIMED_STEPS_EAGER
    t = config["trainer"]
    tokens_per_step = t["batch_size"] * config["model"]["block_size"]
    side = SIDES.get(run["optimizer"])
    if side is None:
        raise RecipeError(f"{run_dir}: optimizer={run['optimizer']} is neither recipe's (adamw: GPT-2's, muon: the "
                          "modern one)")
    warmup = next((r["perf/warmup_s"] for r in records if "perf/warmup_s" in r), None)
    return {**run, "side": side, "model": config["model"]["name"],
            "recipe_lr": run["muon_lr"] if side == "modern" else run["lr"], "max_steps": t["max_steps"],
            "tokens_per_step": tokens_per_step, "budget": t["max_steps"] * tokens_per_step,
            "finished": run["last_step"] == t["max_steps"],
            "stopped_at_target": bool(records) and TARGET_REACHED in records[-1],
            "untimed_steps": untimed, "warmup_s": warmup, "timed_s": timed_seconds(records, untimed),
            "median_step_ms": statistics.median(step_ms) if (step_ms := [r["perf/step_ms"] for r in records
                                                                        if "perf/step_ms" in r]) else None}


def wall_times(run: dict, step: int) -> tuple[float, Optional[float]]:
    """The run's wall time to `step`: compile excluded (its warm-up steps at the timed steps' mean), and included (their
    measured time; None for a run that did not record it)."""
    timed = run["timed_s"].get(step)
    if timed is None:
        raise RecipeError(f"{run['dir']}: step {step} has no timed log record (its first {run['untimed_steps']} "
                          "steps warm up, and trainer.log_every must divide trainer.eval_every)")
    excluded = timed / (step - run["untimed_steps"]) * step
    return excluded, None if run["warmup_s"] is None else timed + run["warmup_s"]


def _best(runs: list[dict]) -> dict:
    """The lowest final validation loss of a finished run with finite losses (a run stopped early is no candidate)."""
    return min(runs, key=lambda r: final_loss(r) if r["finished"] else math.inf)


def _target_run(gpt2_runs: list[dict]) -> Optional[dict]:
    """The GPT-2 recipe's best run, whose final validation loss is the target; None if none finished with finite
    losses."""
    best = _best(gpt2_runs) if gpt2_runs else None
    return best if best is not None and best["finished"] and math.isfinite(final_loss(best)) else None


def reach(run: dict, target: float) -> Optional[int]:
    """The step of a modern run's first evaluation at or below `target`, None if none is. Only a run with finite
    losses that finished its budget or stopped at its own target reaches anything: each made every evaluation it
    was to make up to its end; a run stopped otherwise is no candidate."""
    counts = run["finite"] and (run["finished"] or run["stopped_at_target"])
    return steps_to_reach(run, target) if counts else None


def _fastest(runs: list[dict], target: float) -> dict:
    """The modern recipe's best run: the one reaching the target in the least wall time (compile excluded); where
    none reaches it, the lowest final loss (_best)."""
    reaching = [r for r in runs if reach(r, target) is not None]
    if not reaching:
        return _best(runs)
    return min(reaching, key=lambda r: wall_times(r, reach(r, target))[0])


def known_target(given: Optional[float], gpt2_dir: Path, budget: int) -> tuple[Optional[float], str]:
    """The target the modern recipe's runs stop at and where it comes from: `given` (--target), else the final loss of
    the GPT-2 recipe's best finished run in `gpt2_dir` (WORK/gpt2: made earlier, or by this call first); None where
    neither is known. GPT-2 runs there of another budget than `budget` tokens are refused: theirs would be another
    budget's target."""
    if given is not None:
        return given, "--target"
    runs = [r for r in map(read_run, quality_run_dirs([gpt2_dir])) if r["side"] == "gpt2"]
    other = next((r for r in runs if r["budget"] != budget), None)
    if other is not None:
        raise RecipeError(f"--work: {other['dir']} ran a budget of {other['budget']:,} tokens, not this one's "
                          f"{budget:,}: its target is another budget's; give another --work, or --target")
    best = _target_run(runs)
    if best is None:
        return None, f"no finished run of the GPT-2 recipe in {gpt2_dir}, no --target"
    return final_loss(best), f"the GPT-2 recipe's best final validation loss, {best['dir']}"


def modern_target(given: Optional[float], gpt2_dir: Path, budget: int) -> tuple[list[str], str]:
    """The overrides that stop the modern recipe's runs (and its ablations') at the known target
    (trainer.target_loss), none where none is known (its runs run their whole budget), and the line that says
    which."""
    target, source = known_target(given, gpt2_dir, budget)
    if target is None:
        return [], f"{NAMES['modern']}: no target known ({source}): its runs run their whole budget"
    return [f"trainer.target_loss={target!r}"], (f"{NAMES['modern']}: its runs stop at their first evaluation at or "
                                                 f"below {target!r} ({source})")


def compare(runs: list[dict]) -> dict:
    """The target (the GPT-2 recipe's best final validation loss), and each recipe's best run's tokens and wall times:
    the GPT-2 recipe's to its end, the modern recipe's (the fastest to the target) to its first evaluation at or
    below the target. The GPT-2 runs share one budget (the target is its loss); a modern run's budget may be its own
    (bench_recipe.py --modern-tokens: the length its schedule decays over), as it is timed to the target."""
    sides = {side: [r for r in runs if r["side"] == side] for side in NAMES}
    missing = [NAMES[side] for side, found in sides.items() if not found]
    if missing:
        raise RecipeError(f"no runs of the {' or '.join(missing)} (the GPT-2 recipe's runs use AdamW, the "
                          "modern one's Muon)")
    if len({r["budget"] for r in sides["gpt2"]}) != 1:  # the modern runs' own budgets set only their schedules
        raise RecipeError("the GPT-2 recipe's runs' token budgets differ: " + ", ".join(
            f"{r['dir']}: {r['budget']:,}" for r in sides["gpt2"]))
    gpt2 = _target_run(sides["gpt2"])
    if gpt2 is None:
        raise RecipeError("no run of the GPT-2 recipe finished with finite losses: there is no target")
    target = final_loss(gpt2)
    modern = _fastest(sides["modern"], target)
    result = {"target": target, "budget_tokens": gpt2["budget"], "gpt2": _side(gpt2, gpt2["max_steps"]),
              "modern": _side(modern, reach(modern, target))}
    for kind in ("excluded", "included"):
        g, m = result["gpt2"][f"wall_s_compile_{kind}"], result["modern"][f"wall_s_compile_{kind}"]
        result[f"ratio_compile_{kind}"] = None if g is None or m is None else m / g
    return result


def _side(run: dict, step: Optional[int]) -> dict:
    excluded, included = (None, None) if step is None else wall_times(run, step)
    return {"dir": run["dir"], "lr": run["recipe_lr"], "final": final_loss(run), "budget_tokens": run["budget"],
            "step": step, "loss": None if step is None else run["val"][step],
            "tokens": None if step is None else step * run["tokens_per_step"],
            "wall_s_compile_excluded": excluded, "wall_s_compile_included": included}


def _seconds(value: Optional[float]) -> str:
    return "not recorded" if value is None else f"{value:.1f} s"


def _ratio(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.3f}x"


def _run_end(run: dict) -> str:
    """How a run ended, as its report line says it: its final loss, or where it stopped and why (a run stopped at
    its target has no loss at the end of its budget)."""
    if run["finite"] and run["stopped_at_target"] and not run["finished"]:
        return (f"stopped at its target (trainer.target_loss) at step {run['last_step']} of {run['max_steps']}, "
                f"validation loss {final_loss(run):.4f}")
    return "final validation loss " + (
        f"{final_loss(run):.4f}" if run["finished"] and math.isfinite(final_loss(run)) else
        "NON-FINITE" if not run["finite"] else f"none (stopped at step {run['last_step']} of {run['max_steps']})")


def compare_report(runs: list[dict], result: dict) -> list[str]:
    """Each run's lr and final loss, then both recipes' wall times, tokens and the ratio."""
    lines = [f"{NAMES[r['side']]} {LR_KEYS[r['side']]}={r['recipe_lr']:g}: " + _run_end(r) for r in runs]
    g, m = result["gpt2"], result["modern"]
    lines.append(f"target: {result['target']:.4f}, the GPT-2 recipe's best final validation loss "
                 f"({LR_KEYS['gpt2']}={g['lr']:g})")
    lines.append(f"GPT-2 recipe: {g['step']} steps, {g['tokens']:,} tokens, wall time "
                 f"{_seconds(g['wall_s_compile_excluded'])} compile excluded, "
                 f"{_seconds(g['wall_s_compile_included'])} compile included")
    if m["step"] is None:
        lines.append(f"modern recipe ({LR_KEYS['modern']}={m['lr']:g}): never reaches the target in "
                     f"{m['budget_tokens']:,} tokens (its final validation loss {m['final']:.4f})")
        return lines
    lines.append(f"modern recipe ({LR_KEYS['modern']}={m['lr']:g}): reaches {m['loss']:.4f} at step {m['step']}, "
                 f"{m['tokens']:,} tokens, wall time {_seconds(m['wall_s_compile_excluded'])} compile excluded, "
                 f"{_seconds(m['wall_s_compile_included'])} compile included")
    lines.append(f"ratio (modern / GPT-2 wall time): {_ratio(result['ratio_compile_excluded'])} compile excluded, "
                 f"{_ratio(result['ratio_compile_included'])} compile included")
    return lines


def ablation(work: Path, target: Optional[float]) -> dict:
    """Each option undone alone against the modern recipe: the best run (the fastest to the target where one is known,
    else the lowest final loss) of WORK/modern and of each WORK/ablate/<name> there, their final losses, where and
    when each reached the target, and their median step times. The rows must run the reference's budget: a final
    loss or a schedule of another length would differ for that alone."""
    def best(runs: list[dict]) -> dict:
        return _best(runs) if target is None else _fastest(runs, target)

    reference_runs = [read_run(d) for d in quality_run_dirs([work / "modern"])]
    if not reference_runs:
        raise RecipeError(f"no run of the {NAMES['modern']} in {work / 'modern'}: its runs are the ablation's "
                          "reference (--recipes modern)")
    reference = best(reference_runs)
    rows = {}
    for name in ABLATIONS:
        found = quality_run_dirs([work / ABLATE_DIR / name])  # none for an option not run
        if found:
            rows[name] = best([read_run(d) for d in found])
            if rows[name]["budget"] != reference["budget"]:
                raise RecipeError(f"{rows[name]['dir']} ran a budget of {rows[name]['budget']:,} tokens, not the "
                                  f"{NAMES['modern']}'s {reference['budget']:,} ({reference['dir']}): an ablation "
                                  "runs its reference's budget")
    if not rows:
        raise RecipeError(f"no ablation run in {work / ABLATE_DIR} (--ablate)")
    ref = _ablation_row(reference, target, None)
    return {"target": target, "budget_tokens": reference["budget"], "modern": ref,
            "ablations": {name: {"override": ABLATIONS[name], **_ablation_row(run, target, ref)}
                          for name, run in rows.items()}}


def _ablation_row(run: dict, target: Optional[float], ref: Optional[dict]) -> dict:
    """One run's row: its lr, final loss (and its difference from the reference's when both ran their whole budget),
    the step and wall time (compile excluded) at which it reached the target (and their ratio to the reference's),
    its median step time."""
    step = None if target is None else reach(run, target)
    wall = None if step is None else wall_times(run, step)[0]
    final = final_loss(run) if run["finished"] else None
    row = {"dir": run["dir"], "lr_key": LR_KEYS[run["side"]], "lr": run["recipe_lr"], "final": final, "step": step,
           "wall_s_compile_excluded": wall, "median_step_ms": run["median_step_ms"]}
    if ref is not None:
        row["final_delta"] = None if None in (final, ref["final"]) else final - ref["final"]
        row["wall_ratio"] = None if None in (wall, ref["wall_s_compile_excluded"]) else \
            wall / ref["wall_s_compile_excluded"]
    return row


def ablation_report(result: dict) -> list[str]:
    """One line for the modern recipe, then one per option undone: final loss and its difference, the target's step,
    wall time and its ratio where one is known, the median step time."""
    def line(label: str, row: dict) -> str:
        parts = [f"{label} ({row['lr_key']}={row['lr']:g}):",
                 "final validation loss " + ("none (stopped at the target)" if row["final"] is None else
                                             f"{row['final']:.4f}")]
        if row.get("final_delta") is not None:
            parts.append(f"({row['final_delta']:+.4f})")
        if result["target"] is not None:
            parts.append("| never reaches the target" if row["step"] is None else
                         f"| the target at step {row['step']}, {row['wall_s_compile_excluded']:.1f} s" +
                         ("" if row.get("wall_ratio") is None else f" ({row['wall_ratio']:.3f}x)"))
        parts.append("| " + ("no step time" if row["median_step_ms"] is None else
                             f"{row['median_step_ms']:.2f} ms/step"))
        return " ".join(parts)

    target = "none: each runs its budget" if result["target"] is None else f"{result['target']:.4f}"
    return [f"ablation, {result['budget_tokens']:,} tokens a run, target {target}", line(NAMES["modern"],
            result["modern"])] + [line(f"  {row['override']}", row) for row in result["ablations"].values()]


def plot_curves(run_dirs: list[Path], runs: list[dict], path: Path) -> Optional[Path]:
    """The runs' train and validation losses against tokens (minitrain/tools/report.py's plot), or None without
    matplotlib."""
    if not report.plotting_available():
        return None
    cells = [report.Cell(name=f"{NAMES[r['side']]} {LR_KEYS[r['side']]}={r['recipe_lr']:g}",
                         records=report.read_step_records(Path(d) / METRICS)) for d, r in zip(run_dirs, runs)]
    return report.plot_loss_curves(cells, path)
