"""tanh-GELU as memory-streaming Triton kernels (F.gelu(x, approximate="tanh"), same memory: only x is saved).

Why: inductor's GELU kernels fall short of HBM bandwidth in the compiled GPT-2 step (docs/benchmarks.md, "GELU"):
they compute tanh with libdevice's tanhf. tanh-GELU
is exactly x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3), so one exp2 and one division per element
suffice and each kernel is a pure memory stream: forward reads x and writes y; backward reads grad_out and x,
writes grad_in. All math is fp32; results are stored in x's dtype. A custom op, so torch.compile keeps it opaque.

With a bias (the MLP's first linear, run without its own), the forward adds it per column and the backward
sums the bias gradient from the grad_in it writes, so that gradient costs no second read of grad_in (a
column sum over every token, the 4C-wide activation's size): the backward is then a 2D kernel, each program
a column block over ROWS_PER_PROGRAM rows, writing fp32 partial sums that one small kernel adds up.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.triton_runtime import check_runnable, round_to_bf16_in_fp32, rounds_bf16

_BLOCK = 2048
_NUM_WARPS = 4
# The bias backward's tiling: each program a TILE_COLS-wide column block over ROWS_PER_PROGRAM rows, TILE_ROWS
# at a time (2048 elements a tile, as the flat kernels' blocks); scripts/bench_gelu.py measures the choice.
ROWS_PER_PROGRAM = 256
TILE_ROWS = 8
TILE_COLS = 256
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715
# exp2(z) with z = -2u * log2(e) = x * (_Z1 + _Z3 * x^2), so sigmoid(2u) = 1 / (1 + exp2(z)).
_Z1 = -2.0 * _SQRT_2_OVER_PI * math.log2(math.e)
_Z3 = _Z1 * _KAPPA
# 2 du/dx = _D0 + _D2 * x^2.
_D0 = 2.0 * _SQRT_2_OVER_PI
_D2 = _D0 * 3.0 * _KAPPA
# For |x| > ~12, exp2(z) is 0 or inf, so s * (1 - s) is exactly 0 and x s (1 - s) 2 du/dx is 0 whatever x:
# x is clamped in that term only to keep it finite (0 * inf would be NaN for huge |x|).
_X_CLAMP = 20.0


@triton.jit
def _gelu(x, Z1: tl.constexpr, Z3: tl.constexpr):
    # exp2 overflow (x << 0) gives x / inf = -0 and underflow (x >> 0) gives x / 1 = x: no NaN for finite x.
    return x / (1.0 + tl.exp2(x * (Z1 + Z3 * x * x)))


@triton.jit
def _gelu_grad(grad_out, x, Z1: tl.constexpr, Z3: tl.constexpr, D0: tl.constexpr, D2: tl.constexpr,
               X_CLAMP: tl.constexpr):
    e = tl.exp2(x * (Z1 + Z3 * x * x))
    s = 1.0 / (1.0 + e)
    # 1 - s as e * s: no cancellation when s is near 1; where e overflowed, s = 0 and 1 - s = 1 (not inf * 0).
    one_minus_s = tl.where(s > 0.0, e * s, 1.0)
    xc = tl.minimum(tl.maximum(x, -X_CLAMP), X_CLAMP)
    # d/dx [x s] = s + x s (1 - s) 2 du/dx
    return grad_out * (s * (1.0 + xc * one_minus_s * (D0 + D2 * xc * xc)))


@triton.jit
def _gelu_forward_kernel(x_ptr, bias_ptr, y_ptr, n, cols, HAS_BIAS: tl.constexpr, Z1: tl.constexpr,
                         Z3: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + offs % cols, mask=mask, other=0.0).to(tl.float32)
    y = _gelu(x, Z1, Z3)
    if ROUND_BF16:
        y = round_to_bf16_in_fp32(y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_backward_kernel(grad_out_ptr, x_ptr, grad_in_ptr, n, Z1: tl.constexpr, Z3: tl.constexpr,
                          D0: tl.constexpr, D2: tl.constexpr, X_CLAMP: tl.constexpr, ROUND_BF16: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = _gelu_grad(grad_out, x, Z1, Z3, D0, D2, X_CLAMP)
    if ROUND_BF16:
        g = round_to_bf16_in_fp32(g)
    tl.store(grad_in_ptr + offs, g.to(grad_in_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bias_backward_kernel(grad_out_ptr, x_ptr, bias_ptr, grad_in_ptr, partial_ptr, rows, cols,
                               Z1: tl.constexpr, Z3: tl.constexpr, D0: tl.constexpr, D2: tl.constexpr,
                               X_CLAMP: tl.constexpr, ROUND_BF16: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
                               TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr):
    """grad_in for rows [group * ROWS_PER_PROGRAM, +ROWS_PER_PROGRAM) x one column block, and the sum of those
    rows of grad_in (as stored) into partial row `group`."""
    group = tl.program_id(0)
    col = tl.program_id(1) * TILE_COLS + tl.arange(0, TILE_COLS)
    col_mask = col < cols
    bias = tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    column_sum = tl.zeros([TILE_COLS], dtype=tl.float32)
    for first in range(0, ROWS_PER_PROGRAM, TILE_ROWS):
        row = group * ROWS_PER_PROGRAM + first + tl.arange(0, TILE_ROWS)
        mask = (row < rows)[:, None] & col_mask[None, :]
        offs = row.to(tl.int64)[:, None] * cols + col[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        grad_out = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = _gelu_grad(grad_out, x, Z1, Z3, D0, D2, X_CLAMP)
        if ROUND_BF16:
            g = round_to_bf16_in_fp32(g)
        g = g.to(grad_in_ptr.dtype.element_ty)
        tl.store(grad_in_ptr + offs, g, mask=mask)
        column_sum += tl.sum(g.to(tl.float32), axis=0)  # masked lanes: grad_out 0, so g 0
    tl.store(partial_ptr + group * cols + col, column_sum, mask=col_mask)


@triton.jit
def _gelu_bias_grad_sum_kernel(partial_ptr, out_ptr, groups, cols, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for group in range(0, groups):
        total += tl.load(partial_ptr + group * cols + col, mask=mask, other=0.0)
    if ROUND_BF16:
        total = round_to_bf16_in_fp32(total)
    tl.store(out_ptr + col, total.to(out_ptr.dtype.element_ty), mask=mask)


def _gelu_forward(x: Tensor, bias: Tensor | None, y: Tensor) -> None:
    n = x.numel()
    _gelu_forward_kernel[(triton.cdiv(n, _BLOCK),)](
        x, x if bias is None else bias, y, n, x.shape[-1], HAS_BIAS=bias is not None, Z1=_Z1, Z3=_Z3,
        ROUND_BF16=rounds_bf16(x.dtype), BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )


@torch.library.custom_op("minitrain::gelu_tanh", mutates_args=())
def _gelu_tanh(x: Tensor) -> Tensor:
    """Returns a contiguous tensor of x's shape and dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    _gelu_forward(x, None, y)
    return y


