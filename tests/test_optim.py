"""AdamW (loop / foreach / fused) and TorchAdamW against torch references: torch.optim.AdamW,
clip_grad_norm_, GradScaler; the fused finalize kernel against the torch rule it is the twin of."""

import io
import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from minitrain.amp import DynamicLossScaler
from minitrain.loss_scale import LossScaling
from minitrain.tools.live_bytes import LiveBytes
from minitrain.optim import AdamW, Numerics, TorchAdamW
from minitrain.optim.decision import Counters, decide_step
from minitrain.optim.adamw_triton import BLOCK, GRAD_MULT, INV_BC1, INV_BC2_SQRT, N_SCALARS, NOT_SKIPPED, finalize

from conftest import assert_bit_identical, round_trip

IMPLS = ["loop", "foreach", "fused"]
SHAPES = [(1,), (13,), (1025,), (3, 5, 7), (BLOCK + 37,), (2, BLOCK)]
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def params_like(values, dtype):
    return [torch.nn.Parameter(v.detach().clone().to(dtype)) for v in values]


def two_groups(ps):
    """Per-group lr and weight decay, as the trainer uses them."""
    return [{"params": ps[::2]}, {"params": ps[1::2], "lr": 3e-3, "weight_decay": 0.0}]


def group_order(n):
    """Index into the param list of the optimizer's i-th param (state_dict numbering)."""
    return list(range(0, n, 2)) + list(range(1, n, 2))


def set_grads(ps, grads):
    for p, g in zip(ps, grads):
        p.grad.copy_(g) if p.grad is not None else setattr(p, "grad", g.clone())


def reference_step(ref, opt, grads, max_norm):
    for p, g in zip(ref, grads):
        p.grad = g.float().clone()
    norm = torch.nn.utils.clip_grad_norm_(ref, max_norm or float("inf"))
    opt.step()
    return norm


