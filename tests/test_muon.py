"""Muon (loop / foreach / fused) against torch.optim.Muon, op for op, and against plain-PyTorch references for
every precision; its AdamW side against torch.optim.AdamW; one decision (skip, clip, loss scale) for both sides;
state_dict resumes; Newton–Schulz's batching, FLOP count and workspace; the Exchange under two processes."""

import io
import math
import os
import socket

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch
import torch.multiprocessing as mp

from minitrain.loss_scale import LossScaling
from minitrain.optim import Muon, MuonHyper, Numerics
from minitrain.optim import newton_schulz as ns
from minitrain.tools.live_bytes import LiveBytes

from conftest import assert_bit_identical

IMPLS = ["loop", "foreach", "fused"]
# Tall, wide and square; two of one shape (one batch); one past BLOCK elements in both orientations (two rows of
# the work table each, the second partial).
MATRICES = [(24, 40), (40, 24), (24, 40), (16, 16), (70, 64), (64, 70)]
OTHERS = [(40,), (7,), (24,)]  # AdamW's: norms, biases
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
ADAMW = dict(adamw_lr=1e-3, betas=(0.9, 0.95), eps=1e-8, adamw_weight_decay=0.0)


def params_like(values, dtype=torch.float32):
    return [torch.nn.Parameter(v.detach().clone().to(dtype)) for v in values]


def set_grads(ps, grads):
    for p, g in zip(ps, grads):
        p.grad = g.clone()


def momentum(opt, i):
    return opt.state_dict()["state"][i]["momentum_buffer"]