@_gelu_tanh.register_fake
def _(x):
    return x.new_empty(x.shape)


@torch.library.custom_op("minitrain::gelu_tanh_backward", mutates_args=())
def _gelu_tanh_backward(grad_out: Tensor, x: Tensor) -> Tensor:
    """grad_out * d gelu_tanh(x) / dx, contiguous, in x's dtype."""
    x = x.contiguous()
    grad_in = torch.empty_like(x)
    n = x.numel()
    _gelu_backward_kernel[(triton.cdiv(n, _BLOCK),)](
        grad_out.contiguous(), x, grad_in, n, Z1=_Z1, Z3=_Z3, D0=_D0, D2=_D2, X_CLAMP=_X_CLAMP,
        ROUND_BF16=rounds_bf16(x.dtype), BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )
    return grad_in


@_gelu_tanh_backward.register_fake
def _(grad_out, x):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, grad_out):
    (x,) = ctx.saved_tensors
    return _gelu_tanh_backward(grad_out, x)


_gelu_tanh.register_autograd(_backward, setup_context=_setup_context)


def gelu_tanh(x: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.gelu(x + bias, approximate="tanh") for any float dtype and shape, bias (x.shape[-1],) or None; fp32
    math (x + bias too), output in x's dtype."""
    check_runnable(x, "gelu_tanh", "model.gelu=torch")
    return _gelu_tanh(x) if bias is None else _gelu_tanh_bias(x, bias)


def gelu_tanh_backward(grad_out: Tensor, x: Tensor) -> Tensor:
    """grad_out * gelu_tanh'(x), in x's dtype: for callers that run their own backward (selective
    checkpointing)."""
    return _gelu_tanh_backward(grad_out, x)


@torch.library.custom_op("minitrain::gelu_tanh_bias", mutates_args=())
def _gelu_tanh_bias(x: Tensor, bias: Tensor) -> Tensor:
    """gelu_tanh(x + bias), bias (C,) over x's last dimension; contiguous, in x's dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    _gelu_forward(x, bias.contiguous(), y)
    return y


@_gelu_tanh_bias.register_fake
def _(x, bias):
    return x.new_empty(x.shape)


@torch.library.custom_op("minitrain::gelu_tanh_bias_backward", mutates_args=())
def _gelu_tanh_bias_backward(grad_out: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_in in x's dtype, contiguous; the bias gradient, grad_in's column sum, in bias's dtype)."""
    x = x.contiguous()
    cols = x.shape[-1]
    rows = x.numel() // cols
    grad_in = torch.empty_like(x)
    groups = triton.cdiv(rows, ROWS_PER_PROGRAM)
    partial = torch.empty(groups, cols, device=x.device, dtype=torch.float32)
    _gelu_bias_backward_kernel[(groups, triton.cdiv(cols, TILE_COLS))](
        grad_out.contiguous(), x, bias.contiguous(), grad_in, partial, rows, cols, Z1=_Z1, Z3=_Z3, D0=_D0,
        D2=_D2, X_CLAMP=_X_CLAMP, ROUND_BF16=rounds_bf16(x.dtype), ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
        TILE_ROWS=TILE_ROWS, TILE_COLS=TILE_COLS, num_warps=_NUM_WARPS,
    )
    grad_bias = torch.empty_like(bias)
    _gelu_bias_grad_sum_kernel[(triton.cdiv(cols, _BLOCK),)](partial, grad_bias, groups, cols,
                                                      ROUND_BF16=rounds_bf16(bias.dtype), BLOCK=_BLOCK,
                                                      num_warps=_NUM_WARPS)
    return grad_in, grad_bias


@_gelu_tanh_bias_backward.register_fake
def _(grad_out, x, bias):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _setup_bias_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bias_backward(ctx, grad_out):
    x, bias = ctx.saved_tensors
    return _gelu_tanh_bias_backward(grad_out, x, bias)


_gelu_tanh_bias.register_autograd(_bias_backward, setup_context=_setup_bias_context)
