"""The rotary embedding's cos and sin tables as one opaque op.

Written inline, the tables are elementwise ops on `pos`, and Inductor fuses them into every kernel that rotates q or
k: a cos and a sin per element of each, in the forward and again in the backward. Behind a custom op the compiled
step computes them once per forward (calls with the same positions are one node) and its rotations read them
(docs/benchmarks.md, "Time to target").
"""

import torch
from torch import Tensor


@torch.library.custom_op("minitrain::rope_tables", mutates_args=())
def rope_tables(pos: Tensor, head_size: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin (T, head_size / 2), fp32, of the angles pos * base^(-2i / head_size) at positions `pos` (T,)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, device=pos.device, dtype=torch.float32) / head_size))
    angle = pos.to(torch.float32)[:, None] * inv_freq
    return angle.cos(), angle.sin()


@rope_tables.register_fake
def _(pos, head_size, base):
    shape = (pos.shape[0], head_size // 2)
    return pos.new_empty(shape, dtype=torch.float32), pos.new_empty(shape, dtype=torch.float32)
