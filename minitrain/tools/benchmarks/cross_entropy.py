"""The LM-head loss, forward + backward, on the GPU: naive, naive compiled, Liger, torch's
F.linear_cross_entropy, ours (default and low_memory) (`scripts/bench_cross_entropy.py` is its command line).

Per shape and implementation, first the loss and both gradients against an fp32 reference: a row whose
gradients are outside the tolerances is reported as failed, with its errors, and not timed (a fast wrong loss
is no result); a loss value outside its tolerance (torch's F.linear_cross_entropy returns it in bf16) is
flagged with "!" beside its error and the row timed, since training uses the gradients and only logs the
value. Then: median ms, TFLOP/s at 6*N*H*V (the three matmuls), GPU ms (the profiler's kernel time per call:
Liger's host sync and per-chunk launches made its wall time vary 2x between runs), and extra memory: the
peak above the inputs on a warm call (so compile-time allocations do not count), the gradients included.
bf16 throughout; 1/7 of the targets are the ignore index, as in a packed batch. The naive loss is compiled
for each shape's static shapes, as a training step compiles it.

Beside the losses, each shape times the floor of a fused loss's two schedules: the bare matmuls of a 3-GEMM
schedule (logits, grad_hidden, grad_weight) and of a 4-GEMM one (the logits twice), each GEMM whole over all
rows and columns, bf16 in and out, no softmax: what no chunked loss can beat.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from minitrain.ops import fused_linear_cross_entropy, linear_cross_entropy_reference
from minitrain.tools import bench

SHAPES = [(16384, 768, 50304), (8192, 2048, 128256)]  # GPT-2 and Llama-3 LM heads
IGNORE_INDEX = -100
IGNORED_EVERY = 7  # every 7th target is ignored
GRAD_TOL = 4e-3  # relative error of each gradient vs fp32: what the bf16 naive loss reaches
LOSS_TOL = 1e-4  # the mean over rows averages the bf16 logits' rounding away: a larger error is a bug
ERRORS = ("loss_err", "grad_hidden_err", "grad_weight_err")


def naive(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=IGNORE_INDEX)


def liger() -> Optional[Callable]:
    """Liger's module, or None if the wheel is missing (its row is then skipped)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    module = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    return lambda hidden, weight, targets: module(weight, hidden, targets)


def torch_linear_cross_entropy() -> Optional[Callable]:
    """torch's own F.linear_cross_entropy (torch >= 2.13), batch-chunked with an fp32 weight-gradient
    accumulator across chunks (acc_policy="balanced": the accumulation minitrain keeps), or None where
    this torch has none (its row is then skipped)."""
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None:
        return None
    chunked = options(acc_policy="balanced", acc_dtype=torch.float32)
    return lambda hidden, weight, targets: F.linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX,
                                                                   options=chunked)


def implementations(chunk_mib: Sequence[int] = ()) -> dict[str, Optional[Callable]]:
    """Every row, by name; None where this machine lacks it. `chunk_mib`: more rows of ours, each with that
    logit workspace."""
    impls = {"naive": naive, "naive+compile": torch.compile(naive, dynamic=False), "liger": liger(),
             "torch-lce": torch_linear_cross_entropy(), "ours": fused_linear_cross_entropy,
             "ours-lowmem": functools.partial(fused_linear_cross_entropy, low_memory=True)}
    for mib in chunk_mib:
        impls[f"ours@{mib}MiB"] = functools.partial(fused_linear_cross_entropy, chunk_bytes=mib * 2**20)
    return impls


def make_inputs(n, h, v, device, dtype=torch.bfloat16, seed=0):
    """Leaf hidden (N, H) and weight (V, H) of unit-scale logits, targets (N,) with every 7th ignored."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=gen) / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device, generator=gen)
    targets[::IGNORED_EVERY] = IGNORE_INDEX
    return hidden, weight, targets


def schedule_matmuls(hidden, weight, n_gemms):
    """The matmuls of a fused loss's schedule with nothing else: the logits (twice for n_gemms=4, where
    they are recomputed for the weight gradient), then grad_hidden and grad_weight from them."""
    with torch.no_grad():
        logits = hidden @ weight.T
        if n_gemms == 4:
            logits = hidden @ weight.T
        return logits @ weight, logits.T @ hidden


def measure_matmul_floor(hidden, weight, n_gemms) -> dict:
    ms = bench.kernel_ms(lambda: schedule_matmuls(hidden, weight, n_gemms))
    n, h = hidden.shape
    v = weight.shape[0]
    return {"impl": f"{n_gemms} GEMMs only", "N": n, "H": h, "V": v, "floor": True, "ms": ms,
            "tflops": 2 * n_gemms * n * h * v / ms / 1e9}


def loss_and_grads(loss_fn, hidden, weight, targets):
    """(loss, grad_hidden, grad_weight) of one forward+backward; leaves the inputs' .grad empty."""
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    loss.backward()
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    return loss.detach(), *grads


