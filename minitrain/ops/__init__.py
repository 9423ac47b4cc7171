"""Custom ops: fused kernels and the plain-PyTorch references they are tested against."""

from minitrain.ops.cross_entropy import fused_linear_cross_entropy
from minitrain.ops.cross_entropy_reference import linear_cross_entropy_reference, soft_cap
from minitrain.ops.float8_linear import Float8Linear, float8_linear
from minitrain.ops.gelu import gelu_tanh, gelu_tanh_backward
from minitrain.ops.qk_norm_rope import qk_norm_rope
from minitrain.ops.rope import rope_tables

__all__ = ["Float8Linear", "float8_linear", "fused_linear_cross_entropy", "gelu_tanh", "gelu_tanh_backward",
           "linear_cross_entropy_reference", "qk_norm_rope", "rope_tables", "soft_cap"]
