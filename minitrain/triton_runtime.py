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
