"""The compiled step must compute the model's own loss. Inductor generates its own kernels for the forward
and backward, and for some graphs they round differently enough from eager's to train another function (a
loss that starts off and runs away); nothing else in a run would show it. So the first compiled step's loss
is compared with the uncompiled forward's on the same params and batch, once, before training goes on."""

from __future__ import annotations

from typing import Callable

import torch

from . import distributed
from .data import DeviceBatches

TOLERANCE = 0.01  # nats: far above bf16 rounding's effect on a mean loss, far below a different function's


class CompileMismatchError(RuntimeError):
    """The compiled step's first loss is not the uncompiled model's."""


def eager_loss(forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batches: DeviceBatches,
               step: int, grad_accum: int, dist: distributed.Dist) -> torch.Tensor:
    """The mean loss of this rank's micro-batches of `step` from the uncompiled forward, as the step takes
    them; a device tensor (no host read)."""
    rank, world = dist.rank, dist.world_size
    with torch.no_grad():
        losses = [forward_loss(*batches.get(step, rank * grad_accum + m, world * grad_accum)).float()
                  for m in range(grad_accum)]
    mean = torch.stack(losses).mean()
    if mean.is_cuda:  # the forward's freed blocks would stay reserved beside the CUDA graphs' private pool
        torch.cuda.empty_cache()
    return mean


def agrees(compiled: float, eager: float) -> bool:
    """Within TOLERANCE (a NaN on either side does not agree)."""
    return abs(compiled - eager) <= TOLERANCE


def verify(compiled: torch.Tensor, eager: torch.Tensor, dist: distributed.Dist, setting: str) -> str:
    """Raise if the two losses, averaged over ranks (every rank decides alike), are further apart than
    TOLERANCE; else the line to print. `setting` names what was compiled, for the message."""
    got, expected = float(distributed.mean(compiled, dist)), float(distributed.mean(eager, dist))
    if not agrees(got, expected):
        raise CompileMismatchError(
            f"torch.compile's first step gave loss {got:.4f} where the uncompiled model gives "
            f"{expected:.4f} on the same params and batch ({setting}): the compiled code computes another "
            f"function. Train with trainer.compile=false or another precision=..., or skip this check with "
            f"trainer.compile_check=false")
    return f"compile check: first-step loss {got:.4f}, uncompiled {expected:.4f} (gap {got - expected:+.4f})"
