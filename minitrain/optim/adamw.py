"""AdamW with fp32 master weights, dynamic loss scaling and no host synchronisation.

The optimizer is pure bandwidth (~1 FLOP per byte), so its only levers are bytes moved and
kernels launched. Three implementations of one update make each lever visible:

  loop     torch ops one tensor at a time: ~15 launches per parameter tensor
  foreach  torch._foreach_* over tensor lists: launches per op, but every op is a pass over memory
  fused    Triton (adamw_triton.py): norm pass + finalize + one update pass, 3 launches in all,
           30 B/param for bf16 params with fp32 masters

Memory layout, shared by all three: per parameter dtype, a bucket of flat buffers owned by the
optimizer -- fp32 masters (low-precision params only), m, v and, while a step needs one, the
gradients -- with each parameter a view at an ALIGN-aligned offset. The model's parameters stay
where the model put them.

Gradients stay autograd's own tensors, which backward creates (no 2 B/param during forward, where
a step's memory peaks, and no per-parameter `grad += new`: the first micro-batch's gradient is
stolen, not added). The fused step reads them where they are, through a per-step table of their
offsets (adamw_triton.py). loop and foreach gather them into a zeroed flat buffer of the state's
layout with one multi-tensor copy and point p.grad at its views (a repeated step copies nothing;
not under FSDP, where wrapping each view as a DTensor took most of the gather's host time: 11.8 ms a step
with, 2.2 without, at 148 tensors, cProfile on a CPU);
zero_grad(set_to_none) frees it. DDP and FSDP2 see plain p.grad tensors. With grad_dtype=fp32 a
post-accumulate hook adds each low-precision gradient into an fp32 flat buffer's view and frees
p.grad (micro-batches accumulate in fp32); every implementation reads that buffer.

Under FSDP2 the parameters are DTensors sharded across ranks: every buffer above is built over
their local shards (the ZeRO-3 layout: each rank updates 1/N of the model), the step reads
p.grad's local shard, and `reduce_sumsq` all-reduces the local sum of squares so the norm and the
skip decision are global.
"""

import math
from dataclasses import dataclass
from operator import attrgetter

import torch
from torch.distributed.tensor import DTensor

from minitrain.ops._runtime import check_runnable

IMPLS = ("loop", "foreach", "fused")
ALIGN = 64  # elements: each view starts on a 256 B boundary of its fp32 buffer (vector loads)


def _dtype(d):
    return {"fp32": torch.float32, "float32": torch.float32}.get(d, d)


_GRAD = attrgetter("grad")


