"""minitrain's float8 linear (minitrain/ops/float8_linear.py): its casts bit for bit against torch's, its GEMMs
against torchao's Float8Linear (the same tensorwise recipe, written independently) and against bf16.

CPU tests: the Triton kernels run through the interpreter, torch._scaled_mm on the CPU (torch 2.13)."""

import copy
import importlib

import pytest
import torch

from minitrain.ops import Float8Linear, float8_linear
from minitrain.ops.float8_linear import AMAX_FLOOR, E4M3, E5M2, _cast

pytestmark = pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="needs torch._scaled_mm")
FLOAT8_LINEAR = importlib.import_module("minitrain.ops.float8_linear")  # the package's name is the function's


@pytest.fixture
def small_tiles(monkeypatch):
    """The casts' tiles shrunk to 32 x 64: the interpreter's own (256 x 256) hold most test tensors whole, and a
    tensor that crosses them makes the CPU's float8 GEMMs slow. Read at each cast, so the linear uses them too."""
    monkeypatch.setattr(FLOAT8_LINEAR, "_BM", 32)
    monkeypatch.setattr(FLOAT8_LINEAR, "_BN", 64)


def torch_cast(x, dtype):
    """The recipe in plain torch: scale = max / amax, saturate, round to nearest even."""
    fmax = torch.finfo(dtype).max
    scale = fmax / x.float().abs().max().clamp(min=AMAX_FLOOR)
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), 1 / scale


def bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_bf16_value_casts_to_the_float8_torch_rounds_it_to(dtype):
    """Each bf16 value within the format's range, at scale 1 (amax = the format's max): the subnormals, the round
    ups that carry into the exponent, ties to even, the largest values, both signs."""
    fmax = torch.finfo(dtype).max
    every = torch.arange(2 ** 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = every[every.float().abs() <= fmax]
    values = torch.cat([torch.tensor([fmax], dtype=torch.bfloat16), values[~values.isnan()]])
    values = values[: values.numel() // 128 * 128].view(-1, 128)
    out, out_t, inv_scale, _ = _cast(values, dtype)
    assert inv_scale.item() == 1.0
    expected = values.float().to(dtype)
    assert torch.equal(bits(out), bits(expected))
    assert torch.equal(bits(out_t), bits(expected.t().contiguous()))


@pytest.mark.parametrize("tiles", ["one", "7 x 2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_cast_scales_by_the_amax_in_both_layouts_and_sums_the_columns(dtype, tiles, request):
    """200 x 96 in one interpreter tile, or in 32 x 64 tiles (7 x 2 programs, the last of each partial). The
    largest magnitude is negative, in the last tile: every program's |x| must reach the one amax, and each row of
    tiles adds its own column sums."""
    if tiles != "one":
        request.getfixturevalue("small_tiles")
    torch.manual_seed(0)
    x = (torch.randn(200, 96) * 3).bfloat16()  # rows and columns that do not fill the last tiles
    x[-1, -1] = -2 * x.float().abs().max()
    out, out_t, inv_scale, col_sums = _cast(x, dtype, col_sums=True)
    expected, expected_inv = torch_cast(x, dtype)
    assert torch.equal(bits(out), bits(expected)) and torch.equal(bits(out_t), bits(expected.t().contiguous()))
    assert inv_scale.item() == expected_inv.item() and out.float().abs().max() == torch.finfo(dtype).max
    torch.testing.assert_close(col_sums, x.float().sum(0), rtol=1e-6, atol=1e-4)
    assert _cast(x, dtype)[3] is None


def test_nan_or_inf_anywhere_makes_the_whole_cast_nan_and_zeros_get_a_finite_scale(small_tiles):
    """The step's inf/NaN check reads the gradients: one bad element must reach all of them, not be clamped away,
    from a tile (here the last of 3 x 2) other than theirs."""
    x = torch.randn(80, 100).bfloat16()
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = x.clone()
        poisoned[75, 90] = bad
        out, out_t, inv_scale, _ = _cast(poisoned, E5M2)
        assert out.float().isnan().all() and out_t.float().isnan().all() and inv_scale.isnan()
    out, _, inv_scale, _ = _cast(torch.zeros(80, 100, dtype=torch.bfloat16), E4M3)
    assert (out.float() == 0).all() and inv_scale.item() == pytest.approx(AMAX_FLOOR / 448)


@pytest.mark.parametrize("amax", [1e-14, 1e-30, 3e38])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_cast_of_tiny_or_huge_values_is_torchs(dtype, amax, small_tiles):
    """bf16's extremes: below AMAX_FLOOR the scale stays FP8_MAX / 1e-12 (the values cast small, many to zero, not
    stretched to the format's max); near bf16's max the scale is tiny and its inverse huge, both still finite."""
    torch.manual_seed(1)
    x = torch.randn(80, 100)
    x = (x * (amax / x.abs().max())).bfloat16()
    out, out_t, inv_scale, _ = _cast(x, dtype)
    expected, expected_inv = torch_cast(x, dtype)
    assert torch.equal(bits(out), bits(expected)) and torch.equal(bits(out_t), bits(expected.t().contiguous()))
    assert inv_scale.item() == expected_inv.item() and torch.isfinite(inv_scale)


def twins(bias, K=96, N=160):
    """A bf16 linear, torchao's Float8Linear of it and ours, holding equal weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=bias).bfloat16()
    theirs = torch.nn.Sequential(copy.deepcopy(linear))
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return linear, theirs, Float8Linear.taking_over(copy.deepcopy(linear))


def run(module, x, grad):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(grad)
    return y, x.grad, {k: p.grad for k, p in module.named_parameters()}


@pytest.mark.parametrize("bias", [False, True])
def test_the_linear_computes_torchaos_tensorwise_float8_linear(bias, small_tiles):
    """Two implementations of one recipe: forward and all gradients bit for bit, except that our forward adds the
    bias inside the GEMM (its epilogue, one rounding) where torchao adds it to the rounded bf16 product. 80 tokens,
    96 inputs, 160 outputs: every cast crosses its 32 x 64 tiles, and the bias gradient sums 3 rows of tiles."""
    pytest.importorskip("torchao")
    _, theirs, ours = twins(bias)
    x = (torch.randn(2, 40, 96) * 4).bfloat16()
    grad = torch.randn(2, 40, 160).bfloat16()
    (y_theirs, dx_theirs, g_theirs), (y_ours, dx_ours, g_ours) = run(theirs, x, grad), run(ours, x, grad)
    assert torch.equal(dx_ours, dx_theirs)
    assert torch.equal(g_ours["weight"], g_theirs["0.weight"])
    if bias:
        assert torch.equal(g_ours["bias"], g_theirs["0.bias"])
        # the float8 operands' product plus the bias, in fp32, rounded once to bf16 (up to fp32's summation order)
        x8, _, x_inv, _ = _cast(x.reshape(-1, 96), E4M3)
        w8, _, w_inv, _ = _cast(ours.weight.detach(), E4M3)
        once = ((x8.float() * x_inv) @ (w8.float() * w_inv).t() + ours.bias.float()).bfloat16().view_as(y_ours)
        assert (y_ours == once).float().mean() > 0.999 and (y_theirs == once).float().mean() < 0.9
    else:
        assert torch.equal(y_ours, y_theirs)


def test_the_linear_is_bf16s_within_float8_rounding_and_keeps_its_parameters():
    linear, _, ours = twins(bias=True)
    x, grad = torch.randn(128, 96).bfloat16(), torch.randn(128, 160).bfloat16()
    (y16, dx16, g16), (y8, dx8, g8) = run(linear, x, grad), run(ours, x, grad)
    relative = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert 1e-3 < relative(y8, y16) < 0.05  # e4m3 operands
    assert 1e-3 < relative(dx8, dx16) < 0.1 and 1e-3 < relative(g8["weight"], g16["weight"]) < 0.1  # e5m2 grads
    assert relative(g8["bias"], g16["bias"]) < 1e-2  # summed from the bf16 gradient, not its float8 copy
    source = torch.nn.Linear(96, 160)
    taken = Float8Linear.taking_over(source)
    assert taken.weight is source.weight and taken.bias is source.bias
    assert Float8Linear.taking_over(torch.nn.Linear(96, 160, bias=False)).bias is None
    batched = float8_linear(x.view(4, 32, 96), ours.weight, ours.bias)  # leading dims flattened into the GEMM's M
    assert batched.shape == (4, 32, 160) and torch.equal(batched.view(128, 160), y8)
