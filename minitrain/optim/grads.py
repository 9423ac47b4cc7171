"""Where an optimizer step finds a bucket's gradients: three sources, one per way they are kept.

Gradients stay autograd's own tensors, which backward creates (no 2 B/param held during forward, where
a step's memory peaks, and no per-parameter `grad += new`: the first micro-batch's gradient is stolen,
not added). DDP and FSDP2 see plain p.grad tensors.

  InPlaceGrads   the fused step reads autograd's p.grad where it lies, through a table of addresses
  GatheredGrads  loop and foreach gather them into a flat buffer of the state's layout (their list math
                 wants one), with one multi-tensor copy, and point p.grad at its views
  MainGrads      grad_dtype wider than the params' (fp32 main grads): a post-accumulate hook adds each
                 gradient into the flat fp32 buffer's view and frees p.grad, so micro-batches accumulate
                 in fp32; every implementation reads that buffer

`owners` are the tensors p.grad is set on (DTensors under FSDP2, whose local shards the step reads).
zero_grad(set_to_none) is `release()`: it frees p.grad and any flat buffer.
"""

from operator import attrgetter

import torch

from minitrain.compat import foreach_copy_, foreach_zero_

from .dtensor import any_sharded, local
from .layout import Layout

_GRAD = attrgetter("grad")


class InPlaceGrads:
    def __init__(self, owners, dtype):
        self.owners, self.dtype = owners, dtype
        self.sharded = any_sharded(owners)

    def tensors(self):
        """Autograd's gradients (their local shards), None where a parameter has none."""
        if self.sharded:
            return [None if p.grad is None else local(p.grad) for p in self.owners]
        return list(map(_GRAD, self.owners))  # host time per tensor matters at thousands of tensors

    def release(self):
        for p in self.owners:
            p.grad = None

    def zero(self):
        for p in self.owners:
            if p.grad is not None:
                p.grad.zero_()


class _FlatGrads:
    """A zeroed flat buffer of the layout, made when a step first needs it, with one view per parameter."""

    def __init__(self, owners, layout: Layout, dtype, device):
        self.owners, self.layout, self.dtype, self.device = owners, layout, dtype, device
        self.buffer = self.views = None

    def _ensure(self) -> bool:
        """Make the buffer unless it exists; whether it was just made."""
        if self.buffer is not None:
            return False
        self.buffer = torch.zeros(self.layout.size, dtype=self.dtype, device=self.device)
        self.views = self.layout.views(self.buffer)
        return True

    def release(self):
        self.buffer = self.views = None
        for p in self.owners:
            p.grad = None

    def zero(self):
        if self.buffer is not None:
            self.buffer.zero_()
        for p in self.owners:
            if p.grad is not None:
                p.grad.zero_()


class GatheredGrads(_FlatGrads):
    def __init__(self, owners, layout, dtype, device):
        super().__init__(owners, layout, dtype, device)
        self.sharded = any_sharded(owners)

    def flat(self):
        """The flat buffer holding this step's gradients (zeros where a parameter has none), p.grad pointed
        at its views. Repeated steps over the same grads copy nothing (under FSDP they copy again: p.grad
        stays FSDP's, since a DTensor per view costs more host time than the copy it saves)."""
        made = self._ensure()
        if not made:  # kept since the last step (no zero_grad(set_to_none)): gradients set to None are zeros
            gone = [view for view, p in zip(self.views, self.owners) if p.grad is None]
            if gone:
                foreach_zero_(gone)
        new = [(view, p) for view, p in zip(self.views, self.owners)
               if p.grad is not None and local(p.grad) is not view]
        if new:
            foreach_copy_([view for view, _ in new], [local(p.grad) for _, p in new])
            if not self.sharded:
                for view, p in new:
                    p.grad = view
        return self.buffer


class MainGrads(_FlatGrads):
    def __init__(self, owners, layout, dtype, device):
        super().__init__(owners, layout, dtype, device)
        for i, p in enumerate(owners):
            p.register_post_accumulate_grad_hook(self._accumulate(i))

    def _accumulate(self, i):
        """Post-accumulate hook of parameter i: add its low-precision gradient into fp32 view i."""

        def hook(p):
            self._ensure()
            self.views[i].add_(local(p.grad))
            p.grad = None

        return hook

    def flat(self):
        """The buffer the hooks filled (zeros if no backward ran)."""
        self._ensure()
        return self.buffer

    def tensors(self):
        self._ensure()
        return self.views