def state(opt, i, key):
    return opt.state_dict()["state"][i][key]


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_parity_late_bias_correction(impl):
    """10 steps, odd shapes, 2 groups, moments preloaded at step 1900, lr changed every step."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    m0 = [0.1 * torch.randn(s) for s in SHAPES]
    v0 = [0.01 * torch.rand(s) for s in SHAPES]
    ps, ref = params_like(init, torch.float32), params_like(init, torch.float32)
    opt = AdamW(two_groups(ps), max_grad_norm=None, impl=impl, **HP)
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    order = group_order(len(SHAPES))
    opt.load_state_dict({**opt.state_dict(), "step": torch.tensor(1900.0), "state": {
        i: {"exp_avg": m0[k], "exp_avg_sq": v0[k]} for i, k in enumerate(order)}})
    for r, m, v in zip(ref, m0, v0):
        torch_opt.state[r] = {"step": torch.tensor(1900.0), "exp_avg": m.clone(),
                              "exp_avg_sq": v.clone()}
    for step in range(10):
        for g in opt.param_groups + torch_opt.param_groups:
            g["lr"] = 1e-3 * (1 + step) * (3 if g["weight_decay"] == 0 else 1)
        grads = [torch.randn(s) for s in SHAPES]
        set_grads(ps, grads)
        reference_step(ref, torch_opt, grads, None)
        opt.step()
    for i, k in enumerate(order):
        r = ref[k]
        torch.testing.assert_close(ps[k], r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state(opt, i, "exp_avg"), torch_opt.state[r]["exp_avg"])
        torch.testing.assert_close(state(opt, i, "exp_avg_sq"), torch_opt.state[r]["exp_avg_sq"])
    assert opt.state_dict()["step"].item() == 1910


@pytest.mark.parametrize("impl", IMPLS)
def test_bias_correction_counts_steps_taken(impl):
    """The first steps, where bias correction is large (t=1: 1/(1-beta1) = 10), after an overflowing first
    step: a skipped step must not count, so the next one runs at t=1, as torch's AdamW's first step."""
    torch.manual_seed(12)
    init = [torch.randn(s) for s in SHAPES[:5]]
    ps, ref = params_like(init, torch.float32), params_like(init, torch.float32)
    opt = AdamW(two_groups(ps), max_grad_norm=None, impl=impl, **HP)
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    set_grads(ps, [torch.full(s, float("nan")) for s in SHAPES[:5]])
    opt.step()
    for _ in range(3):
        grads = [torch.randn(s) for s in SHAPES[:5]]
        set_grads(ps, grads)
        reference_step(ref, torch_opt, grads, None)
        opt.step()
        for p, r in zip(ps, ref):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert opt.state_dict()["step"].item() == 3


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_decay_shrinks_the_master(impl):
    """Decay-dominated steps (lr*wd = 0.05, gradients far below eps): the decay must scale the fp32 master,
    not be computed from the bf16 compute copy, whose rounding error times lr*wd (~1e-4 relative per step)
    this tolerance sees."""
    torch.manual_seed(13)
    init = [torch.randn(s).bfloat16().float() for s in SHAPES[:5]]
    ps, ref = params_like(init, torch.bfloat16), params_like(init, torch.float32)
    hp = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=1.0)
    opt = AdamW(ps, max_grad_norm=None, impl=impl, **hp)
    torch_opt = torch.optim.AdamW(ref, **hp)
    for _ in range(4):
        grads = [(1e-12 * torch.randn(s)).bfloat16() for s in SHAPES[:5]]
        set_grads(ps, grads)
        reference_step(ref, torch_opt, grads, None)
        opt.step()
    for i, (p, r) in enumerate(zip(ps, ref)):
        torch.testing.assert_close(state(opt, i, "master"), r.detach(), rtol=1e-6, atol=0)
        assert torch.equal(p, state(opt, i, "master").bfloat16())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_equal_fp32_adamw(dtype, impl):
    """Low-precision params: masters follow fp32 AdamW on an fp32 copy (clipped, and unscaled
    for fp16); the compute copy is exactly the master's cast."""
    torch.manual_seed(1)
    init = [torch.randn(s).to(dtype) for s in SHAPES[:5]]
    ps, ref = params_like(init, dtype), params_like(init, torch.float32)
    scaling = LossScaling(init_scale=2.0**10) if dtype == torch.float16 else None
    opt = AdamW(two_groups(ps), max_grad_norm=1.0, impl=impl, **HP, numerics=Numerics(loss_scaling=scaling))
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    scale = 2.0**10 if scaling else 1.0
    for _ in range(5):
        grads = [torch.randn(p.shape).to(dtype) for p in ps]
        set_grads(ps, [(g.float() * scale).to(dtype) for g in grads])
        reference_step(ref, torch_opt, grads, 1.0)
        opt.step()
    for i, k in enumerate(group_order(len(ps))):
        master = state(opt, i, "master")
        torch.testing.assert_close(master, ref[k].detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(ps[k], master.to(dtype))


def snapshot(opt, ps):
    sd = opt.state_dict()
    tensors = [p.detach().clone() for p in ps] + [sd["step"].clone()]
    for s in sd["state"].values():
        tensors += [t.clone() for t in s.values()]
    return tensors


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_overflow_skips_whole_step(impl, bad):
    torch.manual_seed(2)
    ps = params_like([torch.randn(s) for s in SHAPES[:5]], torch.float16)
    opt = AdamW(two_groups(ps), max_grad_norm=1.0, impl=impl, **HP,
                numerics=Numerics(loss_scaling=LossScaling(init_scale=2.0**8)))
    set_grads(ps, [torch.randn(p.shape).half() for p in ps])
    opt.step()  # a real step first, so moments and masters are non-trivial
    before = snapshot(opt, ps)

    grads = [torch.randn(p.shape).half() for p in ps]
    grads[2].view(-1)[7] = bad
    set_grads(ps, grads)
    opt.step()
    assert_bit_identical(snapshot(opt, ps), before)
    assert opt.stats()["loss_scale"].item() == 2.0**7
    assert opt.stats()["skipped_steps"].item() == 1

    set_grads(ps, [torch.randn(p.shape).half() for p in ps])
    opt.step()
    assert opt.state_dict()["step"].item() == 2
    assert not torch.equal(ps[0], before[0])
    assert opt.stats()["skipped_steps"].item() == 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_norm", [0.5, 1e3, None])
def test_clipping_matches_clip_grad_norm(impl, max_norm):
    """Norm of the unscaled grads, clip coefficient as clip_grad_norm_ (0.5: clipped; 1e3: above the norm, a
    coefficient of 1); None = report only. Adam's update barely sees a uniform gradient scale, so the moments
    are compared too: m is (1 - beta1) times the clipped gradient after the first step."""
    torch.manual_seed(3)
    init = [torch.randn(s) for s in SHAPES[:5]]
    ps, ref = params_like(init, torch.float32), params_like(init, torch.float32)
    opt = AdamW(two_groups(ps), max_grad_norm=max_norm, impl=impl, **HP,
                numerics=Numerics(loss_scaling=LossScaling(init_scale=2.0**4)))
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    for _ in range(3):
        grads = [5 * torch.randn(s) for s in SHAPES[:5]]
        set_grads(ps, [g * 2.0**4 for g in grads])
        norm = reference_step(ref, torch_opt, grads, max_norm)
        opt.step()
        torch.testing.assert_close(opt.stats()["grad_norm"], norm)
    for i, k in enumerate(group_order(len(ps))):
        torch.testing.assert_close(ps[k], ref[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state(opt, i, "exp_avg"), torch_opt.state[ref[k]]["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state(opt, i, "exp_avg_sq"), torch_opt.state[ref[k]]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-12)  # a sum of squares: no cancellation


def test_three_thousand_tiny_tensors_fused():
    torch.manual_seed(4)
    init = [torch.randn(1 + i % 5) for i in range(3000)]
    ps, ref = params_like(init, torch.float32), params_like(init, torch.float32)
    opt = AdamW(two_groups(ps), max_grad_norm=1.0, impl="fused", **HP)
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    for _ in range(2):
        grads = [torch.randn(p.shape) for p in ps]
        set_grads(ps, grads)
        reference_step(ref, torch_opt, grads, 1.0)
        opt.step()
    torch.testing.assert_close(torch.cat(ps), torch.cat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_masters_prevent_swamping(impl):
    """An update of ~lr=1e-3 per step is below half a bf16 ulp at 1.0 (2^-9): without masters
    every step rounds back to 1.0; with them the steps accumulate."""
    kept = {}
    for master in (False, True):
        p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        opt = AdamW([p], lr=1e-3, weight_decay=0.0, max_grad_norm=None, impl=impl,
                    numerics=Numerics(master_weights=master))
        for _ in range(20):
            p.grad = torch.ones_like(p)
            opt.step()
        kept[master] = p.detach().float()
    assert torch.equal(kept[False], torch.ones(64))
    torch.testing.assert_close(kept[True], torch.full((64,), 0.98), atol=4e-3, rtol=0)


def test_impls_agree():
    """fp16 + scaler + clipping + two groups + an overflow step: loop and foreach share the
    list math (equal bits on CPU); fused matches them to rounding."""
    torch.manual_seed(5)
    init = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s).half() for s in SHAPES] for _ in range(4)]
    grads[2][1][3] = float("inf")
    out = {}
    for impl in IMPLS:
        ps = params_like(init, torch.float16)
        opt = AdamW(two_groups(ps), max_grad_norm=1.0, impl=impl, **HP,
                    numerics=Numerics(loss_scaling=LossScaling(init_scale=2.0**6, growth_interval=2)))
        for gs in grads:
            set_grads(ps, gs)
            opt.step()
        out[impl] = snapshot(opt, ps) + [opt.loss_scaler.get_scale().clone(), opt.loss_scaler.growth_tracker.clone(),
                                         opt.stats()["skipped_steps"].clone()]
    assert_bit_identical(out["loop"], out["foreach"])
    for a, b in zip(out["fused"], out["foreach"]):
        if a.dtype == torch.float16:  # the compute copy: fp32 masters a rounding apart may round apart
            torch.testing.assert_close(a, b, rtol=torch.finfo(a.dtype).eps, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_state_dict_resume_is_bit_identical(impl):
    torch.manual_seed(6)
    init = [torch.randn(s) for s in SHAPES[:5]]
    grads = [[torch.randn(s).to(torch.bfloat16) for s in SHAPES[:5]] for _ in range(6)]
    ps = params_like(init, torch.bfloat16)
    opt = AdamW(two_groups(ps), impl=impl, **HP)
    for gs in grads[:3]:
        set_grads(ps, gs)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in ps], "opt": opt.state_dict()}, buf)
    for gs in grads[3:]:
        set_grads(ps, gs)
        opt.step()

    buf.seek(0)
    ckpt = torch.load(buf)
    ps2 = params_like(ckpt["model"], torch.bfloat16)
    opt2 = AdamW(two_groups(ps2), impl=impl, **{**HP, "lr": 0.5})  # lr comes from the ckpt
    opt2.load_state_dict(ckpt["opt"])
    for gs in grads[3:]:
        set_grads(ps2, gs)
        opt2.step()
    assert_bit_identical(snapshot(opt2, ps2), snapshot(opt, ps))


