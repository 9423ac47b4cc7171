"""The optimizer benchmark's Muon half that runs without a GPU (minitrain.tools.benchmarks.optimizer): each row's
check before timing (on a tiny model, the fused rows through the interpreter), the floor's arithmetic, the targets
and the report; Newton-Schulz alone: its batches, each kernel's check, its floors and report; and
`scripts/bench_optimizer.py --quality` on run directories as a sweep leaves them."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch
import yaml

from minitrain.model_config import ModelConfig
from minitrain.optim import Muon, MuonHyper, newton_schulz
from minitrain.optim import newton_schulz_triton
from minitrain.tools.benchmarks import optimizer as bench

from conftest import REPO

TINY = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)


@pytest.fixture
def tiny_case(monkeypatch):
    monkeypatch.setitem(bench.MUON_MODELS, "tiny", TINY)
    monkeypatch.setitem(bench.MUON_CASES, "muon-tiny", "tiny")
    return "muon-tiny"


def test_muon_rows_pass_their_check_and_a_wrong_one_fails(tiny_case, monkeypatch):
    """Every row's first update (ours clipped, torch's not) is the reference's on the CPU; a row whose lr misses the
    shape's ratio, or that leaves the matrices as they were, is refused before it is timed."""
    weights, grads, n = bench.muon_inputs(TINY, "cpu")
    assert n == 4 and [tuple(w.shape) for w in weights[:n]] == [(96, 32), (32, 32), (128, 32), (32, 128)]
    steps = bench.checked_muon_rows(tiny_case, weights, grads, n)
    assert list(steps) == list(bench.MUON_ROWS)
    calls = []
    gram = newton_schulz_triton.gram
    monkeypatch.setattr(newton_schulz_triton, "gram", lambda x, out: calls.append(x.shape) or gram(x, out))
    steps["muon fused (ours)"]()
    assert not calls
    steps["muon fused, triton NS (ours)"]()  # its Newton-Schulz through the triton kernels: each batch, each step
    assert len(calls) == n * newton_schulz.NS_STEPS

    def wrong_ratio(w, g, n):  # Moonshot's adjustment where the reference runs Keller Jordan's
        params = [torch.nn.Parameter(x.clone()) for x in w]
        opt = Muon(bench._split_groups(params, n), MuonHyper(adjust_lr="match_rms_adamw", **bench.MUON_HP),
                   impl="foreach", max_grad_norm=bench.MAX_GRAD_NORM, adamw_lr=bench.HP["lr"])
        for p, x in zip(params, g):
            p.grad = x.clone()
        return opt.step, lambda: ([opt.state_dict()["state"][i]["master"] for i in range(len(params))], params)

    def no_update(w, g, n):
        params = [x.float() for x in w]
        return (lambda: None), lambda: (params, None)

    monkeypatch.setattr(bench, "MUON_ROWS", {"wrong ratio": (wrong_ratio, True)})
    with pytest.raises(bench.ValidationError, match=r"wrong ratio: matrix 0 \(96, 32\): its update is"):
        bench.checked_muon_rows(tiny_case, weights, grads, n)
    monkeypatch.setattr(bench, "MUON_ROWS", {"no update": (no_update, False)})
    with pytest.raises(bench.ValidationError, match="no update: matrix 0"):
        bench.checked_muon_rows(tiny_case, weights, grads, n)


def test_gpt2_1_5b_runs_no_foreach_row():
    assert "muon foreach (ours)" in bench.muon_rows("muon-gpt2-124m")
    assert bench.muon_rows("muon-gpt2-1.5b") == ["muon fused (ours)", "muon fused, triton NS (ours)",
                                                 "torch Muon + fused AdamW"]


