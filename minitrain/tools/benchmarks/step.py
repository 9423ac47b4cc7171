"""The assembled training step, two recipes side by side on one GPU, through the trainer's own code
(`scripts/bench_step.py` is its command line).

reference: what a user writes with plain PyTorch — fp32 params under bf16 autocast, SDPA, F.gelu,
           F.cross_entropy on full logits, torch.optim.AdamW(fused=True), torch.compile.
minitrain: bf16 params + fp32 masters, fused GELU, fused linear cross-entropy, fused AdamW,
           torch.compile with CUDA graphs (mode reduce-overhead: the compiled forward and backward are
           replayed as graphs, so the step is not bound by the host's kernel launches).

Both are `Trainer`s built from configs (RECIPES), so they see the same initialisation, the same data windows
and the same step code; only the parts differ. Before a recipe is timed, its first loss is checked against
its own eager forward on the same params and batch (a compiled baseline that computes another function is
not the baseline); ratios are against the fastest reference row that passes. The timed steps run in rounds
that alternate the recipes (all resident), so a machine that drifts during the run slows all alike; each
recipe's peak memory is measured net of the others' resident state. minitrain is built first, on an empty
GPU: CUDA graphs allocate from a pool of their own that the allocated counter does not see, so its reserved
memory is the honest figure, and others' free blocks must not dilute it.
"""

from __future__ import annotations

import functools
import gc
import json
import subprocess
import tempfile
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from minitrain import compile_check, memory
from minitrain.config import resolve
from minitrain.cli import compose_config
from minitrain.plan import model_config_for
from minitrain.precision import resolve_precision
from minitrain.tools import bench, profile
from minitrain.trainer import Trainer

# Every setting explicit, so the rows do not depend on what `auto` resolves to (a fixed batch, no
# accumulation, no checkpointing unless an ablation asks for it).
RECIPES = {
    "reference": ["precision=amp_bf16", "loss=torch", "optimizer.impl=torch", "model.gelu=torch",
                  "checkpointing=none", "trainer.compile_mode=default"],
    "minitrain": ["precision=bf16", "loss=fused", "optimizer.impl=fused", "model.gelu=fused",
                  "checkpointing=none", "trainer.compile_mode=reduce-overhead"],
}

# Peak learning rates as in GPT-3's table for these sizes, but 1.5b's lower: its compiled reference diverged at 2e-4
# with 32 sequences (GPT-3 used 2e-4 with 1M-token batches) and this 10-step warmup. That reference fails the
# first-loss check at this width (scripts/compile_vs_eager.py), so the divergence is not the rate's alone.
LR = {"gpt2-124m": 6e-4, "gpt2-350m": 3e-4, "gpt2-774m": 2.5e-4, "gpt2-1.5b": 6e-5}

PROBE_STEPS = 3  # compiled: the first steps compile and record the graphs, the third runs as training does
NO_MEMORY_LIMIT = 2**50  # bytes the probe's plan is given as the device's: its fit check never refuses
CANDIDATE_BATCHES = (512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 4, 2, 1)
PROFILED_STEPS = 4  # the profiler's (after its warm-up), then as many more for the phase clock


def build(model: str, batch: int, recipe: str, extra: Sequence[str], out_dir: str,
          device_memory_bytes: Optional[int] = None) -> Trainer:
    lr = LR.get(model, 6e-4)
    overrides = [f"model={model}", f"trainer.batch_size={batch}", "logger.mode=disabled", f"trainer.out_dir={out_dir}",
                 "trainer.max_steps=100000", "trainer.warmup_steps=10", f"trainer.lr={lr}", f"trainer.min_lr={lr / 10}",
                 f"trainer.micro_batch={batch}", *RECIPES[recipe], *extra]
    return Trainer(compose_config(overrides), progress=False, device_memory_bytes=device_memory_bytes)


def largest_fitting_batch(model: str, recipe: str, extra: Sequence[str], budget_bytes: float) -> int:
    """The largest candidate batch whose step of `recipe` the memory model predicts within the budget: the
    first guess of `measured_fitting_batch` (the model predicts an eager step; a compiled one may fit more)."""
    cfg = resolve(compose_config([f"model={model}", "trainer.out_dir=.", *RECIPES[recipe], *extra]))
    device = torch.device("cuda")
    model_cfg = model_config_for(cfg, cfg.data.vocab_size, device)
    precision = resolve_precision(cfg.precision, device)
    for batch in CANDIDATE_BATCHES:
        peak = memory.predict(memory.Candidate(
            model_cfg, precision, batch, cfg.checkpointing, loss_impl="torch" if cfg.loss.impl.value == "torch" else
            "fused", chunk_bytes=cfg.loss.chunk_bytes, loss_low_memory=cfg.loss.low_memory,
            optimizer=cfg.optimizer.name, optimizer_impl=cfg.optimizer.impl.value)).peak
        if peak <= budget_bytes:
            return batch
    return 1