@pytest.mark.parametrize("impl", ["foreach", "torch"])
def test_skipped_steps_survive_a_resume(impl):
    """amp/skipped_steps is logged from the optimizer's count: a resumed run must go on counting from it."""
    def build():
        p = torch.nn.Parameter(torch.ones(5))
        if impl == "torch":
            return TorchAdamW([p], loss_scaling=LossScaling(init_scale=2.0**8))
        return AdamW([p], impl=impl, numerics=Numerics(loss_scaling=LossScaling(init_scale=2.0**8)))

    def overflowing_step(opt):
        param = opt.param_groups[0]["params"][0]
        opt.scale((param * float("inf")).sum()).backward()  # an inf gradient
        opt.step()
        opt.zero_grad()

    saved = build()
    overflowing_step(saved)
    resumed = build()
    resumed.load_state_dict(round_trip(saved.state_dict()))
    assert resumed.stats()["skipped_steps"].item() == 1
    overflowing_step(resumed)
    assert resumed.stats()["skipped_steps"].item() == 2


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_fp32_main_grads_and_foreign_zero_grad(impl):
    """grad_dtype=fp32 accumulates micro-batches into fp32 main grads and frees p.grad; with
    param-dtype grads, a model.zero_grad() (set_to_none) elsewhere still lands in the buffer."""
    torch.manual_seed(7)
    x = [torch.randn(4, 8) for _ in range(2)]
    init = torch.randn(8, 3).to(torch.bfloat16)
    for grad_dtype in ("fp32", None):
        w = torch.nn.Parameter(init.clone())
        opt = AdamW([w], impl=impl, max_grad_norm=None, **HP, numerics=Numerics(grad_dtype=grad_dtype))
        ref = torch.nn.Parameter(init.float())
        torch_opt = torch.optim.AdamW([ref], **HP)
        for _ in range(2):
            opt.zero_grad()
            w.grad = None  # what model.zero_grad() does
            expect = torch.zeros(8, 3)
            for xb in x:
                probe = torch.nn.Parameter(init.clone())
                (xb.to(torch.bfloat16) @ probe).square().sum().backward()
                (xb.to(torch.bfloat16) @ w).square().sum().backward()
                expect = expect + probe.grad.float() if grad_dtype else \
                    (expect.to(torch.bfloat16) + probe.grad).float()
            if grad_dtype:
                assert w.grad is None
            reference_step([ref], torch_opt, [expect], None)
            opt.step()
        torch.testing.assert_close(state(opt, 0, "master"), ref.detach(), rtol=1e-5, atol=1e-6)


