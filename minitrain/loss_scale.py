"""Dynamic loss scaling's rule, written once: its parameters with their defaults, and the rule itself.

fp16's range is narrow, so the loss is multiplied by a scale before backward (small gradients stay representable)
and the optimizer divides it back out. A step whose gradients overflowed (an inf or a NaN) is skipped and the
scale backed off; after `growth_interval` overflow-free steps in a row it grows, unless the grown scale is not a
finite float32. This is torch.amp.GradScaler's rule, with GradScaler's defaults.

Two implementations run it on the device, without a host sync: amp.DynamicLossScaler.update (torch's own kernel,
GradScaler's) and the fused optimizer's finalize kernel (optim/adamw_triton.py). `update_rule` is the plain-Python
reference that tests/test_amp.py holds both to, case by case. No torch here: the config (minitrain/config.py,
read before torch is imported) takes its defaults from `LossScaling`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class LossScaling:
    """The rule's parameters, named as torch.amp.GradScaler names them (precision.init_scale ... in the config)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def to_fp32(x: float) -> float:
    """`x` rounded to the nearest float32 (the scale's dtype); inf past float32's range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # rounds to inf: struct refuses what C's cast would give
        return math.copysign(math.inf, x)


def update_rule(rule: LossScaling, scale: float, tracker: int, found_inf: bool) -> tuple[float, int]:
    """The (scale, growth tracker) after one step that found an inf/NaN in its gradients or not. The scale is a
    float32; a product of it and a factor is taken in double and rounded to float32 once, as torch's kernel
    does (a factor such as 1.1 has no exact float32, so a float32 product can differ in the last bit)."""
    if found_inf:
        return to_fp32(scale * rule.backoff_factor), 0
    successful = tracker + 1
    if successful != rule.growth_interval:  # a tracker already past the interval (never made here) counts on
        return scale, successful
    grown = to_fp32(scale * rule.growth_factor)
    return (grown if math.isfinite(grown) else scale), 0
