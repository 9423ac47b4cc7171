"""The optimizer step on the GPU: ours (loop / foreach / fused) against torch's best recipes, for AdamW and for Muon
(below) (`scripts/bench_optimizer.py` is its command line).

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

from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from minitrain.compat import foreach_copy_
from minitrain.model import GPT
from minitrain.model_config import ModelConfig
from minitrain.optim import AdamW, Muon, MuonHyper, newton_schulz
from minitrain.optim.adamw_triton import fused_bytes_per_param
from minitrain.optim.muon_triton import fused_bytes_per_param as muon_bytes_per_param
from minitrain.rundir import CONFIG_RECORD, METRICS, RECORD
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
        foreach_copy_(params, masters)
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


# -- Muon -----------------------------------------------------------------------------------------------------------
# Muon's cases: a model's whole parameter set, its blocks' matrices through Muon, the rest through AdamW. Rows:
#   muon fused (ours)          Muon(impl="fused"): bf16 params + fp32 masters, bf16 grads, clipping on
#   muon fused, triton NS      the same with optimizer.muon.ns_kernel=triton: X Xᵀ and b·A + c·A·A by the symmetric
#     (ours)                   Triton kernels (newton_schulz_triton.py)
#   muon foreach (ours)        the same, impl="foreach" (gpt2-124m only: at gpt2-1.5b its fp32 copies of every
#                              gradient would crowd the other rows out of the GPU)
#   torch Muon + fused AdamW   the best a user assembles from torch: torch.optim.Muon on the matrices, fp32 params and
#                              grads as it needs, minitrain's fused AdamW on the rest (fp32), no clipping
# Every row's first update is checked against torch.optim.Muon + torch.optim.AdamW (for-loop) in fp32 before it is
# timed; the rows then run in alternating rounds, each round `calls` steps between two CUDA events. The floor is the
# Newton–Schulz GEMM FLOPs at the bf16 rate cuBLAS reaches on a large square GEMM in the same run, plus Muon's and
# AdamW's memory passes at the copy bandwidth measured in the same run.
MUON_MODELS = {"gpt2-124m": ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
               "gpt2-1.5b": ModelConfig(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304)}
MUON_CASES = {f"muon-{name}": name for name in MUON_MODELS}
MUON_HP = dict(lr=0.02, momentum=0.95, weight_decay=0.01)  # optimizer.muon's defaults (minitrain/config.py)
# The relative Frobenius distance of a matrix's first update from the reference's that a row may have: Newton–Schulz
# in bf16 amplifies the rounding of its GEMMs (one GEMM kernel's accumulation order against another's moves an
# update by about 1-4%), a wrong update (its lr's shape ratio, its input) by order 1.
MUON_TOLERANCE = 0.06
GEMM_SIZE = 8192  # the square bf16 GEMM whose rate is the floor's


def model_shapes(cfg: ModelConfig) -> tuple[list[tuple], list[tuple]]:
    """The shapes of the hidden matrices (Muon's) and of every other parameter (AdamW's), from the model on meta."""
    with torch.device("meta"):
        model = GPT(cfg)
    hidden = {id(p) for p in model.hidden_matrices()}
    return ([tuple(p.shape) for p in model.hidden_matrices()],
            [tuple(p.shape) for p in model.parameters() if id(p) not in hidden])


def muon_inputs(cfg: ModelConfig, device, seed=0):
    """(weights, grads, the number of matrices first): bf16, so that every row sees the same values."""
    matrices, others = model_shapes(cfg)
    gen = torch.Generator(device).manual_seed(seed)
    shapes = matrices + others
    weights = [(0.02 * torch.randn(s, device=device, generator=gen)).bfloat16() for s in shapes]
    grads = [torch.randn(s, device=device, generator=gen).bfloat16() for s in shapes]
    return weights, grads, len(matrices)


def _split_groups(params, n_matrices, **adamw):
    return [{"params": params[:n_matrices], "use_muon": True}, {"params": params[n_matrices:], **adamw}]


def muon_reference_update(weights, grads, n_matrices, clip):
    """One fp32 step of torch.optim.Muon on the matrices and torch.optim.AdamW (for-loop) on the rest, clip_grad_norm_
    over all first when `clip`."""
    params = [torch.nn.Parameter(w.float()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.float()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    torch.optim.Muon(params[:n_matrices], **MUON_HP).step()
    torch.optim.AdamW(params[n_matrices:], foreach=False, fused=False, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                      weight_decay=0.0).step()
    return [p.detach() for p in params]


def muon_ours(weights, grads, n_matrices, impl, ns_kernel="cublas"):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Muon(_split_groups(params, n_matrices), MuonHyper(ns_kernel=ns_kernel, **MUON_HP), impl=impl,
               max_grad_norm=MAX_GRAD_NORM, adamw_lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])
    for p, g in zip(params, grads):
        p.grad = g.clone()

    def result():
        state = opt.state_dict()["state"]
        return [state[i]["master"] for i in range(len(params))], params
    return opt.step, result


def torch_muon_fused_adamw(weights, grads, n_matrices):
    params = [torch.nn.Parameter(w.float()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.float()
    muon = torch.optim.Muon(params[:n_matrices], **MUON_HP)
    adamw = AdamW(params[n_matrices:], impl="fused", max_grad_norm=None, **{**HP, "weight_decay": 0.0})

    def step():
        muon.step()
        adamw.step()
    return step, lambda: (params, None)


MUON_ROWS = {
    "muon fused (ours)": (lambda w, g, n: muon_ours(w, g, n, "fused"), True),
    "muon fused, triton NS (ours)": (lambda w, g, n: muon_ours(w, g, n, "fused", "triton"), True),
    "muon foreach (ours)": (lambda w, g, n: muon_ours(w, g, n, "foreach"), True),
    "torch Muon + fused AdamW": (torch_muon_fused_adamw, False),
}  # name: (build(weights, grads, n_matrices) -> (step, result), clips)
MUON_BASELINE = "torch Muon + fused AdamW"


def muon_rows(case: str) -> list[str]:
    return [r for r in MUON_ROWS if not (r == "muon foreach (ours)" and MUON_CASES[case] == "gpt2-1.5b")]


def validate_muon(name, result, weights, reference, n_matrices):
    """The row's fp32 result against the reference update: each matrix's update (the result less its weight) within
    MUON_TOLERANCE of the reference's (relative Frobenius distance), every other param as `validate` checks it; a
    low-precision copy exactly its fp32 result's rounding, made outside autograd."""
    full, copies = result()
    for i, (x, w, want) in enumerate(zip(full[:n_matrices], weights, reference)):
        update, expected = x.detach().float() - w.float(), want - w.float()
        distance = (torch.linalg.vector_norm(update - expected) / torch.linalg.vector_norm(expected)).item()
        if not distance <= MUON_TOLERANCE:
            raise ValidationError(f"{name}: matrix {i} {tuple(x.shape)}: its update is {distance:.3g} of the "
                                  f"reference's away (relative Frobenius distance)")
    validate(name, lambda: (full[n_matrices:], copies[n_matrices:] if copies else None), reference[n_matrices:])
    for i, (x, copy) in enumerate(zip(full[:n_matrices], copies or [])):
        if copy.grad_fn is not None or not torch.equal(copy.detach(), x.detach().to(copy.dtype)):
            raise ValidationError(f"{name}: matrix {i}'s {copy.dtype} copy is not its fp32 result's rounding")