def test_fused_on_cpu_needs_interpreter(monkeypatch):
    from minitrain import triton_runtime

    monkeypatch.setattr(triton_runtime, "interpreted", lambda: False)  # as if TRITON_INTERPRET was unset at import
    with pytest.raises(RuntimeError, match="foreach"):
        AdamW([torch.nn.Parameter(torch.randn(3, device="cpu"))], impl="fused")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are only observable on CUDA")
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_step_never_syncs(impl):
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda").half()) for s in SHAPES]
    opt = AdamW(two_groups(ps), impl=impl, **HP, numerics=Numerics(loss_scaling=LossScaling()))
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()  # first step: compiles kernels, uploads hyperparameters
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            opt.set_lr(1e-4 * (step + 1))
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("impl", IMPLS)
def test_compute_copy_rounds_ties_to_even(impl):
    """Masters exactly halfway between two bf16 neighbours: the compute copy must round as torch's
    cast does (to nearest, ties to even), which random data almost never exercises."""
    torch.manual_seed(8)
    below = torch.randn(BLOCK + 11).bfloat16()
    above = (below.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 away from zero
    ties = (below.float() + above.float()) / 2  # exact in fp32: bf16 has 16 fewer mantissa bits
    p = torch.nn.Parameter(torch.zeros_like(below))
    opt = AdamW([p], lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_grad_norm=None, impl=impl)
    sd = opt.state_dict()
    sd["state"][0]["master"] = ties
    opt.load_state_dict(sd)
    p.grad = torch.zeros_like(p)
    opt.step()  # lr 0: the master stays, the kernel writes its rounding into the compute copy
    assert torch.equal(state(opt, 0, "master"), ties)
    assert torch.equal(p.detach().view(torch.int16), ties.bfloat16().view(torch.int16))


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_grads_stay_autograds_own(impl):
    """No flat gradient buffer outside a step: backward leaves p.grad autograd's own tensor (DDP/FSDP2 see
    plain grads). fused reads it in place; foreach gathers it into a flat buffer and points p.grad at its
    views, which zero_grad(set_to_none) frees. Steps match torch's AdamW."""
    torch.manual_seed(3)
    init = [torch.randn(s) for s in SHAPES]
    ps, ref = params_like(init, torch.float32), params_like(init, torch.float32)
    opt = AdamW(two_groups(ps), max_grad_norm=None, impl=impl, **HP)
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        torch_opt.zero_grad(set_to_none=True)
        assert all(getattr(b.grads, "buffer", None) is None for b in opt.buckets) and all(p.grad is None for p in ps)
        xs = [torch.randn(s) for s in SHAPES]
        for params in (ps, ref):
            for _ in range(2):  # two micro-batches: the second accumulates into autograd's tensor
                sum((p * x).square().sum() for p, x in zip(params, xs)).backward()
        assert all(getattr(b.grads, "buffer", None) is None for b in opt.buckets)
        autograds = [p.grad for p in ps]
        with LiveBytes() as live:
            opt.step()
        torch_opt.step()
        if impl == "fused":  # nothing gradient-sized made: a few bytes of offsets and hyperparameters
            assert all(p.grad is g for p, g in zip(ps, autograds))
            assert live.peak <= 16 * len(ps) + 64
        else:
            assert all(p.grad is view for b in opt.buckets for view, p in zip(b.grads.views, b.owners))
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)


