"""Newton–Schulz's symmetric Triton kernels (minitrain/optim/newton_schulz_triton.py) against fp32 products of the
same bf16 inputs, for shapes past their tiles in every dimension, wide, tall and square; orthogonalize and the Muon
step with kernel="triton" against kernel="cublas"; optimizer.muon.ns_kernel from the config to the kernel."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from minitrain.cli import compose_config
from minitrain.config import resolve
from minitrain.model import GPT
from minitrain.optim import Muon, MuonHyper, from_config
from minitrain.optim import newton_schulz as ns
from minitrain.optim import newton_schulz_triton as nst
from minitrain.plan import make_plan
from minitrain.tools.live_bytes import LiveBytes
from minitrain.triton_runtime import interpreted

# The interpreter's tiles are 64 x 64 outputs over K steps of 32 (INTERPRETER_CONFIG): sides of 1 and 3 (one partial
# tile), 65, 70 and 130 (a tile and 1 or 6 more, two and 2 more) and reductions of 70, 130 and 200 (a partial last K
# step each); each wide shape also tall, and two square ones.
WIDE = [(1, 70), (3, 200), (65, 70), (65, 200), (70, 130), (130, 200)]
SHAPES = WIDE + [(n, m) for m, n in WIDE] + [(65, 65), (130, 130)]
COUNT = 3  # matrices per batch
# Newton–Schulz in bf16 turns one-ulp differences of its GEMMs' roundings into up to about 1% of its result (bf16
# against the same iteration in fp32: 1.4% at these sizes); a wrong product (a coefficient, a term) moves it by order 1.
NS_TOLERANCE = 0.03


def assert_rounded_once(out, ref, magnitude, k):
    """`out` (bf16) is `ref` (the fp32 result of the same bf16 inputs) rounded once: within half a bf16 ulp of it
    (2^-8 relative: 8 significant bits), plus what two fp32 sums of the same k products in other orders may differ
    by (k·2^-24 of the products' magnitudes `magnitude` each, doubled for room)."""
    bound = 2**-8 * ref.abs() + 4 * k * 2**-24 * magnitude
    err = (out.float() - ref).abs()
    assert torch.isfinite(out).all() and (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"


def with_sentinel(count, m):
    """An output of `count` m x m matrices full of NaN (so that an entry never written shows), followed in memory by
    one more (so that a write past the last matrix shows)."""
    whole = torch.full((count + 1, m, m), float("nan"), dtype=torch.bfloat16)
    return whole, whole[:count]


def products(x):
    """(fp32 X Xᵀ, its magnitude |X| |X|ᵀ, the reduction length) along each matrix's short side, as torch computes
    them."""
    xf = x.float()
    if x.size(1) > x.size(2):
        xf = xf.mT
    return xf @ xf.mT, xf.abs() @ xf.abs().mT, xf.size(2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gram_is_the_fp32_product_rounded_once_and_exactly_symmetric(shape):
    torch.manual_seed(0)
    x = torch.randn(COUNT, *shape).bfloat16()
    m = min(shape)
    whole, out = with_sentinel(COUNT, m)
    assert nst.gram(x, out=out) is out
    ref, magnitude, k = products(x)
    assert_rounded_once(out, ref, magnitude, k)
    assert torch.equal(out, out.mT)
    assert whole[COUNT].isnan().all()  # nothing written past the batch


def test_fp32_matrices_keep_fp32_precision_under_the_interpreter():
    """fp32 in, fp32 out: the interpreter rounds only bf16 results as the GPU stores them (triton_runtime.rounds_bf16),
    so an fp32 Gram and polynomial are the fp32 results (a bf16 rounding would be off by up to 2^-9). The GPU's fp32
    tl.dot is tf32, whose own rounding this bound does not admit: the interpreter's case alone."""
    if not interpreted():
        pytest.skip("the rounding under test is the interpreter's")
    torch.manual_seed(2)
    x = torch.randn(COUNT, 65, 70)
    gram = nst.gram(x, out=torch.empty(COUNT, 65, 65))
    torch.testing.assert_close(gram, x @ x.mT, rtol=1e-5, atol=1e-5)
    _, b, c = ns.NS_COEFFICIENTS
    a = gram / 70
    poly = nst.symmetric_polynomial(a, b, c, out=torch.empty(COUNT, 65, 65))
    torch.testing.assert_close(poly, b * a + c * a @ a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 65, 130])
def test_symmetric_polynomial_is_the_fp32_result_rounded_once_and_exactly_symmetric(m):
    """b·A + c·A·A with Newton–Schulz's own coefficients, A a symmetric bf16 matrix (a Gram matrix's rounding)."""
    torch.manual_seed(1)
    r = torch.randn(COUNT, m, m + 5)
    a = (r @ r.mT / (m + 5)).bfloat16()
    assert torch.equal(a, a.mT)
    _, b, c = ns.NS_COEFFICIENTS
    whole, out = with_sentinel(COUNT, m)
    assert nst.symmetric_polynomial(a, b, c, out=out) is out
    af = a.float()
    ref = b * af + c * (af @ af)
    assert_rounded_once(out, ref, abs(b) * af.abs() + abs(c) * (af.abs() @ af.abs()), m + 1)
    assert torch.equal(out, out.mT)
    assert whole[COUNT].isnan().all()


@pytest.mark.parametrize("config", nst.CONFIGS, ids=lambda c: "{BLOCK}x{BLOCK_K}".format(**c.kwargs)
                         + f"-w{c.num_warps}-s{c.num_stages}")
def test_every_autotuned_config_gives_the_products_rounded_once(config, monkeypatch):
    """Each config autotuning may pick (here forced), on sides past its tile: the wide and the tall Gram, then the
    polynomial of the first."""
    monkeypatch.setattr(nst, "fixed_config", lambda: config)
    torch.manual_seed(4)
    for shape in [(130, 200), (200, 130)]:
        x = torch.randn(2, *shape).bfloat16()
        whole, out = with_sentinel(2, 130)
        nst.gram(x, out=out)
        ref, magnitude, k = products(x)
        assert_rounded_once(out, ref, magnitude, k)
        assert torch.equal(out, out.mT) and whole[2].isnan().all()
    a = (out.float() / 200).bfloat16()
    _, b, c = ns.NS_COEFFICIENTS
    nst.symmetric_polynomial(a, b, c, out=out)
    af = a.float()
    assert_rounded_once(out, b * af + c * (af @ af), abs(b) * af.abs() + abs(c) * (af.abs() @ af.abs()), 131)
    assert torch.equal(out, out.mT)


def test_the_kernels_refuse_an_output_of_another_shape():
    x = torch.randn(2, 5, 9).bfloat16()
    with pytest.raises(ValueError, match=r"out must be \(2, 5, 5\)"):
        nst.gram(x, out=torch.empty(2, 9, 9, dtype=torch.bfloat16))


def relative_distance(x, y):
    """Each matrix's Frobenius distance from its reference's, relative to the reference's norm."""
    x, y = x.float(), y.float()
    return torch.linalg.vector_norm(x - y, dim=(-2, -1)) / torch.linalg.vector_norm(y, dim=(-2, -1))


@pytest.mark.parametrize("shape", [(65, 200), (200, 65), (70, 70)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_orthogonalize_with_the_triton_kernels_is_the_cublas_iteration(shape):
    """The whole iteration, wide, tall and square, 5 steps and 4 (the result in the other buffer): the kernels'
    result within NS_TOLERANCE of torch's GEMMs', in the same buffer of the two."""
    torch.manual_seed(2)
    x = torch.randn(COUNT, *shape).bfloat16()
    for steps in (5, 4):
        cublas_in, triton_in = x.clone(), x.clone()
        want = ns.orthogonalize(cublas_in, steps=steps)
        got = ns.orthogonalize(triton_in, steps=steps, kernel="triton")
        assert (got is triton_in) == (want is cublas_in)
        assert relative_distance(got, want).max() <= NS_TOLERANCE


def test_orthogonalize_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match=r"kernel must be one of \('cublas', 'triton'\), got 'cutlass'"):
        ns.orthogonalize(torch.randn(1, 4, 8).bfloat16(), kernel="cutlass")


@pytest.mark.parametrize("shape", [(48, 80), (80, 48)])
def test_the_triton_kernels_hold_the_same_workspace(shape):
    """The same buffers as torch's GEMMs (the memory model's workspace_bytes): the kernels allocate nothing (after
    a first call, which on a GPU autotunes them)."""
    x = torch.randn(3, *shape).bfloat16()
    ns.orthogonalize(x.clone(), kernel="triton")
    with LiveBytes() as live:
        ns.orthogonalize(x, kernel="triton")
    assert ns.workspace_bytes(shape, 3) <= live.peak <= ns.workspace_bytes(shape, 3) + 64


def test_symmetric_flops_count_the_upper_triangles():
    """X Xᵀ and A·A on the m(m + 1)/2 entries on and above the diagonal, B·X whole: per step
    m(m + 1)·n + m(m + 1)·m + 2·m²·n."""
    m, n = 768, 3072
    assert ns.flops((n, m), symmetric=True) == ns.flops((m, n), symmetric=True) == \
        5 * (m * (m + 1) * n + m * (m + 1) * m + 2 * m * m * n)
    assert ns.flops((1, 1), steps=1, symmetric=True) == ns.flops((1, 1), steps=1) == 6


# -- the Muon step ------------------------------------------------------------------------------------------------
MATRICES = [(24, 40), (40, 24), (24, 40), (70, 66)]  # wide (a batch of two), tall, one past a tile
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1)


def counted_kernel_calls(monkeypatch):
    calls = []
    gram = nst.gram

    def counted(x, out):
        calls.append(tuple(x.shape))
        return gram(x, out)

    monkeypatch.setattr(nst, "gram", counted)
    return calls


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_a_muon_step_with_the_triton_kernels_is_the_cublas_one(impl, monkeypatch):
    """bf16 params over fp32 masters, three steps: the same momentum bits, and each matrix's update (the masters'
    move) within NS_TOLERANCE of the cublas step's; the kernels ran for each batch's 5 Newton–Schulz steps."""
    torch.manual_seed(3)
    init = [torch.randn(s) for s in MATRICES]
    grads = [[torch.randn(s).bfloat16() for s in MATRICES] for _ in range(3)]
    calls = counted_kernel_calls(monkeypatch)
    out = {}
    for kernel in ("cublas", "triton"):
        ps = [torch.nn.Parameter(v.bfloat16()) for v in init]
        opt = Muon(ps, MuonHyper(ns_kernel=kernel, **MUON), impl=impl, adamw_lr=1e-3)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        state = opt.state_dict()["state"]
        out[kernel] = [(state[i]["momentum_buffer"], state[i]["master"]) for i in range(len(ps))]
    assert len(calls) == 3 * 3 * ns.NS_STEPS  # 3 steps, 3 batches (the two (24, 40) together)
    for i, ((buf, master), (want_buf, want_master)) in enumerate(zip(out["triton"], out["cublas"])):
        assert torch.equal(buf, want_buf), f"momentum of {i}"
        start = init[i].bfloat16().float()
        assert relative_distance(master - start, want_master - start) <= NS_TOLERANCE, f"update of {i}"


@pytest.mark.parametrize("kernel", ["cublas", "triton"])
def test_optimizer_muon_ns_kernel_is_the_kernel_each_batch_runs(kernel, monkeypatch):
    """optimizer.muon.ns_kernel through the plan and the optimizer's builder: every batch's Newton–Schulz runs it."""
    cfg = resolve(compose_config(["trainer.out_dir=.", "optimizer=muon", f"optimizer.muon.ns_kernel={kernel}",
                                  "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16"]))
    plan = make_plan(cfg, 64, torch.device("cpu"), 1)
    model = GPT(plan.model)
    opt = from_config(cfg.optimizer, plan, model)
    kernels, orthogonalize = [], ns.orthogonalize

    def recorded(x, coefficients, steps, eps, kernel):
        kernels.append(kernel)
        return orthogonalize(x, coefficients, steps, eps, kernel)

    monkeypatch.setattr(ns, "orthogonalize", recorded)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert kernels == [kernel] * 4  # the block's four shapes


def test_muon_refuses_the_triton_kernels_where_triton_cannot_run(monkeypatch):
    from minitrain import triton_runtime

    with pytest.raises(ValueError, match=r"ns_kernel must be one of \('cublas', 'triton'\), got 'torch'"):
        Muon([torch.nn.Parameter(torch.randn(3, 4))], MuonHyper(ns_kernel="torch"), impl="foreach")
    monkeypatch.setattr(triton_runtime, "interpreted", lambda: False)  # as if TRITON_INTERPRET was unset at import
    with pytest.raises(RuntimeError, match=r"Muon\(ns_kernel='triton'\).*optimizer.muon.ns_kernel=cublas"):
        Muon([torch.nn.Parameter(torch.randn(3, 4, device="cpu"))], MuonHyper(ns_kernel="triton"), impl="foreach")
    Muon([torch.nn.Parameter(torch.randn(3, 4, device="cpu"))], MuonHyper(ns_kernel="cublas"), impl="foreach")


def test_the_config_is_chosen_by_rule_under_the_interpreter_and_trainer_deterministic(monkeypatch):
    """Timing may pick another config in another run (another tile, another order of sums): a deterministic run
    takes the first of CONFIGS; the interpreter its own; otherwise none is fixed (autotuned)."""
    monkeypatch.setattr(nst, "interpreted", lambda: True)
    assert nst.fixed_config() is nst.INTERPRETER_CONFIG
    monkeypatch.setattr(nst, "interpreted", lambda: False)
    assert nst.fixed_config() is None
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert nst.fixed_config() is nst.CONFIGS[0]
