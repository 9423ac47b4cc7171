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
the norm, the clip coefficient, the bias corrections and the loss-scale update: `decide_step` is that
rule in torch, and the fused path's finalize kernel is its twin (tests/test_optim.py compares them).

Under FSDP2 the parameters are DTensors sharded across ranks: every buffer above is built over
their local shards (the ZeRO-3 layout: each rank updates 1/N of the model), the step reads
p.grad's local shard, and `reduce_sumsq` all-reduces the local sum of squares so the norm and the
skip decision are global.
"""

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from minitrain.amp import DynamicLossScaler, LossScaling
from minitrain.triton_runtime import check_runnable

from .adamw_triton import FusedStep
from .bucket import Bucket
from .dtensor import like, local

IMPLS = ("loop", "foreach", "fused")
_HYPER_ROWS = ("lr", "weight_decay")  # the per-group hyperparameter table on the device: one row each


def _dtype(d):
    return {"fp32": torch.float32, "float32": torch.float32}.get(d, d)


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


def _adamw_(p, g, m, v, c: _Coefficients, group, betas, eps):
    """AdamW on lists of fp32 tensors in torch's op order (decay, then the Adam step).
    The fused kernel computes the same expression per element."""
    beta1, beta2 = betas
    torch._foreach_mul_(m, c.beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, c.beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_mul_(denom, c.inv_bc2_sqrt)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, denom)
    torch._foreach_mul_(update, c.step_size[group])
    torch._foreach_mul_(p, c.decay[group])
    torch._foreach_sub_(p, update)


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

        by_dtype, i = {}, 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                by_dtype.setdefault(p.dtype, []).append((p, gi, i))
                i += 1
        grad_dtype = _dtype(grad_dtype)
        self.buckets = [
            Bucket([p for p, _, _ in pg], [gi for _, gi, _ in pg], [i for _, _, i in pg], impl,
                   has_master=dtype != torch.float32 and master_weights is not False,
                   grad_dtype=grad_dtype or dtype)
            for dtype, pg in by_dtype.items()]

        # bucket-order lists for the torch paths; a batch is what one list-math call covers:
        # one tensor (loop) or one group within one bucket (foreach)
        self._p = [p for b in self.buckets for p in b.params]
        self._m = [m for b in self.buckets for m in b.state.exp_avgs]
        self._v = [v for b in self.buckets for v in b.state.exp_avg_sqs]
        self._groups = [g for b in self.buckets for g in b.groups]
        keys = [(id(b), g) for b in self.buckets for g in b.groups]
        self._batches = [[i] for i in range(len(keys))] if impl == "loop" else \
            [[i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)]

        self.counters = Counters.zeros(self.device)
        self._hyper = torch.zeros(len(_HYPER_ROWS), len(self.param_groups), dtype=torch.float32, device=self.device)
        self._lr, self._wd = self._hyper.unbind()  # views of its rows, which each upload refills
        self._hyper_host = None
        self.loss_scaler = DynamicLossScaler(**asdict(loss_scaling), device=self.device) if loss_scaling else None
        self._fused = FusedStep(self.buckets, self.betas, self.eps, max_grad_norm, reduce_sumsq) \
            if impl == "fused" else None

    # -- step ---------------------------------------------------------------------------------

    def scale(self, loss: Tensor) -> Tensor:
        """The loss to call backward() on: multiplied by the loss scale when the optimizer has a scaler."""
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self):
        scaler = self.loss_scaler
        self._upload_hyper()
        if self._fused is not None:
            self._fused(self._lr, self._wd, self.counters, scaler)
        else:
            self._torch_step(scaler)

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

    def _torch_step(self, scaler):
        """loop and foreach: the same list math, applied per tensor or per (bucket, group)."""
        flats = [b.grads.flat() for b in self.buckets]
        # fp32 grads (fp32 grads are unscaled in place, like GradScaler.unscale_). foreach
        # upcasts each flat buffer in one op: torch has no foreach cast, and no foreach `where`
        # to zero non-finite grads on a skipped step, so nan_to_num on the flat buffer does it.
        if self.impl == "loop":
            units = grads = [g.float() for b in self.buckets for g in b.grads.views]
        else:
            units = [flat.float() for flat in flats]
            grads = [g for b, u in zip(self.buckets, units) for g in b.layout.views(u)]
        norms = [n for idx in self._batches for n in torch._foreach_norm(_pick(grads, idx))]
        sumsq = torch.stack(norms).square().sum()
        if self.reduce_sumsq is not None:
            self.reduce_sumsq(sumsq)
        s = decide_step(sumsq, self.counters, self.max_grad_norm, self.betas, scaler)
        for u in units:
            u.mul_(s.grad_mult).nan_to_num_(0.0, 0.0, 0.0)
        keep = s.not_skipped.bool()
        lr = self._lr * s.not_skipped
        c = _Coefficients(beta1=torch.where(keep, self.betas[0], 1.0), beta2=torch.where(keep, self.betas[1], 1.0),
                          inv_bc2_sqrt=s.inv_bc2_sqrt, decay=1 - lr * self._wd,
                          step_size=lr * s.inv_bc1)

        work = [w for b in self.buckets for w in (
            b.state.masters if b.state.master is not None else
            b.params if b.params[0].dtype == torch.float32 else
            [p.float() for p in b.params])]  # bf16_no_master: fp32 math, rounded into the param
        for idx in self._batches:
            _adamw_(_pick(work, idx), _pick(grads, idx), _pick(self._m, idx), _pick(self._v, idx),
                    c, self._groups[idx[0]], self.betas, self.eps)
            if work[idx[0]] is not self._p[idx[0]]:
                torch._foreach_copy_(_pick(self._p, idx), _pick(work, idx))

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
            for j, i in enumerate(b.index):
                p = self._params[i]
                state[i] = {"exp_avg": like(p, b.state.exp_avgs[j]), "exp_avg_sq": like(p, b.state.exp_avg_sqs[j])}
                if b.state.master is not None:
                    state[i]["master"] = like(p, b.state.masters[j])
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
            for j, i in enumerate(b.index):
                saved = sd["state"][i]
                b.state.exp_avgs[j].copy_(local(saved["exp_avg"]))
                b.state.exp_avg_sqs[j].copy_(local(saved["exp_avg_sq"]))
                if b.state.master is not None and "master" in saved:
                    b.state.masters[j].copy_(local(saved["master"]))
                    b.params[j].copy_(b.state.masters[j])  # the compute copy is the master's cast
        self.counters.step.copy_(sd["step"])
        self.counters.skipped.copy_(sd["skipped_steps"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(sd["loss_scaler"])