def checked_muon_rows(case: str, weights, grads, n_matrices) -> dict:
    """Each of the case's rows built, its first step run and validated: name -> its step function, in the rows'
    order. The rows that clip are checked against the clipped reference, then the others against the unclipped one:
    one fp32 reference alive at a time (at gpt2-1.5b each is 6 GB beside three rows' state)."""
    steps = {}
    for clip in (True, False):
        names = [name for name in muon_rows(case) if MUON_ROWS[name][1] == clip]
        reference = muon_reference_update(weights, grads, n_matrices, clip) if names else None
        for name in names:
            fn, result = MUON_ROWS[name][0](weights, grads, n_matrices)
            fn()
            validate_muon(name, result, weights, reference, n_matrices)
            steps[name] = fn
        del reference
    return {name: steps[name] for name in muon_rows(case)}


def muon_floor(cfg: ModelConfig, gemm_flops: float, copy_bw: float) -> dict:
    """The case's floor: Newton–Schulz's GEMM FLOPs at `gemm_flops` FLOP/s, plus the bytes of Muon's passes over its
    matrices and AdamW's over the rest (bf16 params + fp32 masters, bf16 grads) at `copy_bw` bytes/s."""
    matrices, others = model_shapes(cfg)
    flops = sum(newton_schulz.flops(s) for s in matrices)
    muon_params = sum(torch.Size(s).numel() for s in matrices)
    adamw_params = sum(torch.Size(s).numel() for s in others)
    nbytes = muon_params * muon_bytes_per_param(torch.bfloat16, torch.bfloat16, True) + adamw_params * BYTES_OURS
    return dict(matrices=len(matrices), muon_params=muon_params, adamw_params=adamw_params, ns_flops=flops,
                bytes=nbytes, gemm_ms=flops / gemm_flops * 1e3, memory_ms=nbytes / copy_bw * 1e3,
                floor_ms=(flops / gemm_flops + nbytes / copy_bw) * 1e3)


