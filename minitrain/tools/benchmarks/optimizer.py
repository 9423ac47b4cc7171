"""The optimizer step on the GPU: ours (loop / foreach / fused) against torch's best recipes
(`scripts/bench_optimizer.py` is its command line).

Two cases: GPT-2-124M parameter shapes (148 tensors) and 4096 tensors of 4096 elements. Rows:
  loop / foreach / fused   AdamW(impl=...), bf16 params + fp32 masters, bf16 grads,
                           clipping on (so the grad-norm pass is included)
  torch fused fp32         torch.optim.AdamW(fused=True) on fp32 params and grads
  torch master path        AdamW(fused=True) on fp32 masters with fp32 grads,
                           then torch._foreach_copy_ of the masters into the bf16 params (under no_grad:
                           autograd records nothing)
Every row starts from the same weights and gradients, and its first step is checked against a reference
update (torch.optim.AdamW, for-loop implementation, in fp32; clipped where the row clips) before it is
timed: a row that computes something else fails the run instead of being timed.
Columns: GPU launches per step (the profiler), median ms, the minimum bytes/param the recipe must move, the
bandwidth that implies, and that bandwidth as a % of a device-to-device copy measured in the same run. For
loop and foreach the bytes are the recipe's minimum, not what their many passes actually move: their TB/s
is "effective".
"""

import torch

from minitrain.optim import AdamW
from minitrain.optim.adamw_triton import fused_bytes_per_param
from minitrain.tools import bench

HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_GRAD_NORM = 1.0  # our rows clip; torch's rows do not
BYTES_OURS = fused_bytes_per_param(torch.bfloat16, torch.bfloat16, master_weights=True)
BYTES_TORCH_FP32 = 28    # fp32 grad read (4), param, m, v read+write (3*8)
BYTES_TORCH_MASTER = 34  # the above + master read (4) and bf16 write (2) of _foreach_copy_


class ValidationError(RuntimeError):
    """A row's first step is not the reference update: its timing would measure something else."""


