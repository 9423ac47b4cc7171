"""The loop and foreach steps: one update in torch list math, applied per tensor (loop) or per (bucket, param
group) (foreach). The twin of adamw_triton's FusedStep, called the same way and in the same three phases: the
gradients of every side's buckets as fp32 with their norms, one decision from their sum of squares, then each
side's update (AdamW's here, Muon's in muon_torch.py)."""

from dataclasses import dataclass

import torch
from torch import Tensor

from minitrain.compat import (foreach_add_, foreach_addcmul_, foreach_copy_, foreach_div, foreach_mul_, foreach_norm,
                              foreach_sqrt, foreach_sub_)

from .decision import StepScalars, decide_step


@dataclass
class _Coefficients:
    """The torch paths' per-step coefficients: on a skipped step the betas, decay and step size make the
    update an exact identity, with no host branch."""

    beta1: Tensor         # beta1, or 1 when skipped
    beta2: Tensor
    inv_bc2_sqrt: Tensor
    decay: Tensor         # [groups] 1 - lr*wd, 1 when skipped
    step_size: Tensor     # [groups] lr / (1 - beta1^t), 0 when skipped


def _pick(xs, idx):
    return [xs[i] for i in idx]


def batches(buckets, impl: str) -> list[list[int]]:
    """What one list-math call covers, as indices into bucket-order lists: one tensor (loop) or one param group
    within one bucket (foreach)."""
    keys = [(id(b), g) for b in buckets for g in b.groups]
    if impl == "loop":
        return [[i] for i in range(len(keys))]
    return [[i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)]


def fp32_grads(buckets, impl: str):
    """The step's gradients as fp32: `units`, the tensors the unscale multiplies (the flat buffers, or under loop
    each gradient), and `grads`, a view per parameter in bucket order. fp32 grads are unscaled in place, like
    GradScaler.unscale_. foreach upcasts each flat buffer in one op: torch has no foreach cast, and no foreach
    `where` to zero non-finite grads on a skipped step, so nan_to_num on the flat buffer does it."""
    flats = [b.grads.flat() for b in buckets]
    if impl == "loop":
        units = grads = [g.float() for b in buckets for g in b.grads.views]
    else:
        units = [flat.float() for flat in flats]
        grads = [g for b, u in zip(buckets, units) for g in b.layout.views(u)]
    return units, grads


def _adamw_(p, g, m, v, c: _Coefficients, group, betas, eps):
    """AdamW on lists of fp32 tensors in torch's op order (decay, then the Adam step).
    The fused kernel computes the same expression per element."""
    beta1, beta2 = betas
    foreach_mul_(m, c.beta1)
    foreach_add_(m, g, alpha=1 - beta1)
    foreach_mul_(v, c.beta2)
    foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = foreach_sqrt(v)
    foreach_mul_(denom, c.inv_bc2_sqrt)
    foreach_add_(denom, eps)
    update = foreach_div(m, denom)
    foreach_mul_(update, c.step_size[group])
    foreach_mul_(p, c.decay[group])
    foreach_sub_(p, update)


class AdamWUpdate:
    """The AdamW update of some buckets, built once: its batches index bucket-order lists."""

    def __init__(self, buckets, impl, betas, eps):
        self.buckets, self.betas, self.eps = buckets, betas, eps
        self.params = [p for b in buckets for p in b.params]
        self.exp_avgs = [m for b in buckets for m in b.state.exp_avgs]
        self.exp_avg_sqs = [v for b in buckets for v in b.state.exp_avg_sqs]
        self.groups = [g for b in buckets for g in b.groups]
        self.batches = batches(buckets, impl)

    def __call__(self, grads, s: StepScalars, lr, weight_decay):
        """grads: fp32, unscaled and clipped (zeros on a skipped step), in bucket order."""
        keep = s.not_skipped.bool()
        lr = lr * s.not_skipped
        c = _Coefficients(beta1=torch.where(keep, self.betas[0], 1.0), beta2=torch.where(keep, self.betas[1], 1.0),
                          inv_bc2_sqrt=s.inv_bc2_sqrt, decay=1 - lr * weight_decay,
                          step_size=lr * s.inv_bc1)

        work = [w for b in self.buckets for w in (
            b.state.masters if b.state.master is not None else
            b.params if b.params[0].dtype == torch.float32 else
            [p.float() for p in b.params])]  # bf16_no_master: fp32 math, rounded into the param
        for idx in self.batches:
            _adamw_(_pick(work, idx), _pick(grads, idx), _pick(self.exp_avgs, idx), _pick(self.exp_avg_sqs, idx),
                    c, self.groups[idx[0]], self.betas, self.eps)
            if work[idx[0]] is not self.params[idx[0]]:
                foreach_copy_(_pick(self.params, idx), _pick(work, idx))


class TorchStep:
    """One step of the loop or foreach path, built once over `sides` (updates, each with its `buckets`): the
    norms of every side's gradients, one decision from their sum of squares, then each side's update."""

    def __init__(self, sides, impl, betas, max_grad_norm, reduce_sumsq):
        self.sides, self.impl = sides, impl
        self.betas, self.max_grad_norm, self.reduce_sumsq = betas, max_grad_norm, reduce_sumsq
        self.buckets = [b for side in sides for b in side.buckets]
        self.batches = batches(self.buckets, impl)
        self.n_tensors = [sum(len(b.params) for b in side.buckets) for side in sides]

    def __call__(self, lr, weight_decay, counters, scaler):
        """One step. lr, weight_decay: [groups] fp32 device tensors; counters, scaler: updated in place."""
        units, grads = fp32_grads(self.buckets, self.impl)
        norms = [n for idx in self.batches for n in foreach_norm(_pick(grads, idx))]
        sumsq = torch.stack(norms).square().sum()
        if self.reduce_sumsq is not None:
            self.reduce_sumsq(sumsq)
        s = decide_step(sumsq, counters, self.max_grad_norm, self.betas, scaler)
        for u in units:
            u.mul_(s.grad_mult).nan_to_num_(0.0, 0.0, 0.0)
        start = 0
        for side, n in zip(self.sides, self.n_tensors):
            side(grads[start:start + n], s, lr, weight_decay)
            start += n
