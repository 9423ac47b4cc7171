"""The optimizer a resolved precision asks for: AdamW, TorchAdamW or Muon, each owning its loss scaler."""

from minitrain.config import ConfigError
from minitrain.loss_scale import LossScaling

from .adamw import AdamW
from .muon import Muon
from .torch_baseline import TorchAdamW


def _loss_scaling(precision) -> LossScaling | None:
    return precision.loss_scale if precision.loss_scaling else None


def _grad_dtype(precision):
    """grad_dtype only where it differs from the params' (under FSDP the stored params may be fp32 already)."""
    return precision.grad_dtype if precision.fp32_main_grads else None


def build_adamw(param_groups, impl: str, precision, reduce_sumsq=None, **hyper):
    """impl: loop | foreach | fused (AdamW) or torch (TorchAdamW); precision: a resolved
    minitrain.precision.Precision (masters, fp32 main grads, loss scaling and the scaler's parameters);
    hyper: lr, betas, eps, weight_decay, max_grad_norm. reduce_sumsq: as AdamW's (sharded params)."""
    scaling = _loss_scaling(precision)
    if impl == "torch":
        if reduce_sumsq is not None:
            raise ConfigError("optimizer.impl=torch: distributed=fsdp runs minitrain's own AdamW on the local "
                              "shards; use optimizer.impl=auto|fused|foreach|loop")
        return TorchAdamW(param_groups, loss_scaling=scaling, **hyper)
    return AdamW(param_groups, impl=impl, master_weights=precision.master_weights,
                 grad_dtype=_grad_dtype(precision), reduce_sumsq=reduce_sumsq, loss_scaling=scaling, **hyper)


def build_muon(param_groups, impl: str, precision, reduce_sumsq=None, replicas=None, **hyper):
    """Muon (loop | foreach | fused; `use_muon` groups, the rest AdamW) for a resolved precision, as build_adamw;
    hyper: Muon's arguments. `replicas`: (rank, world size) under ddp."""
    return Muon(param_groups, impl=impl, master_weights=precision.master_weights, grad_dtype=_grad_dtype(precision),
                reduce_sumsq=reduce_sumsq, loss_scaling=_loss_scaling(precision), replicas=replicas, **hyper)
