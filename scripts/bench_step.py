"""The assembled training step, two recipes side by side on one GPU, through the trainer's own code.

reference: what a user writes with plain PyTorch — fp32 params under bf16 autocast, SDPA, F.gelu,
           F.cross_entropy on full logits, torch.optim.AdamW(fused=True), torch.compile.
minitrain: bf16 params + fp32 masters, fused GELU, fused linear cross-entropy, fused AdamW,
           torch.compile with CUDA graphs (mode reduce-overhead: the compiled forward and backward are
           replayed as graphs, so the step is not bound by the host's kernel launches).

Both are `minitrain.trainer.Trainer`s built from configs (RECIPES below), so they see the same
initialisation, the same data windows and the same step code; only the parts differ. Before a recipe is
timed, its first loss is checked against its own eager forward on the same params and batch (a compiled
baseline that computes another function is not the baseline); ratios are against the fastest reference
row that passes, `--reference-eager` adds the uncompiled reference for where none does. The timed steps
run in rounds that alternate the recipes (all resident), so a machine that drifts during the run
(clocks, heat) slows all alike; each recipe's peak memory is measured net of the others' resident
state. minitrain is built first, on an empty GPU: CUDA graphs allocate from a pool of their own that
the allocated counter does not see, so its reserved memory is the honest figure, and others' free
blocks must not dilute it. Prints ms/step, tokens/s, MFU, peak memory and the loss after the timed
steps, and writes JSON to --out.

    python scripts/bench_step.py --models gpt2-124m --out bench_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minitrain import compile_check, memory  # noqa: E402
from minitrain import plan as planning  # noqa: E402
from minitrain.config import compose_config, resolve  # noqa: E402
from minitrain.metrics import is_gpu_work  # noqa: E402
from minitrain.plan import model_config_for  # noqa: E402
from minitrain.precision import resolve_precision  # noqa: E402
from minitrain.tools import kernel_floors  # noqa: E402
from minitrain.trainer import Trainer  # noqa: E402

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
UNPLANNED_MEMORY = 2**50  # bytes the probe's plan believes the device has: its fit check never refuses
CANDIDATE_BATCHES = (512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 4, 2, 1)


def largest_fitting_batch(model: str, recipe: str, extra: list[str], budget_bytes: float) -> int:
    """The largest candidate batch whose step of `recipe` the memory model predicts within the budget: the
    first guess of `measured_fitting_batch` (the model predicts an eager step; a compiled one may fit more)."""
    cfg = resolve(compose_config([f"model={model}", "trainer.out_dir=.", *RECIPES[recipe], *extra]))
    device = torch.device("cuda")
    model_cfg = model_config_for(cfg, cfg.data.vocab_size, device)
    precision = resolve_precision(cfg.precision, device)
    for batch in CANDIDATE_BATCHES:
        peak = memory.predict(model_cfg, precision, cfg.checkpointing, batch, model_cfg.block_size,
                              "torch" if cfg.loss.impl.value == "torch" else "fused", cfg.loss.chunk_bytes,
                              loss_low_memory=cfg.loss.low_memory, optimizer_impl=cfg.optimizer.impl.value).peak
        if peak <= budget_bytes:
            return batch
    return 1


def probe_fits(model: str, recipe: str, extra: list[str], batch: int, budget_bytes: float) -> bool:
    """Whether `recipe`'s step at `batch` runs within the budget, measured: PROBE_STEPS steps (compilation
    included) in a process of its own, so its peak reserved memory is its own and an OOM ends only it. A
    step that fails for another reason raises, naming it."""
    cmd = [sys.executable, __file__, "--probe", f"{model}:{recipe}:{batch}", "--probe-extra", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 and "OutOfMemoryError" not in done.stderr:
        # Not memory (the first-loss check, a mode that cannot run): a smaller batch would fail alike.
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise RuntimeError(f"{model} {recipe} at B={batch} failed, not for memory: {reason}"[:300])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    fits = done.returncode == 0 and bool(lines) and json.loads(lines[-1])["peak_reserved_bytes"] <= budget_bytes
    print(f"  {model} {recipe} at B={batch}: {'fits' if fits else 'does not fit'}", flush=True)
    return fits


def measured_fitting_batch(model: str, recipe: str, extra: list[str], budget_bytes: float,
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


def probe(spec: str, extra: list[str]) -> None:
    """--probe model:recipe:batch, in a child process: PROBE_STEPS steps, then the peak reserved bytes. The
    plan's fit check is lifted (the memory model predicts the reference's eager step, more than its compiled
    one takes): the allocator decides what fits, the parent compares the peak with the budget."""
    model, recipe, batch = spec.split(":")
    with mock.patch.object(planning, "device_memory", lambda device: UNPLANNED_MEMORY), \
            tempfile.TemporaryDirectory() as out:
        run = Run(build(model, int(batch), recipe, extra, out), 0, 0)
        run.steps(PROBE_STEPS)
        torch.cuda.synchronize()
        print(json.dumps({"peak_reserved_bytes": torch.cuda.max_memory_reserved()}))


def build(model: str, batch: int, recipe: str, extra: list[str], out_dir: str) -> Trainer:
    lr = LR.get(model, 6e-4)
    overrides = [f"model={model}", f"trainer.batch_size={batch}", "logger.mode=disabled", f"trainer.out_dir={out_dir}",
                 "trainer.max_steps=100000", "trainer.warmup_steps=10", f"trainer.lr={lr}", f"trainer.min_lr={lr / 10}",
                 f"trainer.micro_batch={batch}",
                 *RECIPES[recipe], *extra]
    return Trainer(compose_config(overrides), progress=False)


class Run:
    """One recipe's trainer and what it has done: steps are numbered on, so data and schedule continue."""

    def __init__(self, trainer: Trainer, base_allocated: int, base_reserved: int):
        self.trainer, self.step, self.losses, self.round_ms = trainer, 0, [], []
        self.base_allocated, self.base_reserved = base_allocated, base_reserved

    def steps(self, n: int) -> None:
        self.losses += [self.trainer.train_step(s) for s in range(self.step, self.step + n)]
        self.step += n

    def timed(self, n: int) -> None:
        """n steps between two device events: wall time of the GPU queue, no per-step sync."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.steps(n)
        end.record()
        torch.cuda.synchronize()
        self.round_ms.append(start.elapsed_time(end) / n)

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
        ms = sum(self.round_ms) / len(self.round_ms)
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


def start_run(model: str, batch: int, recipe: str, extra: list[str], out_dir: str, warmup: int) -> tuple[Run, dict]:
    """Build, check the first loss against the eager forward's, warm up (compilation happens here) and
    measure peak memory over 2 steps."""
    gc.collect()
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    run = Run(build(model, batch, recipe, extra, out_dir), base_allocated, base_reserved)
    t = run.trainer
    eager = float(compile_check.eager_loss(t._forward_loss, t.train_batches, 0, t.plan.grad_accum, t.dist))
    run.steps(warmup)
    return run, {**run.memory_peaks(2), "first_loss": float(run.losses[0]), "first_loss_eager": eager}


CLOCK_QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active"
CLOCK_SAMPLE_MS = 250
SW_POWER_CAP = 0x4  # the throttle-reasons bit nvidia-smi sets while the driver holds the board at its power limit


def clock_summary(samples: str) -> dict | None:
    """The SM clock and board power over nvidia-smi's samples (`CLOCK_QUERY`, csv without header or units):
    under a GEMM-heavy step an H200 sits at its power limit, and the clock the driver then allows, not idle
    gaps between kernels, sets the step's time. None without samples."""
    rows = []
    for line in samples.strip().splitlines():
        try:
            sm, sm_limit, power, power_limit, reasons = line.split(", ")
            rows.append((int(sm), int(sm_limit), float(power), float(power_limit), int(reasons, 16)))
        except ValueError:  # a field this GPU does not report ("[N/A]"), or a line cut short at the end
            continue
    if not rows:
        return None
    sm = sorted(r[0] for r in rows)
    power = sorted(r[2] for r in rows)
    return {"samples": len(rows), "sm_mhz_median": sm[len(sm) // 2], "sm_mhz_min": sm[0], "sm_mhz_max": sm[-1],
            "sm_mhz_limit": rows[0][1], "power_w_median": power[len(power) // 2], "power_w_limit": rows[0][3],
            "power_capped_share": sum(bool(r[4] & SW_POWER_CAP) for r in rows) / len(rows)}


@contextlib.contextmanager
def clock_log():
    """nvidia-smi sampling the GPU every CLOCK_SAMPLE_MS while the block runs; the block's `summary` holds
    clock_summary's figures after it (None where nvidia-smi is missing)."""
    log = SimpleNamespace(summary=None)
    # by UUID: CUDA's device index is not nvidia-smi's
    gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    with tempfile.TemporaryFile("w+") as out:
        try:
            sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={CLOCK_QUERY}", "--format=csv,noheader,nounits",
                                        "-lms", str(CLOCK_SAMPLE_MS), "-i", gpu], stdout=out,
                                       stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            yield log
            return
        try:
            yield log
        finally:
            sampler.terminate()
            sampler.wait()
            out.seek(0)
            log.summary = clock_summary(out.read())


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")  # the last: to show how many copies a step queues (async from pinned memory)


PROFILE_WARMUP_STEPS = 2  # traced and discarded: they refill the queue the profiler's start drained
LONG_GAP_US = 20  # longer than a kernel launch's own latency: the device waited for the host (or a sync)


class TraceEvent(NamedTuple):
    """One record of the profiler's trace, times in us. Read from its kineto records: the FunctionEvents of
    some torch versions do not carry `linked_correlation_id`, which ties a kernel to the op that launched it."""
    name: str
    device_type: torch.autograd.DeviceType
    start: float
    end: float
    id: int
    linked_correlation_id: int
    is_user_annotation: bool
    stream: int  # a GPU event's stream (a host event's thread)


def trace_events(prof) -> list[TraceEvent]:
    return [TraceEvent(e.name(), e.device_type(), e.start_ns() / 1e3, e.end_ns() / 1e3, e.correlation_id(),
                       e.linked_correlation_id(), e.is_user_annotation(), e.device_resource_id())
            for e in prof.profiler.kineto_results.events()]


def started_in(events: list[TraceEvent], label: str) -> Callable[[TraceEvent], bool]:
    """Whether a host event started inside one of the `label` ranges (the host's, not the label's copy on the
    GPU's timeline)."""
    cpu = torch.autograd.DeviceType.CPU
    ranges = [(e.start, e.end) for e in events if e.name == label and e.device_type == cpu]
    return lambda event: any(a <= event.start <= b for a, b in ranges)


WINDOW_MARK = "bench.window"  # the range of the one-element kernel queued before the traced steps and after them


def step_window(events: list[TraceEvent]) -> tuple[float, float]:
    """The traced steps' span on the GPU's timeline: from the end of the kernel queued just before the first
    traced step to the start of the one queued just after the last, both on the steps' stream (a stream runs
    in order). The host runs ahead, so the trace opens while the GPU still runs the warm-up steps' queued
    kernels; those ran before the first mark. Linking each kernel to the op that queued it cannot say this:
    a CUDA graph's kernels link to its launch, whichever step it ran for, and the optimizer's Triton launches
    link to no op on torch 2.11."""
    inside = started_in(events, WINDOW_MARK)
    ops = {e.id for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.linked_correlation_id == 0
           and e.name != WINDOW_MARK and inside(e)}
    marks = sorted((e.start, e.end) for e in events if is_gpu_work(e) and e.linked_correlation_id in ops)
    if len(marks) != 2:
        raise RuntimeError(f"expected the two {WINDOW_MARK} kernels in the trace, found {len(marks)}")
    return marks[0][1], marks[1][0]


SPAN_TOLERANCE = 0.15  # the profiler's own overhead lengthens a GPU-bound traced step a little, not by this much


def span_matches_step(span_ms: float, timed_ms: float) -> bool:
    """Whether the profile's span per step is one timed step: a check on what the span took in, and on how
    far tracing slowed the step."""
    return abs(span_ms / timed_ms - 1.0) <= SPAN_TOLERANCE


def work_in_window(events: list[TraceEvent], window: tuple[float, float]) -> list[TraceEvent]:
    """The kernels and copies that start in the steps' span (`step_window`; the closing mark is not theirs)."""
    start, end = window
    return [e for e in events if is_gpu_work(e) and start <= e.start < end]


def idle_gaps(events: list[TraceEvent], window: tuple[float, float], top: int = 8) -> dict:
    """GPU idle time in the steps' span (no kernel or copy running, whichever step queued it), with the work on
    either side and the innermost host-side events running at the gap's middle (what the CPU was doing while
    the GPU waited). All of it (`idle_ms`), the part in gaps over LONG_GAP_US (`long_idle_ms`; the short ones are
    the device's launch latency between queued kernels, a cost of the kernel count), and by the kind of work
    each gap follows (`after_ms`: a memset's gap is longer than a kernel's, so memsets are worth counting)."""
    start, end = window
    spans = sorted((max(e.start, start), e.end, e.name) for e in events
                   if is_gpu_work(e) and e.end >= start and e.start <= end)  # the marks too: the gaps next to them
    host = [(e.start, e.end, e.name) for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    gaps, busy_until, before = [], spans[0][1], spans[0][2]
    for span_start, span_end, name in spans[1:]:
        if span_start > busy_until:
            gaps.append({"us": span_start - busy_until, "after": before[:60], "before": name[:60], "at": busy_until})
        if span_end > busy_until:
            busy_until, before = span_end, name
    after_ms = defaultdict(float)
    for g in gaps:
        after_ms[work_kind(g["after"])] += g["us"] / 1e3
    largest = sorted(gaps, key=lambda g: -g["us"])[:top]
    for g in largest:
        middle = g.pop("at") + g["us"] / 2
        running = sorted((host_end - host_start, name) for host_start, host_end, name in host
                         if host_start <= middle <= host_end)
        g["host"] = " < ".join(name[:50] for _, name in running[:3])
    return {"idle_ms": sum(g["us"] for g in gaps) / 1e3,
            "long_idle_ms": sum(g["us"] for g in gaps if g["us"] > LONG_GAP_US) / 1e3,
            "after_ms": dict(after_ms), "largest": largest}


def work_kind(name: str) -> str:
    """"memset", "copy" or "kernel", by the profiler's name for a piece of GPU work."""
    return "memset" if name.startswith("Memset") else "copy" if name.startswith("Memcpy") else "kernel"


class PhaseClock:
    """Passed to the step in place of `record_function`: each labelled phase of `train_step` starts on an
    idle GPU, so its host time is what the CPU spends enqueueing it and its wall time (to the GPU's finish)
    bounds its GPU time. A phase whose host time is near its wall time keeps the GPU waiting."""

    def __init__(self):
        self.host, self.wall = defaultdict(float), defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        self.host[name] += (enqueued - start) * 1e3
        self.wall[name] += (time.perf_counter() - start) * 1e3


def phase_times(trainer: Trainer, first: int, steps: int) -> dict:
    """ms per step of each phase (data, forward, backward, optimizer), host enqueue vs wall; no profiler."""
    clock, original = PhaseClock(), trainer.train_step.phase
    trainer.train_step.phase = clock
    try:
        for s in range(first, first + steps):
            trainer.train_step(s)
    finally:
        trainer.train_step.phase = original
    return {name.removeprefix("minitrain."): {"host_ms": clock.host[name] / steps, "wall_ms": clock.wall[name] / steps}
            for name in clock.host}


def traced_steps(trainer: Trainer, first: int, steps: int):
    """The profiler's trace of `steps` steps in the steady state, each in a "bench.step" range. The
    profiler's start drains the device's queue, so it first traces PROFILE_WARMUP_STEPS steps it discards:
    the window then opens with the queue as full as in training (a window opened on an idle device shows
    its first step's host enqueue latency as idle, which training pays after log steps only)."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    marker = torch.zeros(1, device=trainer.device)

    def mark():
        with record_function(WINDOW_MARK):
            marker.add_(1)

    window = schedule(wait=0, warmup=PROFILE_WARMUP_STEPS, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=window) as prof:
        for s in range(first, first + PROFILE_WARMUP_STEPS):
            trainer.train_step(s)
            prof.step()
        last = first + PROFILE_WARMUP_STEPS + steps - 1
        mark()
        for s in range(first + PROFILE_WARMUP_STEPS, last + 1):
            with record_function("bench.step"):
                trainer.train_step(s)
            if s == last:
                mark()
                torch.cuda.synchronize()  # every kernel in the window; outside the steps, not counted as theirs
            prof.step()
    return prof


def profile_steps(trainer: Trainer, first: int, steps: int) -> dict:
    """GPU time by kernel over `steps` traced steps (the next cost to attack), each class of kernels beside its
    floor on this device (minitrain/tools/kernel_floors.py), GPU idle gaps, and the host syncs issued inside
    the steps."""
    ceilings = kernel_floors.measure_ceilings(trainer.device)  # before the trace, so none of its kernels is in it
    events = trace_events(traced_steps(trainer, first, steps))
    calls, busy_us = defaultdict(int), defaultdict(float)
    window = step_window(events)
    for e in work_in_window(events, window):
        calls[e.name] += 1
        busy_us[e.name] += e.end - e.start
    kernels = sorted(busy_us, key=busy_us.get, reverse=True)
    total = sum(busy_us.values())
    inside, syncs = started_in(events, "bench.step"), defaultdict(int)
    for e in events:
        if e.name in SYNC_CALLS and inside(e):
            syncs[e.name] += 1
    top = [{"kernel": k[:kernel_floors.NAME_CHARS], "calls_per_step": calls[k] / steps,
            "ms_per_step": busy_us[k] / 1e3 / steps, "share": busy_us[k] / total} for k in kernels[:25]]
    plan = trainer.plan
    work = kernel_floors.step_work(trainer.model, plan.precision, plan.batch_size, trainer.model_cfg.block_size,
                                   plan.compiled)
    per_kernel = [(k, busy_us[k] / 1e3 / steps, calls[k] / steps) for k in kernels]  # all of them
    rows = kernel_floors.floor_table(per_kernel, kernel_floors.floors_ms(work, ceilings))
    idle = idle_gaps(events, window)
    return {"span_ms_per_step": (window[1] - window[0]) / 1e3 / steps,
            "gpu_ms_per_step": total / 1e3 / steps, "idle_ms_per_step": idle["idle_ms"] / steps,
            "long_idle_ms_per_step": idle["long_idle_ms"] / steps,
            "idle_ms_per_step_after": {k: v / steps for k, v in idle["after_ms"].items()},
            "memsets_per_step": sum(n for k, n in calls.items() if work_kind(k) == "memset") / steps,
            "largest_gaps": idle["largest"], "top_kernels": top,
            "kernels_per_step": sum(calls.values()) / steps,
            "floors": {**asdict(ceilings), "rows": rows},
            "syncs_per_step": {k: v / steps for k, v in syncs.items()}}


def finish(run: Run, row: dict, profile: bool, val: bool) -> None:
    row.update(run.summary())
    if val:
        row["val_loss"] = run.trainer.evaluate()
    if profile:
        steps = 4  # the profiler's (after its warm-up), then as many more for the phase clock
        row["profile"] = profile_steps(run.trainer, run.step, steps)
        row["profile"]["phases"] = phase_times(run.trainer, run.step + PROFILE_WARMUP_STEPS + steps, steps)


def main() -> None:
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
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # model:recipe:batch, run in this process (probe_fits)
    ap.add_argument("--probe-extra", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        probe(args.probe, args.probe_extra)
        return
    compile_flag = [f"trainer.compile={not args.no_compile}"]
    budget = 0.9 * torch.cuda.get_device_properties(0).total_memory
    results = []
    for model, batch in zip(args.models, args.batch):
        ours_extra = list(args.minitrain_extra)
        if "1.5b" in model or "774m" in model:
            ours_extra.append(f"checkpointing={args.big_checkpointing}")
        runs, rows = {}, {}
        rounds = 1 if batch == "auto" else args.rounds  # at its largest batch, each recipe needs the GPU alone
        with tempfile.TemporaryDirectory() as tmp:
            variants = [("minitrain", "minitrain", ours_extra)]
            theirs = list(args.reference_extra)  # every reference row's
            if args.reference_compiled:
                variants.append(("reference", "reference", theirs))
            if args.reference_graphs:
                variants.append(("reference graphed", "reference", theirs + ["trainer.compile_mode=reduce-overhead"]))
            if args.reference_eager:
                variants.append(("reference eager", "reference", theirs + ["trainer.compile=false"]))
            for ablation in args.ablate:  # minitrain with one part swapped: that part's share of the gain
                variants.append((f"minitrain {ablation}", "minitrain", ours_extra + ablation.split()))
            for name, recipe, recipe_extra in variants:  # every probe before this process holds GPU memory
                extra = compile_flag + recipe_extra
                row = rows[name] = {"model": model, "batch": batch, "recipe": name, "overrides": extra}
                try:
                    row["batch"] = int(batch) if batch != "auto" else measured_fitting_batch(
                        model, recipe, extra, budget,
                        functools.partial(probe_fits, model, recipe, extra, budget_bytes=budget))
                except Exception as e:
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
            for i, (name, recipe, _) in enumerate(variants):
                row = rows[name]
                if "error" in row:
                    continue
                graphed_before = any(r.trainer.plan.cuda_graphs for r in runs.values())
                try:
                    run, memory_peaks = start_run(model, row["batch"], recipe, row["overrides"], f"{tmp}/{i}",
                                                  args.warmup)
                    if memory_peaks["cuda_graphs"] and graphed_before:
                        # One CUDA-graph pool serves every graphed recipe of the process: this one's graphs
                        # reuse what the earlier one reserved, so no peak here is its own.
                        memory_peaks.update(peak_allocated_gb=None, peak_reserved_gb=None)
                    row.update(memory_peaks)
                    runs[name] = run
                    if rounds == 1:  # alone on the GPU: time it now and free it
                        run.timed(args.steps)
                        finish(runs.pop(name), row, args.profile, args.val)
                except Exception as e:  # OOM, or a mode that cannot run here: reported, the others go on
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    runs.pop(name, None)
                run = None
            with clock_log() as clocks:
                for r in range(rounds if len(runs) > 1 else 0):
                    for recipe in list(runs)[:: 1 if r % 2 == 0 else -1]:
                        runs[recipe].timed(args.steps // rounds)
            for row in rows.values():
                row["gpu_clocks"] = clocks.summary if len(runs) > 1 else None  # alone, a run was timed before
            for name, run in runs.items():
                if not run.round_ms:  # the other recipes failed: time this one alone
                    run.timed(args.steps)
                finish(run, rows[name], args.profile, args.val)
            runs.clear()
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
        for row in rows.values():
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "profile")}), flush=True)
            if "profile" in row:
                prof = row["profile"]
                print(f"  GPU timeline {prof['span_ms_per_step']:.2f} ms/step: kernel time {prof['gpu_ms_per_step']:.2f} "
                      f"in {prof['kernels_per_step']:.0f} kernels, "
                      f"idle between kernels {prof['idle_ms_per_step']:.2f} ms/step ({prof['long_idle_ms_per_step']:.2f} "
                      f"in gaps > {LONG_GAP_US} us); sync and copy calls/step inside the steps {prof['syncs_per_step']}")
                print("  idle ms/step by the work before the gap: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in sorted(prof["idle_ms_per_step_after"].items()))
                      + f" ({prof['memsets_per_step']:.0f} memsets/step)")
                if not span_matches_step(prof["span_ms_per_step"], row["ms_per_step"]):
                    print(f"  warning: the profile's GPU timeline is {prof['span_ms_per_step']:.2f} ms/step against "
                          f"{row['ms_per_step']:.2f} timed: its per-step figures are not a timed step's (the "
                          "profiler slowed a host-bound step, or the span took in other steps' work)")
                print("  phases, ms/step (each from an idle GPU): " + ", ".join(
                    f"{k} host {v['host_ms']:.2f} / wall {v['wall_ms']:.2f}" for k, v in prof["phases"].items()))
                for g in prof["largest_gaps"]:
                    print(f"  idle {g['us']:7.1f} us after {g['after'][:40]} / before {g['before'][:40]}; "
                          f"host in {g['host']}")
                for k in prof["top_kernels"]:
                    print(f"  {k['ms_per_step']:7.3f} ms {k['share']:6.1%} x{k['calls_per_step']:5.1f}  {k['kernel']}")
                for line in kernel_floors.format_table(prof["floors"]):
                    print(f"  {line}")
    Path(args.out).write_text(json.dumps(results, indent=1))

    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"steps={args.steps} after {args.warmup} warm-up")
    print(f"{'model':<10} {'B':>3} {'recipe':<28} {'ms/step':>8} {'tok/s':>10} {'MFU':>6} {'HFU':>6} {'peak alloc':>10} "
          f"{'peak resv':>9} {'loss@end':>8} {'val':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:<10} {r['batch']:>3} {r['recipe']:<28} {r['error']}")
            continue
        memory = (f"{'(shared graph pool)':>20}" if r["peak_reserved_gb"] is None else
                  f"{r['peak_allocated_gb']:>8.2f}GB{'*' if r['cuda_graphs'] else ' '}{r['peak_reserved_gb']:>7.2f}GB")
        val = f"{r['val_loss']:>7.4f}" if "val_loss" in r else f"{'':>7}"
        check = "" if passes_check(r) else \
            f"  first loss {r['first_loss']:.4f}, eager {r['first_loss_eager']:.4f}: FAILED"
        print(f"{r['model']:<10} {r['batch']:>3} {r['recipe']:<28} {r['ms_per_step']:>8.2f} "
              f"{r['tokens_per_s']:>10,.0f} {r['mfu']:>6.1%} {r['hfu']:>6.1%} {memory} {r['losses'][-1]:>8.4f} {val}{check}")
    if any(r.get("cuda_graphs") for r in results):
        print("* CUDA graphs: their memory pool is in the reserved figure, not in the allocated one")
    for model in args.models:
        ok = [r for r in results if r["model"] == model and "error" not in r]
        references = [r for r in ok if r["recipe"].startswith("reference")]
        ref, failed = baselines(references)  # the baseline at its best, among rows that compute the same loss
        mem_ref = memory_baseline(ref, references)
        if ref is not None and len(references) > 1:
            print(f"{model}: ratios against the fastest reference row that passed the first-loss check, "
                  f"{ref['recipe']!r}")
        if failed is not None:
            print(f"{model}: {failed['recipe']!r} ran faster, {failed['tokens_per_s']:,.0f} tokens/s, but its first "
                  f"loss {failed['first_loss']:.4f} is not its eager forward's {failed['first_loss_eager']:.4f}")
        for ours in (r for r in ok if not passes_check(r) and not r["recipe"].startswith("reference")):
            print(f"{model} {ours['recipe']}: its first loss {ours['first_loss']:.4f} is not its eager forward's "
                  f"{ours['first_loss_eager']:.4f}")
        for ours in (r for r in ok if ref and not r["recipe"].startswith("reference")):
            gap = max(abs(a - b) for a, b in zip(ref["losses"], ours["losses"]))
            per_round = [a / b * ours["batch"] / ref["batch"]  # tokens/s ratios of the rounds
                         for a, b in zip(ref["ms_per_round"], ours["ms_per_round"])]
            batches = "" if ref["batch"] == ours["batch"] else (
                f" (each at its batch: {ref['batch']}, {ours['batch']}; "
                f"{'the reference' if ref['batch'] < ours['batch'] else ours['recipe']} memory-limited)")
            if ours["peak_reserved_gb"] is None:
                peak = "memory not its own (it shares a graphed recipe's pool)"
            elif mem_ref is None:
                peak = "no reference that passed the check has memory peaks of its own"
            elif ours["cuda_graphs"]:  # the allocated counter misses the graphs' pool: what the process holds
                peak = (f"peak reserved {ours['peak_reserved_gb'] / mem_ref['peak_reserved_gb']:.3f}x "
                        f"{mem_ref['recipe']}'s reserved, {ours['peak_reserved_gb'] / mem_ref['peak_allocated_gb']:.3f}x "
                        "its allocated")
            else:
                peak = f"{ours['peak_allocated_gb'] / mem_ref['peak_allocated_gb']:.3f}x {mem_ref['recipe']}'s peak allocated"
            val_gap = (f"; validation loss gap {ours['val_loss'] - ref['val_loss']:+.4f}"
                       if "val_loss" in ours and "val_loss" in ref else "")
            print(f"{model} {ours['recipe']}: {ours['tokens_per_s'] / ref['tokens_per_s']:.3f}x the reference's "
                  f"tokens/s{batches} (rounds {min(per_round):.3f}-{max(per_round):.3f}), {peak}; "
                  f"max |loss gap| over {len(ref['losses'])} steps {gap:.3f}{val_gap}")
        clocks = next((r["gpu_clocks"] for r in ok if r.get("gpu_clocks")), None)
        if clocks:
            print(f"{model}: the GPU in the timed rounds: SM clock {clocks['sm_mhz_median']} MHz median "
                  f"({clocks['sm_mhz_min']}-{clocks['sm_mhz_max']}, at most {clocks['sm_mhz_limit']}), "
                  f"{clocks['power_w_median']:.0f} W of {clocks['power_w_limit']:.0f}, at the power cap in "
                  f"{clocks['power_capped_share']:.0%} of {clocks['samples']} samples")


if __name__ == "__main__":
    main()