def gpt2_124m_shapes(vocab=50257, ctx=1024, d=768, layers=12):
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
             (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


CASES = {"gpt2-124m": gpt2_124m_shapes(), "4096x4096": [(4096,)] * 4096}


def groups(params):
    """The trainer's grouping: no decay on 1-D params."""
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def inputs(shapes, device, seed=0):
    """Weights and gradients every row starts from, bf16-representable so each recipe sees the same values."""
    gen = torch.Generator(device).manual_seed(seed)
    weights = [(0.02 * torch.randn(s, device=device, generator=gen)).bfloat16().float() for s in shapes]
    grads = [torch.randn(s, device=device, generator=gen).bfloat16().float() for s in shapes]
    return weights, grads


def reference_update(weights, grads, clip):
    """One fp32 AdamW step by torch's for-loop implementation (clip_grad_norm_ first when `clip`)."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    torch.optim.AdamW(groups(params), foreach=False, fused=False, **HP).step()
    return [p.detach() for p in params]


def params_of(weights, dtype):
    return [torch.nn.Parameter(w.clone().to(dtype)) for w in weights]


def ours(weights, grads, impl):
    params = params_of(weights, torch.bfloat16)
    opt = AdamW(groups(params), max_grad_norm=MAX_GRAD_NORM, impl=impl, **HP)
    for p, g in zip(params, grads):
        p.grad = g.bfloat16()

    def result():
        """The fp32 masters, in params' order (the state_dict numbers them group by group), and the compute copy."""
        state = opt.state_dict()["state"]
        order = [p for g in opt.param_groups for p in g["params"]]
        masters = {id(p): state[i]["master"] for i, p in enumerate(order)}
        return [masters[id(p)] for p in params], params
    # the timed steps find the gradients where the first one left them: loop/foreach in their flat buffer,
    # fused at the addresses whose offsets it uploaded
    return opt.step, BYTES_OURS, result


def torch_fused_fp32(weights, grads):
    params = params_of(weights, torch.float32)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = torch.optim.AdamW(groups(params), fused=True, **HP)
    return opt.step, BYTES_TORCH_FP32, lambda: (params, None)


def torch_master_path(weights, grads):
    masters = params_of(weights, torch.float32)
    params = [m.detach().to(torch.bfloat16) for m in masters]
    for m, g in zip(masters, grads):
        m.grad = g.clone()
    opt = torch.optim.AdamW(groups(masters), fused=True, **HP)

    @torch.no_grad()  # the masters are Parameters: outside no_grad autograd would record every copy
    def step():
        opt.step()
        torch._foreach_copy_(params, masters)
    return step, BYTES_TORCH_MASTER, lambda: (masters, params)


ROWS = {
    "loop": (lambda w, g: ours(w, g, "loop"), True),
    "foreach": (lambda w, g: ours(w, g, "foreach"), True),
    "fused (ours)": (lambda w, g: ours(w, g, "fused"), True),
    "torch fused fp32": (torch_fused_fp32, False),
    "torch master path": (torch_master_path, False),
}  # name: (build(weights, grads) -> (step, bytes/param, result), clips)


def validate(name, result, reference):
    """The row's fp32 result against the reference update; its low-precision copy (if any) must be exactly the
    fp32 result's rounding, made outside autograd."""
    full, copies = result()
    for i, (x, want) in enumerate(zip(full, reference)):
        if not torch.allclose(x.detach().float(), want, rtol=1e-5, atol=1e-7):
            err = (x.detach().float() - want).abs().max().item()
            raise ValidationError(f"{name}: tensor {i} {tuple(x.shape)} differs from the reference update by {err:.3g}")
    for i, (x, copy) in enumerate(zip(full, copies or [])):
        if copy.grad_fn is not None:
            raise ValidationError(f"{name}: autograd recorded the copy into tensor {i} ({copy.grad_fn.name()})")
        if not torch.equal(copy.detach(), x.detach().to(copy.dtype)):
            raise ValidationError(f"{name}: tensor {i}'s {copy.dtype} copy is not its fp32 result's rounding")


def checked_first_step(name, weights, grads, references):
    """Build row `name`, run its first step and validate it; its step function and bytes/param, to time."""
    build, clips = ROWS[name]
    fn, bytes_per_param, result = build(weights, grads)
    fn()  # also compiles the kernels
    validate(name, result, references[clips])
    return fn, bytes_per_param


def run_case(shapes, copy_bw):
    """Every row on one case's shapes: checked, then its launches per step and median ms."""
    n = sum(torch.Size(s).numel() for s in shapes)
    weights, grads = inputs(shapes, "cuda")
    references = {clips: reference_update(weights, grads, clips) for clips in (False, True)}
    rows = []
    for name in ROWS:
        fn, bytes_per_param = checked_first_step(name, weights, grads, references)
        launches = bench.kernel_count(fn, calls=1 if name == "loop" else 5).launches
        ms = bench.kernel_ms(fn)
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


TABLE = (bench.Column("row", "row"), bench.Column("launches", "launches", ".0f"), bench.Column("ms", "ms", ".3f"),
         bench.Column("B/param", "bytes_per_param", "d"), bench.Column("TB/s", "tb_s", ".2f"),
         bench.Column("% copy", "pct_copy", ".1f"))


def report(results: dict, targets: dict) -> list[str]:
    """Each target met or missed, then each case's table."""
    lines = [f"  target {name:38s} {value:8.2f}  {'met' if ok else 'MISSED'}" for name, (value, ok) in targets.items()]
    for case, res in results.items():
        lines += ["", f"{case}: {res['tensors']} tensors, {res['params'] / 1e6:.1f}M params"]
        lines += [f"  {line}" for line in bench.table(res["rows"], TABLE)]
    return lines