def test_the_floor_is_newton_schulz_at_the_gemm_rate_plus_the_passes_at_copy_bandwidth():
    """gpt2-124m: per block c_attn (2304 x 768), attn.c_proj (768 x 768), c_fc (3072 x 768) and mlp.c_proj
    (768 x 3072), each 5 steps of 4·m²·n + 2·m³ (m the short side); Muon's 32 bytes a param (bf16 grads read twice,
    the momentum read and written, the bf16 input written, read by the norm, read and written by the division, the
    update read, the master read and written, the param written), AdamW's 30 on the rest."""
    floor = bench.muon_floor(bench.MUON_MODELS["gpt2-124m"], gemm_flops=1e15, copy_bw=4e12)
    m = 768
    per_block = sum(5 * (4 * m * m * n + 2 * m**3) for n in (2304, 768, 3072, 3072))
    assert floor["ns_flops"] == 12 * per_block and floor["matrices"] == 48
    assert floor["muon_params"] == 12 * 12 * m * m
    assert floor["adamw_params"] == 50304 * m + 1024 * m + 12 * 13 * m + 2 * m  # embeddings, biases and norms
    assert floor["bytes"] == floor["muon_params"] * 32 + floor["adamw_params"] * 30
    assert floor["floor_ms"] == pytest.approx(12 * per_block / 1e15 * 1e3 + floor["bytes"] / 4e12 * 1e3)
    assert newton_schulz.flops((2304, 768)) == newton_schulz.flops((768, 2304))


def test_targets_and_report():
    def case(ours, torch_ms, floor):
        return {"matrices": 4, "muon_params": 1e6, "adamw_params": 1e5, "ns_flops": 1e12, "bytes": 1e9,
                "gemm_ms": floor / 2, "memory_ms": floor / 2, "floor_ms": floor,
                "rows": [dict(row="muon fused (ours)", launches=80, ms=ours, low=ours, high=ours,
                              of_floor=ours / floor),
                         dict(row=bench.MUON_BASELINE, launches=4000, ms=torch_ms, low=torch_ms, high=torch_ms,
                              of_floor=torch_ms / floor)]}

    results = {"muon-gpt2-124m": case(2.0, 5.0, 1.0), "muon-gpt2-1.5b": case(100.0, 150.0, 80.0)}
    targets = bench.check_muon_targets(results)
    assert targets == {"muon-gpt2-124m: >= 2x torch Muon + fused AdamW": (2.5, True),
                       "muon-gpt2-1.5b: >= 2x torch Muon + fused AdamW": (1.5, False),
                       "muon-gpt2-1.5b: within 1.2x of the floor": (1.25, False)}
    lines = bench.muon_report(results, targets)
    assert sum("MISSED" in line for line in lines) == 2 and "2.000 (2.000-2.000)" in "\n".join(lines)


def test_newton_schulz_alone_checks_each_kernel_and_times_each_batch_and_all(monkeypatch):
    """The tiny model's four shapes, one matrix each: both kernels pass the check against the fp32 iteration; a
    triton polynomial without its c·A·A fails it, named; the runs are each kernel on each batch and on all of them."""
    assert bench.ns_batches(TINY) == [((32, 32), 1), ((32, 128), 1), ((96, 32), 1), ((128, 32), 1)]
    assert bench.ns_batches(bench.MUON_MODELS["gpt2-1.5b"]) == [((1600, 1600), 48), ((1600, 6400), 48),
                                                                ((4800, 1600), 48), ((6400, 1600), 48)]
    inputs = bench.ns_inputs(TINY, "cpu")
    assert {s: tuple(x.shape) for s, x in inputs.items()} == {s: (1, *s) for s, _ in bench.ns_batches(TINY)}
    bench.check_ns_kernels(inputs)
    runs = bench.ns_runs(inputs)
    assert list(runs) == [(k, b) for k in ("cublas", "triton")
                          for b in ("all", "32x32 x1", "32x128 x1", "96x32 x1", "128x32 x1")]
    calls = []
    orthogonalize = newton_schulz.orthogonalize
    monkeypatch.setattr(newton_schulz, "orthogonalize",
                        lambda x, kernel: calls.append((tuple(x.shape), kernel)) or orthogonalize(x, kernel=kernel))
    runs["triton", "all"]()
    runs["cublas", "96x32 x1"]()
    assert calls == [((1, *s), "triton") for s in inputs] + [((1, 96, 32), "cublas")]
    monkeypatch.setattr(newton_schulz, "orthogonalize", orthogonalize)
    polynomial = newton_schulz_triton.symmetric_polynomial
    monkeypatch.setattr(newton_schulz_triton, "symmetric_polynomial",
                        lambda a, b, c, out: polynomial(a, b, 0.0, out))
    with pytest.raises(bench.ValidationError, match=r"ns_kernel=triton: 32x32: its result is .* away"):
        bench.check_ns_kernels(inputs)