def gemm_flops_per_s(device, n: int = GEMM_SIZE) -> float:
    """The bf16 rate cuBLAS reaches on an n x n x n GEMM here (the median of do_bench)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (bench.kernel_ms(lambda: a @ b) * 1e-3)


def run_muon_case(case: str, copy_bw: float, gemm_flops: float, rounds: int, calls: int) -> dict:
    """The case's rows checked, then timed in alternating rounds; its floor; each row's launches per step."""
    cfg = MUON_MODELS[MUON_CASES[case]]
    weights, grads, n = muon_inputs(cfg, "cuda")
    steps = checked_muon_rows(case, weights, grads, n)
    del weights, grads
    torch.cuda.empty_cache()
    launches = {name: bench.kernel_count(fn, calls=1).launches for name, fn in steps.items()}
    measured = bench.alternating_rounds(steps, rounds, calls)
    floor = muon_floor(cfg, gemm_flops, copy_bw * 1e12)
    rows = []
    for name, ms in measured.items():
        spread = bench.Spread.of(ms)
        rows.append(dict(row=name, launches=launches[name], ms=spread.median, low=spread.low, high=spread.high,
                         of_floor=spread.median / floor["floor_ms"]))
    return dict(**floor, rows=rows)


def check_muon_targets(results: dict) -> dict:
    """≥ 2x the torch baseline at each case measured; within 1.2x of the floor at gpt2-1.5b."""
    targets = {}
    for case, res in results.items():
        ms = {r["row"]: r["ms"] for r in res["rows"]}
        speedup = ms[MUON_BASELINE] / ms["muon fused (ours)"]
        targets[f"{case}: >= 2x {MUON_BASELINE}"] = (speedup, speedup >= 2)
        if MUON_CASES[case] == "gpt2-1.5b":
            of_floor = ms["muon fused (ours)"] / res["floor_ms"]
            targets[f"{case}: within 1.2x of the floor"] = (of_floor, of_floor <= 1.2)
    return targets


MUON_TABLE = (bench.Column("row", "row"), bench.Column("launches", "launches", ".0f"),
              bench.Column("ms", lambda r: f"{r['ms']:.3f} ({r['low']:.3f}-{r['high']:.3f})"),
              bench.Column("x floor", "of_floor", ".2f"))


def muon_report(results: dict, targets: dict) -> list[str]:
    lines = [f"  target {name:48s} {value:8.2f}  {'met' if ok else 'MISSED'}" for name, (value, ok) in targets.items()]
    for case, res in results.items():
        lines += ["", f"{case}: {res['matrices']} matrices ({res['muon_params'] / 1e6:.1f}M params) + "
                      f"{res['adamw_params'] / 1e6:.1f}M AdamW params; floor {res['floor_ms']:.3f} ms = Newton-Schulz "
                      f"{res['ns_flops'] / 1e12:.2f} TFLOP in {res['gemm_ms']:.3f} ms + {res['bytes'] / 1e9:.2f} GB "
                      f"in {res['memory_ms']:.3f} ms"]
        lines += [f"  {line}" for line in bench.table(res["rows"], MUON_TABLE)]
    return lines


# -- Newton–Schulz alone ----------------------------------------------------------------------------------------------
# orthogonalize on a model's Muon batches (each shape's matrices together, as the fused step batches them), with
# kernel=cublas and kernel=triton (newton_schulz.NS_KERNELS), each batch alone and the whole model, in alternating
# rounds; each kernel's result first checked against the same iteration in fp32. Beside the floors at the bf16 rate of
# the large square GEMM in the same run: every FLOP of the iteration (what cublas computes), and only those of the
# entries on and above the diagonals of X Xᵀ and A·A (the least triton computes).
NS_CASES = {f"ns-{name}": name for name in MUON_MODELS}
ALL_BATCHES = "all"


def ns_batches(cfg: ModelConfig) -> list[tuple[tuple, int]]:
    """The model's Muon batches: (shape, count) for each shape of its hidden matrices."""
    return sorted(Counter(model_shapes(cfg)[0]).items())


def batch_name(shape: tuple, count: int) -> str:
    """A batch's row name: its matrices' shape and their number."""
    return f"{shape[0]}x{shape[1]} x{count}"


