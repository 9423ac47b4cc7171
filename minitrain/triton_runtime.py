"""Where the Triton kernels run -- the GPU, or the CPU through Triton's interpreter -- and what that changes.

Shared by `minitrain.ops` and `minitrain.optim`, below both: neither package imports the other, and importing
it loads no op.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, as Triton does


def interpreted() -> bool:
    """Whether Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1 when Triton was imported)."""
    return _INTERPRETED


def rounds_bf16(dtype: torch.dtype) -> bool:
    """The ROUND_BF16 flag of a kernel storing `dtype`: under the interpreter only (see below)."""
    return interpreted() and dtype == torch.bfloat16


def dots_in_fp32(dtype: torch.dtype) -> bool:
    """The DOT_IN_FP32 flag of a kernel multiplying `dtype` tiles with tl.dot: under the interpreter, for bf16 only,
    whose dot multiplies bf16 tiles' raw bits (products of bf16 values are exact in fp32, so the result is the GPU's)."""
    return interpreted() and dtype == torch.bfloat16


@triton.jit
def round_to_bf16_in_fp32(x):
    """The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: kernels round
    explicitly under it, so CPU tests see the GPU's numerics."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def check_runnable(tensor: Tensor, what: str, fallback: str) -> None:
    """Raise if `tensor` is on the CPU and Triton's interpreter is off; `fallback` names the plain-PyTorch path."""
    if tensor.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            f"{what} runs Triton kernels: on CPU set TRITON_INTERPRET=1 before importing minitrain (tests), "
            f"or use {fallback}."
        )


def rounds_float8() -> bool:
    """The ROUND_FP8 flag of a kernel storing float8: under the interpreter only (see below)."""
    return interpreted()


@triton.jit
def float8_bits(y, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The float8 encoding (as uint8) of fp32 `y`, |y| within the format's range or NaN, rounded to nearest even as
    the GPU's conversion does. The interpreter's own fp32 -> float8 conversion truncates, drops the carry of a
    round-up into the exponent and has no NaN, so kernels store these bits under it instead."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = ((bits >> 31) << 7).to(tl.uint8)
    magnitude = tl.abs(y)
    # Normal numbers: round the fp32 mantissa to MANTISSA bits (a carry moves into the exponent), rebias.
    shift: tl.constexpr = 23 - MANTISSA
    rounded = ((bits & 0x7FFFFFFF) + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((127 - BIAS) << MANTISSA)
    # Below the smallest normal, 2**(1 - BIAS): a count of the subnormal step, rounded to even by adding 2**23
    # (whose ulp is 1); a count of 2**MANTISSA is the smallest normal's encoding.
    subnormal = (magnitude * (2.0 ** (BIAS - 1 + MANTISSA)) + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where(magnitude < 2.0 ** (1 - BIAS), subnormal, normal)
    return tl.where(y == y, sign | code.to(tl.uint8), 0x7F)
