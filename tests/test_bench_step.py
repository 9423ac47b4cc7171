"""The step benchmark's logic that runs without a GPU (minitrain.tools.benchmarks.step, and the trace analysis
and clock summary of minitrain.tools.profile): the auto batch, the baselines, the idle-gap report."""

import contextlib
import dataclasses
import subprocess
from types import SimpleNamespace

import pytest
import torch

from minitrain.cli import compose_config
from minitrain.config import resolve
from minitrain.memory import Candidate, predict
from minitrain.plan import model_config_for
from minitrain.precision import resolve_precision
from minitrain.tools import profile
from minitrain.tools.benchmarks import step


def test_auto_batch_is_the_largest_the_model_fits():
    extra = ["checkpointing=full"]
    cfg = resolve(compose_config(["model=gpt2-1.5b", "trainer.out_dir=.", *step.RECIPES["minitrain"], *extra]))
    model_cfg = model_config_for(cfg, cfg.data.vocab_size, torch.device("cuda"))
    precision = resolve_precision(cfg.precision, torch.device("cuda"))

    def peak(batch):
        return predict(Candidate(model_cfg, precision, batch, cfg.checkpointing)).peak

    assert peak(64) < peak(96) < peak(128)  # activations dominate at these batches
    assert step.largest_fitting_batch("gpt2-1.5b", "minitrain", extra, peak(96)) == 96
    assert step.largest_fitting_batch("gpt2-1.5b", "minitrain", extra, peak(96) - 1) == 64
    # the reference recipe (fp32 params, full logits, no checkpointing) fits far fewer sequences
    assert step.largest_fitting_batch("gpt2-1.5b", "reference", [], peak(96)) <= 16


def _event(start, end, name, device, annotation=False, id=0, linked=0, stream=7):
    return profile.TraceEvent(name, device, start, end, id, linked, annotation, stream)


GPU, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _launched(start, end, name, launch_at, op, stream=7):
    """A kernel, the op that queued it and the runtime call in between (its own id is CUPTI's, not an op's)."""
    return [_event(launch_at, launch_at + 1, f"aten::op{op}", CPU, id=op),
            _event(launch_at, launch_at + 1, "cudaLaunchKernel", CPU, id=1000 + op, linked=op),
            _event(start, end, name, GPU, linked=op, stream=stream)]


def _marks(open_end, close_start):
    """The two one-element kernels of the "bench.window" ranges around the traced steps (their ops queued
    long before they run: the host is ahead of the GPU)."""
    events = []
    for i, (start, end) in enumerate([(open_end - 1, open_end), (close_start, close_start + 1)]):
        op = 10**9 + i  # no other op's id
        events += [_event(-10 + i, -9 + i, profile.WINDOW_MARK, CPU)]
        events += _launched(start, end, "vectorized_elementwise_kernel", launch_at=-10 + i, op=op)
    return events


def test_idle_gaps_between_overlapping_kernels_name_the_host_work():
    events = [_event(0, 101, "bench.step", CPU), _event(0, 100, "minitrain.optimizer", CPU),
              _event(31, 39, "aten::view", CPU),
              _event(0, 50, "minitrain.forward", GPU, annotation=True)]  # a label on the GPU timeline, not work
    kernels = [(0, 10, "a"), (15, 20, "b"), (18, 30, "c"), (12, 16, "d"),  # c overlaps b
               (40, 41, "e"), (41 + profile.LONG_GAP_US, 70, "f")]
    for i, (start, end, name) in enumerate(kernels):
        events += _launched(start, end, name, launch_at=i, op=i + 1)
    marked = events + _marks(0, 70)
    idle = profile.idle_gaps(marked, profile.step_window(marked), top=1)
    # 10..12 and 30..40 (d, b and c together keep the GPU busy 12..30), then a gap of exactly LONG_GAP_US
    assert idle["idle_ms"] == (2 + 10 + profile.LONG_GAP_US) / 1e3
    assert idle["long_idle_ms"] == 0  # no gap is longer than a launch's latency
    assert idle["largest"] == [{"us": profile.LONG_GAP_US, "after": "e", "before": "f",
                                "host": "minitrain.optimizer < bench.step"}]
    marked = events + _launched(70 + profile.LONG_GAP_US + 1, 100, "g", launch_at=50, op=99) + _marks(0, 100)
    assert profile.idle_gaps(marked, profile.step_window(marked))["long_idle_ms"] == (
        (profile.LONG_GAP_US + 1) / 1e3)


