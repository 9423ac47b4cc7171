"""LM-head loss forward+backward on the GPU: naive, naive compiled, Liger, torch's F.linear_cross_entropy,
ours (default and low_memory).

Per shape and implementation, first the loss and both gradients against an fp32
reference: a row whose gradients are outside the tolerances is reported as failed,
with its errors, and not timed (a fast wrong loss is no result); a loss value
outside its tolerance (torch's F.linear_cross_entropy returns it in bf16) is
flagged with "!" beside its error and the row timed, since training uses the
gradients and only logs the value. Then: median ms
(triton.testing.do_bench), TFLOP/s at 6*N*H*V (the three matmuls), GPU ms (the
profiler's kernel time per call: wall time also counts the host, which differs
between machines; Liger's host sync and per-chunk launches made its wall time
vary 2x between runs), and extra memory: the peak above the inputs on a warm
call (so compile-time allocations do not count), the gradients included (every
implementation must produce them). bf16 throughout; 1/7 of the targets are the
ignore index, as in a packed batch. The naive loss is compiled for each shape's
static shapes, as a training step compiles it.

Beside the losses, each shape times the floor of a fused loss's two schedules: the bare matmuls of a
3-GEMM schedule (logits, grad_hidden, grad_weight) and of a 4-GEMM one (the logits twice), each GEMM
whole over all rows and columns, bf16 in and out, no softmax: what no chunked loss can beat. The table's
last lines set them beside 0.8x the compiled naive loss.

    python scripts/bench_cross_entropy.py [--out bench_cross_entropy.json] [--chunk-mib 32 64 256]
                                          [--shapes 16384x768x50304 8192x2048x128256]
"""

import argparse
import functools
import json

import torch
import torch.nn.functional as F
import triton

from minitrain.metrics import is_gpu_work
from minitrain.ops import fused_linear_cross_entropy, linear_cross_entropy_reference

SHAPES = [(16384, 768, 50304), (8192, 2048, 128256)]  # GPT-2 and Llama-3 LM heads
IGNORE_INDEX = -100
IGNORED_EVERY = 7  # every 7th target is ignored
GRAD_TOL = 4e-3  # relative error of each gradient vs fp32: what the bf16 naive loss reaches
LOSS_TOL = 1e-4  # the mean over rows averages the bf16 logits' rounding away: a larger error is a bug


def naive(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=IGNORE_INDEX)


def liger():
    """Liger's module, or None if the wheel is missing (its row is then skipped)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    module = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    return lambda hidden, weight, targets: module(weight, hidden, targets)


def torch_linear_cross_entropy():
    """torch's own F.linear_cross_entropy (torch >= 2.13), batch-chunked with an fp32 weight-gradient
    accumulator across chunks (acc_policy="balanced": the accumulation minitrain keeps), or None where
    this torch has none (its row is then skipped)."""
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None:
        return None
    chunked = options(acc_policy="balanced", acc_dtype=torch.float32)
    return lambda hidden, weight, targets: F.linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX,
                                                                   options=chunked)


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


def measure_matmul_floor(hidden, weight, n_gemms):
    ms = triton.testing.do_bench(lambda: schedule_matmuls(hidden, weight, n_gemms), return_mode="median")
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
    errors = {
        name: relative_error(out, ref)
        for name, out, ref in zip(
            ("loss_err", "grad_hidden_err", "grad_weight_err"), loss_and_grads(loss_fn, hidden, weight, targets),
            reference,
        )
    }
    tolerances = {"loss_err": loss_tol, "grad_hidden_err": grad_tol, "grad_weight_err": grad_tol}
    # `not err <= tol` also fails a NaN error
    failed = [name for name, err in errors.items() if not err <= tolerances[name]]
    return {**errors, "ok": not failed, "failed": failed}


def gpu_ms(step, calls=3):
    """Kernel time per call, from the profiler: what the GPU spent, whatever the host did."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if is_gpu_work(e)) / 1e3 / calls


def measure(loss_fn, hidden, weight, targets):
    """(ms, GPU ms, bytes of peak memory above the inputs on a warm call) of one forward+backward."""
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
    ms = triton.testing.do_bench(step, grad_to_none=[hidden, weight], return_mode="median")
    hidden.grad = weight.grad = None
    kernel_ms = gpu_ms(step)
    hidden.grad = weight.grad = None
    return ms, kernel_ms, extra


