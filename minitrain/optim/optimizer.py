"""What AdamW and Muon share around their step: param groups whose lr and weight decay live on the device, the
counters every step updates there, the loss scaler, the buckets and the state_dict that covers them all.

A subclass builds `buckets` (every parameter's state, whatever its update) and `_impl_step`, a callable
`(lr, weight_decay, counters, scaler)` built once: the norm pass over every gradient, one decision, then each
side's update (adamw_torch.TorchStep, adamw_triton.FusedStep)."""

from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from minitrain.amp import DynamicLossScaler
from minitrain.loss_scale import LossScaling

from .decision import Counters

IMPLS = ("loop", "foreach", "fused")
_HYPER_ROWS = ("lr", "weight_decay")  # the per-group hyperparameter table on the device: one row each


def dtype_of(d):
    return {"fp32": torch.float32, "float32": torch.float32}.get(d, d)


def as_groups(params, defaults: dict) -> list[dict]:
    """torch's param-groups convention: a list of params or of dicts; each group's missing keys from `defaults`.
    Params that need no gradient are left out."""
    groups = list(params)
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [{**defaults, **g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]


@dataclass(frozen=True)
class Numerics:
    """How a step holds and decides, whatever its update rule (AdamW's, Muon's): the precision's part and the job's.

    master_weights: fp32 masters for low-precision params (None: where the params are not fp32); grad_dtype: the
    dtype gradients accumulate in (None: the params'; fp32: fp32 main grads); loss_scaling: None, or the dynamic loss
    scaler's parameters. reduce_sumsq: None, or an in-place function on the step's sum of squared (scaled) grads, a
    one-element fp32 device tensor, run before anything is decided from it: with sharded params it all-reduces (sums)
    across ranks, so the norm is the global one and, a sum holding an inf/NaN being inf/NaN, every rank takes the
    same skip decision and loss-scale update."""

    master_weights: Optional[bool] = None
    grad_dtype: Any = None
    loss_scaling: Optional[LossScaling] = None
    reduce_sumsq: Optional[Callable[[Tensor], Any]] = None


class DeviceOptimizer:
    """step() never synchronises with the host: lr/weight_decay go to the device through a pinned buffer when they
    change; the skip decision, clip coefficient, step count and loss-scale update are device tensors.

    loss_scaling: None, or the dynamic loss scaler's parameters; the optimizer then owns the scaler
    (`loss_scaler`): the caller scales the loss with `scale(loss)`, and state_dict carries its state."""

    buckets: list
    _impl_step: object

    def __init__(self, param_groups: list[dict], defaults: dict, loss_scaling: LossScaling | None):
        self.param_groups, self.defaults = param_groups, defaults
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.device = self._params[0].device
        self.counters = Counters.zeros(self.device)
        self._hyper = torch.zeros(len(_HYPER_ROWS), len(self.param_groups), dtype=torch.float32, device=self.device)
        self._lr, self._wd = self._hyper.unbind()  # views of its rows, which each upload refills
        self._hyper_host = None
        self.loss_scaler = DynamicLossScaler(loss_scaling, device=self.device) if loss_scaling else None

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
