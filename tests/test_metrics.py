"""The throughput meter (which steps it times, what it reports) and a CPU run's peak memory."""

import os

import pytest

from minitrain import metrics


def test_the_warm_up_steps_are_not_timed_and_the_clock_starts_on_a_drained_device(monkeypatch):
    now, synced = [0.0], []
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    meter = metrics.Throughput(tokens_per_step=100, model_flops_per_token=6, hardware_flops_per_token=8, peak=1e4,
                               untimed_steps=2, sync=lambda: synced.append(now[0]))
    now[0] += 30.0  # compiling
    meter.step()
    now[0] += 2.0  # an evaluation between the warm-up steps restarts the interval, not the warm-up's clock
    meter.restart()
    now[0] += 5.0  # recording CUDA graphs
    meter.step()
    assert synced == [37.0]  # once, after the last untimed step
    assert meter.read() == {"perf/warmup_s": 37.0}  # an interval of untimed steps only has no rate, but their time
    for _ in range(4):
        now[0] += 0.5
        meter.step()
    rates = meter.read()
    assert "perf/warmup_s" not in rates  # reported once
    assert rates["perf/step_ms"] == 500.0 and rates["perf/tokens_per_s"] == 200.0
    assert rates["perf/mfu"] == 200.0 * 6 / 1e4 and rates["perf/hfu"] == 200.0 * 8 / 1e4
    now[0] += 1.0
    meter.step()  # after the warm-up, every step counts; a read starts the next interval
    assert meter.read()["perf/step_ms"] == pytest.approx(1000.0)
    assert synced == [37.0]


def test_a_meter_without_warm_up_times_from_its_first_step(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    meter = metrics.Throughput(10, 1, 1, peak=None)
    now[0] += 2.0
    meter.step()
    assert meter.read() == {"perf/step_ms": 2000.0, "perf/tokens_per_s": 5.0}  # no peak: no MFU


def vm_hwm_bytes() -> int:
    """The kernel's peak resident size of this process, read from /proc (Linux)."""
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from /proc (Linux)")
def test_a_cpu_runs_memory_figure_is_the_peak_not_the_resident_size_at_the_log_step():
    """A step's activations come and go between two log steps: what is resident at the log step is not the peak."""
    import torch

    held = 400 * 2**20
    buffer = torch.ones(held // 4)  # touched: resident
    del buffer  # a large block goes back to the kernel (munmap): the resident size drops again
    current = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = metrics.memory_stats(torch.device("cpu"))["mem/peak_rss_gb"] * 1e9
    assert peak >= current + 0.9 * held
    assert peak == pytest.approx(vm_hwm_bytes(), rel=0.01)  # the same peak as the kernel's own record