def _local(t):
    """This rank's shard of a DTensor (a view: writing it writes the parameter); a tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(p, t):
    """`t`, a tensor shaped like p's local shard, as a tensor shaped like p: a DTensor over `t` when
    p is one (for p.grad and for a state_dict torch.distributed.checkpoint can reshard)."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class _Bucket:
    """The params of one dtype and the flat buffers holding their grads and optimizer state.
    `params` are the tensors the update writes (local shards under FSDP); `index` their positions
    in the optimizer's parameter list."""

    def __init__(self, params, groups, index, has_master, grad_dtype):
        self.params, self.groups, self.index = [_local(p) for p in params], groups, index
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += -(-p.numel() // ALIGN) * ALIGN
        self.layout = [(p.shape, torch.empty(p.shape, device="meta").stride(), o)
                       for p, o in zip(self.params, self.offsets)]
        dev = self.params[0].device
        self.size, self.grad_dtype = n, grad_dtype
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=dev)
        self.master = torch.zeros(n, dtype=torch.float32, device=dev) if has_master else None
        self.exp_avgs, self.exp_avg_sqs = self.views(self.exp_avg), self.views(self.exp_avg_sq)
        self.masters = self.views(self.master) if has_master else None
        if has_master:
            torch._foreach_copy_(self.masters, [p.detach() for p in self.params])
        self.owners = list(params)  # what p.grad is set on (DTensors under FSDP2)
        self.sharded = any(isinstance(p, DTensor) for p in self.owners)
        self.grad = self.grads = None
        self.main_grads = grad_dtype != self.params[0].dtype
        if self.main_grads:
            for i, p in enumerate(self.owners):
                p.register_post_accumulate_grad_hook(self._accumulate_main_grad(i))

    def views(self, flat):
        """One view per parameter, shaped like it (contiguous) at its offset: made for every step's new
        grad buffer, so one as_strided call each (half the host time of slice + view)."""
        return [flat.as_strided(shape, strides, o) for shape, strides, o in self.layout]

    def _ensure_grads(self) -> bool:
        """A zeroed flat grad buffer unless one exists; whether it was just made."""
        if self.grad is not None:
            return False
        self.grad = torch.zeros(self.size, dtype=self.grad_dtype, device=self.exp_avg.device)
        self.grads = self.views(self.grad)
        return True

    def grad_tensors(self):
        """The gradients the fused step reads in place: autograd's (None where a parameter has none),
        or the fp32 buffer's views that the hooks filled."""
        if self.main_grads:
            self._ensure_grads()
            return self.grads
        if self.sharded:
            return [None if p.grad is None else _local(p.grad) for p in self.owners]
        return list(map(_GRAD, self.owners))  # host time per tensor matters at thousands of tensors

    def gather_grads(self):
        """The flat gradient buffer the step reads, p.grad pointed at its views (zeros where a
        parameter has no gradient). Repeated steps over the same grads copy nothing (under FSDP they copy
        again: p.grad stays FSDP's)."""
        made = self._ensure_grads()
        if self.main_grads:  # the hooks have filled it
            return
        if not made:  # kept since the last step (no zero_grad(set_to_none)): gradients set to None are zeros
            gone = [view for view, p in zip(self.grads, self.owners) if p.grad is None]
            if gone:
                torch._foreach_zero_(gone)
        new = [(view, p) for view, p in zip(self.grads, self.owners)
               if p.grad is not None and _local(p.grad) is not view]
        if new:
            torch._foreach_copy_([view for view, _ in new], [_local(p.grad) for _, p in new])
            if not self.sharded:  # under FSDP a DTensor per view costs more host time than the copy it saves
                for view, p in new:
                    p.grad = view

    def release_grads(self):
        self.grad = self.grads = None
        for p in self.owners:
            p.grad = None

    def zero_grads(self):
        if self.grad is not None:
            self.grad.zero_()
        for p in self.owners:
            if p.grad is not None:
                p.grad.zero_()

    def _accumulate_main_grad(self, i):
        """Post-accumulate hook of parameter i: add its low-precision gradient into fp32 view i."""

        def hook(p):
            self._ensure_grads()
            self.grads[i].add_(_local(p.grad))
            p.grad = None

        return hook


@dataclass
class _Scalars:
    """One step's coefficients, 0-d device tensors. On a skipped step grad_mult is 0 and the
    betas, decay and step size make the update an exact identity: no host branch."""
    grad_mult: torch.Tensor    # 1/scale * clip coefficient, 0 when skipped
    beta1: torch.Tensor
    beta2: torch.Tensor
    inv_bc2_sqrt: torch.Tensor
    decay: torch.Tensor        # [groups] 1 - lr*wd
    step_size: torch.Tensor    # [groups] lr / (1 - beta1^t)


def _pick(xs, idx):
    return [xs[i] for i in idx]


def _adamw_(p, g, m, v, s, group, betas, eps):
    """AdamW on lists of fp32 tensors in torch's op order (decay, then the Adam step).
    The fused kernel computes the same expression per element."""
    beta1, beta2 = betas
    torch._foreach_mul_(m, s.beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, s.beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_mul_(denom, s.inv_bc2_sqrt)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, denom)
    torch._foreach_mul_(update, s.step_size[group])
    torch._foreach_mul_(p, s.decay[group])
    torch._foreach_sub_(p, update)