def assert_close_to_torch(ps, ref, opt, torch_opt, order):
    """Momentum buffers the same bits as torch.optim.Muon's; params within a few fp32 rounding steps (the lr's
    product is rounded in fp32 on the device, torch's in double)."""
    for i, k in enumerate(order):
        assert torch.equal(momentum(opt, i), torch_opt.state[ref[k]]["momentum_buffer"]), f"momentum of {k}"
        torch.testing.assert_close(ps[k].detach(), ref[k].detach(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nesterov, adjust_lr", [(True, "original"), (False, "match_rms_adamw")])
def test_update_is_torch_muons(impl, nesterov, adjust_lr):
    """fp32, two groups of their own lr and weight decay, lr changed every step: the same momentum bits as
    torch.optim.Muon and the same params, whatever the shape or the implementation."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in MATRICES]
    ps, ref = params_like(init), params_like(init)
    groups = lambda xs: [{"params": xs[::2], "use_muon": True},  # noqa: E731
                         {"params": xs[1::2], "use_muon": True, "lr": 0.05, "weight_decay": 0.0}]
    opt = Muon(groups(ps), MuonHyper(nesterov=nesterov, adjust_lr=adjust_lr, **MUON), max_grad_norm=None, impl=impl,
               **ADAMW)
    torch_opt = torch.optim.Muon([{k: v for k, v in g.items() if k != "use_muon"} for g in groups(ref)],
                                 nesterov=nesterov, adjust_lr_fn=adjust_lr, **MUON)
    for step in range(4):
        opt.set_lr(1e-3 * (1 + step))  # the schedule's lr: each group keeps its ratio to adamw_lr
        for g, base in zip(torch_opt.param_groups, (0.02, 0.05)):
            g["lr"] = base * (1 + step)
        grads = [torch.randn(s) for s in MATRICES]
        set_grads(ps, grads)
        set_grads(ref, grads)
        opt.step()
        torch_opt.step()
    assert_close_to_torch(ps, ref, opt, torch_opt, list(range(0, 6, 2)) + list(range(1, 6, 2)))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.08, 0.2])


def mixed(values, dtype=torch.float32):
    """Muon's matrices, then AdamW's vectors, as the trainer groups them."""
    ps = params_like(values, dtype)
    return ps, [{"params": ps[:len(MATRICES)], "use_muon": True}, {"params": ps[len(MATRICES):]}]


def torch_pair(ref):
    """The plain-PyTorch recipe a user assembles: torch.optim.Muon on the matrices, torch.optim.AdamW on the rest."""
    return (torch.optim.Muon(ref[:len(MATRICES)], **MUON),
            torch.optim.AdamW(ref[len(MATRICES):], lr=ADAMW["adamw_lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                              weight_decay=ADAMW["adamw_weight_decay"]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_one_norm_clips_both_sides(impl, max_norm):
    """The norm is of every gradient, both sides' (clip_grad_norm_ over all params); its clip coefficient scales
    both: the first momentum is (1 - mu) times the clipped gradient, AdamW's m (1 - beta1) times it. 0.5 clips,
    1e3 is above the norm (a coefficient of exactly 1: the whole update is torch's, bit for bit in the momentum)."""
    torch.manual_seed(3)
    init = [torch.randn(s) for s in MATRICES + OTHERS]
    ps, groups = mixed(init)
    ref = params_like(init)
    opt = Muon(groups, MuonHyper(**MUON), max_grad_norm=max_norm, impl=impl, **ADAMW)
    torch_muon, torch_adamw = torch_pair(ref)
    grads = [3 * torch.randn(p.shape) for p in ps]
    set_grads(ps, grads)
    set_grads(ref, grads)
    norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    opt.step()
    torch_muon.step()
    torch_adamw.step()
    torch.testing.assert_close(opt.stats()["grad_norm"], norm)
    for i, r in enumerate(ref[:len(MATRICES)]):
        torch.testing.assert_close(momentum(opt, i), torch_muon.state[r]["momentum_buffer"], rtol=1e-6, atol=0)
    for i, r in enumerate(ref[len(MATRICES):], start=len(MATRICES)):
        torch.testing.assert_close(opt.state_dict()["state"][i]["exp_avg"], torch_adamw.state[r]["exp_avg"],
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(ps[i], r, rtol=1e-6, atol=1e-7)
    if max_norm > 1:
        assert_close_to_torch(ps, ref, opt, torch_muon, range(len(MATRICES)))


def fp32_reference(init, grads_per_step, scale, max_norm):
    """torch.optim.Muon + torch.optim.AdamW on fp32 copies of the params, fed each step's unscaled gradients,
    clipped by clip_grad_norm_ (the plain-PyTorch definition of a step on fp32 masters)."""
    ref = params_like(init)
    torch_muon, torch_adamw = torch_pair(ref)
    for grads in grads_per_step:
        set_grads(ref, [g.float() / scale for g in grads])
        torch.nn.utils.clip_grad_norm_(ref, max_norm)
        torch_muon.step()
        torch_adamw.step()
    return ref


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16_fp32_grads", "bf16_no_master"])
def test_every_precision_follows_the_fp32_reference(impl, precision):
    """bf16 and fp16 params over fp32 masters (fp16 with its gradients scaled by 2^10, the scaler's), fp32 main
    grads, and bf16 without masters: the masters follow the fp32 reference (clipping on, above the norm here: the
    coefficient 1 keeps the Newton–Schulz inputs the reference's bits), the compute copy is exactly their cast; without
    masters each step rounds into the bf16 param, as the reference's values rounded each step."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    torch.manual_seed(1)
    init = [torch.randn(s).to(dtype).float() for s in MATRICES + OTHERS]
    ps, groups = mixed(init, dtype)
    scale = 2.0**10 if precision == "fp16" else 1.0
    opt = Muon(groups, MuonHyper(**MUON), max_grad_norm=1e6, impl=impl, **ADAMW, numerics=Numerics(
        master_weights=precision != "bf16_no_master", grad_dtype="fp32" if precision == "bf16_fp32_grads" else None,
        loss_scaling=LossScaling(init_scale=scale) if precision == "fp16" else None))
    steps = [[(torch.randn(p.shape) * scale).to(dtype) for p in ps] for _ in range(3)]
    for grads in steps:
        if precision == "bf16_fp32_grads":  # what the main-grad hooks accumulate: the bf16 grads, in fp32
            opt.zero_grad()
            for p, g in zip(ps, grads):
                (p * g).sum().backward()
        else:
            set_grads(ps, grads)
        opt.step()
    if precision == "bf16_no_master":
        ref = params_like(init)
        torch_muon, torch_adamw = torch_pair(ref)
        for grads in steps:
            set_grads(ref, [g.float() for g in grads])
            torch_muon.step()
            torch_adamw.step()
            with torch.no_grad():
                for r in ref:
                    r.copy_(r.to(dtype))  # the param holds the bf16 rounding of each step's fp32 result
        for p, r in zip(ps, ref):
            torch.testing.assert_close(p.float(), r.detach(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        return
    ref = fp32_reference(init, steps, scale, 1e6)
    state = opt.state_dict()["state"]
    for i, (p, r) in enumerate(zip(ps, ref)):
        torch.testing.assert_close(state[i]["master"], r.detach(), rtol=2e-6, atol=1e-7)
        assert torch.equal(p.detach(), state[i]["master"].to(dtype))


def snapshot(opt, ps):
    sd = opt.state_dict()
    tensors = [p.detach().clone() for p in ps] + [sd["step"].clone(), sd["skipped_steps"].clone()]
    for s in sd["state"].values():
        tensors += [t.clone() for t in s.values()]
    if opt.loss_scaler is not None:
        tensors += [opt.loss_scaler.get_scale().clone(), opt.loss_scaler.growth_tracker.clone()]
    return tensors


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("side, bad", [("muon", float("inf")), ("muon", float("nan")), ("adamw", float("inf"))])
def test_an_overflow_on_either_side_skips_the_whole_step(impl, side, bad):
    """fp16 with loss scaling: an inf or NaN in one gradient, of a matrix or of a vector, leaves every param,
    master, momentum and moment bit for bit as they were (the momentum pass selects, it does not multiply), backs
    the scale off once and counts one skip; the next step runs, at step 2."""
    torch.manual_seed(2)
    ps, groups = mixed([torch.randn(s) for s in MATRICES + OTHERS], torch.float16)
    opt = Muon(groups, MuonHyper(**MUON), impl=impl, **ADAMW,
               numerics=Numerics(loss_scaling=LossScaling(init_scale=2.0**8)))
    set_grads(ps, [torch.randn(p.shape).half() for p in ps])
    opt.step()  # a real step first: momentum, moments and masters non-trivial
    before = snapshot(opt, ps)
    grads = [torch.randn(p.shape).half() for p in ps]
    grads[4 if side == "muon" else len(MATRICES) + 1].view(-1)[-1] = bad
    set_grads(ps, grads)
    opt.step()
    after = snapshot(opt, ps)
    assert opt.stats()["loss_scale"].item() == 2.0**7 and opt.stats()["skipped_steps"].item() == 1
    assert_bit_identical(after[:len(ps) + 1] + after[len(ps) + 2:-2], before[:len(ps) + 1] + before[len(ps) + 2:-2])
    set_grads(ps, [torch.randn(p.shape).half() for p in ps])
    opt.step()
    assert opt.state_dict()["step"].item() == 2 and not torch.equal(ps[0], before[0])


def test_impls_agree():
    """fp16 + scaler + clipping + an overflow step + growth: loop and foreach share the list math (per-matrix and
    batched Newton–Schulz give the same bits on the CPU); fused computes the same momentum and Newton–Schulz
    inputs, its update a rounding apart."""
    torch.manual_seed(5)
    init = [torch.randn(s) for s in MATRICES + OTHERS]
    grads = [[torch.randn(s).half() for s in MATRICES + OTHERS] for _ in range(4)]
    grads[2][1][3] = float("inf")
    out = {}
    for impl in IMPLS:
        ps = params_like(init, torch.float16)
        opt = Muon([{"params": ps[:len(MATRICES)], "use_muon": True}, {"params": ps[len(MATRICES):]}],
                   MuonHyper(**MUON), impl=impl, max_grad_norm=1.0, **ADAMW,
                   numerics=Numerics(loss_scaling=LossScaling(init_scale=2.0**6, growth_interval=2)))
        for gs in grads:
            set_grads(ps, gs)
            opt.step()
        out[impl] = snapshot(opt, ps)
    assert_bit_identical(out["loop"], out["foreach"])
    for a, b in zip(out["fused"], out["foreach"]):
        if a.dtype == torch.float16:  # the compute copy: masters a rounding apart may round apart
            torch.testing.assert_close(a, b, rtol=torch.finfo(a.dtype).eps, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_state_dict_resume_is_bit_identical(impl):
    """bf16 params, fp32 masters: three steps, a state_dict through torch.save, three more; a new optimizer (another
    lr, which the state_dict replaces) loaded from it takes the same three steps to the same bits. The state holds
    one momentum buffer per matrix, m and v per vector."""
    torch.manual_seed(6)
    init = [torch.randn(s) for s in MATRICES + OTHERS]
    grads = [[torch.randn(s).bfloat16() for s in MATRICES + OTHERS] for _ in range(6)]

    def build(values, lr):
        ps = params_like(values, torch.bfloat16)
        return ps, Muon([{"params": ps[:len(MATRICES)], "use_muon": True}, {"params": ps[len(MATRICES):]}],
                        MuonHyper(**{**MUON, "lr": lr}), impl=impl, **ADAMW)

    ps, opt = build(init, 0.02)
    for gs in grads[:3]:
        set_grads(ps, gs)
        opt.set_lr(5e-4)
        opt.step()
    state = opt.state_dict()["state"]
    assert set(state[0]) == {"momentum_buffer", "master"} and set(state[len(MATRICES)]) == {"exp_avg", "exp_avg_sq",
                                                                                            "master"}
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in ps], "opt": opt.state_dict()}, buf)
    for gs in grads[3:]:
        set_grads(ps, gs)
        opt.step()
    buf.seek(0)
    ckpt = torch.load(buf)
    ps2, opt2 = build(ckpt["model"], 0.5)
    opt2.load_state_dict(ckpt["opt"])
    for gs in grads[3:]:
        set_grads(ps2, gs)
        opt2.step()
    assert_bit_identical(snapshot(opt2, ps2), snapshot(opt, ps))


def test_the_schedule_scales_both_sides_alike():
    """set_lr gives the AdamW side the schedule's lr and Muon's group the same multiple of its own."""
    ps, groups = mixed([torch.randn(s) for s in MATRICES + OTHERS])
    opt = Muon(groups, MuonHyper(**MUON), impl="foreach", **ADAMW)
    opt.set_lr(2.5e-4)
    assert opt.param_groups[1]["lr"] == 2.5e-4
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 / 4)


def test_muon_refuses_what_it_cannot_orthogonalize(monkeypatch):
    from minitrain import triton_runtime

    with pytest.raises(ValueError, match=r"shape \(7,\) takes AdamW"):
        Muon([torch.nn.Parameter(torch.randn(7))], impl="foreach")
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([torch.nn.Parameter(torch.randn(3, 4))], MuonHyper(adjust_lr="none"), impl="foreach")
    monkeypatch.setattr(triton_runtime, "interpreted", lambda: False)  # as if TRITON_INTERPRET was unset at import
    with pytest.raises(RuntimeError, match=r"Muon\(impl='fused'\).*optimizer.impl=foreach"):
        Muon([torch.nn.Parameter(torch.randn(3, 4, device="cpu"))], impl="fused")


# -- Newton–Schulz ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16), (37, 5)])
def test_batched_newton_schulz_is_torchs(shape):
    """A batch of one shape through batched GEMMs, the tall one multiplied on the right: the bits of torch's
    per-matrix, transposing iteration (on the CPU), for 5 steps and for 4 (the result in the other buffer)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(9)
    mats = [torch.randn(shape) for _ in range(3)]
    for steps in (5, 4):
        want = torch.stack([_zeropower_via_newtonschulz(m, ns.NS_COEFFICIENTS, steps, ns.NS_EPS) for m in mats])
        assert torch.equal(ns.orthogonalize(torch.stack(mats).bfloat16(), steps=steps), want)


def test_newton_schulz_orthogonalizes():
    """The output's singular values land in the quintic's band around 1 (torch's docstring: roughly 0.7 to 1.2)."""
    x = torch.randn(2, 32, 96).bfloat16()
    s = torch.linalg.svdvals(ns.orthogonalize(x).float())
    assert s.min() > 0.6 and s.max() < 1.25


def test_lr_ratio_and_flops_count():
    assert ns.lr_ratio((3072, 768), "original") == 2.0 and ns.lr_ratio((768, 3072), "original") == 1.0
    assert ns.lr_ratio((768, 3072), "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(3072))
    m, n = 768, 2304
    assert ns.flops((n, m)) == ns.flops((m, n)) == 5 * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def test_workspace_is_what_orthogonalize_holds():
    """LiveBytes around the call, its input made before: the peak beyond the input is workspace_bytes (+ the norms'
    few bytes)."""
    for shape in [(48, 80), (80, 48)]:
        x = torch.randn(3, *shape).bfloat16()
        with LiveBytes() as live:
            ns.orthogonalize(x)
        assert ns.workspace_bytes(shape, 3) <= live.peak <= ns.workspace_bytes(shape, 3) + 64


def _exchange_worker(rank, port, path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    mats = torch.randn(3, 10, 6).bfloat16()
    out, orthogonalize = {"counts": []}, ns.orthogonalize

    def counted(x, *args):  # how many matrices this rank orthogonalizes
        out["counts"].append(x.size(0))
        return orthogonalize(x, *args)

    ns.orthogonalize = counted
    replicated = ns.Exchange("replicated", rank, 2)
    x = replicated.inputs(3, (10, 6), (10, 6), "cpu")
    x[:3] = mats
    out["replicated"] = replicated(x, 3, 10, (10, 6)).clone()
    sharded = ns.Exchange("sharded", rank, 2)  # 10 rows: rank 0 rows 0-4, rank 1 rows 5-9
    for whole in (mats, mats[:, :9]):  # FSDP2's chunks of 5 rows: of 9, rank 1 holds 4
        mine = whole[:, rank * 5:rank * 5 + 5]
        x = sharded.inputs(3, tuple(mine.shape[1:]), tuple(whole.shape[1:]), "cpu")
        x[:3, :mine.shape[1]] = mine
        out[f"sharded{whole.shape[1]}"] = sharded(x, 3, mine.shape[1], tuple(whole.shape[1:])).clone()
    torch.save(out, f"{path}/rank{rank}.pt")
    dist.destroy_process_group()


def test_exchange_splits_the_work_and_gathers_the_whole(tmp_path):
    """Two gloo processes, 3 matrices: rank 0 owns two, rank 1 one and a zero pad. replicated (ddp) gives every rank
    every matrix's result, all-gathered from the owners; sharded (fsdp) sends each owner the row blocks of its
    matrices and each rank its rows of every result back, row blocks of 5 and 5, then of 5 and 4: the same bits as
    one process orthogonalizing the whole batch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_exchange_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    mats = torch.randn(3, 10, 6).bfloat16()
    whole = {10: ns.orthogonalize(mats.clone()), 9: ns.orthogonalize(mats[:, :9].clone())}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["counts"] == [2, 2, 2]  # its share of each batch (one and a zero pad on rank 1), not all three
        assert torch.equal(got["replicated"], whole[10])
        for rows in (10, 9):
            assert torch.equal(got[f"sharded{rows}"], whole[rows][:, rank * 5:(rank + 1) * 5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are only observable on CUDA")
@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("ns_kernel", ["cublas", "triton"])
def test_step_never_syncs(impl, ns_kernel):
    """The first step (which compiles the kernels and autotunes the Newton–Schulz ones) aside, no step syncs."""
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda").half()) for s in MATRICES + OTHERS]
    opt = Muon([{"params": ps[:len(MATRICES)], "use_muon": True}, {"params": ps[len(MATRICES):]}],
               MuonHyper(ns_kernel=ns_kernel, **MUON), impl=impl, **ADAMW, numerics=Numerics(loss_scaling=LossScaling()))
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            opt.set_lr(1e-4 * (step + 1))
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("ns_kernel", ["cublas", "triton"])
def test_fused_step_replays_as_a_cuda_graph(ns_kernel):
    """The fused step captured once and replayed: the same bits as the same steps run eagerly (its lr and every
    decision are device values; its Newton–Schulz buffers come from the graph's pool; the warm-up step before the
    capture autotunes the triton kernels)."""
    torch.manual_seed(0)
    shapes = MATRICES + OTHERS
    init = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda").bfloat16() for s in shapes] for _ in range(4)]
    results = []
    for graphed in (False, True):
        ps = params_like(init, torch.bfloat16)
        opt = Muon([{"params": ps[:len(MATRICES)], "use_muon": True}, {"params": ps[len(MATRICES):]}],
                   MuonHyper(ns_kernel=ns_kernel, **MUON), impl="fused", **ADAMW)
        static = [g.clone() for g in grads[0]]
        for p, g in zip(ps, static):
            p.grad = g  # read in place, at the addresses the graph records
        step = opt.step
        if graphed:
            fresh = opt.state_dict()  # (views: cloned below, before the warm-up step moves them)
            fresh = {**fresh, "state": {i: {k: v.clone() for k, v in s.items()} for i, s in fresh["state"].items()},
                     "step": fresh["step"].clone(), "skipped_steps": fresh["skipped_steps"].clone()}
            opt.step()  # warm up: compiles the kernels, uploads the hyperparameters
            opt.load_state_dict(fresh)  # back to the start
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                opt.step()
            step = graph.replay
        for gs in grads:
            for s, g in zip(static, gs):
                s.copy_(g)
            step()
        torch.cuda.synchronize()
        results.append(snapshot(opt, ps))
    assert_bit_identical(results[0], results[1])