def test_newton_schulz_floors_and_report():
    """Every FLOP, and the symmetric count, of each batch's matrices at the GEMM rate; the report's rows."""
    batches = [((768, 3072), 12), ((768, 768), 12)]
    floors = bench.ns_floors(batches, gemm_flops=1e15)
    every = 12 * (newton_schulz.flops((768, 3072)) + newton_schulz.flops((768, 768)))
    symmetric = 12 * (newton_schulz.flops((768, 3072), symmetric=True) + newton_schulz.flops((768, 768), symmetric=True))
    assert floors == pytest.approx(dict(ns_flops=every, symmetric_flops=symmetric, floor_ms=every / 1e12,
                                        symmetric_floor_ms=symmetric / 1e12), rel=1e-12)
    row = dict(batch="all", kernel="triton", ms=2.0, low=1.9, high=2.1, tflops=500.0, of_floor=1.25,
               of_symmetric_floor=1.6)
    lines = bench.ns_report({"ns-gpt2-124m": dict(matrices=24, **floors, rows=[row])})
    assert lines[1].startswith("ns-gpt2-124m: Newton-Schulz on 24 matrices; floor ")
    assert lines[-1].split() == ["all", "triton", "2.000", "(1.900-2.100)", "500", "1.25", "1.60"]


def write_run(root, name, optimizer, lr, val, muon_lr=0.02):
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(
        {"optimizer": {"name": optimizer, "muon": {"lr": muon_lr}}, "trainer": {"lr": lr}}))
    records = [{"plan": {"optimizer_name": optimizer}}] + [{"step": s, "train/loss": v, "val/loss": v}
                                                           for s, v in val.items()]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    return run


def test_quality_finds_the_steps_muon_needs_to_reach_adamws_best(tmp_path):
    """AdamW's best lr (of a sweep's dir) ends at 3.0 by step 300; Muon's best (not its diverged one; run dirs given
    alone) is at or below 3.0 from step 200: two thirds of the steps. Only one optimizer's runs: exit 2, one line."""
    runs = [write_run(tmp_path / "adamw-sweep", "0", "adamw", 6e-4, {100: 4.0, 200: 3.5, 300: 3.1}),
            write_run(tmp_path / "adamw-sweep", "1", "adamw", 1.2e-3, {100: 3.8, 200: 3.3, 300: 3.0}),
            write_run(tmp_path, "m1", "muon", 6e-4, {100: 3.5, 200: 2.99, 300: 2.8}, muon_lr=0.02),
            write_run(tmp_path, "m2", "muon", 6e-4, {100: 3.4, 200: None, 300: 2.0}, muon_lr=0.08)]
    (tmp_path / "adamw-sweep" / "multirun.yaml").write_text("")  # a sweep's dir: its cells are the runs
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_optimizer.py"), "--quality",
                          str(tmp_path / "adamw-sweep"), *map(str, runs[2:]), "--out", str(tmp_path / "q.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "best AdamW: trainer.lr 0.0012, final validation loss 3.0000 at step 300" in out.stdout
    assert "best Muon: trainer.lr 0.0006 optimizer.muon.lr 0.02" in out.stdout
    assert "Muon reaches AdamW's final loss at step 200 of 300 (67% of the steps)" in out.stdout
    assert "NON-FINITE LOSS" in out.stdout
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["muon_steps"] == 200 and saved["best"]["muon"].endswith("m1")
    alone = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_optimizer.py"), "--quality", str(runs[0])],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert alone.returncode == 2 and alone.stderr.strip() == \
        "error: --quality: the quality comparison needs AdamW runs and Muon runs"
