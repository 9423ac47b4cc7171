"""The fp8 benchmark's logic that runs without a GPU (minitrain.tools.benchmarks.fp8's speed half): the settings
both precisions share, the build order and clean-up, the time limit, the report. Its quality half is checked on
real runs in tests/test_fp8.py."""

from types import SimpleNamespace

import pytest
import torch

from minitrain.tools import bench
from minitrain.tools.benchmarks import fp8, step

from conftest import fake_gpu

H200 = 143_771_566_080  # bytes
H100 = 85_020_000_000  # an H100 80GB HBM3, as torch reports it to 0.01 GB


def test_both_precisions_run_bf16s_whole_gpu_policy_at_the_micro_batch_that_fits_their_share(monkeypatch):
    """Within 45% of an H200 bf16's own plan for gpt2-1.5b would recompute (selective); on the whole GPU, as a user
    runs it, it does not: the benchmark keeps the user's policy and halves the micro-batch until both fit."""
    fake_gpu(monkeypatch, bf16=True, memory=H200)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.shared_settings("gpt2-1.5b", 0.47, []) == [
        "trainer.micro_batch=16", "checkpointing=none", "checkpointing.every_k=2"]
    assert fp8.shared_settings("gpt2-1.5b", 0.45, []) == [
        "trainer.micro_batch=8", "checkpointing=none", "checkpointing.every_k=2"]
    # an explicit policy wins, and the micro-batch is the largest that fits with it
    assert fp8.shared_settings("gpt2-1.5b", 0.45, ["checkpointing=full"]) == [
        "trainer.micro_batch=32", "checkpointing=full", "checkpointing.every_k=2"]
    # on an H100 a user's bf16 recomputes (selective), under which fp8 keeps its float8 copies beside the outputs
    # that selective saves: fp8 is the tighter, at half bf16's micro-batch of 8
    fake_gpu(monkeypatch, bf16=True, memory=H100)
    assert fp8.shared_settings("gpt2-1.5b", 0.47, []) == [
        "trainer.micro_batch=4", "checkpointing=selective", "checkpointing.every_k=2"]


class FakeTrainer:
    def __init__(self, cfg, graphs: bool, closed: list):
        self.cfg, self.closed = cfg, closed
        linears = ("mlp.c_fc",) if cfg.precision.name == "fp8" else ()
        self.plan = SimpleNamespace(cuda_graphs=graphs, float8_linears=linears, micro_batch=16, grad_accum=2,
                                    checkpointing=SimpleNamespace(policy=SimpleNamespace(value="none")),
                                    memory=SimpleNamespace(peak=50e9))

    def throughput(self):
        return SimpleNamespace(tokens_per_step=1000, model_flops=1.0, hardware_flops=1.0, peak=1e6)

    def close(self):
        self.closed.append(self.cfg.precision.name)


def fake_start(built: list, closed: list, fail: str = ""):
    """step.start_trainer's stand-in: records what it builds, in order, and whether a graphed trainer came first."""
    def start(make, warmup, graphed_before):
        trainer = make()
        built.append((trainer.cfg.precision.name, graphed_before))
        if trainer.cfg.precision.name == fail:
            raise RuntimeError(f"{fail} does not fit")
        run = step.Run(trainer, 0, 0)
        run.losses = [torch.tensor(11.0), torch.tensor(10.0 if fail else 10.5)]
        return run, {"first_loss": 11.0, "first_loss_eager": 11.0, "peak_reserved_gb": None if graphed_before else 40.0}
    return start


@pytest.fixture
def measured(monkeypatch):
    built, closed = [], []
    monkeypatch.setattr(fp8, "shared_settings", lambda model, budget, extra: ["trainer.micro_batch=16"])
    monkeypatch.setattr(fp8, "Trainer", lambda cfg, progress: FakeTrainer(cfg, graphs=True, closed=closed))
    monkeypatch.setattr(step, "start_trainer", fake_start(built, closed))
    monkeypatch.setattr(bench, "alternating_rounds", lambda runs, rounds, calls: {
        "fp8": [8.0, 10.0], "bf16": [10.0, 11.0]} if list(runs) == ["fp8", "bf16"] else pytest.fail(list(runs)))
    return built, closed


def test_fp8_is_built_first_each_trainer_with_the_shared_settings_and_both_closed(measured):
    built, closed = measured
    rows = fp8.measure("gpt2-124m", 0.47, warmup=3, rounds=2, steps=4, extra=["trainer.micro_batch=8"])
    assert built == [("fp8", False), ("bf16", True)]  # bf16's graphs reuse fp8's pool: only fp8's peak is its own
    assert closed == ["fp8", "bf16"]
    assert [(r["precision"], r["micro_batch"], r["ms_per_round"]) for r in rows] == [
        ("fp8", 16, [8.0, 10.0]), ("bf16", 16, [10.0, 11.0])]
    assert rows[0]["float8_linears"] == ["mlp.c_fc"] and rows[0]["predicted_peak_gb"] == 50.0
    assert rows[0]["tokens_per_s"] == 1000 / 0.009  # the median round


def test_the_settings_come_after_the_benchmarks_own_and_the_users_extra_after_them(monkeypatch, measured):
    seen = []
    monkeypatch.setattr(fp8, "compose_config", lambda overrides: seen.append(overrides) or compose(overrides))
    fp8.measure("gpt2-124m", 0.47, warmup=3, rounds=2, steps=4, extra=["trainer.micro_batch=8"])
    for overrides in seen:
        assert overrides[-2:] == ["trainer.micro_batch=16", "trainer.micro_batch=8"]
        assert "trainer.memory_budget=0.47" in overrides