def test_fused_reads_gradients_wherever_they_are():
    """Gradients that are views into one larger buffer at odd element offsets (no 16-byte alignment), a
    missing one (None: zeros, as foreach's gather makes it), new values at the same addresses (offsets
    cached), then new addresses: every step matches foreach on the same gradients."""
    torch.manual_seed(11)
    init = [torch.randn(s).bfloat16() for s in SHAPES]
    fused_ps, foreach_ps = params_like(init, torch.bfloat16), params_like(init, torch.bfloat16)
    fused = AdamW(two_groups(fused_ps), impl="fused", **HP)
    foreach = AdamW(two_groups(foreach_ps), impl="foreach", **HP)
    numels = [p.numel() for p in fused_ps]
    for step in range(4):
        if step in (0, 2):  # (re)place the gradients: views of one buffer, each at an odd element offset
            arena = torch.empty(sum(numels) + 2 * len(numels) + 1, dtype=torch.bfloat16)
            starts = [1 + sum(numels[:i]) + 2 * i for i in range(len(numels))]
            for p, start, n in zip(fused_ps, starts, numels):
                p.grad = arena[start:start + n].view(p.shape)
        for p, q in zip(fused_ps, foreach_ps):
            g = torch.randn(p.shape).bfloat16()
            p.grad.copy_(g)
            q.grad = g.clone()
        if step == 1:  # a tensor of two blocks: each of its blocks must read the zero block
            fused_ps[4].grad = foreach_ps[4].grad = None
        fused.step()
        foreach.step()
        if step == 1:
            fused_ps[4].grad = arena[starts[4]:starts[4] + numels[4]].view(fused_ps[4].shape)
        for a, b in zip(snapshot(fused, fused_ps), snapshot(foreach, foreach_ps)):  # as in test_impls_agree
            if a.dtype == torch.bfloat16:
                torch.testing.assert_close(a, b, rtol=torch.finfo(a.dtype).eps, atol=0)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_rejects_a_gradient_it_cannot_read_in_place():
    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = AdamW([p], impl="fused", **HP)
    p.grad = torch.randn(6, 4).t()  # the right shape, transposed strides
    with pytest.raises(ValueError, match=r"contiguous.*stride \(1, 4\)"):
        opt.step()