def probe_fits(model: str, recipe: str, extra: Sequence[str], batch: int, budget_bytes: float, *,
               command: Sequence[str]) -> bool:
    """Whether `recipe`'s step at `batch` runs within the budget, measured: `command` + "model:recipe:batch"
    + the overrides runs `probe` in a process of its own (compilation included), so its peak reserved memory
    is its own and an OOM ends only it. A step that fails for another reason raises, naming it."""
    done = subprocess.run([*command, f"{model}:{recipe}:{batch}", *extra], capture_output=True, text=True)
    if done.returncode != 0 and "OutOfMemoryError" not in done.stderr:
        # Not memory (the first-loss check, a mode that cannot run): a smaller batch would fail alike.
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise RuntimeError(f"{model} {recipe} at B={batch} failed, not for memory: {reason}"[:300])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    fits = done.returncode == 0 and bool(lines) and json.loads(lines[-1])["peak_reserved_bytes"] <= budget_bytes
    print(f"  {model} {recipe} at B={batch}: {'fits' if fits else 'does not fit'}", flush=True)
    return fits


def measured_fitting_batch(model: str, recipe: str, extra: Sequence[str], budget_bytes: float,
                           fits: Callable[[int], bool]) -> int:
    """The largest candidate batch whose step `fits` (measured; see probe_fits): from the memory model's
    guess, up while the next larger one fits, or down until one does."""
    i = CANDIDATE_BATCHES.index(largest_fitting_batch(model, recipe, extra, budget_bytes))
    if fits(CANDIDATE_BATCHES[i]):
        while i > 0 and fits(CANDIDATE_BATCHES[i - 1]):
            i -= 1
        return CANDIDATE_BATCHES[i]
    for batch in CANDIDATE_BATCHES[i + 1:]:
        if fits(batch):
            return batch
    raise RuntimeError(f"{model} {recipe}: not even a batch of {CANDIDATE_BATCHES[-1]} fits")


def probe(spec: str, extra: Sequence[str]) -> dict:
    """`probe_fits`'s child: "model:recipe:batch", PROBE_STEPS steps, then the peak reserved bytes. The plan is
    given NO_MEMORY_LIMIT (the memory model predicts the reference's eager step, more than its compiled one
    takes): the allocator decides what fits, the parent compares the peak with the budget."""
    model, recipe, batch = spec.split(":")
    with tempfile.TemporaryDirectory() as out:
        run = Run(build(model, int(batch), recipe, extra, out, device_memory_bytes=NO_MEMORY_LIMIT), 0, 0)
        run.steps(PROBE_STEPS)
        torch.cuda.synchronize()
        return {"peak_reserved_bytes": torch.cuda.max_memory_reserved()}


class Run:
    """One recipe's trainer and what it has done: steps are numbered on, so data and schedule continue."""

    def __init__(self, trainer: Trainer, base_allocated: int, base_reserved: int):
        self.trainer, self.step, self.losses, self.round_ms = trainer, 0, [], []
        self.base_allocated, self.base_reserved = base_allocated, base_reserved

    def steps(self, n: int) -> None:
        self.losses += [self.trainer.train_step(s) for s in range(self.step, self.step + n)]
        self.step += n

    def one_step(self) -> None:
        self.steps(1)

    def memory_peaks(self, n: int) -> dict:
        """Peak allocated / reserved over n steps, net of what was resident before this trainer was built
        (the other recipes' state, when they are interleaved)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.steps(n)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return {"peak_allocated_gb": (stats["allocated_bytes.all.peak"] - self.base_allocated) / 1e9,
                "peak_reserved_gb": (stats["reserved_bytes.all.peak"] - self.base_reserved) / 1e9,
                "cuda_graphs": self.trainer.plan.cuda_graphs}

    def summary(self) -> dict:
        """ms/step as the median over the timed rounds; tokens/s, MFU and HFU from the trainer's own meter."""
        ms = bench.Spread.of(self.round_ms).median
        meter = self.trainer.throughput()
        tokens_per_s = meter.tokens_per_step / (ms / 1000)
        return {"ms_per_step": ms, "ms_per_round": self.round_ms, "tokens_per_s": tokens_per_s,
                "mfu": tokens_per_s * meter.model_flops / meter.peak,
                "hfu": tokens_per_s * meter.hardware_flops / meter.peak,
                "losses": [float(x) for x in torch.stack(self.losses).tolist()]}


