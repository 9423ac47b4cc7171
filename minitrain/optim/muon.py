"""Muon for the hidden matrices, AdamW for the rest: one optimizer, one step, one decision, one state_dict.

Muon (Keller Jordan's; torch.optim.Muon's definition, op for op) keeps one momentum buffer per matrix, mixes it
with the gradient (Nesterov), orthogonalizes the mix by a Newton–Schulz iteration in bf16 and steps along the
result, its lr scaled by the matrix's shape (newton_schulz.lr_ratio). It is for 2-D weights inside the network:
embeddings, the head, norms and biases take AdamW (torch.optim.Muon's advice), here in the same object, so that
one step makes one decision for every parameter: one sum of squares over all gradients (both sides), one skip,
clip coefficient and loss-scale update, one step counter (decision.py), all on the device.

The step runs in AdamW's three phases (adamw_triton.FusedStep, adamw_torch.TorchStep): the norm pass over every
gradient; the decision; then AdamW's update of its buckets and Muon's of its own, which per batch of matrices of
one shape is a momentum pass (gradient and buffer in, buffer and bf16 input out), Newton–Schulz as batched bf16
GEMMs on tensor cores, and an update pass over the fp32 masters (muon_triton.py; muon_torch.py is the torch
twin). Under ddp and fsdp each rank orthogonalizes its share of each batch: under ddp the results are all-gathered;
under fsdp the owner gathers its matrices' row shards and scatters the results' rows back (newton_schulz.Exchange).

Per-group lr and weight decay, as AdamW's; each group keeps its lr's ratio to the schedule's (`set_lr`), so the
schedule (warmup, cosine) scales Muon's lr by the same factor as AdamW's.
"""

from dataclasses import dataclass

import torch.distributed as dist

from minitrain.loss_scale import LossScaling
from minitrain.triton_runtime import check_runnable

from .adamw_torch import AdamWUpdate, TorchStep
from .adamw_triton import AdamWKernel, FusedStep
from .bucket import MuonState, buckets_by_dtype
from .dtensor import any_sharded
from .muon_torch import MuonUpdate
from .muon_triton import MuonKernels
from .newton_schulz import ADJUST_LR, NS_COEFFICIENTS, NS_EPS, NS_KERNELS, NS_STEPS, Exchange
from .optimizer import IMPLS, DeviceOptimizer, Numerics, as_groups, dtype_of