def parse_shape(text):
    try:
        n, h, v = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes NxHxV (e.g. 16384x768x50304), got {text!r}") from None
    return n, h, v


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_cross_entropy.json")
    parser.add_argument("--chunk-mib", type=int, nargs="*", default=[],
                        help="extra 'ours' rows with these logit workspace budgets (the 'ours' row uses the default)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES,
                        help="NxHxV shapes (default: " + " ".join("x".join(map(str, s)) for s in SHAPES) + ")")
    args = parser.parse_args()

    impls = {
        "naive": naive,
        "naive+compile": torch.compile(naive, dynamic=False),
        "liger": liger(),
        "torch-lce": torch_linear_cross_entropy(),
        "ours": fused_linear_cross_entropy,
        "ours-lowmem": functools.partial(fused_linear_cross_entropy, low_memory=True),
    }
    for mib in args.chunk_mib:
        impls[f"ours@{mib}MiB"] = lambda h, w, y, b=mib * 2**20: fused_linear_cross_entropy(h, w, y, chunk_bytes=b)
    if impls["liger"] is None:
        print("note: liger-kernel not installed, its rows are skipped")
    if impls["torch-lce"] is None:
        print(f"note: torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13), its rows are skipped")

    results = []
    for n, h, v in args.shapes:
        torch._dynamo.reset()  # each shape gets its own static graph, not a guard-failure recompile
        hidden, weight, targets = make_inputs(n, h, v, "cuda")
        reference = fp32_reference(hidden, weight, targets)
        for name, fn in impls.items():
            row = {"impl": name, "N": n, "H": h, "V": v}
            if fn is None:
                row["skipped"] = "not available"
            else:
                try:
                    check = check_against_reference(fn, hidden, weight, targets, reference)
                    row.update({k: check[k] for k in ("loss_err", "grad_hidden_err", "grad_weight_err")})
                    grads_off = [name for name in check["failed"] if name != "loss_err"]
                    row["loss_off"] = "loss_err" in check["failed"]
                    if not grads_off:
                        ms, kernel_ms, extra = measure(fn, hidden, weight, targets)
                        row.update(ms=ms, gpu_ms=kernel_ms, tflops=6 * n * h * v / ms / 1e9, extra_gb=extra / 1e9)
                    else:
                        row["skipped"] = "failed: " + ", ".join(check["failed"])
                except torch.OutOfMemoryError:
                    row["skipped"] = "OOM"
                    hidden.grad = weight.grad = None
                    torch.cuda.empty_cache()
            results.append(row)
            print(json.dumps(row), flush=True)
        for n_gemms in (3, 4):
            results.append(measure_matmul_floor(hidden, weight, n_gemms))
            print(json.dumps(results[-1]), flush=True)
        del hidden, weight, targets, reference
        torch.cuda.empty_cache()

    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    print_table(results)


def print_table(results):
    """Last: the table, with ours' time (wall, GPU) and memory as fractions of each row's."""
    by_key = {(r["impl"], r["N"], r["H"], r["V"]): r for r in results}
    print(f"\n{'N':>6} {'H':>5} {'V':>7}  {'impl':<14} {'ms':>8} {'GPU ms':>8} {'TFLOP/s':>8} {'extra GB':>8} "
          f"{'loss err':>9} {'gH err':>9} {'gW err':>9}  (time, GPU time, mem) of ours, ours-lowmem / this")
    for r in results:
        shape = f"{r['N']:>6} {r['H']:>5} {r['V']:>7}  {r['impl']:<14}"
        errors = (f"{r['loss_err']:8.1e}{'!' if r['loss_off'] else ' '} {r['grad_hidden_err']:9.1e} "
                  f"{r['grad_weight_err']:9.1e}" if "loss_err" in r else "")
        if "skipped" in r:
            print(f"{shape} {r['skipped']:>35} {errors}")
            continue
        if r.get("floor"):
            print(f"{shape} {r['ms']:8.2f} {'':>8} {r['tflops']:8.0f}")
            continue
        ours = (by_key[(k, r["N"], r["H"], r["V"])] for k in ("ours", "ours-lowmem"))
        ratio = "  ".join(f"{o['ms'] / r['ms']:.2f}x {o['gpu_ms'] / r['gpu_ms']:.2f}x "
                          f"{o['extra_gb'] / r['extra_gb']:.2f}x" for o in ours if "ms" in o)
        print(f"{shape} {r['ms']:8.2f} {r['gpu_ms']:8.2f} {r['tflops']:8.0f} {r['extra_gb']:8.3f} {errors}  {ratio}")
    for (impl, n, h, v), r in by_key.items():
        floors = [by_key.get((f"{k} GEMMs only", n, h, v)) for k in (3, 4)]
        if impl == "naive+compile" and "ms" in r and all(floors):
            print(f"{n}x{h}x{v}: 0.8x naive+compile {0.8 * r['ms']:.2f} ms; the matmuls alone, whole: "
                  f"3 GEMMs {floors[0]['ms']:.2f} ms, 4 GEMMs {floors[1]['ms']:.2f} ms")


if __name__ == "__main__":
    main()