def passes_check(row: dict) -> bool:
    """The recipe's first loss is its own eager forward's (the trainer's check, minitrain/compile_check.py)."""
    return compile_check.agrees(row["first_loss"], row["first_loss_eager"])


def baselines(references: list[dict]) -> tuple[dict | None, dict | None]:
    """The fastest reference row whose first loss passed the check (the ratios' baseline), and a faster one
    that failed it, if any (reported beside, not used)."""
    fastest = functools.partial(max, key=lambda r: r["tokens_per_s"], default=None)
    ref = fastest([r for r in references if passes_check(r)])
    failed = fastest([r for r in references if not passes_check(r)
                      and (ref is None or r["tokens_per_s"] > ref["tokens_per_s"])])
    return ref, failed


def memory_baseline(ref: dict | None, references: list[dict]) -> dict | None:
    """The reference row to set peak memory beside: the speed baseline when its peaks are its own, else another
    that passed the first-loss check and has peaks of its own (a graphed reference built after ours shares our
    pool); never one that computes another function."""
    own = [r for r in references if passes_check(r) and r.get("peak_reserved_gb") is not None]
    return ref if ref in own else next(iter(own), None)


def start_run(model: str, batch: int, recipe: str, extra: Sequence[str], out_dir: str, warmup: int,
              graphed_before: bool = False) -> tuple[Run, dict]:
    return start_trainer(lambda: build(model, batch, recipe, extra, out_dir), warmup, graphed_before)


def start_trainer(make: Callable[[], Trainer], warmup: int, graphed_before: bool = False) -> tuple[Run, dict]:
    """Build (`make()`), check the first loss against the eager forward's, warm up (compilation happens here)
    and measure peak memory over 2 steps, net of what was resident before. `graphed_before`: a trainer of this
    process already replays CUDA graphs."""
    gc.collect()
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    run = Run(make(), base_allocated, base_reserved)
    t = run.trainer
    eager = float(compile_check.eager_loss(t.eager_forward_loss, t.train_batches, 0, t.plan.grad_accum, t.dist))
    run.steps(warmup)
    peaks = run.memory_peaks(2)
    if peaks["cuda_graphs"] and graphed_before:
        # One CUDA-graph pool serves every graphed trainer of the process: this one's graphs reuse what the
        # earlier one reserved, so no peak here is its own.
        peaks.update(peak_allocated_gb=None, peak_reserved_gb=None)
    return run, {**peaks, "first_loss": float(run.losses[0]), "first_loss_eager": eager}


@dataclass(frozen=True)
class Variant:
    """One row of the comparison: its name, the recipe it starts from and the overrides on top."""

    name: str
    recipe: str
    extra: tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    """What to measure for each model and how: which rows beside minitrain (every reference row gets
    `reference_extra`; each ablation is minitrain with one set of overrides more) and the steps to run."""

    compiled: bool = True
    minitrain_extra: tuple[str, ...] = ()
    reference_extra: tuple[str, ...] = ()
    reference_compiled: bool = True
    reference_graphs: bool = False
    reference_eager: bool = False
    ablate: tuple[str, ...] = ()
    big_checkpointing: str = "none"  # minitrain's policy for gpt2-774m and gpt2-1.5b
    warmup: int = 8
    steps: int = 24
    rounds: int = 4
    profile: bool = False
    val: bool = False

    def variants(self, model: str) -> list[Variant]:
        """minitrain first (it is built on an empty GPU), then the reference rows asked for, then ablations."""
        flag = (f"trainer.compile={self.compiled}",)
        big = (f"checkpointing={self.big_checkpointing}",) if "1.5b" in model or "774m" in model else ()
        ours, theirs = (*flag, *self.minitrain_extra, *big), (*flag, *self.reference_extra)
        rows = [Variant("minitrain", "minitrain", ours)]
        if self.reference_compiled:
            rows.append(Variant("reference", "reference", theirs))
        if self.reference_graphs:
            rows.append(Variant("reference graphed", "reference", (*theirs, "trainer.compile_mode=reduce-overhead")))
        if self.reference_eager:
            rows.append(Variant("reference eager", "reference", (*theirs, "trainer.compile=false")))
        return rows + [Variant(f"minitrain {a}", "minitrain", (*ours, *a.split())) for a in self.ablate]