def step_case(rng, skipped, clip, scaled):
    """One step's inputs to decide: partial sums of squares (one non-finite when skipped), counters at a random
    step, and a scaler at a random point of its growth cycle (the boundary included)."""
    n = rng.choice([1, 3, 1500])  # 1500 > FINALIZE_BLOCK: the kernel's loop runs twice
    partials = torch.rand(n) * 10.0 ** rng.randint(-4, 4)
    if skipped:
        partials[rng.randrange(n)] = rng.choice([float("inf"), float("nan")])
    counters = Counters(torch.tensor(float(rng.choice([0, 1, 7, 1900]))),
                        torch.tensor(rng.randint(0, 5), dtype=torch.int32), torch.tensor(0.0))
    scaler = None
    if scaled:
        scaler = DynamicLossScaler(LossScaling(init_scale=2.0 ** rng.randint(0, 24),
                                               growth_factor=rng.choice([2.0, 4.0]),
                                               backoff_factor=rng.choice([0.5, 0.25]),
                                               growth_interval=rng.randint(1, 4)))
        scaler.growth_tracker.fill_(rng.randrange(scaler.rule.growth_interval))
    max_grad_norm = 10 ** rng.uniform(-2, 1) if clip else None
    return partials, counters, scaler, max_grad_norm, rng.choice([(0.9, 0.95), (0.8, 0.999)])


def copy_of(counters, scaler):
    twin = None
    if scaler is not None:
        twin = DynamicLossScaler()
        twin.load_state_dict(scaler.state_dict())
    return Counters(*(t.clone() for t in (counters.step, counters.skipped, counters.grad_norm))), twin


