"""The optimizer the config and the plan ask for: AdamW, TorchAdamW or Muon, each owning its loss scaler."""

from minitrain import distributed
from minitrain.config import DistributedMode
from minitrain.optimizer_config import OptimizerConfig, OptimizerName
from minitrain.distributed import Dist
from minitrain.errors import ConfigError
from minitrain.loss_scale import LossScaling

from .adamw import AdamW
from .muon import Muon, MuonHyper
from .optimizer import Numerics
from .torch_baseline import TorchAdamW


def _loss_scaling(precision) -> LossScaling | None:
    return precision.loss_scale if precision.loss_scaling else None


def _grad_dtype(precision):
    """grad_dtype only where it differs from the params' (under FSDP the stored params may be fp32 already)."""
    return precision.grad_dtype if precision.fp32_main_grads else None


def numerics(precision, reduce_sumsq=None) -> Numerics:
    """What a resolved minitrain.precision.Precision asks of the step (masters, fp32 main grads, loss scaling and
    the scaler's parameters), with the job's `reduce_sumsq` (sharded params)."""
    return Numerics(master_weights=precision.master_weights, grad_dtype=_grad_dtype(precision),
                    loss_scaling=_loss_scaling(precision), reduce_sumsq=reduce_sumsq)


def build_adamw(param_groups, impl: str, precision, reduce_sumsq=None, **hyper):
    """impl: loop | foreach | fused (AdamW) or torch (TorchAdamW); precision: a resolved
    minitrain.precision.Precision; hyper: lr, betas, eps, weight_decay, max_grad_norm. reduce_sumsq: as
    Numerics' (sharded params)."""
    if impl == "torch":
        if reduce_sumsq is not None:
            raise ConfigError("optimizer.impl=torch: distributed=fsdp runs minitrain's own AdamW on the local "
                              "shards; use optimizer.impl=auto|fused|foreach|loop")
        return TorchAdamW(param_groups, loss_scaling=_loss_scaling(precision), **hyper)
    return AdamW(param_groups, impl=impl, numerics=numerics(precision, reduce_sumsq), **hyper)


def from_config(o: OptimizerConfig, plan, model, dist: Dist = Dist()):
    """The optimizer group's optimizer over `model`, as the plan (minitrain.plan.Plan) resolved its implementation,
    precision and lr schedule: AdamW (fused / foreach / loop, or torch's own), or Muon on the hidden matrices with
    AdamW on the rest, with the loss scaler the precision asks for. Under fsdp the params are shards: the grad norm
    and overflow flag are agreed across ranks; under ddp Muon's ranks share the Newton–Schulz work."""
    reduce_sumsq = distributed.all_reduce_sum_ if dist.sharded else None
    common = dict(impl=plan.optimizer_impl, betas=tuple(o.betas), eps=o.eps, max_grad_norm=o.max_grad_norm or None)
    if o.name == OptimizerName.muon:
        m = o.muon
        hyper = MuonHyper(lr=m.lr, momentum=m.momentum, nesterov=m.nesterov, weight_decay=m.weight_decay,
                          adjust_lr=m.adjust_lr.value, ns_coefficients=tuple(m.ns_coefficients), ns_steps=m.ns_steps,
                          ns_eps=m.ns_eps, ns_kernel=m.ns_kernel.value)
        replicas = (dist.rank, dist.world_size) if dist.mode == DistributedMode.ddp else None
        return Muon(model.muon_param_groups(o.weight_decay), hyper, adamw_lr=plan.schedule.lr,
                    numerics=numerics(plan.precision, reduce_sumsq), replicas=replicas, **common)
    return build_adamw(model.param_groups(o.weight_decay), precision=plan.precision, reduce_sumsq=reduce_sumsq,
                       lr=plan.schedule.lr, weight_decay=o.weight_decay, **common)