class FusedAdamW:
    """AdamW (decoupled weight decay, bias correction, fp32 math) with optional fp32 masters,
    global-norm clipping and dynamic loss scaling, all decided on the device.

    step() never synchronises with the host: lr/weight_decay go to the device through a pinned
    buffer when they change; the skip decision, clip coefficient, step count and loss-scale
    update are device tensors. Per-group lr and weight_decay; betas, eps and max_grad_norm are
    global.

    reduce_sumsq: None, or an in-place function on the step's sum of squared (scaled) grads, a
    one-element fp32 device tensor, run before anything is decided from it. With sharded params it
    all-reduces (sums) across ranks: the norm becomes the global one, and since a sum holding an
    inf/NaN is inf/NaN, every rank takes the same skip decision and loss-scale update.
    """

    def __init__(self, params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 max_grad_norm=1.0, impl="fused", master_weights=None, grad_dtype=None, reduce_sumsq=None):
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
            check_runnable(self._params[0], "FusedAdamW(impl='fused')", "impl='foreach' (optimizer.impl=foreach)")

        by_dtype, i = {}, 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                by_dtype.setdefault(p.dtype, []).append((p, gi, i))
                i += 1
        grad_dtype = _dtype(grad_dtype)
        self.buckets = [
            _Bucket([p for p, _, _ in pg], [gi for _, gi, _ in pg], [i for _, _, i in pg],
                    has_master=dtype != torch.float32 and master_weights is not False,
                    grad_dtype=grad_dtype or dtype)
            for dtype, pg in by_dtype.items()]

        # bucket-order lists for the torch paths; a batch is what one list-math call covers:
        # one tensor (loop) or one group within one bucket (foreach)
        self._p = [p for b in self.buckets for p in b.params]
        self._m = [m for b in self.buckets for m in b.exp_avgs]
        self._v = [v for b in self.buckets for v in b.exp_avg_sqs]
        self._groups = [g for b in self.buckets for g in b.groups]
        keys = [(id(b), g) for b in self.buckets for g in b.groups]
        self._batches = [[i] for i in range(len(keys))] if impl == "loop" else \
            [[i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)]

        f32 = dict(dtype=torch.float32, device=self.device)
        self._step = torch.zeros((), **f32)
        self._skipped = torch.zeros((), dtype=torch.int32, device=self.device)
        self._grad_norm = torch.zeros((), **f32)
        self._one = torch.ones((), **f32)
        self._hyper = torch.zeros(2, len(self.param_groups), **f32)  # rows: lr, weight_decay
        self._hyper_host = None
        self._scaler = None
        if impl == "fused":
            from .adamw_triton import FusedStep
            self._fused = FusedStep(self)

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, scaler=None):
        if self.impl != "fused":
            for b in self.buckets:
                b.gather_grads()
        self._upload_hyper()
        if scaler is not None:
            scaler.to(self.device)
        self._scaler = scaler
        if self.impl == "fused":
            self._fused(scaler)
        else:
            self._torch_step(scaler)

    def _upload_hyper(self):
        """Copy per-group lr/wd to the device when they changed, without a sync: pageable H2D
        copies synchronise, so the source is pinned (the caching host allocator keeps it alive
        until the copy has run)."""
        host = [float(g[k]) for k in ("lr", "weight_decay") for g in self.param_groups]
        if host != self._hyper_host:
            src = torch.tensor(host, dtype=torch.float32, device="cpu").view(self._hyper.shape)
            if self._hyper.is_cuda:
                src = src.pin_memory()
            self._hyper.copy_(src, non_blocking=True)
            self._hyper_host = host

    def _step_scalars(self, sumsq, scaler):
        """Everything a step decides, from the scaled grads' sum of squares, on the device:
        skip flag, unscaled norm, clip coefficient, step count, bias corrections, loss scale.
        (adamw_triton._finalize_kernel is the fused twin of this function.)"""
        found_inf = ~torch.isfinite(sumsq)
        keep = (~found_inf).float()
        if scaler is None:
            inv_scale = self._one
        else:
            inv_scale = scaler.get_scale().double().reciprocal().float()  # as GradScaler
            scaler.update(found_inf.float())
        norm = sumsq.sqrt() * inv_scale
        mult = inv_scale
        if self.max_grad_norm:
            mult = mult * (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        self._grad_norm.copy_(norm)
        self._skipped.add_(found_inf)
        self._step.add_(keep)
        t = self._step.clamp(min=1.0)  # a skipped first step must not divide by 1 - beta^0
        beta1, beta2 = self.betas
        lr = self._hyper[0] * keep
        return _Scalars(
            grad_mult=torch.where(found_inf, 0.0, mult),
            beta1=torch.where(found_inf, 1.0, beta1),
            beta2=torch.where(found_inf, 1.0, beta2),
            inv_bc2_sqrt=(1 - torch.exp2(t * math.log2(beta2))).rsqrt(),
            decay=1 - lr * self._hyper[1],
            step_size=lr / (1 - torch.exp2(t * math.log2(beta1))))

    def _torch_step(self, scaler):
        """loop and foreach: the same list math, applied per tensor or per (bucket, group)."""
        loop = self.impl == "loop"
        # fp32 grads (fp32 grads are unscaled in place, like GradScaler.unscale_). foreach
        # upcasts each flat buffer in one op: torch has no foreach cast, and no foreach `where`
        # to zero non-finite grads on a skipped step, so nan_to_num on the flat buffer does it.
        if loop:
            units = grads = [g.float() for b in self.buckets for g in b.grads]
        else:
            units = [b.grad.float() for b in self.buckets]
            grads = [g for b, u in zip(self.buckets, units) for g in b.views(u)]
        norms = [n for idx in self._batches for n in torch._foreach_norm(_pick(grads, idx))]
        sumsq = torch.stack(norms).square().sum()
        if self.reduce_sumsq is not None:
            self.reduce_sumsq(sumsq)
        s = self._step_scalars(sumsq, scaler)
        for u in units:
            u.mul_(s.grad_mult).nan_to_num_(0.0, 0.0, 0.0)

        work = [w for b in self.buckets for w in (
            b.masters if b.master is not None else
            b.params if b.params[0].dtype == torch.float32 else
            [p.float() for p in b.params])]  # bf16_no_master: fp32 math, rounded into the param
        for idx in self._batches:
            _adamw_(_pick(work, idx), _pick(grads, idx), _pick(self._m, idx), _pick(self._v, idx),
                    s, self._groups[idx[0]], self.betas, self.eps)
            if work[idx[0]] is not self._p[idx[0]]:
                torch._foreach_copy_(_pick(self._p, idx), _pick(work, idx))

    # -- the rest of the optimizer interface ------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """set_to_none frees the gradients and the flat buffers; else zeroes them."""
        for b in self.buckets:
            b.release_grads() if set_to_none else b.zero_grads()

    def stats(self):
        """Live 0-d device tensors; read (or clone) them at log steps only."""
        return {"grad_norm": self._grad_norm, "skipped_steps": self._skipped,
                "loss_scale": self._scaler.get_scale() if self._scaler is not None else self._one}

    def state_dict(self):
        """torch-like layout: per-param views (torch.save stores each flat buffer once); DTensors
        over the local views when the params are sharded."""
        state = {}
        for b in self.buckets:
            for j, i in enumerate(b.index):
                p = self._params[i]
                state[i] = {"exp_avg": _like(p, b.exp_avgs[j]), "exp_avg_sq": _like(p, b.exp_avg_sqs[j])}
                if b.master is not None:
                    state[i]["master"] = _like(p, b.masters[j])
        index = {p: i for i, p in enumerate(self._params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups, "step": self._step,
                "skipped_steps": self._skipped}

    @torch.no_grad()
    def load_state_dict(self, sd):
        if [len(g["params"]) for g in sd["param_groups"]] != \
                [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state_dict's param groups do not match this optimizer's")
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for b in self.buckets:
            for j, i in enumerate(b.index):
                saved = sd["state"][i]
                b.exp_avgs[j].copy_(_local(saved["exp_avg"]))
                b.exp_avg_sqs[j].copy_(_local(saved["exp_avg_sq"]))
                if b.master is not None and "master" in saved:
                    b.masters[j].copy_(_local(saved["master"]))
                    b.params[j].copy_(b.masters[j])  # the compute copy is the master's cast
        self._step.copy_(sd["step"])
        self._skipped.copy_(sd["skipped_steps"])