@pytest.mark.parametrize("skipped,clip,scaled", list(itertools.product([False, True], repeat=3)))
def test_finalize_kernel_is_decide_steps_twin(skipped, clip, scaled):
    """The fused step's finalize kernel decides what decide_step (the torch reference) decides: the step's
    scalars, the step and skip counters, the norm, the loss scale and growth tracker."""
    import random

    rng = random.Random(4 * skipped + 2 * clip + scaled)
    torch.manual_seed(14)
    for _ in range(4):
        partials, counters, scaler, max_grad_norm, betas = step_case(rng, skipped, clip, scaled)
        ref_counters, ref_scaler = copy_of(counters, scaler)
        want = decide_step(partials.sum(), ref_counters, max_grad_norm, betas, ref_scaler)
        got = torch.full((N_SCALARS.value,), float("nan"))
        finalize(partials, counters, scaler, max_grad_norm, betas, got)
        slots = [GRAD_MULT.value, NOT_SKIPPED.value, INV_BC1.value, INV_BC2_SQRT.value]
        torch.testing.assert_close(got[slots], torch.stack([want.grad_mult, want.not_skipped, want.inv_bc1,
                                                            want.inv_bc2_sqrt]), rtol=1e-5, atol=0)
        assert counters.step.item() == ref_counters.step.item()
        assert counters.skipped.item() == ref_counters.skipped.item()
        torch.testing.assert_close(counters.grad_norm, ref_counters.grad_norm, rtol=1e-5, atol=0, equal_nan=True)
        if scaled:
            assert scaler.get_scale().item() == ref_scaler.get_scale().item()
            assert scaler.growth_tracker.item() == ref_scaler.growth_tracker.item()


@pytest.mark.parametrize("scaling", [None, LossScaling(init_scale=2.0**8, growth_interval=2)])
def test_torch_adamw_is_torchs_recipe(scaling):
    """TorchAdamW, the benchmarks' plain-PyTorch reference, is torch.optim.AdamW + clip_grad_norm_ + GradScaler
    written out: the loss scaled through scale(), per-group lr via set_lr, clipping active, an overflowing
    step skipped and counted, the scale backed off and grown."""
    torch.manual_seed(15)
    init = [torch.randn(s) for s in SHAPES[:5]]
    ps, ref = params_like(init, torch.float32), params_like(init, torch.float32)
    opt = TorchAdamW(two_groups(ps), max_grad_norm=1.0, loss_scaling=scaling, **HP)
    torch_opt = torch.optim.AdamW(two_groups(ref), **HP)
    scaler = torch.amp.GradScaler(ref[0].device.type, init_scale=scaling.init_scale,
                                  growth_interval=scaling.growth_interval) if scaling else None
    overflow_step = 2 if scaling else None
    for step in range(6):
        xs = [3 * torch.randn(s) for s in SHAPES[:5]]
        if step == overflow_step:
            xs[1].view(-1)[0] = float("inf")
        lr = 1e-3 * (step + 1)
        opt.set_lr(lr)
        opt.scale(sum((p * x).sum() for p, x in zip(ps, xs))).backward()
        opt.step()
        for g in torch_opt.param_groups:
            g["lr"] = lr
        loss = sum((p * x).sum() for p, x in zip(ref, xs))
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(torch_opt)
        norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        if scaler:
            scaler.step(torch_opt)
            scaler.update()
        else:
            torch_opt.step()
        if step != overflow_step:
            torch.testing.assert_close(opt.stats()["grad_norm"], norm)
        if scaler:
            assert opt.stats()["loss_scale"].item() == scaler.get_scale()
        else:
            assert "loss_scale" not in opt.stats()  # no scaler, no scale to log
        opt.zero_grad()
        torch_opt.zero_grad()
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert opt.stats()["skipped_steps"].item() == (1 if scaling else 0)


