"""The learning-rate schedule: linear warmup from lr/warmup to lr, then cosine decay to min_lr.

Step s (0-based) of warmup trains at lr * (s + 1) / warmup, so the first step already moves and the
last warmup step reaches lr; decay then runs over the remaining steps and holds min_lr after max_steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def default_warmup(max_steps: int) -> int:
    """10% of the run: a short run warms up over its own first steps instead of failing."""
    return max_steps // 10


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_steps: int
    max_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (self.lr - self.min_lr)