def test_idle_is_split_by_the_work_the_gap_follows():
    """A memset before a cuBLAS or cuDNN kernel leaves a longer gap than a kernel does: the split says how much
    of the idle the memsets cost."""
    events = [_event(0, 100, "bench.step", CPU)]
    work = [(0, 10, "gemm"), (12, 13, "Memset (Unknown)"), (17, 20, "gemm"), (21, 22, "Memcpy DtoD"),
            (25, 30, "Memset (Unknown)"), (36, 40, "sdpa")]
    for i, (start, end, name) in enumerate(work):
        events += _launched(start, end, name, launch_at=i, op=i + 1)
    events += _marks(0, 40)
    idle = profile.idle_gaps(events, profile.step_window(events))
    assert idle["after_ms"] == {"kernel": 3 / 1e3, "memset": 10 / 1e3, "copy": 3 / 1e3}
    assert idle["idle_ms"] == 16 / 1e3


def test_the_window_holds_what_ran_between_the_marks():
    """The host runs ahead, so the trace opens while the GPU still runs the warm-up steps' kernels (the opening
    mark runs after them, on the same stream). A kernel's link to the op that queued it cannot place it: a CUDA
    graph's kernels link to its launch, the optimizer's Triton launches to no op at all."""
    events = [_event(100, 300, "bench.step", CPU)]
    events += [_event(90, 150, "warm-up tail", GPU, linked=1)]  # a warm-up step's kernel, still queued
    events += _launched(152, 190, "graph kernel", launch_at=110, op=7)
    events += [_event(200, 210, "_adamw_kernel", GPU, linked=5000)]  # links to no op in the trace
    events += _marks(151, 215)
    window = profile.step_window(events)
    assert window == (151, 215)
    assert [e.name for e in profile.work_in_window(events, window)] == ["graph kernel", "_adamw_kernel"]
    idle = profile.idle_gaps(events, window)
    assert idle["idle_ms"] == (1 + 10 + 5) / 1e3  # after the opening mark, 190..200, before the closing one
    assert [(g["after"], g["before"]) for g in idle["largest"][:1]] == [("graph kernel", "_adamw_kernel")]


def test_a_trace_without_both_marks_is_refused():
    events = _marks(151, 215)[:-1]  # the closing mark's kernel did not make it into the trace
    with pytest.raises(RuntimeError, match="two bench.window kernels"):
        profile.step_window(events)


def test_the_clock_summary_reads_nvidia_smis_samples():
    """Under the step an H200 sits at its power limit: the summary says at what clock, and how often capped."""
    samples = ("1695, 1980, 692.64, 700.00, 0x0000000000000004\n"
               "1980, 1980, 467.84, 700.00, 0x0000000000000001\n"  # idle, not capped
               "[N/A], 1980, 500.00, 700.00, 0x0000000000000000\n"
               "1470, 1980, 699.10, 700.00, 0x0000000000000005\n"
               "1700, 19")  # cut short when the sampler stopped
    assert profile.clock_summary(samples) == {
        "samples": 3, "sm_mhz_median": 1695, "sm_mhz_min": 1470, "sm_mhz_max": 1980, "sm_mhz_limit": 1980,
        "power_w_median": 692.64, "power_w_limit": 700.0, "power_capped_share": 2 / 3}
    assert profile.clock_summary("") is None


def test_a_profile_whose_span_is_not_one_step_is_flagged():
    """The graphed runs' span of 2026-12-01 held 1.3 steps of work per step (40.6 ms against 30.9 timed)."""
    assert profile.span_matches_step(31.5, 30.9) and profile.span_matches_step(28.0, 30.9)
    assert not profile.span_matches_step(40.6, 30.9) and not profile.span_matches_step(24.0, 30.9)


def test_a_rows_mfu_and_hfu_come_from_the_trainers_meter(make_cfg):
    """HFU counts the recomputed forward; both over the peak the trainer would log against."""
    from minitrain.trainer import Trainer

    trainer = Trainer(make_cfg("checkpointing=full", "trainer.peak_flops=1e12", "trainer.micro_batch=8"),
                      progress=False)
    try:
        run = step.Run(trainer, 0, 0)
        run.round_ms, run.losses = [40.0, 60.0], [torch.tensor(1.0)]
        row = run.summary()
        T, flops = 64, trainer.model.flops_per_token(64)
        assert row["tokens_per_s"] == 8 * T / 0.05
        assert row["mfu"] == row["tokens_per_s"] * flops / 1e12
        assert row["hfu"] > row["mfu"] * 1.2  # full recompute reruns every block's forward
    finally:
        trainer.close()