def fit_batch(model: str, batch: str, variant: Variant, budget_bytes: float, probe_command: Sequence[str]) -> dict:
    """The variant's row with its batch: `batch`, or with "auto" the largest that runs (probed)."""
    row = {"model": model, "batch": batch, "recipe": variant.name, "overrides": list(variant.extra)}
    try:
        row["batch"] = int(batch) if batch != "auto" else measured_fitting_batch(
            model, variant.recipe, variant.extra, budget_bytes,
            functools.partial(probe_fits, model, variant.recipe, variant.extra, budget_bytes=budget_bytes,
                              command=probe_command))
    except Exception as e:
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def finish(run: Run, row: dict, how: Comparison) -> None:
    row.update(run.summary())
    if how.val:
        row["val_loss"] = run.trainer.evaluate()
    if how.profile:
        row["profile"] = profile.profile_steps(run.trainer, run.step, PROFILED_STEPS)
        row["profile"]["phases"] = profile.phase_times(
            run.trainer, run.step + profile.PROFILE_WARMUP_STEPS + PROFILED_STEPS, PROFILED_STEPS)


def start_runs(model: str, variants: list[Variant], rows: dict[str, dict], tmp: str, how: Comparison,
               alone: bool) -> dict[str, Run]:
    """Build every row that has a batch, in order; `alone`: time and finish each at once and free it (at its
    largest batch a recipe needs the GPU to itself). A row that cannot run is reported; the others go on."""
    runs: dict[str, Run] = {}
    for i, v in enumerate(variants):
        row = rows[v.name]
        if "error" in row:
            continue
        graphed_before = any(r.trainer.plan.cuda_graphs for r in runs.values())
        try:
            run, peaks = start_run(model, row["batch"], v.recipe, v.extra, f"{tmp}/{i}", how.warmup, graphed_before)
            row.update(peaks)
            runs[v.name] = run
            if alone:
                run.round_ms = bench.alternating_rounds({v.name: run.one_step}, 1, how.steps)[v.name]
                finish(runs.pop(v.name), row, how)
        except Exception as e:  # OOM, or a mode that cannot run here: reported, the others go on
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            runs.pop(v.name, None)
        run = None  # a finished run's trainer must be freed before the next one is built
    return runs


