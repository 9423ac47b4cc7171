"""AdamW with fp32 master weights, dynamic loss scaling and no host synchronisation.

The optimizer is pure bandwidth (~1 FLOP per byte), so its only levers are bytes moved and
kernels launched. Three implementations of one update make each lever visible:

  loop     torch ops one tensor at a time: ~15 launches per parameter tensor
  foreach  torch._foreach_* over tensor lists: launches per op, but every op is a pass over memory
  fused    Triton (adamw_triton.py): norm pass + finalize + one update pass, 3 launches in all

Per parameter dtype, a Bucket (bucket.py) holds fp32 masters (low-precision params only), m and v in
flat buffers owned by the optimizer (layout.py), and says where the step finds the gradients (grads.py).
The model's parameters stay where the model put them.

Each step decides on the device, from the scaled gradients' sum of squares, whether it is skipped,
the norm, the clip coefficient, the bias corrections and the loss-scale update (decision.py). The loop
and foreach steps run in torch (adamw_torch.py), the fused one in Triton: each a callable built once.

Under FSDP2 the parameters are DTensors sharded across ranks: every buffer above is built over
their local shards (the ZeRO-3 layout: each rank updates 1/N of the model), the step reads
p.grad's local shard, and `reduce_sumsq` all-reduces the local sum of squares so the norm and the
skip decision are global.
"""

from dataclasses import asdict

import torch
from torch import Tensor

from minitrain.amp import DynamicLossScaler, LossScaling
from minitrain.triton_runtime import check_runnable

from .adamw_torch import TorchStep
from .adamw_triton import FusedStep
from .bucket import buckets_by_dtype
from .decision import Counters

IMPLS = ("loop", "foreach", "fused")
_HYPER_ROWS = ("lr", "weight_decay")  # the per-group hyperparameter table on the device: one row each


def _dtype(d):
    return {"fp32": torch.float32, "float32": torch.float32}.get(d, d)


class AdamW:
    """AdamW (decoupled weight decay, bias correction, fp32 math) with optional fp32 masters,
    global-norm clipping and dynamic loss scaling, all decided on the device.

    step() never synchronises with the host: lr/weight_decay go to the device through a pinned
    buffer when they change; the skip decision, clip coefficient, step count and loss-scale
    update are device tensors. Per-group lr and weight_decay; betas, eps and max_grad_norm are
    global.

    loss_scaling: None, or the dynamic loss scaler's parameters; the optimizer then owns the scaler
    (`loss_scaler`): the caller scales the loss with `scale(loss)`, and state_dict carries its state.

    reduce_sumsq: None, or an in-place function on the step's sum of squared (scaled) grads, a
    one-element fp32 device tensor, run before anything is decided from it. With sharded params it
    all-reduces (sums) across ranks: the norm becomes the global one, and since a sum holding an
    inf/NaN is inf/NaN, every rank takes the same skip decision and loss-scale update.
    """

    def __init__(self, params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 max_grad_norm=1.0, impl="fused", master_weights=None, grad_dtype=None, reduce_sumsq=None,
                 loss_scaling: LossScaling | None = None):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = [{"lr": lr, "weight_decay": weight_decay, **g,
                              "params": [p for p in g["params"] if p.requires_grad]}
                             for g in groups]
        self.defaults = {"lr": lr, "weight_decay": weight_decay}
        self.betas, self.eps, self.max_grad_norm, self.impl = tuple(betas), eps, max_grad_norm, impl
        self.reduce_sumsq = reduce_sumsq
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.device = self._params[0].device
        if impl == "fused":
            check_runnable(self._params[0], "AdamW(impl='fused')", "impl='foreach' (optimizer.impl=foreach)")

        self.buckets = buckets_by_dtype(self.param_groups, impl, master_weights, _dtype(grad_dtype))
        self.counters = Counters.zeros(self.device)
        self._hyper = torch.zeros(len(_HYPER_ROWS), len(self.param_groups), dtype=torch.float32, device=self.device)
        self._lr, self._wd = self._hyper.unbind()  # views of its rows, which each upload refills
        self._hyper_host = None
        self.loss_scaler = DynamicLossScaler(**asdict(loss_scaling), device=self.device) if loss_scaling else None
        self._impl_step = FusedStep(self.buckets, self.betas, eps, max_grad_norm, reduce_sumsq) if impl == "fused" \
            else TorchStep(self.buckets, impl, self.betas, eps, max_grad_norm, reduce_sumsq)

    # -- step ---------------------------------------------------------------------------------

    def scale(self, loss: Tensor) -> Tensor:
        """The loss to call backward() on: multiplied by the loss scale when the optimizer has a scaler."""
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self):
        self._upload_hyper()
        self._impl_step(self._lr, self._wd, self.counters, self.loss_scaler)

    def _upload_hyper(self):
        """Copy per-group lr/wd to the device when they changed, without a sync: pageable H2D
        copies synchronise, so the source is pinned (the caching host allocator keeps it alive
        until the copy has run)."""
        host = [float(g[k]) for k in _HYPER_ROWS for g in self.param_groups]
        if host != self._hyper_host:
            src = torch.tensor(host, dtype=torch.float32, device="cpu").view(self._hyper.shape)
            if self._hyper.is_cuda:
                src = src.pin_memory()
            self._hyper.copy_(src, non_blocking=True)
            self._hyper_host = host

    # -- the rest of the optimizer interface ------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """set_to_none frees the gradients and the flat buffers; else zeroes them."""
        for b in self.buckets:
            b.grads.release() if set_to_none else b.grads.zero()

    def stats(self):
        """Live 0-d device tensors; read (or clone) them at log steps only. loss_scale only with a loss scaler."""
        stats = {"grad_norm": self.counters.grad_norm, "skipped_steps": self.counters.skipped}
        if self.loss_scaler is not None:
            stats["loss_scale"] = self.loss_scaler.get_scale()
        return stats

    def state_dict(self):
        """torch-like layout: per-param views (torch.save stores each flat buffer once); DTensors
        over the local views when the params are sharded. The loss scaler's state (None without one)."""
        state = {}
        for b in self.buckets:
            state.update(b.state_dict())
        index = {p: i for i, p in enumerate(self._params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups, "step": self.counters.step,
                "skipped_steps": self.counters.skipped,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, sd):
        if [len(g["params"]) for g in sd["param_groups"]] != \
                [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state_dict's param groups do not match this optimizer's")
        if self.loss_scaler is not None and sd.get("loss_scaler") is None:
            raise ValueError("state_dict has no loss-scaler state, but this optimizer scales the loss "
                             "(it was saved by a run without loss scaling)")
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for b in self.buckets:
            b.load_state_dict(sd["state"])
        self.counters.step.copy_(sd["step"])
        self.counters.skipped.copy_(sd["skipped_steps"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(sd["loss_scaler"])