def test_the_profile_window_holds_the_steps_after_its_warm_up_only(make_cfg, monkeypatch):
    """The warm-up steps refill the queue the profiler's start drained; they must not be in the trace."""
    from minitrain.trainer import Trainer

    trainer = Trainer(make_cfg(), progress=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the window's last sync, on a CPU
    steps_run = []
    train_step = trainer.train_step
    monkeypatch.setattr(trainer.parts, "train_step", lambda s: steps_run.append(s) or train_step(s))
    prof = profile.traced_steps(trainer, first=5, steps=3)
    trainer.close()
    assert steps_run == list(range(5, 5 + profile.PROFILE_WARMUP_STEPS + 3))
    averages = {e.key: e.count for e in prof.key_averages()}
    assert averages["bench.step"] == 3
    assert averages["minitrain.optimizer"] == 3  # no op of a warm-up step is in the trace
    steps = [e for e in profile.trace_events(prof) if e.name == "bench.step"]  # the kineto records read too
    assert len(steps) == 3 and all(0 < e.start < e.end for e in steps)


def test_the_profile_sets_every_kernel_of_the_step_beside_its_floor(make_cfg, monkeypatch):
    """All GPU kernels, not the top 25, go into the table; the floors are of the optimizer step's whole batch
    (not a micro-batch's) against the device's ceilings, measured once."""
    from minitrain.tools import kernel_floors
    from minitrain.trainer import Trainer

    trainer = Trainer(make_cfg("trainer.micro_batch=4"), progress=False)  # batch 8 in 2 micro-batches
    trainer.close()
    ceilings = kernel_floors.Ceilings(copy_bytes_per_s=1e12, gemm_flops_per_s=1e14)
    monkeypatch.setattr(kernel_floors, "measure_ceilings", lambda device: ceilings)
    steps = 4
    events, at = [_event(0, 10**9, "bench.step", CPU)], 0
    for name, calls, us in [*((f"triton_poi_fused_add_{i}", 8, 1000.0 * (40 - i)) for i in range(29)),
                            ("nvjet_sm90_tst_128x128_64x6_2x4_h_bz_NTT", 3 * steps, 400.0)]:  # 30th by time
        for _ in range(calls):
            events += _launched(at, at + us / calls, name, launch_at=at, op=len(events) + 1)
            at += us / calls
    events += _marks(0, at)
    monkeypatch.setattr(profile, "traced_steps", lambda trainer, first, steps: None)
    monkeypatch.setattr(profile, "trace_events", lambda prof: events)
    prof = profile.profile_steps(trainer, first=0, steps=steps)
    floors = prof["floors"]

    assert (floors["copy_bytes_per_s"], floors["gemm_flops_per_s"]) == (1e12, 1e14)
    rows = {r["class"]: r for r in floors["rows"]}
    gemm = rows[kernel_floors.GEMM]
    assert (gemm["kernels"], gemm["calls_per_step"]) == (1, 3)
    assert gemm["ms_per_step"] == pytest.approx(0.1)  # 400 us over 4 steps
    work = kernel_floors.step_work(trainer.model, trainer.plan.precision, 8, 64, compiled=False)  # eager on a CPU
    assert gemm["floor_ms_per_step"] == work[kernel_floors.GEMM].seconds(ceilings) * 1e3
    assert rows[kernel_floors.ADAMW]["floor_ms_per_step"] == work[kernel_floors.ADAMW].seconds(ceilings) * 1e3
    assert rows[kernel_floors.LAYER_NORM_FORWARD]["floor_ms_per_step"] is None  # eager: the adds run apart
    assert rows[kernel_floors.OTHER]["kernels"] == 29

    prof["phases"] = {"forward": {"host_ms": 1.0, "wall_ms": 2.0}}
    span = prof["span_ms_per_step"]
    printed = profile.format_profile(prof, timed_ms=span)
    assert not any(line.startswith("warning") for line in printed)
    assert "forward host 1.00 / wall 2.00" in printed[2] and printed[-len(floors["rows"]) - 2].startswith("floors")
    assert any(line.startswith("warning") for line in profile.format_profile(prof, timed_ms=span / 1.3))


def test_auto_batch_is_measured_from_the_memory_models_guess(monkeypatch):
    """The memory model's guess is only where the search starts: a compiled step may fit more, or less."""
    candidates = step.CANDIDATE_BATCHES
    for guess, largest_that_runs in [(32, 48), (32, 32), (64, 24), (512, 512)]:
        monkeypatch.setattr(step, "largest_fitting_batch", lambda *args, g=guess: g)
        probed = []

        def fits(batch, limit=largest_that_runs):
            probed.append(batch)
            return batch <= limit

        assert step.measured_fitting_batch("m", "reference", [], 1.0, fits) == largest_that_runs
        assert probed[0] == guess  # the guess is tried first, and no candidate twice
        assert len(probed) == len(set(probed)) <= abs(candidates.index(guess) - candidates.index(largest_that_runs)) + 2
    with pytest.raises(RuntimeError, match="not even a batch of 1 fits"):
        step.measured_fitting_batch("m", "reference", [], 1.0, lambda batch: False)


@pytest.mark.parametrize("returncode, stdout, stderr, expected", [
    (0, '{"peak_reserved_bytes": 90}\n', "", True),
    (0, '{"peak_reserved_bytes": 110}\n', "", False),
    (1, "", "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
    (1, "", "Traceback ...\nminitrain.compile_check.CompileMismatchError: torch.compile's first step gave loss 11.1",
     "failed, not for memory: minitrain.compile_check.CompileMismatchError: torch.compile's first step"),
], ids=["fits", "over-budget", "oom", "another-failure"])
def test_a_probe_that_fails_for_another_reason_than_memory_says_so(monkeypatch, returncode, stdout, stderr, expected):
    """A recipe whose step fails for a reason a smaller batch keeps (the first-loss check) is no 'does not fit':
    probing down from it would compile every smaller candidate in turn, and report the wrong reason."""
    monkeypatch.setattr(step.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, returncode, stdout, stderr))
    if isinstance(expected, bool):
        assert step.probe_fits("m", "reference", [], 32, budget_bytes=100, command=["probe"]) is expected
    else:
        with pytest.raises(RuntimeError, match=expected):
            step.probe_fits("m", "reference", [], 32, budget_bytes=100, command=["probe"])


def test_a_probe_runs_a_step_the_memory_model_would_refuse(data_cache, monkeypatch):
    """What fits is the allocator's call: the child's plan must not stop a batch its prediction is over."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # a CPU stands in for the GPU
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 12345)
    assert step.probe("tiny:reference:2", [f"data.cache_dir={data_cache}", "model.block_size=32", "trainer.device=cpu",
                                           "trainer.compile=false", "trainer.memory_budget=1e-6"]  # 25 kB of this RAM
                      ) == {"peak_reserved_bytes": 12345}


def test_the_baseline_is_the_fastest_reference_that_computes_the_same_loss():
    from minitrain.compile_check import TOLERANCE as tol

    def row(name, tokens_per_s, first_loss):
        return {"recipe": name, "tokens_per_s": tokens_per_s, "first_loss": first_loss, "first_loss_eager": 11.0}

    compiled, eager = row("reference", 50.0, 11.0 - 2 * tol), row("reference eager", 40.0, 11.0)
    assert step.baselines([compiled, eager]) == (eager, compiled)
    slow_and_off = row("reference graphed", 30.0, 11.0 + 2 * tol)
    assert step.baselines([eager, slow_and_off]) == (eager, None)  # a slower failure is not reported
    within = row("reference", 50.0, 11.0 + 0.9 * tol)
    assert step.baselines([within, eager]) == (within, None)
    assert step.baselines([compiled]) == (None, compiled)


def test_memory_is_set_beside_a_reference_that_computes_the_same_loss():
    """gpt2-774m: the compiled reference fails the first-loss check, so its smaller peak is no baseline."""
    from minitrain.compile_check import TOLERANCE as tol

    def row(name, tokens_per_s, first_loss, reserved):
        return {"recipe": name, "tokens_per_s": tokens_per_s, "first_loss": first_loss, "first_loss_eager": 11.0,
                "peak_reserved_gb": reserved}

    compiled, eager = row("reference", 50.0, 11.0 - 2 * tol, 37.7), row("reference eager", 40.0, 11.0, 48.4)
    ref, _ = step.baselines([compiled, eager])
    assert step.memory_baseline(ref, [compiled, eager]) is eager
    graphed = row("reference graphed", 60.0, 11.0, None)  # built after ours: its peaks are our pool's
    ref, _ = step.baselines([graphed, eager])
    assert ref is graphed and step.memory_baseline(ref, [graphed, eager]) is eager
    assert step.memory_baseline(None, [compiled]) is None


def test_every_recipes_batch_is_probed_before_this_process_holds_gpu_memory(monkeypatch):
    """The probes run in child processes on the same GPU: one that runs while a recipe's trainer (or the cache
    it leaves) holds this process's memory finds too little free and reads 'does not fit' at every batch."""
    events, probed_extras = [], []

    def probe(model, recipe, extra, budget, fits):
        events.append(("probe", recipe))
        probed_extras.append(extra)
        return 8

    def start(model, batch, recipe, extra, out_dir, warmup, graphed_before):
        events.append(("start", recipe))
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(step, "measured_fitting_batch", probe)
    monkeypatch.setattr(step, "start_run", start)
    monkeypatch.setattr(profile, "clock_log", lambda: contextlib.nullcontext(SimpleNamespace(summary=None)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=100))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    how = step.Comparison(reference_eager=True, reference_graphs=True, reference_extra=("checkpointing=full",))
    rows = step.measure("gpt2-124m", "auto", how, probe_command=["probe"])
    assert events == [("probe", "minitrain")] + [("probe", "reference")] * 3 + \
        [("start", "minitrain")] + [("start", "reference")] * 3
    assert [r["recipe"] for r in rows] == ["minitrain", "reference", "reference graphed", "reference eager"]
    assert [r["batch"] for r in rows] == [8] * 4 and all("no GPU here" in r["error"] for r in rows)
    assert ["checkpointing=full" in extra for extra in probed_extras] == [False, True, True, True]
    assert sum("no GPU here" in line for line in step.report(rows, ["gpt2-124m"])) == 4  # each row says why

    events.clear()  # a reference known to fail its check compiled is left out, not built and probed
    rows = step.measure("gpt2-124m", "auto", dataclasses.replace(how, reference_compiled=False), probe_command=["p"])
    assert [r["recipe"] for r in rows] == ["minitrain", "reference graphed", "reference eager"]


