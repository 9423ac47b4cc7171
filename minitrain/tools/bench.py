"""What every benchmark shares, so that a figure means the same in each of them: GPU time per call, rounds
that alternate what they compare (a median and its spread), the copy ceiling measured one way, the
profiler's kernel time and launch count, the printed table, and the header of every result file.

A benchmark's own checks and arithmetic live in `minitrain/tools/benchmarks/`; `scripts/bench_*.py` are
their command lines. Measured figures live in docs/benchmarks.md and docs/results/, not here.
"""

from __future__ import annotations

import datetime
import functools
import json
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from minitrain.metrics import is_gpu_work

COPY_BYTES = 2**29  # per buffer: many times any GPU's L2, so the copy streams from and to HBM
MISSING = "—"  # a table cell with no value (not measured, no floor, a row that failed)


def kernel_ms(fn: Callable[[], object], grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> float:
    """Median ms per call of `fn` on the GPU: triton's do_bench (CUDA events around each call, the L2 cache
    flushed between calls, as many calls as its time budget holds); `grad_to_none`: tensors whose .grad is
    reset before each call, so that a backward does not time its accumulation."""
    import triton.testing

    return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")


def event_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """ms per call over `calls` calls of `fn` between two CUDA events: the wall time of the GPU's queue, with
    no sync between the calls, so a step that runs ahead of the GPU is timed as training runs it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def take_turns(figures: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each of `figures` measured once per round. They take turns, in the order given on even rounds and
    reversed on odd ones, so a machine that drifts during the measurement (clocks, heat) moves them all alike."""
    measured: dict[str, list[float]] = {name: [] for name in figures}
    for r in range(rounds):
        for name in list(figures)[:: 1 if r % 2 == 0 else -1]:
            measured[name].append(figures[name]())
    return measured


def alternating_rounds(runs: Mapping[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, list[float]]:
    """ms per call of each of `runs`, one figure per round (`event_ms` of `calls` calls), in `take_turns`."""
    return take_turns({name: functools.partial(event_ms, fn, calls) for name, fn in runs.items()}, rounds)


@dataclass(frozen=True)
class Spread:
    """A figure's median over rounds, with its lowest and highest round: the noise a comparison must beat."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))

    def format(self, spec: str) -> str:
        """`median (low-high)`, each in `spec` (e.g. ".3f")."""
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


def copy_ms(src: torch.Tensor) -> float:
    """Median ms of a device-to-device copy of `src`, its bytes read once and written once: the ceiling that a
    memory-bound kernel over the same bytes is set beside (the one copy every benchmark measures)."""
    dst = torch.empty_like(src)
    return kernel_ms(lambda: dst.copy_(src))


def copy_bytes_per_s(device: torch.device) -> float:
    """The device's copy bandwidth, bytes read plus bytes written per second, over COPY_BYTES."""
    with torch.cuda.device(device):
        return 2 * COPY_BYTES / (copy_ms(torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)) / 1e3)


def default_memory_budget() -> float:
    """The default trainer.memory_budget: the share of a GPU that a plan fills when the user sets none."""
    from minitrain.config import resolve
    from minitrain.cli import compose_config

    return resolve(compose_config(["trainer.out_dir=."])).trainer.memory_budget


def memory_budget_bytes() -> float:
    """The default trainer.memory_budget's share of this GPU: what a benchmark fits a recipe into, as a plan
    would."""
    return default_memory_budget() * torch.cuda.get_device_properties(0).total_memory


@dataclass(frozen=True)
class KernelCount:
    """What the profiler saw of one call: GPU time in kernels and copies, whatever the host did meanwhile (wall
    time also counts the host, which differs between machines), and how many kernels and copies it queued."""

    gpu_ms: float
    launches: float


def kernel_count(fn: Callable[[], object], calls: int = 3) -> KernelCount:
    """Per call of `fn`, over `calls` profiled calls after an untimed one."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if is_gpu_work(e))
    return KernelCount(gpu_ms=gpu_us / 1e3 / calls, launches=sum(map(is_gpu_work, prof.events())) / calls)


@dataclass(frozen=True)
class Column:
    """One column of a printed table: its header, the row's key (or a function of the row) and the value's
    format spec. A column with a spec holds numbers, right-aligned; one without holds text, left-aligned."""

    header: str
    value: Union[str, Callable[[Mapping], Any]]
    spec: str = ""

    def cell(self, row: Mapping) -> str:
        value = self.value(row) if callable(self.value) else row.get(self.value)
        return MISSING if value is None else f"{value:{self.spec}}"


def table(rows: Sequence[Mapping], columns: Sequence[Column],
          note: Optional[Callable[[Mapping], str]] = None) -> list[str]:
    """The lines of a table: the headers, then one line per row, each column as wide as its widest cell. A
    value that is None or missing prints as MISSING; `note` puts text after the last column (a row's
    error, a flag)."""
    cells = [[c.cell(row) for c in columns] for row in rows]
    widths = [max([len(c.header), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]

    def line(texts: Sequence[str], extra: str = "") -> str:
        aligned = [f"{t:>{w}}" if c.spec else f"{t:<{w}}" for t, w, c in zip(texts, widths, columns)]
        return (" ".join(aligned) + (f"  {extra}" if extra else "")).rstrip()

    return [line([c.header for c in columns]),
            *(line(texts, note(row) if note else "") for texts, row in zip(cells, rows))]


def run_header() -> dict[str, str]:
    """When, where and how a result was measured: the head of every result file, and of every record in
    docs/results/ (which adds the run's figures)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "command": shlex.join(["python", *sys.argv])}


def write_results(path: Union[str, Path], results: Mapping[str, Any]) -> None:
    """`results` as JSON, after `run_header()`'s fields."""
    Path(path).write_text(json.dumps({**run_header(), **results}, indent=1))
