"""Throughput and memory numbers you can trust: tokens/s, MFU, the allocator's own counters, a CPU run's peak.

MFU = achieved model FLOP/s / peak FLOP/s of the device in the compute dtype, where model FLOPs per
token = 6·N (N: parameters without the position table, the tied head once) + 12·n_layer·n_embd·T
(attention scores and values), as in PaLM and nanoGPT. Recompute done by activation checkpointing is
not model work, so it never raises MFU.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Callable, Optional

import torch

# Dense peak FLOP/s per device by name fragment and compute dtype (vendor datasheets, SXM parts).
# fp32 means true fp32 matmuls; tf32 fp32 matmuls on TF32 tensor cores (trainer.tf32, the CUDA default).
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
}


def peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """The device's dense peak in `dtype`, or None when unknown (set trainer.peak_flops)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, table in PEAK_FLOPS.items():
        if fragment in name:
            return table[dtype]
    return None


def is_gpu_work(event) -> bool:
    """A profiler event that is a kernel or copy: not a `record_function` label, which the profiler also
    shows on the GPU's timeline (the trainer labels its phases)."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def peak_rss_bytes() -> int:
    """The largest resident size this process has had since it started (the kernel's own high-water mark): a
    CPU run's peak, which the resident size at a log step is not (activations come and go within a step)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocator counters in GB on CUDA (peaks since the last reset); on a CPU the process's peak resident size
    over its whole life (the interpreter, torch and the data included)."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        gb = 1e9
        return {
            "mem/allocated_gb": s.get("allocated_bytes.all.current", 0) / gb,
            "mem/reserved_gb": s.get("reserved_bytes.all.current", 0) / gb,
            "mem/peak_allocated_gb": s.get("allocated_bytes.all.peak", 0) / gb,
            "mem/peak_reserved_gb": s.get("reserved_bytes.all.peak", 0) / gb,
            "mem/alloc_retries": float(s.get("num_alloc_retries", 0)),
        }
    return {"mem/peak_rss_gb": peak_rss_bytes() / 1e9}


class Throughput:
    """Tokens/s, MFU and HFU over the steps between two log points (the device is synced at each).
    HFU counts the FLOPs the hardware ran, recompute included; MFU only the model's.

    The first `untimed_steps` steps of the meter's life are not training time: compilation, CUDA-graph
    recording and the allocator's first requests run in them. The clock starts after them, on a device
    that `sync` has drained; an interval with no timed step reports no rates. Their own wall time (from the
    meter's start to that drained device, whatever ran meanwhile) is reported once, as perf/warmup_s in the
    next read: what a user waits for the compile is part of a run's time to a loss (scripts/bench_recipe.py)."""

    def __init__(self, tokens_per_step: int, model_flops_per_token: int, hardware_flops_per_token: int,
                 peak: Optional[float], untimed_steps: int = 0, sync: Callable[[], None] = lambda: None):
        self.tokens_per_step, self.peak = tokens_per_step, peak
        self.model_flops, self.hardware_flops = model_flops_per_token, hardware_flops_per_token
        self.untimed_steps, self.sync, self.seen = untimed_steps, sync, 0
        self.t0, self.steps = time.perf_counter(), 0
        self.started, self.warmup_s = self.t0, None

    def step(self) -> None:
        self.seen += 1
        if self.seen == self.untimed_steps:
            self.sync()
            self.restart()
            self.warmup_s = self.t0 - self.started
        elif self.seen > self.untimed_steps:
            self.steps += 1

    def restart(self) -> None:
        """Start a new interval (after eval or a checkpoint save, which are not training time)."""
        self.t0, self.steps = time.perf_counter(), 0

    def read(self) -> dict[str, float]:
        """Rates since the last read (and the warm-up's time, once); call after a device sync so the time is real."""
        warmup = {} if self.warmup_s is None else {"perf/warmup_s": self.warmup_s}
        self.warmup_s = None
        if not self.steps:
            self.restart()
            return warmup
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        tokens_per_s = self.tokens_per_step * self.steps / dt
        out = {**warmup, "perf/step_ms": 1000 * dt / self.steps, "perf/tokens_per_s": tokens_per_s}
        if self.peak:
            out["perf/mfu"] = tokens_per_s * self.model_flops / self.peak
            out["perf/hfu"] = tokens_per_s * self.hardware_flops / self.peak
        self.restart()
        return out
