"""A linear layer that multiplies in float8 with one dynamic scale per tensor, its casts in two memory passes.

Why: a float8 GEMM runs far faster than a bf16 one, but each operand must first be cast: its amax over the whole
tensor, then every element scaled, clamped and rounded to float8, in the row-major layout one GEMM reads and the
transposed layout another reads (torch's float8 GEMM, compat.scaled_mm, takes its first operand row-major, its second column-major).
A cast that reads the tensor once for the amax and once more to write both layouts moves 6 bytes per bf16
element; torchao's casts under torch.compile move much more, which is where its float8 step loses what the GEMMs
gain (docs/benchmarks.md, fp8). Here each cast is two Triton kernels: `_amax_kernel` (reduces |x|, and sums
the output gradient's columns for the bias gradient on the way) and `_cast_kernel` (writes both layouts from one
read).

Numerics are torchao's tensorwise recipe: inputs and weights in e4m3, output gradients in e5m2, scale =
fp8 max / amax (amax clamped to 1e-12), saturating casts; a NaN or inf anywhere makes the whole cast NaN, so the
step's inf/NaN check sees it. Backward saves the input's and the weight's transposed float8 copies (1 byte an
element), not the bf16 input. Both directions are custom ops: torch.compile keeps them opaque, and compiled
`selective` checkpointing saves the forward's outputs (minitrain/recompute.py).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.compat import scaled_mm
from minitrain.triton_runtime import check_runnable, float8_bits, interpreted, rounds_float8

E4M3 = torch.float8_e4m3fn  # inputs and weights: more mantissa
E5M2 = torch.float8_e5m2  # output gradients: more range
_MANTISSA, _BIAS = {E4M3: 3, E5M2: 2}, {E4M3: 7, E5M2: 15}
AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale
# A tile: 8,192 elements, rows of 256 bytes in bf16; the interpreter runs each tile as numpy calls, so there a
# tile is as large as most test tensors (tests that cross tiles shrink _BM, _BN, which each cast reads).
_BM, _BN = (256, 256) if interpreted() else (64, 128)
_NUM_WARPS = 8


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, col_sums_ptr, M, N, COL_SUMS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr):
    """amax_ptr[0] = max |x| over the row-major (M, N) `x`, NaN counted as inf; with COL_SUMS, each row of tiles
    writes its fp32 column sums to col_sums_ptr[pid_m, :] (the bias gradient, summed over pid_m after)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    magnitude = tl.where(x == x, tl.abs(x), float("inf"))
    tl.atomic_max(amax_ptr, tl.max(magnitude))
    if COL_SUMS:
        tl.store(col_sums_ptr + pid_m.to(tl.int64) * N + cols, tl.sum(x, axis=0), mask=cols < N)


@triton.jit
def _cast_kernel(x_ptr, amax_ptr, out_ptr, out_t_ptr, inv_scale_ptr, M, N, FP8_MAX: tl.constexpr,
                 AMAX_FLOOR: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, ROUND_FP8: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
    """out = float8(clamp(x * scale)) in x's row-major (M, N) layout and out_t its transpose (N, M), from one read
    of x; scale = FP8_MAX / amax (NaN when amax is inf), and inv_scale_ptr[0] = 1 / scale for the GEMM."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    amax = tl.load(amax_ptr)
    scale = tl.where(amax < float("inf"), FP8_MAX / tl.maximum(amax, AMAX_FLOOR), float("nan"))
    if (pid_m == 0) & (pid_n == 0):
        tl.store(inv_scale_ptr, 1.0 / scale)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    y = float8_bits(y, MANTISSA, BIAS) if ROUND_FP8 else y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)
    tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(y), mask=tl.trans(mask))


def _cast(x: Tensor, dtype: torch.dtype, col_sums: bool = False
          ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(float8 x, float8 x transposed (contiguous), 1 / scale, x's column sums or None) of a 2-D tensor."""
    M, N = x.shape
    grid = (triton.cdiv(M, _BM), triton.cdiv(N, _BN))
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    sums = torch.empty((grid[0], N), dtype=torch.float32, device=x.device) if col_sums else None
    _amax_kernel[grid](x, amax, sums, M, N, COL_SUMS=col_sums, BM=_BM, BN=_BN, num_warps=_NUM_WARPS)
    out = torch.empty((M, N), dtype=dtype, device=x.device)
    out_t = torch.empty((N, M), dtype=dtype, device=x.device)
    inv_scale = torch.empty((), dtype=torch.float32, device=x.device)
    bits = rounds_float8()  # the interpreter stores float8_bits' encoding into a uint8 view
    _cast_kernel[grid](x, amax, out.view(torch.uint8) if bits else out, out_t.view(torch.uint8) if bits else out_t,
                       inv_scale, M, N, FP8_MAX=torch.finfo(dtype).max, AMAX_FLOOR=AMAX_FLOOR,
                       MANTISSA=_MANTISSA[dtype], BIAS=_BIAS[dtype], ROUND_FP8=bits, BM=_BM, BN=_BN,
                       num_warps=_NUM_WARPS)
    return out, out_t, inv_scale, (sums.sum(0) if col_sums else None)


@torch.library.custom_op("minitrain::float8_linear", mutates_args=())
def _float8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, x8_t, x_inv_scale, w8_t, w_inv_scale): y = x @ weight.T + bias in x's dtype; the rest is what backward
    reads (the transposed float8 copies and their inverse scales)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    x8, x8_t, x_inv, _ = _cast(x2, E4M3)
    w8, w8_t, w_inv, _ = _cast(weight.contiguous(), E4M3)
    y = scaled_mm(x8, w8.t(), x_inv, w_inv, bias=bias, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0]), x8_t, x_inv, w8_t, w_inv