def measure(model: str, batch: str, how: Comparison, probe_command: Sequence[str]) -> list[dict]:
    """Every row of `model` at `batch` (a number, or "auto": each recipe at its largest batch that runs, timed
    alone): every batch probed before this process holds GPU memory (a probe beside this process's trainers
    would find too little free), then built, timed in alternating rounds and finished."""
    variants = how.variants(model)
    budget = bench.memory_budget_bytes()
    rows = {v.name: fit_batch(model, batch, v, budget, probe_command) for v in variants}
    rounds = 1 if batch == "auto" else how.rounds
    with tempfile.TemporaryDirectory() as tmp:
        runs = start_runs(model, variants, rows, tmp, how, alone=rounds == 1)
        with profile.clock_log() as clocks:
            if len(runs) > 1:
                timed = bench.alternating_rounds({n: r.one_step for n, r in runs.items()}, rounds, how.steps // rounds)
                for name, ms in timed.items():
                    runs[name].round_ms = ms
        for row in rows.values():
            row["gpu_clocks"] = clocks.summary if len(runs) > 1 else None  # alone, a run was timed before
        for name, run in runs.items():
            if not run.round_ms:  # the other recipes failed: time this one alone
                run.round_ms = bench.alternating_rounds({name: run.one_step}, 1, how.steps)[name]
            finish(run, rows[name], how)
        runs.clear()
        gc.collect()
        torch.cuda.empty_cache()
        torch.compiler.reset()
    return list(rows.values())


def _memory_cell(row: dict, key: str) -> str | None:
    """A peak in GB, starred where CUDA graphs keep their pool outside the allocated counter."""
    if row.get(key) is None:
        return None
    return f"{row[key]:.2f}{'*' if row['cuda_graphs'] and key == 'peak_allocated_gb' else ''}"


TABLE = (bench.Column("model", "model"), bench.Column("B", lambda r: str(r["batch"]), "s"),
         bench.Column("recipe", "recipe"),
         bench.Column("ms/step", "ms_per_step", ".2f"), bench.Column("tok/s", "tokens_per_s", ",.0f"),
         bench.Column("MFU", "mfu", ".1%"), bench.Column("HFU", "hfu", ".1%"),
         bench.Column("peak alloc GB", lambda r: _memory_cell(r, "peak_allocated_gb"), "s"),
         bench.Column("peak resv GB", lambda r: _memory_cell(r, "peak_reserved_gb"), "s"),
         bench.Column("loss@end", lambda r: r["losses"][-1] if "losses" in r else None, ".4f"),
         bench.Column("val", "val_loss", ".4f"))


def _table_note(row: dict) -> str:
    if "error" in row:
        return row["error"]
    if not passes_check(row):
        return f"first loss {row['first_loss']:.4f}, eager {row['first_loss_eager']:.4f}: FAILED"
    return "(memory: a shared graph pool)" if row.get("peak_reserved_gb") is None else ""


def _peak_ratio(ours: dict, mem_ref: dict | None) -> str:
    if ours["peak_reserved_gb"] is None:
        return "memory not its own (it shares a graphed recipe's pool)"
    if mem_ref is None:
        return "no reference that passed the check has memory peaks of its own"
    if ours["cuda_graphs"]:  # the allocated counter misses the graphs' pool: what the process holds
        return (f"peak reserved {ours['peak_reserved_gb'] / mem_ref['peak_reserved_gb']:.3f}x "
                f"{mem_ref['recipe']}'s reserved, {ours['peak_reserved_gb'] / mem_ref['peak_allocated_gb']:.3f}x "
                "its allocated")
    return f"{ours['peak_allocated_gb'] / mem_ref['peak_allocated_gb']:.3f}x {mem_ref['recipe']}'s peak allocated"


def _ratio_line(model: str, ours: dict, ref: dict, mem_ref: dict | None) -> str:
    """minitrain's row (or an ablation) against the baseline: tokens/s with the rounds' spread, memory, losses."""
    gap = max(abs(a - b) for a, b in zip(ref["losses"], ours["losses"]))
    per_round = bench.Spread.of(a / b * ours["batch"] / ref["batch"]  # tokens/s ratios of the rounds
                                for a, b in zip(ref["ms_per_round"], ours["ms_per_round"]))
    batches = "" if ref["batch"] == ours["batch"] else (
        f" (each at its batch: {ref['batch']}, {ours['batch']}; "
        f"{'the reference' if ref['batch'] < ours['batch'] else ours['recipe']} memory-limited)")
    val_gap = (f"; validation loss gap {ours['val_loss'] - ref['val_loss']:+.4f}"
               if "val_loss" in ours and "val_loss" in ref else "")
    return (f"{model} {ours['recipe']}: {ours['tokens_per_s'] / ref['tokens_per_s']:.3f}x the reference's "
            f"tokens/s{batches} (rounds {per_round.low:.3f}-{per_round.high:.3f}), {_peak_ratio(ours, mem_ref)}; "
            f"max |loss gap| over {len(ref['losses'])} steps {gap:.3f}{val_gap}")


def model_lines(model: str, results: list[dict]) -> list[str]:
    """Under the table, per model: the baseline, a faster reference that failed the first-loss check, our rows
    that failed it, each of our rows against the baseline, and the GPU's clock in the timed rounds."""
    ok = [r for r in results if r["model"] == model and "error" not in r]
    references = [r for r in ok if r["recipe"].startswith("reference")]
    ref, failed = baselines(references)  # the baseline at its best, among rows that compute the same loss
    lines = []
    if ref is not None and len(references) > 1:
        lines.append(f"{model}: ratios against the fastest reference row that passed the first-loss check, "
                     f"{ref['recipe']!r}")
    if failed is not None:
        lines.append(f"{model}: {failed['recipe']!r} ran faster, {failed['tokens_per_s']:,.0f} tokens/s, but its "
                     f"first loss {failed['first_loss']:.4f} is not its eager forward's "
                     f"{failed['first_loss_eager']:.4f}")
    ours = [r for r in ok if not r["recipe"].startswith("reference")]
    lines += [f"{model} {r['recipe']}: its first loss {r['first_loss']:.4f} is not its eager forward's "
              f"{r['first_loss_eager']:.4f}" for r in ours if not passes_check(r)]
    if ref is not None:
        lines += [_ratio_line(model, r, ref, memory_baseline(ref, references)) for r in ours]
    clocks = next((r["gpu_clocks"] for r in ok if r.get("gpu_clocks")), None)
    if clocks:
        lines.append(f"{model}: the GPU in the timed rounds: {profile.format_clocks(clocks)}")
    return lines


def report(results: list[dict], models: Sequence[str]) -> list[str]:
    """The table of every row, then each model's ratios."""
    lines = bench.table(results, TABLE, note=_table_note)
    if any(r.get("cuda_graphs") for r in results):
        lines.append("* CUDA graphs: their memory pool is in the reserved figure, not in the allocated one")
    for model in models:
        lines += model_lines(model, results)
    return lines
