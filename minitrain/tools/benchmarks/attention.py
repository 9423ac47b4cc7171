"""SDPA's attention backends side by side, per shape: causal forward + backward on the GPU, each checked first
(`scripts/bench_attention.py` is its command line).

The model calls `F.scaled_dot_product_attention` and lets torch choose the kernel; the step's attention is far
from its floor (`bench_step.py --profile`), so which backend is fastest on each shape, and at what rate,
decides what to use or build. Every backend's output and gradients are checked against an fp32 reference
before it is timed; a backend that is off or cannot run the shape is reported, not timed. The rate counts the
useful FLOPs as the MFU does (the causal half of the score and value products, the backward twice the
forward; a flash backward's recompute is not counted).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minitrain.tools import bench
from minitrain.tools.kernel_floors import causal_attention_flops

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}  # default: what the model gets, torch's own choice
# batch x heads x seq_len x head_dim: gpt2-124m, 350m, 774m at 16 sequences, 1.5b at 8, a long-context shape
SHAPES = ["16x12x1024x64", "16x16x1024x64", "16x20x1024x64", "8x25x1024x64", "4x16x2048x128"]
TOLERANCE = 2e-2  # relative error of bf16 operands against the fp32 reference, output and each gradient


def causal_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> float:
    """Forward + backward FLOPs of one causal attention layer, as the step's floor counts them."""
    return causal_attention_flops(batch * seq_len, 1, heads * head_dim, seq_len)


def forward_backward(q, k, v, grad_out, backend=None):
    """The output and the gradients of q, k, v, under `backend` (None: torch's choice)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad_out)
    return out, q.grad, k.grad, v.grad


def relative_error(got, want) -> float:
    """The largest ||got - want|| / ||want|| over the output and the three gradients (NaN fails)."""
    errors = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got, want)]
    return max(errors, key=lambda e: float("inf") if e != e else e)


def measure_shape(shape: str) -> list[dict]:
    """Every backend at one "BxHxTxD" shape: checked against fp32 (math backend), then timed if it passes."""
    b, h, t, d = map(int, shape.split("x"))
    q, k, v, grad_out = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    with sdpa_kernel(SDPBackend.MATH):
        want = forward_backward(q.float(), k.float(), v.float(), grad_out.float())
    rows = []
    for name, backend in BACKENDS.items():
        row = {"shape": shape, "backend": name}
        try:
            err = relative_error(forward_backward(q, k, v, grad_out, backend), want)
        except RuntimeError as e:  # the backend cannot run this shape or is not built here
            rows.append(row | {"error": str(e).splitlines()[0][:120]})
            continue
        row["relative_error"] = err
        if not err <= TOLERANCE:
            rows.append(row | {"error": f"off: relative error {err:.2e} > {TOLERANCE}"})
            continue
        ms = bench.kernel_ms(lambda: forward_backward(q, k, v, grad_out, backend))
        rows.append(row | {"ms": ms, "tflops": causal_flops(b, h, t, d) / ms / 1e9})
    return rows


TABLE = (bench.Column("shape", "shape"), bench.Column("backend", "backend"), bench.Column("ms", "ms", ".3f"),
         bench.Column("TFLOP/s", "tflops", ".0f"), bench.Column("rel err", "relative_error", ".1e"))


def report(rows: list[dict]) -> list[str]:
    """The table; the fastest backend of each shape is marked, a backend that did not run says why."""
    def note(r: dict) -> str:
        fastest = min((x["ms"] for x in rows if x["shape"] == r["shape"] and "ms" in x), default=None)
        return r["error"] if "error" in r else "fastest" if r["ms"] == fastest else ""

    return bench.table(rows, TABLE, note=note)
