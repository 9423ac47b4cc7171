"""Muon's side of the loop and foreach steps: torch.optim.Muon's update in torch list math, per batch of one shape
(foreach) or per matrix (loop, as torch.optim.Muon runs it). The twin of muon_triton's MuonKernels, called by
adamw_torch.TorchStep after the one decision of the step."""

import torch

from minitrain.compat import foreach_addcmul_, foreach_copy_, foreach_lerp, foreach_lerp_, foreach_mul_

from .adamw_triton import BLOCK
from .decision import StepScalars
from .newton_schulz import batches


class MuonUpdate:
    """torch.optim.Muon's update of some buckets, built once: momentum B = lerp(B, g, 1 - mu) (mu·B + (1 - mu)·g),
    the Newton–Schulz input lerp(g, B, mu) with Nesterov (B without), orthogonalized in bf16, then
    p = p·(1 - lr·wd) - lr·ratio·O on the fp32 master, each op as torch.optim.Muon writes it."""

    def __init__(self, buckets, impl: str, momentum: float, nesterov: bool, exchange, adjust_lr: str):
        self.buckets, self.momentum, self.nesterov, self.exchange = buckets, momentum, nesterov, exchange
        self.runs, start = [], 0
        for b in buckets:
            self.runs += [(b, start, batch) for batch in batches(b, impl == "loop", adjust_lr, BLOCK)]
            start += len(b.params)

    def __call__(self, grads, s: StepScalars, lr, weight_decay):
        """grads: fp32, unscaled and clipped (zeros on a skipped step), in bucket order. On a skipped step the
        momentum's weight is 0, so the buffer stays exactly itself, and lr is 0: the update is an identity."""
        buffer_weight = s.not_skipped * (1 - self.momentum)
        lr = lr * s.not_skipped
        for b, start, batch in self.runs:
            j = slice(batch.first, batch.first + batch.count)
            g, buf = grads[start + j.start:start + j.stop], b.state.momentums[j]
            foreach_lerp_(buf, g, [buffer_weight] * batch.count)  # a tensor weight: no .item(), no sync
            x = self.exchange.inputs(batch.count, batch.local_shape, batch.shape, buf[0].device)
            rows = batch.local_shape[0]
            mixed = foreach_lerp(g, buf, self.momentum) if self.nesterov else buf
            foreach_copy_([m[:rows] for m in x[:batch.count]], mixed)  # rounded to bf16
            del mixed
            o = self.exchange(x, batch.count, rows, batch.shape)
            del x
            work = b.state.masters[j] if b.state.master is not None else \
                b.params[j] if b.params[0].dtype == torch.float32 else [p.float() for p in b.params[j]]
            step = -batch.ratio * lr[batch.group]
            foreach_mul_(work, 1 - lr[batch.group] * weight_decay[batch.group])
            foreach_addcmul_(work, list(o), [step] * batch.count)
            if work[0] is not b.params[batch.first]:
                foreach_copy_(b.params[j], work)
            del o, work  # before the next batch's buffers are made
