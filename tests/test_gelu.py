"""Fused tanh-GELU against an fp64 truth, kernels through the Triton interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minitrain.ops import gelu_tanh  # noqa: E402

# The interpreter's numpy warns where exp2 overflows to inf (x < -11) and where tl.where drops the inf * 0 it
# computed beside it; the kernels rely on both, and the tests below check that no NaN comes out.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

# 4551 elements: more than one 2048-element block, not a multiple of it; 1000: less than one block.
SHAPES = [(3, 37, 41), (1000,)]


def make_input(seed, shape, scale, dtype=torch.float32):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    grad_out = torch.randn(shape, generator=g)
    return x.to(dtype), grad_out.to(dtype)


def value_and_grad(fn, x, grad_out):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def naive(x):
    return F.gelu(x, approximate="tanh")


def truth(x, grad_out):
    return value_and_grad(naive, x.double(), grad_out.double())


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scale", [1.0, 3.0, 10.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_truth(shape, scale):
    x, grad_out = make_input(int(scale), shape, scale)
    got = value_and_grad(gelu_tanh, x, grad_out)
    for name, a, b in zip(("out", "grad"), got, truth(x, grad_out)):
        assert a.dtype == torch.float32 and a.shape == x.shape, name
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("scale", [1.0, 3.0, 10.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_no_worse_than_naive(dtype, scale):
    """Rounded once from fp32, as F.gelu in that dtype is: bf16 needs round-to-nearest-even (not truncation)."""
    x, grad_out = make_input(10 + int(scale), SHAPES[0], scale, dtype)
    want = truth(x, grad_out)
    for name, f, p, t in zip(("out", "grad"), value_and_grad(gelu_tanh, x, grad_out),
                             value_and_grad(naive, x, grad_out), want):
        assert f.dtype == p.dtype == dtype, name
        err_fused, err_naive = rel_err(f, t), rel_err(p, t)
        assert err_fused <= 1.05 * err_naive + 1e-7, (name, err_fused, err_naive)


@pytest.mark.parametrize("dtype, big", [(torch.float32, [1e4, 3e38]), (torch.bfloat16, [1e4, 3e38]),
                                        (torch.float16, [6e4, 65504.0])])
def test_huge_and_infinite_inputs(dtype, big):
    """Finite huge |x|: F.gelu's x or -0, and gradient 1 or 0 (where F.gelu's own is NaN for 3e38).
    +-inf: F.gelu's values (inf, NaN), and the gradient's limits 1 and 0."""
    values = [v for b in big for v in (b, -b)] + [float("inf"), -float("inf")]
    x = torch.tensor(values).to(dtype)
    y, grad = value_and_grad(gelu_tanh, x, torch.ones_like(x))
    torch.testing.assert_close(y, naive(x), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(grad, (x > 0).to(dtype)), grad


@pytest.mark.parametrize("view", [lambda t: t.T, lambda t: t[:, ::3]], ids=["transposed", "strided"])
def test_non_contiguous_input(view):
    base, _ = make_input(20, (37, 41), 3.0)
    _, grad_out = make_input(21, view(base).shape, 1.0)
    got = value_and_grad(lambda b: gelu_tanh(view(b)), base, grad_out)
    want = value_and_grad(lambda b: naive(view(b)), base.double(), grad_out.double())
    assert got[0].shape == view(base).shape
    for name, a, b in zip(("out", "grad"), got, want):
        assert rel_err(a, b) < 1e-5, name


def test_torch_compile_fullgraph():
    """The custom op and its autograd trace without a graph break and give eager's values (aot_eager on CPU:
    no C++ build; inductor on CUDA)."""
    x, _ = make_input(30, (37, 41), 1.0)
    w, _ = make_input(31, (41, 29), 41**-0.5)
    backend = "inductor" if x.is_cuda else "aot_eager"

    def step(x, w):
        return gelu_tanh(x @ w).square().sum()  # square: a grad_out that is not all ones

    def run(fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xg, wg)
        loss.backward()
        return loss.detach(), xg.grad, wg.grad

    for a, b in zip(run(torch.compile(step, backend=backend, fullgraph=True)), run(step)):
        torch.testing.assert_close(a, b)


def test_saves_only_x():
    """Same activation memory as F.gelu: backward keeps x and nothing else."""
    x, _ = make_input(40, (5, 7), 1.0)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gelu_tanh(x)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr() and saved[0].shape == x.shape


def test_opcheck():
    """Schema, fake (meta) implementations, autograd registration and tracing of both custom ops."""
    x, grad_out = make_input(50, (3, 37, 41), 3.0)
    samples = [(x,), (x.transpose(0, 2).requires_grad_(),), (x[:, ::2].bfloat16().requires_grad_(),)]
    for args in samples:
        torch.library.opcheck(torch.ops.minitrain.gelu_tanh.default, args)
    torch.library.opcheck(torch.ops.minitrain.gelu_tanh_backward.default, (grad_out.transpose(0, 1), x.transpose(0, 1)))


def test_cpu_without_interpreter_raises(monkeypatch):
    from minitrain import triton_runtime

    monkeypatch.setattr(triton_runtime, "interpreted", lambda: False)  # as if TRITON_INTERPRET was unset at import
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gelu_tanh(torch.randn(4, device="cpu"))
