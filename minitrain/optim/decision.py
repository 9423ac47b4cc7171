"""What each step decides on the device, from the scaled gradients' sum of squares, with no host sync: whether
it is skipped, the norm, the clip coefficient, the bias corrections and the loss-scale update. `decide_step` is
that rule in torch (the loop and foreach steps run it); adamw_triton's finalize kernel is its twin
(tests/test_optim.py compares them)."""

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Counters:
    """What every step updates on the device and the state_dict keeps: the steps taken (t of the bias
    corrections), the steps skipped, and the last step's gradient norm."""

    step: Tensor       # fp32
    skipped: Tensor    # int32
    grad_norm: Tensor  # fp32, of the unscaled gradients

    @classmethod
    def zeros(cls, device):
        return cls(torch.zeros((), dtype=torch.float32, device=device),
                   torch.zeros((), dtype=torch.int32, device=device),
                   torch.zeros((), dtype=torch.float32, device=device))


@dataclass
class StepScalars:
    """What one step decided, 0-d fp32 device tensors: the fused kernels' scalars buffer, field for field."""

    grad_mult: Tensor     # 1/scale * clip coefficient; 0 on a skipped step
    not_skipped: Tensor   # 1, or 0 on a skipped step
    inv_bc1: Tensor       # 1 / (1 - beta1^t)
    inv_bc2_sqrt: Tensor  # 1 / sqrt(1 - beta2^t)


def decide_step(sumsq: Tensor, counters: Counters, max_grad_norm, betas, scaler) -> StepScalars:
    """Everything a step decides from its scaled gradients' sum of squares, without a host sync: skip it if
    the sum is not finite; the unscaled norm and the clip coefficient (as clip_grad_norm_); the step
    count, which a skipped step does not advance, and the bias corrections at t = max(step, 1) (a skipped
    first step must not divide by 1 - beta^0); the loss-scale update (scaler.update, the rule's owner).
    The reference of adamw_triton's finalize kernel."""
    found_inf = ~torch.isfinite(sumsq)
    keep = (~found_inf).float()
    inv_scale = 1.0
    if scaler is not None:
        inv_scale = scaler.get_scale().double().reciprocal().float()  # as GradScaler
        scaler.update(found_inf.float())
    norm = sumsq.sqrt() * inv_scale
    mult = inv_scale
    if max_grad_norm:
        mult = mult * (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
    counters.grad_norm.copy_(norm)
    counters.skipped.add_(found_inf)
    counters.step.add_(keep)
    t = counters.step.clamp(min=1.0)
    beta1, beta2 = betas
    return StepScalars(grad_mult=torch.where(found_inf, 0.0, mult), not_skipped=keep,
                       inv_bc1=(1 - torch.exp2(t * math.log2(beta1))).reciprocal(),
                       inv_bc2_sqrt=(1 - torch.exp2(t * math.log2(beta2))).rsqrt())