@_float8_linear.register_fake
def _(x, weight, bias):
    M = x.numel() // x.shape[-1]
    scalar = x.new_empty((), dtype=torch.float32)
    return (x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((x.shape[-1], M), dtype=E4M3), scalar,
            x.new_empty(weight.shape[::-1], dtype=E4M3), scalar.clone())


@torch.library.custom_op("minitrain::float8_linear_backward", mutates_args=())
def _float8_linear_backward(grad_y: Tensor, x8_t: Tensor, x_inv: Tensor, w8_t: Tensor, w_inv: Tensor,
                            has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x (M, K), grad_weight (N, K), grad_bias (N,), empty without a bias), in grad_y's dtype."""
    g = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
    g8, g8_t, g_inv, g_sums = _cast(g, E5M2, col_sums=has_bias)
    grad_x = scaled_mm(g8, w8_t.t(), g_inv, w_inv, out_dtype=g.dtype)
    grad_weight = scaled_mm(g8_t, x8_t.t(), g_inv, x_inv, out_dtype=g.dtype)
    grad_bias = g_sums.to(g.dtype) if has_bias else g.new_empty(0)
    return grad_x, grad_weight, grad_bias


@_float8_linear_backward.register_fake
def _(grad_y, x8_t, x_inv, w8_t, w_inv, has_bias):
    M, N, K = x8_t.shape[1], grad_y.shape[-1], x8_t.shape[0]
    return grad_y.new_empty((M, K)), grad_y.new_empty((N, K)), grad_y.new_empty((N,) if has_bias else (0,))


def _setup_context(ctx, inputs, output):
    x, _, bias = inputs
    ctx.x_shape, ctx.has_bias = x.shape, bias is not None
    ctx.save_for_backward(*output[1:])


def _backward(ctx, grad_y, *_):
    grad_x, grad_weight, grad_bias = _float8_linear_backward(grad_y, *ctx.saved_tensors, ctx.has_bias)
    return grad_x.view(ctx.x_shape), grad_weight, grad_bias if ctx.has_bias else None


_float8_linear.register_autograd(_backward, setup_context=_setup_context)


def float8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, weight, bias) with both GEMMs of backward and the forward's in float8 (tensorwise scales);
    bf16 in and out. Dimensions must be multiples of 16 (the float8 GEMM's)."""
    check_runnable(x, "float8_linear", "precision.float8_kernels=torchao")
    return _float8_linear(x, weight, bias)[0]


class Float8Linear(torch.nn.Linear):
    """nn.Linear whose matmuls run in float8 (`float8_linear`); its weight and bias are the ordinary Parameters."""

    def forward(self, x: Tensor) -> Tensor:
        return float8_linear(x, self.weight, self.bias)

    @classmethod
    def taking_over(cls, linear: torch.nn.Linear) -> "Float8Linear":
        """A Float8Linear that holds `linear`'s own weight and bias Parameters (the optimizer's, the checkpoint's)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias
        return new
