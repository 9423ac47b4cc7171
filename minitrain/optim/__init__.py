"""Optimizers: FusedAdamW (loop / foreach / fused Triton) and the plain-PyTorch baseline."""

from .adamw import FusedAdamW
from .torch_baseline import TorchAdamW

__all__ = ["FusedAdamW", "TorchAdamW"]