def ns_inputs(cfg: ModelConfig, device, seed=0) -> dict[tuple, torch.Tensor]:
    """Each batch's bf16 matrices, (count, rows, cols), by shape."""
    gen = torch.Generator(device).manual_seed(seed)
    return {shape: torch.randn(count, *shape, device=device, generator=gen).bfloat16()
            for shape, count in ns_batches(cfg)}


def check_ns_kernels(inputs: dict) -> None:
    """Each kernel's result on each batch against Newton–Schulz on an fp32 copy of it (torch's fp32 GEMMs): every
    matrix within MUON_TOLERANCE (relative Frobenius distance), else ValidationError."""
    for shape, x in inputs.items():
        want = newton_schulz.orthogonalize(x.float())
        for kernel in newton_schulz.NS_KERNELS:
            got = newton_schulz.orthogonalize(x.clone(), kernel=kernel).float()
            distance = (torch.linalg.vector_norm(got - want, dim=(-2, -1))
                        / torch.linalg.vector_norm(want, dim=(-2, -1))).max().item()
            if not distance <= MUON_TOLERANCE:
                raise ValidationError(f"ns_kernel={kernel}: {shape[0]}x{shape[1]}: its result is {distance:.3g} of "
                                      f"the fp32 iteration's away (relative Frobenius distance)")
        del want


def ns_runs(inputs: dict) -> dict[tuple[str, str], Callable]:
    """(kernel, batch) -> one call orthogonalizing that batch (`ALL_BATCHES`: every batch), in place: each call
    normalizes its input first, so repeated calls stay in Newton–Schulz's range."""
    def run(kernel, batches):
        def call():
            for x in batches:
                newton_schulz.orthogonalize(x, kernel=kernel)
        return call

    batches = [(ALL_BATCHES, list(inputs.values()))] + [(batch_name(s, x.size(0)), [x]) for s, x in inputs.items()]
    return {(kernel, batch): run(kernel, xs) for kernel in newton_schulz.NS_KERNELS for batch, xs in batches}


def ns_floors(batches: list[tuple[tuple, int]], gemm_flops: float) -> dict:
    """FLOPs and floor ms (at `gemm_flops` FLOP/s) of the batches: every FLOP, and the symmetric count."""
    flops = sum(count * newton_schulz.flops(shape) for shape, count in batches)
    symmetric = sum(count * newton_schulz.flops(shape, symmetric=True) for shape, count in batches)
    return dict(ns_flops=flops, symmetric_flops=symmetric, floor_ms=flops / gemm_flops * 1e3,
                symmetric_floor_ms=symmetric / gemm_flops * 1e3)


def run_ns_case(case: str, gemm_flops: float, rounds: int, calls: int) -> dict:
    """The case's batches checked, then each (kernel, batch) timed in alternating rounds, beside its floors."""
    cfg = MUON_MODELS[NS_CASES[case]]
    batches = ns_batches(cfg)
    inputs = ns_inputs(cfg, "cuda")
    check_ns_kernels(inputs)
    torch.cuda.empty_cache()
    runs = ns_runs(inputs)
    measured = bench.alternating_rounds({f"{k} {b}": fn for (k, b), fn in runs.items()}, rounds, calls)
    floors = {ALL_BATCHES: ns_floors(batches, gemm_flops)}
    floors.update({batch_name(s, count): ns_floors([(s, count)], gemm_flops) for s, count in batches})
    rows = []
    for (kernel, batch) in runs:
        spread, floor = bench.Spread.of(measured[f"{kernel} {batch}"]), floors[batch]
        rows.append(dict(batch=batch, kernel=kernel, ms=spread.median, low=spread.low, high=spread.high,
                         tflops=floor["ns_flops"] / (spread.median * 1e-3) / 1e12,
                         of_floor=spread.median / floor["floor_ms"],
                         of_symmetric_floor=spread.median / floor["symmetric_floor_ms"]))
    rows.sort(key=lambda r: (r["batch"] != ALL_BATCHES, r["batch"]))
    return dict(matrices=sum(c for _, c in batches), **floors[ALL_BATCHES], rows=rows)


NS_TABLE = (bench.Column("batch", "batch"), bench.Column("ns_kernel", "kernel"),
            bench.Column("ms", lambda r: f"{r['ms']:.3f} ({r['low']:.3f}-{r['high']:.3f})"),
            bench.Column("TFLOP/s", "tflops", ".0f"), bench.Column("x floor", "of_floor", ".2f"),
            bench.Column("x symmetric floor", "of_symmetric_floor", ".2f"))


