"""One training step, top to bottom: micro-batches of forward + loss + backward, then one optimizer step.

It depends on interfaces only — `forward_loss(x, y)` (the model's forward and the loss, compiled or
not), `optimizer.scale(loss)`, `optimizer.step()` — so the fused kernels and the plain-PyTorch parts swap
behind config switches without touching it. Nothing here reads a device value on the host: the loss
comes back as a device tensor, read at log steps only. `phase(name)` wraps each phase (a profiler
label by default; benchmarks pass timers).
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch.profiler import record_function

from . import distributed
from .data import DeviceBatches
from .schedule import LRSchedule

Phase = Callable[[str], ContextManager]


class TrainStep:
    def __init__(self, forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], module: nn.Module,
                 optimizer, batches: DeviceBatches, schedule: LRSchedule, grad_accum: int, dist: distributed.Dist,
                 cuda_graphs: bool, phase: Phase = record_function):
        self.forward_loss, self.module, self.optimizer = forward_loss, module, optimizer
        self.batches, self.schedule, self.accum, self.dist = batches, schedule, grad_accum, dist
        self.cuda_graphs, self.phase = cuda_graphs, phase

    def __call__(self, step: int) -> torch.Tensor:
        """One optimizer step over the global batch; returns this rank's mean loss as a device tensor.
        Each rank takes its slices of the global batch: micro-batch m of rank r is part r * accum + m."""
        accum, rank, world = self.accum, self.dist.rank, self.dist.world_size
        total = torch.zeros((), device=self.optimizer.device)
        for micro in range(accum):
            with self.phase("minitrain.data"):
                x, y = self.batches.get(step, rank * accum + micro, world * accum)
            with distributed.grad_sync(self.module, sync=micro == accum - 1):
                with self.phase("minitrain.forward"):
                    loss = self.forward_loss(x, y)
                with self.phase("minitrain.backward"):
                    self.optimizer.scale(loss / accum).backward()
            if micro == 0 and accum > 1 and self.cuda_graphs:
                self._own_graph_gradients()
            total += loss.detach().float()
        with self.phase("minitrain.optimizer"):
            self.optimizer.set_lr(self.schedule(step))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total / accum

    def _own_graph_gradients(self) -> None:
        """Under CUDA graphs the first micro-batch's gradients are graph outputs, in the pool the next replay
        overwrites: copied out once, the later micro-batches add into the copies."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad = p.grad.clone()
