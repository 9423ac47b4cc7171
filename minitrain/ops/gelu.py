"""tanh-GELU as two memory-streaming Triton kernels (F.gelu(x, approximate="tanh"), same memory: only x is saved).

Why: inductor's GELU kernels fall short of HBM bandwidth in the compiled GPT-2 step (docs/benchmarks.md, "GELU"):
they compute tanh with libdevice's tanhf. tanh-GELU
is exactly x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3), so one exp2 and one division per element
suffice and each kernel is a pure memory stream: forward reads x and writes y; backward reads grad_out and x,
writes grad_in. All math is fp32; results are stored in x's dtype. A custom op, so torch.compile keeps it opaque.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.triton_runtime import check_runnable, round_to_bf16_in_fp32, rounds_bf16

_BLOCK = 2048
_NUM_WARPS = 4
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
def tanh_gelu_fp32(x, Z1: tl.constexpr, Z3: tl.constexpr):
    """tanh-GELU of fp32 `x` as x * sigmoid(2u): exp2 overflow (x << 0) gives x / inf = -0 and underflow (x >> 0)
    gives x / 1 = x, no NaN for finite x. Also the decode kernels' epilogue (minitrain/ops/decode.py)."""
    return x / (1.0 + tl.exp2(x * (Z1 + Z3 * x * x)))


@triton.jit
def _gelu_forward_kernel(x_ptr, y_ptr, n, Z1: tl.constexpr, Z3: tl.constexpr, ROUND_BF16: tl.constexpr,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tanh_gelu_fp32(x, Z1, Z3)
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
    e = tl.exp2(x * (Z1 + Z3 * x * x))
    s = 1.0 / (1.0 + e)
    # 1 - s as e * s: no cancellation when s is near 1; where e overflowed, s = 0 and 1 - s = 1 (not inf * 0).
    one_minus_s = tl.where(s > 0.0, e * s, 1.0)
    xc = tl.minimum(tl.maximum(x, -X_CLAMP), X_CLAMP)
    # d/dx [x s] = s + x s (1 - s) 2 du/dx
    g = grad_out * (s * (1.0 + xc * one_minus_s * (D0 + D2 * xc * xc)))
    if ROUND_BF16:
        g = round_to_bf16_in_fp32(g)
    tl.store(grad_in_ptr + offs, g.to(grad_in_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("minitrain::gelu_tanh", mutates_args=())
def _gelu_tanh(x: Tensor) -> Tensor:
    """Returns a contiguous tensor of x's shape and dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    _gelu_forward_kernel[(triton.cdiv(n, _BLOCK),)](
        x, y, n, Z1=_Z1, Z3=_Z3, ROUND_BF16=rounds_bf16(x.dtype), BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )
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


def gelu_tanh(x: Tensor) -> Tensor:
    """F.gelu(x, approximate="tanh") for any float dtype and shape; fp32 math, output in x's dtype."""
    check_runnable(x, "gelu_tanh", "model.gelu=torch")
    return _gelu_tanh(x)


def gelu_tanh_backward(grad_out: Tensor, x: Tensor) -> Tensor:
    """grad_out * gelu_tanh'(x), in x's dtype: for callers that run their own backward (selective
    checkpointing)."""
    return _gelu_tanh_backward(grad_out, x)