def test_the_rows_overrides_name_the_compile_flag_first_and_each_rows_own_last():
    """Each row's overrides in order: a later one wins, so the eager reference's compile=false must come after
    the shared flag, and an ablation's after minitrain's own."""
    how = step.Comparison(minitrain_extra=("trainer.seed=3",), reference_extra=("checkpointing=full",),
                          reference_eager=True, ablate=("model.gelu=torch loss=torch",), big_checkpointing="full")
    rows = {v.name: v for v in how.variants("gpt2-1.5b")}
    assert rows["minitrain"] == step.Variant("minitrain", "minitrain",
                                             ("trainer.compile=True", "trainer.seed=3", "checkpointing=full"))
    assert rows["reference eager"].extra == ("trainer.compile=True", "checkpointing=full", "trainer.compile=false")
    assert rows["minitrain model.gelu=torch loss=torch"].extra == (*rows["minitrain"].extra, "model.gelu=torch",
                                                                   "loss=torch")
    big = step.Comparison(big_checkpointing="full")
    assert "checkpointing=full" in big.variants("gpt2-774m")[0].extra
    assert "checkpointing=full" not in big.variants("gpt2-124m")[0].extra


def test_the_report_sets_each_of_our_rows_beside_the_baseline():
    def row(recipe, tokens_per_s, ms_per_round, reserved, allocated, graphs, first_loss=11.0):
        return {"model": "m", "batch": 16, "recipe": recipe, "tokens_per_s": tokens_per_s, "ms_per_step": 1.0,
                "ms_per_round": ms_per_round, "mfu": 0.5, "hfu": 0.5, "peak_reserved_gb": reserved,
                "peak_allocated_gb": allocated, "cuda_graphs": graphs, "losses": [11.0, 10.0], "first_loss": first_loss,
                "first_loss_eager": 11.0}

    ours = row("minitrain", 110.0, [10.0, 8.0], 7.5, 6.0, True)
    ours["losses"] = [11.0, 10.25]
    reference = row("reference", 100.0, [11.0, 9.6], 10.0, 9.0, False)
    lines = step.report([ours, reference], ["m"])
    assert lines[0].split()[:3] == ["model", "B", "recipe"] and "6.00*" in lines[1]
    assert ("m minitrain: 1.100x the reference's tokens/s (rounds 1.100-1.200), peak reserved 0.750x reference's "
            "reserved, 0.833x its allocated; max |loss gap| over 2 steps 0.250") in lines
