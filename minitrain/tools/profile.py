"""Where a training step's time goes, from the profiler's trace and from nvidia-smi: the GPU time of every
kernel beside its floor (minitrain/tools/kernel_floors.py), the GPU's idle gaps and what the host did in
them, the host syncs inside the steps, each phase's host and wall time, and the SM clock and board power
while the steps ran. `scripts/bench_step.py --profile` prints these for each recipe.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from minitrain.metrics import is_gpu_work
from minitrain.tools import kernel_floors

if TYPE_CHECKING:
    from minitrain.trainer import Trainer

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
    work = kernel_floors.step_work(trainer.model, plan.precision, plan.batch_size, trainer.plan.model.block_size,
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




def format_profile(prof: dict, timed_ms: float) -> list[str]:
    """The lines printed under a recipe's row: the GPU timeline's totals, idle by what it follows, a warning
    where the span is not one timed step, each phase's host and wall time, the largest gaps and kernels, and
    the kernel classes beside their floors."""
    lines = [f"GPU timeline {prof['span_ms_per_step']:.2f} ms/step: kernel time {prof['gpu_ms_per_step']:.2f} in "
             f"{prof['kernels_per_step']:.0f} kernels, idle between kernels {prof['idle_ms_per_step']:.2f} ms/step "
             f"({prof['long_idle_ms_per_step']:.2f} in gaps > {LONG_GAP_US} us); sync and copy calls/step inside "
             f"the steps {prof['syncs_per_step']}",
             "idle ms/step by the work before the gap: " + ", ".join(
                 f"{k} {v:.2f}" for k, v in sorted(prof["idle_ms_per_step_after"].items()))
             + f" ({prof['memsets_per_step']:.0f} memsets/step)"]
    if not span_matches_step(prof["span_ms_per_step"], timed_ms):
        lines.append(f"warning: the profile's GPU timeline is {prof['span_ms_per_step']:.2f} ms/step against "
                     f"{timed_ms:.2f} timed: its per-step figures are not a timed step's (the profiler slowed a "
                     "host-bound step, or the span took in other steps' work)")
    lines.append("phases, ms/step (each from an idle GPU): " + ", ".join(
        f"{k} host {v['host_ms']:.2f} / wall {v['wall_ms']:.2f}" for k, v in prof["phases"].items()))
    lines += [f"idle {g['us']:7.1f} us after {g['after'][:40]} / before {g['before'][:40]}; host in {g['host']}"
              for g in prof["largest_gaps"]]
    lines += [f"{k['ms_per_step']:7.3f} ms {k['share']:6.1%} x{k['calls_per_step']:5.1f}  {k['kernel']}"
              for k in prof["top_kernels"]]
    return lines + kernel_floors.format_table(prof["floors"])


def format_clocks(clocks: dict) -> str:
    """One line: the SM clock and board power over `clock_summary`'s samples."""
    return (f"SM clock {clocks['sm_mhz_median']} MHz median ({clocks['sm_mhz_min']}-{clocks['sm_mhz_max']}, at most "
            f"{clocks['sm_mhz_limit']}), {clocks['power_w_median']:.0f} W of {clocks['power_w_limit']:.0f}, at the "
            f"power cap in {clocks['power_capped_share']:.0%} of {clocks['samples']} samples")