def precision(param_dtype, grad_dtype, master_weights, loss_scaling):
    """A resolved precision, as minitrain.precision.Precision gives build_adamw."""
    from types import SimpleNamespace

    return SimpleNamespace(param_dtype=param_dtype, grad_dtype=grad_dtype, master_weights=master_weights,
                           fp32_main_grads=grad_dtype != param_dtype, loss_scaling=loss_scaling,
                           loss_scale=LossScaling(init_scale=2.0**9, growth_factor=4.0, backoff_factor=0.25,
                                                  growth_interval=7))


def test_build_adamw_follows_the_precision():
    """fp16 + loss scaling: a scaler with the precision's parameters. bf16 under FSDP: the stored params are the
    fp32 masters and their grads fp32, so no fp32 main-grad hooks. torch: TorchAdamW, never on shards; our AdamW on
    shards sums their squares through the job's reduction."""
    from minitrain.errors import ConfigError
    from minitrain.optim import build_adamw

    fp16 = build_adamw([torch.nn.Parameter(torch.randn(3).half())], "foreach",
                       precision(torch.float16, torch.float16, True, True))
    scaler = fp16.loss_scaler
    assert (scaler.get_scale().item(), scaler.rule) == (2.0**9, LossScaling(2.0**9, 4.0, 0.25, 7))
    assert fp16.buckets[0].state.master is not None
    sharded_bf16 = build_adamw([torch.nn.Parameter(torch.randn(3))], "foreach",
                               precision(torch.bfloat16, torch.bfloat16, True, False))
    assert sharded_bf16.buckets[0].grads.dtype == torch.float32 and sharded_bf16.loss_scaler is None
    main_grads = build_adamw([torch.nn.Parameter(torch.randn(3).bfloat16())], "foreach",
                             precision(torch.bfloat16, torch.float32, True, False))
    assert main_grads.buckets[0].grads.dtype == torch.float32
    reference = precision(torch.float32, torch.float32, False, False)
    assert isinstance(build_adamw([torch.nn.Parameter(torch.randn(3))], "torch", reference), TorchAdamW)
    with pytest.raises(ConfigError, match="optimizer.impl=torch"):
        build_adamw([torch.nn.Parameter(torch.randn(3))], "torch", reference, reduce_sumsq=lambda t: t)
    reduced, shard = [], torch.nn.Parameter(torch.randn(3))
    shard.grad = torch.ones(3)
    build_adamw([shard], "foreach", reference, reduce_sumsq=reduced.append).step()
    assert len(reduced) == 1  # the sharded job's sum of squares goes through its reduction, once a step


def test_bench_optimizer_rows_pass_their_check_and_a_wrong_one_fails(monkeypatch):
    """The optimizer benchmark validates each row's first step before timing it: every row (ours through the
    interpreter) passes on small shapes; a row that skips the update, or whose master copy autograd records
    (the unfair torch baseline it used to time), is refused."""
    from minitrain.tools.benchmarks import optimizer as bench

    shapes = [(48, 40), (40,), (BLOCK + 5,)]
    weights, grads = bench.inputs(shapes, torch.get_default_device())
    references = {clips: bench.reference_update(weights, grads, clips) for clips in (False, True)}
    for name in bench.ROWS:
        bench.checked_first_step(name, weights, grads, references)

    def recorded_master_path(w, g):
        step, nbytes, result = bench.torch_master_path(w, g)
        masters, params = result()
        return lambda: (step(), torch._foreach_copy_(params, masters)), nbytes, result

    monkeypatch.setitem(bench.ROWS, "no update", (lambda w, g: (lambda: None, 0, lambda: (w, None)), False))
    monkeypatch.setitem(bench.ROWS, "recorded", (recorded_master_path, False))
    with pytest.raises(bench.ValidationError, match="no update: tensor 0"):
        bench.checked_first_step("no update", weights, grads, references)
    with pytest.raises(bench.ValidationError, match="recorded: autograd recorded"):
        bench.checked_first_step("recorded", weights, grads, references)