def fp32_reference(hidden, weight, targets):
    """(loss, grad_hidden, grad_weight) from the inputs upcast to fp32: the truth every row is checked against."""
    upcast = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    return loss_and_grads(
        functools.partial(linear_cross_entropy_reference, ignore_index=IGNORE_INDEX), *upcast, targets
    )


def relative_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_against_reference(loss_fn, hidden, weight, targets, reference, grad_tol=GRAD_TOL, loss_tol=LOSS_TOL):
    """Relative errors of loss_fn's loss and gradients vs `reference` (fp32_reference's), and whether all pass."""
    errors = {name: relative_error(out, ref)
              for name, out, ref in zip(ERRORS, loss_and_grads(loss_fn, hidden, weight, targets), reference)}
    tolerances = {"loss_err": loss_tol, "grad_hidden_err": grad_tol, "grad_weight_err": grad_tol}
    # `not err <= tol` also fails a NaN error
    failed = [name for name, err in errors.items() if not err <= tolerances[name]]
    return {**errors, "ok": not failed, "failed": failed}


def measure(loss_fn, hidden, weight, targets) -> dict:
    """ms, GPU ms and GB of peak memory above the inputs on a warm call, of one forward+backward."""
    def step():
        loss_fn(hidden, weight, targets).backward()

    step()  # warm: compilation, autotuning and allocator growth are not the loss's memory
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    hidden.grad = weight.grad = None
    ms = bench.kernel_ms(step, grad_to_none=[hidden, weight])
    hidden.grad = weight.grad = None
    gpu_ms = bench.kernel_count(step).gpu_ms
    hidden.grad = weight.grad = None
    n, h = hidden.shape
    return {"ms": ms, "gpu_ms": gpu_ms, "tflops": 6 * n * h * weight.shape[0] / ms / 1e9, "extra_gb": extra / 1e9}


def measure_row(name: str, fn: Optional[Callable], inputs: tuple, reference: tuple) -> dict:
    """One implementation at one shape: checked, then timed if its gradients pass."""
    hidden, weight, targets = inputs
    (n, h), v = hidden.shape, weight.shape[0]
    row = {"impl": name, "N": n, "H": h, "V": v}
    if fn is None:
        return row | {"skipped": "not available"}
    try:
        check = check_against_reference(fn, hidden, weight, targets, reference)
        row.update({k: check[k] for k in ERRORS}, loss_off="loss_err" in check["failed"])
        if any(name != "loss_err" for name in check["failed"]):
            return row | {"skipped": "failed: " + ", ".join(check["failed"])}
        return row | measure(fn, hidden, weight, targets)
    except torch.OutOfMemoryError:
        hidden.grad = weight.grad = None
        torch.cuda.empty_cache()
        return row | {"skipped": "OOM"}


def _ratios(r: dict, by_key: dict) -> str:
    """(time, GPU time, memory) of ours and ours-lowmem over this row's."""
    ours = (by_key[(k, r["N"], r["H"], r["V"])] for k in ("ours", "ours-lowmem"))
    return "  ".join(f"{o['ms'] / r['ms']:.2f}x {o['gpu_ms'] / r['gpu_ms']:.2f}x {o['extra_gb'] / r['extra_gb']:.2f}x"
                     for o in ours if "ms" in o and "gpu_ms" in r)


def _errors(r: dict) -> Optional[str]:
    if "loss_err" not in r:
        return None
    return (f"{r['loss_err']:.1e}{'!' if r['loss_off'] else ' '} {r['grad_hidden_err']:.1e} "
            f"{r['grad_weight_err']:.1e}")


TABLE = (bench.Column("N", "N", "d"), bench.Column("H", "H", "d"), bench.Column("V", "V", "d"),
         bench.Column("impl", "impl"), bench.Column("ms", "ms", ".2f"), bench.Column("GPU ms", "gpu_ms", ".2f"),
         bench.Column("TFLOP/s", "tflops", ".0f"), bench.Column("extra GB", "extra_gb", ".3f"),
         bench.Column("loss gH gW err", _errors, "s"))


def report(results: list[dict]) -> list[str]:
    """The table, with ours' time (wall, GPU) and memory as fractions of each row's, then per shape the
    target (0.8x the compiled naive loss) beside the bare matmuls of the two schedules."""
    by_key = {(r["impl"], r["N"], r["H"], r["V"]): r for r in results}
    lines = bench.table(results, TABLE, note=lambda r: r.get("skipped") or _ratios(r, by_key))
    lines[0] += "  (time, GPU time, mem) of ours, ours-lowmem / this"
    for (impl, n, h, v), r in by_key.items():
        floors = [by_key.get((f"{k} GEMMs only", n, h, v)) for k in (3, 4)]
        if impl == "naive+compile" and "ms" in r and all(floors):
            lines.append(f"{n}x{h}x{v}: 0.8x naive+compile {0.8 * r['ms']:.2f} ms; the matmuls alone, whole: "
                         f"3 GEMMs {floors[0]['ms']:.2f} ms, 4 GEMMs {floors[1]['ms']:.2f} ms")
    return lines
