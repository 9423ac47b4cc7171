"""tanh-GELU of the GPT's MLP, forward and backward, on the GPU: torch eager, inductor, ours.

Both directions are memory streams (forward: read x, write y; backward: read grad and x, write the
input grad), so each row is shown against a device-to-device copy of the same bytes. Then the same with
c_fc's bias, whose gradient is a column sum of the input grad: inductor's fused kernels, ours followed by
a compiled column sum (the bias left in the GEMM), and ours summing it in the backward's own pass, per
tiling (rows per program x tile rows x tile columns). Every row is checked against fp32 first.

    python scripts/bench_gelu.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.ops import gelu as gelu_module  # noqa: E402
from minitrain.ops import gelu_tanh  # noqa: E402

TOLERANCE = 1e-2  # relative error of a bf16 result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16384x3072", help="tokens x MLP width (gpt2-124m, B=16, T=1024)")
    ap.add_argument("--tilings", nargs="*", default=["256x8x256", "128x8x256", "512x8x256", "256x4x512",
                                                      "256x16x128", "64x8x256"],
                    help="the bias backward's tilings, rows per program x tile rows x tile columns")
    ap.add_argument("--out", default="bench_gelu.json")
    args = ap.parse_args()
    shape = tuple(map(int, args.shape.split("x")))
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2
    grad = torch.randn_like(x)
    dst = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(x), return_mode="median")  # 2 x numel x 2 bytes
    forward = {
        "torch eager": lambda t: F.gelu(t, approximate="tanh"),
        "inductor": torch.compile(lambda t: F.gelu(t, approximate="tanh")),
        "ours": gelu_tanh,
    }
    backward = {
        "torch eager": lambda g, t: torch.ops.aten.gelu_backward(g, t, approximate="tanh"),
        "inductor": torch.compile(lambda g, t: torch.ops.aten.gelu_backward(g, t, approximate="tanh")),
        "ours": torch.ops.minitrain.gelu_tanh_backward,
    }
    want = F.gelu(x.float(), approximate="tanh")
    results = []
    print(f"{torch.cuda.get_device_name()}  x {tuple(shape)} bf16; copy {copy_ms:.3f} ms "
          f"({2 * x.numel() * 2 / copy_ms / 1e9:.2f} TB/s)")
    print(f"{'impl':<12} {'fwd ms':>7} {'of copy':>7} {'bwd ms':>7} {'of floor':>8} {'fwd err':>9}")
    for name in forward:
        err = ((forward[name](x).float() - want).norm() / want.norm()).item()
        fwd_ms = triton.testing.do_bench(lambda: forward[name](x), return_mode="median")
        bwd_ms = triton.testing.do_bench(lambda: backward[name](grad, x), return_mode="median")
        row = {"impl": name, "forward_ms": fwd_ms, "forward_of_copy": copy_ms / fwd_ms,  # read x, write y
               "backward_ms": bwd_ms, "backward_of_copy": 1.5 * copy_ms / bwd_ms,  # read grad and x, write grad_in
               "forward_rel_err": err}
        results.append(row)
        print(f"{name:<12} {fwd_ms:>7.3f} {row['forward_of_copy']:>7.0%} {bwd_ms:>7.3f} "
              f"{row['backward_of_copy']:>8.0%} {err:>9.2e}")
    results += bias_rows(x, grad, copy_ms, args.tilings)
    Path(args.out).write_text(json.dumps({"shape": shape, "copy_ms": copy_ms, "rows": results}, indent=1))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def bias_rows(x: torch.Tensor, grad: torch.Tensor, copy_ms: float, tilings: list[str]) -> list[dict]:
    """GELU(x + bias) forward, and its backward with the bias gradient, per implementation."""
    bias = torch.randn(x.shape[-1], device=x.device, dtype=x.dtype)
    xb, bb = x.float().requires_grad_(), bias.float().requires_grad_()
    F.gelu(xb + bb, approximate="tanh").backward(grad.float())
    want = (F.gelu(x.float() + bias.float(), approximate="tanh"), xb.grad, bb.grad)
    column_sum = torch.compile(lambda g: g.sum(0))

    def inductor_backward(g, t, b):
        grad_in = torch.ops.aten.gelu_backward(g, t + b, approximate="tanh")
        return grad_in, grad_in.sum(0)

    def ours_then_sum(g, t, b):  # the bias added by the GEMM, so the GELU's input is x + bias
        grad_in = torch.ops.minitrain.gelu_tanh_backward(g, t)
        return grad_in, column_sum(grad_in)

    with_bias = x + bias
    variants = {"inductor, bias": (torch.compile(lambda t, b: F.gelu(t + b, approximate="tanh")),
                                   torch.compile(inductor_backward), (x, bias)),
                "ours, then a column sum": (lambda t, b: gelu_tanh(t), ours_then_sum, (with_bias, None))}
    for tiling in tilings:
        variants[f"ours, bias, {tiling}"] = (gelu_tanh, torch.ops.minitrain.gelu_tanh_bias_backward, (x, bias))
    print(f"with c_fc's bias ({x.shape[-1]}): the backward also writes the bias gradient")
    print(f"{'impl':<26} {'fwd ms':>7} {'of copy':>7} {'bwd ms':>7} {'of floor':>8} {'max err':>9}")
    rows = []
    defaults = (gelu_module.ROWS_PER_PROGRAM, gelu_module.TILE_ROWS, gelu_module.TILE_COLS)
    try:
        for name, (forward, backward, (t, b)) in variants.items():
            if name.startswith("ours, bias, "):
                (gelu_module.ROWS_PER_PROGRAM, gelu_module.TILE_ROWS,
                 gelu_module.TILE_COLS) = map(int, name.removeprefix("ours, bias, ").split("x"))
            got = (forward(t, b), *backward(grad, t, b))
            err = max(rel_err(a, w) for a, w in zip(got, want))
            if not err < TOLERANCE:
                print(f"{name:<26} fails the fp32 check: relative error {err:.2e}")
                continue
            fwd_ms = triton.testing.do_bench(lambda: forward(t, b), return_mode="median")
            bwd_ms = triton.testing.do_bench(lambda: backward(grad, t, b), return_mode="median")
            row = {"impl": name, "forward_ms": fwd_ms, "forward_of_copy": copy_ms / fwd_ms, "backward_ms": bwd_ms,
                   "backward_of_copy": 1.5 * copy_ms / bwd_ms, "max_rel_err": err}
            rows.append(row)
            print(f"{name:<26} {fwd_ms:>7.3f} {row['forward_of_copy']:>7.0%} {bwd_ms:>7.3f} "
                  f"{row['backward_of_copy']:>8.0%} {err:>9.2e}")
    finally:
        gelu_module.ROWS_PER_PROGRAM, gelu_module.TILE_ROWS, gelu_module.TILE_COLS = defaults
    return rows


if __name__ == "__main__":
    main()
