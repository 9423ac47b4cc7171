"""Optimizer step on the GPU: ours (loop / foreach / fused) against torch's best recipes.

Two cases: GPT-2-124M parameter shapes (148 tensors) and 4096 tensors of 4096 elements.
Rows:
  loop / foreach / fused   FusedAdamW(impl=...), bf16 params + fp32 masters, bf16 grads,
                           clipping on (so the grad-norm pass is included)
  torch fused fp32         torch.optim.AdamW(fused=True) on fp32 params and grads
  torch master path        AdamW(fused=True) on fp32 masters with fp32 grads,
                           then torch._foreach_copy_ of the masters into the bf16 params
Columns: GPU launches per step (torch.profiler), median ms (triton.testing.do_bench), the
minimum bytes/param the recipe must move, the bandwidth that implies, and that bandwidth as a
% of a device-to-device copy measured in the same run. For loop and foreach the bytes are the
recipe's minimum, not what their many passes actually move: their TB/s is "effective".
"""

import argparse
import json

import torch
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from minitrain.optim import FusedAdamW

HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# bf16 grad read by the norm pass and by the update (2+2), master, m, v read+write (3*8),
# bf16 param write (2)
BYTES_OURS = 30
BYTES_TORCH_FP32 = 28    # fp32 grad read (4), param, m, v read+write (3*8)
BYTES_TORCH_MASTER = 34  # the above + master read (4) and bf16 write (2) of _foreach_copy_


def gpt2_124m_shapes(vocab=50257, ctx=1024, d=768, layers=12):
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
             (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


CASES = {"gpt2-124m": gpt2_124m_shapes(), "4096x4096": [(4096,)] * 4096}


def groups(params):
    """The trainer's grouping: no decay on 1-D params."""
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make(shapes, dtype):
    return [torch.nn.Parameter(0.02 * torch.randn(s, device="cuda", dtype=dtype))
            for s in shapes]


def ours(shapes, impl):
    params = make(shapes, torch.bfloat16)
    opt = FusedAdamW(groups(params), max_grad_norm=1.0, impl=impl, **HP)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # compiles the kernels; loop/foreach gather the grads into their flat buffer (the timed steps
    # find them there), fused uploads the grads' offsets (the timed steps find the addresses unchanged)
    return lambda: opt.step(), BYTES_OURS


def torch_fused_fp32(shapes):
    params = make(shapes, torch.float32)
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(groups(params), fused=True, **HP)
    return opt.step, BYTES_TORCH_FP32


def torch_master_path(shapes):
    masters = make(shapes, torch.float32)
    params = [m.detach().to(torch.bfloat16) for m in masters]
    for m in masters:
        m.grad = torch.randn_like(m)
    opt = torch.optim.AdamW(groups(masters), fused=True, **HP)

    def step():
        opt.step()
        torch._foreach_copy_(params, masters)
    return step, BYTES_TORCH_MASTER


ROWS = {
    "loop": lambda s: ours(s, "loop"),
    "foreach": lambda s: ours(s, "foreach"),
    "fused (ours)": lambda s: ours(s, "fused"),
    "torch fused fp32": torch_fused_fp32,
    "torch master path": torch_master_path,
}


def launches_per_step(fn, steps):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events()) / steps


def copy_tb_s(nbytes=1 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e12


def run_case(shapes, copy_bw):
    n = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    for name, build in ROWS.items():
        fn, bytes_per_param = build(shapes)
        steps = 1 if name == "loop" else 5
        launches = launches_per_step(fn, steps)
        ms = triton.testing.do_bench(fn, return_mode="median")
        tb_s = n * bytes_per_param / (ms * 1e-3) / 1e12
        rows.append(dict(row=name, launches=launches, ms=ms, bytes_per_param=bytes_per_param,
                         tb_s=tb_s, pct_copy=100 * tb_s / copy_bw))
        del fn
        torch.cuda.empty_cache()
    return dict(tensors=len(shapes), params=n, rows=rows)


def check_targets(results, copy_bw):
    def ms(case, row):
        return next(r["ms"] for r in results[case]["rows"] if r["row"] == row)

    big, tiny = results["gpt2-124m"], results["4096x4096"]
    fused_big = next(r for r in big["rows"] if r["row"] == "fused (ours)")
    floor_tiny = tiny["params"] * BYTES_OURS / (copy_bw * 1e12) * 1e3
    return {
        "124m: fused >= 90% of copy": (fused_big["pct_copy"], fused_big["pct_copy"] >= 90),
        "124m: >= 1.3x torch master path": (
            ms("gpt2-124m", "torch master path") / fused_big["ms"],
            ms("gpt2-124m", "torch master path") / fused_big["ms"] >= 1.3),
        "tiny: >= 20x torch fused": (
            ms("4096x4096", "torch fused fp32") / ms("4096x4096", "fused (ours)"),
            ms("4096x4096", "torch fused fp32") / ms("4096x4096", "fused (ours)") >= 20),
        "tiny: within 3x of bandwidth floor": (
            ms("4096x4096", "fused (ours)") / floor_tiny,
            ms("4096x4096", "fused (ours)") <= 3 * floor_tiny),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_optimizer.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_tb_s()
    results = {case: run_case(shapes, copy_bw) for case, shapes in CASES.items()}
    targets = check_targets(results, copy_bw)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_tb_s": copy_bw,
                   "cases": results,
                   "targets": {k: {"value": v, "met": ok} for k, (v, ok) in targets.items()}},
                  f, indent=2)

    print(f"\n{torch.cuda.get_device_name()}: device-to-device copy {copy_bw:.2f} TB/s")
    for name, (value, ok) in targets.items():
        print(f"  target {name:38s} {value:8.2f}  {'met' if ok else 'MISSED'}")
    for case, res in results.items():
        print(f"\n{case}: {res['tensors']} tensors, {res['params'] / 1e6:.1f}M params")
        print(f"  {'row':20s} {'launches':>9s} {'ms':>9s} {'B/param':>8s} {'TB/s':>7s} {'% copy':>7s}")
        for r in res["rows"]:
            print(f"  {r['row']:20s} {r['launches']:9.0f} {r['ms']:9.3f} {r['bytes_per_param']:8d}"
                  f" {r['tb_s']:7.2f} {r['pct_copy']:7.1f}")


if __name__ == "__main__":
    main()
