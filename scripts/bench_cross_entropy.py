"""LM-head loss forward+backward on the GPU: naive, naive compiled, Liger, ours (default and low_memory).

Per shape and implementation: median ms (triton.testing.do_bench), TFLOP/s at
6*N*H*V (the three matmuls), GPU ms (the profiler's kernel time per call: wall
time also counts the host, which differs between machines; Liger's host sync and
per-chunk launches made its wall time vary 2x between runs), and peak memory
above the inputs (the gradients included: every implementation must produce
them). bf16 throughout.

    python scripts/bench_cross_entropy.py [--out bench_cross_entropy.json] [--chunk-mib 32 64 256]
                                          [--shapes 16384x768x50304]
"""

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from minitrain.metrics import is_gpu_work
from minitrain.ops import fused_linear_cross_entropy

SHAPES = list(itertools.product((8192, 16384, 32768), (768, 2048), (50304, 128256)))


def naive(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).float(), targets)


def liger():
    """Liger's module, or None if the wheel is missing (its row is then skipped)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    module = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, targets: module(weight, hidden, targets)


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
    """(ms, GPU ms, bytes of peak memory above the inputs, loss) of one forward+backward."""

    def step():
        loss = loss_fn(hidden, weight, targets)
        loss.backward()
        return loss

    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step().detach()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(step, grad_to_none=[hidden, weight], return_mode="median")
    hidden.grad = weight.grad = None
    kernel_ms = gpu_ms(step)
    hidden.grad = weight.grad = None
    return ms, kernel_ms, peak, loss.float().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_cross_entropy.json")
    parser.add_argument("--chunk-mib", type=int, nargs="*", default=[],
                        help="extra 'ours' rows with these logit workspace budgets (the 'ours' row uses the default)")
    parser.add_argument("--shapes", nargs="*", default=None, help="NxHxV shapes (default: all 12)")
    args = parser.parse_args()

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    torch._dynamo.config.cache_size_limit = 64
    impls = {
        "naive": naive,
        "naive+compile": torch.compile(naive, dynamic=True),
        "liger": liger(),
        "ours": fused_linear_cross_entropy,
        "ours-lowmem": functools.partial(fused_linear_cross_entropy, low_memory=True),
    }
    for mib in args.chunk_mib:
        impls[f"ours@{mib}MiB"] = lambda h, w, y, b=mib * 2**20: fused_linear_cross_entropy(h, w, y, chunk_bytes=b)
    if impls["liger"] is None:
        print("note: liger-kernel not installed, its rows are skipped")

    results = []
    for n, h, v in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5).bfloat16().requires_grad_()
        targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
        for name, fn in impls.items():
            row = {"impl": name, "N": n, "H": h, "V": v}
            if fn is None:
                row["skipped"] = "not installed"
            else:
                try:
                    ms, kernel_ms, peak, loss = measure(fn, hidden, weight, targets)
                    row.update(ms=ms, gpu_ms=kernel_ms, tflops=6 * n * h * v / ms / 1e9, peak_gb=peak / 1e9,
                               loss=loss)
                except torch.OutOfMemoryError:
                    row["skipped"] = "OOM"
                    torch.cuda.empty_cache()
            results.append(row)
            print(json.dumps(row), flush=True)
        del hidden, weight, targets
        torch.cuda.empty_cache()

    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)

    # Last: the table, with ours' time (wall, GPU) and memory as fractions of each row's.
    by_key = {(r["impl"], r["N"], r["H"], r["V"]): r for r in results}
    print(f"\n{'N':>6} {'H':>5} {'V':>7}  {'impl':<14} {'ms':>8} {'GPU ms':>8} {'TFLOP/s':>8} {'peak GB':>8} "
          f"{'loss':>8}  (time, GPU time, mem) of ours, ours-lowmem / this")
    for r in results:
        shape = f"{r['N']:>6} {r['H']:>5} {r['V']:>7}  {r['impl']:<14}"
        if "skipped" in r:
            print(f"{shape} {r['skipped']:>8}")
            continue
        ours = (by_key[(k, r["N"], r["H"], r["V"])] for k in ("ours", "ours-lowmem"))
        ratio = "  ".join(f"{o['ms'] / r['ms']:.2f}x {o['gpu_ms'] / r['gpu_ms']:.2f}x "
                          f"{o['peak_gb'] / r['peak_gb']:.2f}x" for o in ours if "ms" in o)
        print(f"{shape} {r['ms']:8.2f} {r['gpu_ms']:8.2f} {r['tflops']:8.0f} {r['peak_gb']:8.3f} {r['loss']:8.4f}  "
              f"{ratio}")


if __name__ == "__main__":
    main()