@dataclass(frozen=True)
class MuonHyper:
    """Muon's hyperparameters, torch.optim.Muon's (its `eps` is `ns_eps` here: `eps` is AdamW's); `lr` and
    `weight_decay` are the defaults of the `use_muon` groups; `ns_kernel` (one of newton_schulz.NS_KERNELS) who
    computes Newton–Schulz's two symmetric products."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.01
    adjust_lr: str = "original"
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    ns_steps: int = NS_STEPS
    ns_eps: float = NS_EPS
    ns_kernel: str = "cublas"


class Muon(DeviceOptimizer):
    """Param groups with `use_muon` (Keller Jordan's MuonWithAuxAdam convention) take Muon, with `lr` and
    `weight_decay` defaulting to `muon`'s; the others take AdamW, defaulting to `adamw_lr`, `adamw_weight_decay`.
    A plain list of params is all Muon. `set_lr(lr)` is the schedule's lr for the AdamW side: each group's lr
    keeps the ratio to `adamw_lr` it was built with.

    betas, eps, max_grad_norm, impl, numerics: AdamW's, for both sides. `replicas`: (rank, world size) of a ddp
    job, whose ranks share the Newton–Schulz work; sharded (FSDP2) params are found by their type."""

    def __init__(self, params, muon: MuonHyper = MuonHyper(), adamw_lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                 adamw_weight_decay=0.0, max_grad_norm=1.0, impl="fused", numerics: Numerics = Numerics(),
                 replicas: tuple[int, int] | None = None):
        momentum, nesterov, adjust_lr = muon.momentum, muon.nesterov, muon.adjust_lr
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
        if not 0 < muon.ns_steps < 100 or len(muon.ns_coefficients) != 3:
            raise ValueError("ns_steps must be in [1, 100) and ns_coefficients three numbers")
        if muon.ns_kernel not in NS_KERNELS:
            raise ValueError(f"ns_kernel must be one of {NS_KERNELS}, got {muon.ns_kernel!r}")
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups, "use_muon": True}]
        muon_defaults = {"lr": muon.lr, "weight_decay": muon.weight_decay}
        adamw_defaults = {"lr": adamw_lr, "weight_decay": adamw_weight_decay}
        groups = [g for group in groups for g in as_groups(
            [group], {**(muon_defaults if group.get("use_muon") else adamw_defaults), "use_muon": False})]
        for g in groups:
            g["lr_ratio"] = g["lr"] / adamw_lr
            if g["use_muon"] and any(p.dim() != 2 for p in g["params"]):
                shape = next(tuple(p.shape) for p in g["params"] if p.dim() != 2)
                raise ValueError(f"Muon orthogonalizes 2-D matrices; a param of shape {shape} takes AdamW "
                                 "(a group without use_muon)")
        super().__init__(groups, {**muon_defaults, "adamw_lr": adamw_lr, "adamw_weight_decay": adamw_weight_decay},
                         numerics.loss_scaling)
        self.betas, self.eps, self.max_grad_norm, self.impl = tuple(betas), eps, max_grad_norm, impl
        self.momentum, self.nesterov, self.adjust_lr = momentum, nesterov, adjust_lr
        if impl == "fused":
            check_runnable(self._params[0], "Muon(impl='fused')", "impl='foreach' (optimizer.impl=foreach)")
        if muon.ns_kernel == "triton":
            check_runnable(self._params[0], "Muon(ns_kernel='triton')",
                           "ns_kernel='cublas' (optimizer.muon.ns_kernel=cublas)")
        orthogonalized = {i for i, g in enumerate(groups) if g["use_muon"]}
        adamw = set(range(len(groups))) - orthogonalized
        masters, grad_dtype = numerics.master_weights, dtype_of(numerics.grad_dtype)
        self.adamw_buckets = buckets_by_dtype(groups, impl, masters, grad_dtype, groups=adamw) if adamw else []
        self.muon_buckets = buckets_by_dtype(groups, impl, masters, grad_dtype, state=MuonState, groups=orthogonalized,
                                             order=lambda p, group: (tuple(p.shape), group)) if orthogonalized else []
        self.buckets = self.adamw_buckets + self.muon_buckets
        self.exchange = Exchange(*self._split(replicas), coefficients=muon.ns_coefficients, steps=muon.ns_steps,
                                 eps=muon.ns_eps, kernel=muon.ns_kernel)
        if impl == "fused":
            sides = [AdamWKernel(self.adamw_buckets, self.betas, eps),
                     MuonKernels(self.muon_buckets, momentum, nesterov, self.exchange, adjust_lr)]
            self._impl_step = FusedStep([s for s in sides if s.buckets], self.betas, max_grad_norm,
                                        numerics.reduce_sumsq)
        else:
            sides = [AdamWUpdate(self.adamw_buckets, impl, self.betas, eps),
                     MuonUpdate(self.muon_buckets, impl, momentum, nesterov, self.exchange, adjust_lr)]
            self._impl_step = TorchStep([s for s in sides if s.buckets], impl, self.betas, max_grad_norm,
                                        numerics.reduce_sumsq)

    def _split(self, replicas) -> tuple[str, int, int]:
        """How the job splits the Newton–Schulz work: (mode, rank, world size) of newton_schulz.Exchange."""
        if any_sharded(b_owner for b in self.muon_buckets for b_owner in b.owners):
            return "sharded", dist.get_rank(), dist.get_world_size()
        if replicas is not None and replicas[1] > 1:
            return ("replicated", *replicas)
        return "local", 0, 1

    def set_lr(self, lr: float) -> None:
        """`lr`: the schedule's, AdamW's side's; every group's keeps its ratio to it."""
        for g in self.param_groups:
            g["lr"] = lr * g["lr_ratio"]