def ns_report(results: dict) -> list[str]:
    lines = []
    for case, res in results.items():
        lines += ["", f"{case}: Newton-Schulz on {res['matrices']} matrices; floor {res['floor_ms']:.3f} ms "
                      f"({res['ns_flops'] / 1e12:.2f} TFLOP), {res['symmetric_floor_ms']:.3f} ms counting X X^T and "
                      f"A A on and above their diagonals ({res['symmetric_flops'] / 1e12:.2f} TFLOP)"]
        lines += [f"  {line}" for line in bench.table(res["rows"], NS_TABLE)]
    return lines


# -- Muon's quality at a fixed architecture ---------------------------------------------------------------------------
def quality_run_dirs(paths) -> list[Path]:
    """The runs `paths` name: a run dir itself, a sweep's dir its cells (each dir beneath with a metrics.jsonl)."""
    from minitrain.tools import report

    return [run for p in map(Path, paths)
            for run in ([p] if report.is_run_dir(p) else sorted(m.parent for m in p.glob(f"*/{METRICS}")))]


def read_quality_run(run_dir) -> dict:
    """A run's optimizer, its lrs (trainer.lr; Muon's), its validation loss by step, whether every logged loss was
    finite, its last logged step."""
    import math

    import yaml

    from minitrain.tools import report

    run_dir = Path(run_dir)
    steps = report.read_step_records(run_dir / METRICS)
    config = yaml.safe_load((run_dir / RECORD / CONFIG_RECORD).read_text())
    optimizer = config["optimizer"]["name"]
    losses = [r[k] for r in steps for k in ("train/loss", "val/loss") if k in r]
    return {"dir": str(run_dir), "optimizer": optimizer, "lr": config["trainer"]["lr"],
            "muon_lr": config["optimizer"]["muon"]["lr"] if optimizer == "muon" else None,
            "val": {r["step"]: r["val/loss"] for r in steps if r.get("val/loss") is not None},
            "finite": all(x is not None and math.isfinite(x) for x in losses),
            "last_step": max((r["step"] for r in steps), default=0)}


def final_loss(run: dict) -> float:
    """The validation loss at its last evaluation; infinite for a run with a non-finite loss or none evaluated."""
    return run["val"][max(run["val"])] if run["finite"] and run["val"] else float("inf")


def steps_to_reach(run: dict, loss: float) -> int | None:
    """The first evaluated step at which `run`'s validation loss is at most `loss`; None if none is."""
    return next((s for s, v in sorted(run["val"].items()) if v <= loss), None)


def quality(runs: list[dict]) -> dict:
    """Each optimizer's best run (the lowest final validation loss of its lr sweep, all of the same length), and the
    steps Muon's best needs to reach AdamW's best final loss (at the runs' evaluation steps)."""
    best = {name: min((r for r in runs if r["optimizer"] == name), key=final_loss, default=None)
            for name in ("adamw", "muon")}
    if None in best.values():
        raise ValueError("the quality comparison needs AdamW runs and Muon runs")
    if len({r["last_step"] for r in runs}) != 1:
        raise ValueError("the runs differ in length: " + ", ".join(f"{r['dir']}: {r['last_step']}" for r in runs))
    target = final_loss(best["adamw"])
    reached = steps_to_reach(best["muon"], target)
    steps = best["adamw"]["last_step"]
    return {"best": best, "adamw_final": target, "muon_final": final_loss(best["muon"]), "muon_steps": reached,
            "steps": steps, "muon_share": None if reached is None else reached / steps}


def quality_report(runs: list[dict], result: dict) -> list[str]:
    def lrs(r):
        return f"trainer.lr {r['lr']:g}" + (f" optimizer.muon.lr {r['muon_lr']:g}" if r["muon_lr"] is not None else "")

    lines = [f"{r['optimizer']} {lrs(r)}: {'finite' if r['finite'] else 'NON-FINITE LOSS'} | val "
             + " ".join(f"{s}:{v:.4f}" for s, v in sorted(r["val"].items())) for r in runs]
    adamw, muon = result["best"]["adamw"], result["best"]["muon"]
    lines.append(f"best AdamW: {lrs(adamw)}, final validation loss {result['adamw_final']:.4f} "
                 f"at step {result['steps']}")
    lines.append(f"best Muon: {lrs(muon)}, final validation loss {result['muon_final']:.4f}")
    if result["muon_steps"] is None:
        lines.append("Muon's best never reaches AdamW's best final loss")
    else:
        lines.append(f"Muon reaches AdamW's final loss at step {result['muon_steps']} of {result['steps']} "
                     f"({result['muon_share']:.0%} of the steps)")
    return lines