def compose(overrides):
    from minitrain.cli import compose_config

    return compose_config(overrides)


def test_a_model_that_fails_frees_its_trainers_and_the_next_goes_on_until_the_time_limit(monkeypatch, measured):
    built, closed = measured
    monkeypatch.setattr(step, "start_trainer", fake_start(built, closed, fail="bf16"))
    clock = iter([0.0, 0.0, 0.0, 10.0, 10.0, 10.0, 350.0, 350.0])  # each model's check, start and end
    monkeypatch.setattr(fp8.time, "monotonic", lambda: next(clock))
    models = list(fp8.measure_models(["gpt2-124m", "gpt2-350m", "gpt2-774m"], 300, memory_budget=0.47, warmup=3,
                                     rounds=2, steps=4, extra=[]))
    assert closed == ["fp8", "fp8"]  # the one that started, though its bf16 failed
    assert [r["error"] for rows in models for r in rows] == ["RuntimeError: bf16 does not fit"] * 2 + \
        [fp8.NOT_MEASURED]
    assert models[0][0]["model_s"] == 10.0
    assert "RuntimeError: bf16 does not fit" in "\n".join(fp8.speed_report(models[0]))


def test_the_report_sets_fp8_beside_bf16_round_by_round():
    def row(precision, ms_per_round, losses, reserved):
        return {"model": "gpt2-1.5b", "precision": precision, "float8_linears": [], "micro_batch": 16,
                "grad_accum": 2, "checkpointing": "none", "tokens_per_s": 1.0, "mfu": 0.5, "predicted_peak_gb": 50.0,
                "peak_reserved_gb": reserved, "ms_per_round": ms_per_round, "losses": losses, "first_loss": 11.0,
                "first_loss_eager": 11.0, "model_s": 100.0}

    rows = [row("fp8", [10.0, 8.0, 9.0], [11.0, 10.0, 9.5], 40.0), row("bf16", [11.0, 10.0, 9.9], [11.0, 10.25, 9.5],
                                                                       None)]
    lines = fp8.speed_report(rows)
    assert lines[0].split()[:3] == ["model", "precision", "micro"] and "16 x 2" in lines[1]
    assert "(memory: fp8's graph pool)" in lines[2]
    assert lines[3:] == ["gpt2-1.5b fp8: 1.100x bf16's tokens/s (rounds 1.100-1.250); peak reserved 40.00 GB, "
                         "predicted 50.00 (1.250x); max |loss gap| to bf16 over 3 steps 0.2500"]
    rows[0]["first_loss"] = 11.5
    assert "first loss 11.5000, eager 11.0000: FAILED" in fp8.speed_report(rows)[1]
    assert len(fp8.speed_report(rows[:1])) == 2  # no bf16 row: no ratio


def test_the_quality_report_sets_each_fp8_run_beside_bf16_of_its_seed_and_bf16s_spread_over_seeds():
    def run(precision, seed, val, skipped=0, finite=True):
        return {"dir": f"{precision}-{seed}", "precision": precision, "seed": seed, "val": val, "skipped": skipped,
                "finite": finite, "last_step": 1000,
                "overrides": ["model=gpt2-124m", f"precision={precision}", f"trainer.seed={seed}"]}

    runs = [run("bf16", 1, {500: 4.0, 1000: 3.0}), run("fp8", 1, {500: 4.2, 1000: 3.03}, skipped=2),
            run("fp8", 2, {500: 4.1, 1000: 3.12}, finite=False), run("bf16", 2, {500: 4.1, 1000: 3.2})]
    assert fp8.relative_gaps(runs[1], runs[0]) == pytest.approx({500: 0.05, 1000: 0.01})
    lines = fp8.quality_report(runs)
    assert lines[:3] == ["seed 1 bf16: 1000 steps, 0 skipped, finite | val 500:4.0000 1000:3.0000",
                         "seed 1 fp8: 1000 steps, 2 skipped, finite | val 500:4.2000 1000:3.0300",
                         "  vs bf16: 500:+5.00% 1000:+1.00% (largest |gap| 5.00%)"]
    assert "seed 2 fp8: 1000 steps, 0 skipped, NON-FINITE LOSS | val 500:4.1000 1000:3.1200" in lines
    assert lines[-2:] == ["fp8: final validation loss against bf16's of the same seed: +1.00%, -2.50%",
                          "bf16's final validation loss over 2 seeds: 3.0000-3.2000 (6.67% apart)"]


def test_a_noise_control_sets_a_second_bf16_run_beside_the_first_of_its_seed():
    """bf16 twice with another GELU kernel (model.gelu=fused,torch): labelled by the override that differs, the
    second compared with the first."""
    def run(gelu, val):
        return {"dir": gelu, "precision": "bf16", "seed": 1337, "val": val, "skipped": 0, "finite": True,
                "last_step": 1000, "overrides": ["model=gpt2-350m", "precision=bf16", f"model.gelu={gelu}"]}

    lines = fp8.quality_report([run("fused", {500: 4.0, 1000: 3.0}), run("torch", {500: 3.9, 1000: 3.03})])
    assert lines == ["seed 1337 bf16 model.gelu=fused: 1000 steps, 0 skipped, finite | val 500:4.0000 1000:3.0000",
                     "seed 1337 bf16 model.gelu=torch: 1000 steps, 0 skipped, finite | val 500:3.9000 1000:3.0300",
                     "  vs bf16 model.gelu=fused: 500:-2.50% 1000:+1.00% (largest |gap| 2.50%)",
                     "bf16 model.gelu=torch: final validation loss against bf16's of the same seed: +1.00%"]
