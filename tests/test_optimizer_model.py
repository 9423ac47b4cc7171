"""minitrain.tools.optimizer_model and scripts/optimizer_widget.py: the regimes the model predicts."""

import json
import subprocess
import sys

import pytest
import torch

from minitrain.optim.adamw_triton import fused_bytes_per_param
from minitrain.tools import optimizer_model as om

from conftest import REPO


def test_optimizer_model_regimes():
    params, bandwidth = 124_000_000, 4e12
    fused = om.predict_step("fused", params, 148, bandwidth=bandwidth)
    assert fused.bound == "bandwidth" and fused.seconds == pytest.approx(params * 30 / bandwidth)
    assert om.predict_step("per-tensor", params, 100_000).bound == "host"
    assert om.predict_step("foreach", params, 148).launches < om.predict_step("per-tensor", params, 148).launches
    assert om.memory_floor(params) == 16 * params and om.memory_floor(params, fp32_grads=True) == 18 * params
    assert om.memory_floor(params, master_weights=False) == 16 * params


def test_fused_step_pays_host_time_per_tensor():
    """4096 tensors of 4096 elements (bench_optimizer.py's tiny case): three launches, but the host reads every
    p.grad, so the fused step is host-bound and grows with the tensor count instead of staying flat."""
    params = 4096 * 4096
    tiny = om.predict_step("fused", params, 4096, launch_s=5e-6, host_s_per_tensor=0.3e-6)
    assert tiny.bound == "host"
    assert tiny.seconds == pytest.approx(3 * 5e-6 + 4096 * 0.3e-6)
    assert om.predict_step("fused", params, 16384).seconds > om.predict_step("fused", params, 4096).seconds


def test_fused_bytes_per_param_counts_the_kernels_traffic():
    """bf16 params + fp32 masters: grad read twice (4), master, m, v read and written (24), param written (2).
    fp32 params, no master: grad read twice (8), m, v read and written (16), param read and written (8)."""
    assert fused_bytes_per_param(torch.bfloat16, torch.bfloat16, master_weights=True) == 30
    assert fused_bytes_per_param(torch.bfloat16, torch.float32, master_weights=True) == 34
    assert fused_bytes_per_param(torch.float32, torch.float32, master_weights=False) == 32


def test_muon_costs_per_parameter_beside_adamw():
    """gpt2-124m's 48 matrices: 5·(4·m·n + 2·m³/…) GEMM FLOPs, per block 5·768²·(4·2304 + 2·768 + 6·768 + 2·(4·3072 +
    2·768)) over its 12·768² params, exactly 17,920 a param against AdamW's 15; 32 bytes moved a param (AdamW's
    30) and 12 kept (AdamW's 16); the floor: the FLOPs at the GEMM rate plus the bytes at the bandwidth."""
    from minitrain.memory import hidden_shapes
    from minitrain.tools.benchmarks.optimizer import MUON_MODELS

    shapes = hidden_shapes(MUON_MODELS["gpt2-124m"])
    muon, adamw = om.muon_costs(shapes), om.adamw_costs()
    assert (muon.flops, muon.hbm_bytes, muon.state_bytes) == (17920, 32, 12)
    assert (adamw.flops, adamw.hbm_bytes, adamw.state_bytes) == (15, 30, 16)
    n = 12 * 12 * 768**2
    assert muon.step_s(n, gemm_flops=1e15, bandwidth=4e12) == pytest.approx(17920 * n / 1e15 + 32 * n / 4e12)
    assert adamw.step_s(n, gemm_flops=1e15, bandwidth=4e12) == pytest.approx(30 * n / 4e12)  # no GEMMs


@pytest.mark.parametrize("steps", [3, 5])
def test_muon_costs_count_the_gemms_of_optimizer_muon_ns_steps(steps):
    """For optimizer.muon.ns_steps=3 as for the default 5: muon_costs' FLOPs a param, times the params, are what
    torch's FLOP counter counts of orthogonalize over the same matrices (wide, tall, square) for that many steps."""
    from torch.utils.flop_counter import FlopCounterMode

    from minitrain.optim import newton_schulz

    shapes = [(24, 40), (40, 24), (16, 16)]
    counter = FlopCounterMode(display=False)
    with counter:
        for shape in shapes:
            newton_schulz.orthogonalize(torch.randn(1, *shape).bfloat16(), steps=steps)
    n = sum(rows * cols for rows, cols in shapes)
    assert om.muon_costs(shapes, steps).flops == pytest.approx(counter.get_total_flops() / n, rel=1e-12)


def test_optimizer_widget_writes_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    bench = {"cases": {"gpt2-124m": {"tensors": 148, "params": 124_000_000, "rows": [
        {"row": "loop", "ms": 12.0}, {"row": "foreach", "ms": 4.1}, {"row": "fused (ours)", "ms": 1.0},
        {"row": "torch fused fp32", "ms": 1.3}]}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert om.measured_points(bench) == {"per-tensor": [(148, 12.0)], "foreach": [(148, 4.1)], "fused": [(148, 1.0)]}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "optimizer_widget.py"), "--measured", "bench.json",
                          "--out", "w.png"], check=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "fused" in out.stdout and "148 tensors" in out.stdout and "16 B/param" in out.stdout
    assert "48 matrices (84.9M params)" in out.stdout and "Muon          17,920         32       12" in out.stdout
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    three = subprocess.run([sys.executable, str(REPO / "scripts" / "optimizer_widget.py"), "--ns-steps", "3",
                            "--out", "w3.png"], check=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "Muon at 3 Newton-Schulz steps" in three.stdout and "Muon          10,752" in three.stdout
