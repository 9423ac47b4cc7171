"""Triton kernels of the fused AdamW step: three launches for any number of tensors. The first two (the norm pass
and the decision, NormPass and finalize) are the fused step's whatever updates follow: Muon's (muon_triton.py)
runs after AdamW's from the same scalars (FusedStep).

  _sumsq_kernel     reads every gradient once, one program per row of the work table (below),
                    writing one partial sum of squares per row (no atomics: the norm is
                    deterministic).
  _finalize_kernel  one program: global norm, non-finite flag, clip coefficient, 1/scale, bias
                    corrections, step/skip counters and the loss-scaler update. Twin of
                    decision.decide_step (and of amp.DynamicLossScaler.update: loss_scale.update_rule).
  _adamw_kernel     one program per row of a work table, a row being one BLOCK-chunk of one
                    tensor: reads grad, master, m, v; writes master, m, v and the compute copy
                    (bf16/fp16 param) in the same pass. Exits at once on a skipped step.

Why a work table rather than making the params views of one flat buffer (the llm.c way): the
optimizer owns masters, m and v, so those are flat already and one offset addresses them. The
compute copy -- the model's own parameters -- lives elsewhere; it is addressed as (lowest param
pointer + element offset), so the table is plain integers, the kernel never casts an integer to
a pointer, and the model's storage is never re-pointed (module.to(), weight tying, state_dict
loading keep working). The table costs 48 B per BLOCK elements, is built once, and a row never
straddles two tensors, so full rows run unmasked and vectorised. The kernels address the table, the
step's scalars and the grad offsets through the named columns and slots below, which the host code
that builds them uses too.

Gradients are read where autograd left them, not gathered into a flat buffer first (which cost a
memset and a copy, 6 B/param, and ~150 host calls per step): each step uploads one element
offset per tensor, from a zero-filled BLOCK of the grad dtype that also stands in for a missing
gradient. Steps whose gradients sit at the same addresses as the last one (the caching allocator
and CUDA graphs' pools make that the rule) upload nothing.
"""

import math

import numpy as np
import torch
import triton
import triton.language as tl

from minitrain.triton_runtime import round_to_bf16_in_fp32

from .layout import ALIGN

BLOCK = 4096        # elements per update program: 16 per thread at 8 warps, 4 x 128-bit fp32 loads
NUM_WARPS = 8
FINALIZE_BLOCK = 1024

# Columns of the work table, one row per BLOCK-chunk of one tensor.
COL_STATE_OFFSET = tl.constexpr(0)  # the chunk's first element in the bucket's flat state buffers
COL_PARAM_OFFSET = tl.constexpr(1)  # ... counted in elements from the bucket's lowest param address
COL_NUMEL = tl.constexpr(2)         # elements in the chunk (BLOCK but for a tensor's last chunk)
COL_GROUP = tl.constexpr(3)         # its param group: the column of the lr and weight-decay rows
COL_TENSOR = tl.constexpr(4)        # its tensor: the index of the step's grad offset
COL_START = tl.constexpr(5)         # the chunk's first element in its tensor
TABLE_COLUMNS = tl.constexpr(6)

# Slots of the step's scalars, written by _finalize_kernel and read by _adamw_kernel (decision.StepScalars).
GRAD_MULT = tl.constexpr(0)
NOT_SKIPPED = tl.constexpr(1)
INV_BC1 = tl.constexpr(2)
INV_BC2_SQRT = tl.constexpr(3)
N_SCALARS = tl.constexpr(4)

_MISSING = tl.constexpr(-(2**62))  # grad offset of a parameter without a gradient: it reads the zero block


def fused_bytes_per_param(param_dtype: torch.dtype, grad_dtype: torch.dtype, master_weights: bool) -> int:
    """HBM bytes the fused step moves per parameter, its bandwidth floor: the gradient read twice (the norm
    pass, then the update), m and v read and written, the fp32 master read and written (without one, the
    param read instead), the param written."""
    state = 2 * 4 * (3 if master_weights else 2)
    return 2 * grad_dtype.itemsize + state + param_dtype.itemsize * (1 if master_weights else 2)


@triton.jit
def _grad_row(table_ptr, grad_offsets_ptr, zeros_ptr, GRAD_ALIGN: tl.constexpr):
    """This program's table row: its gradient's pointer (into the zero block for a missing one) and its numel."""
    row = table_ptr + tl.program_id(0) * TABLE_COLUMNS
    goff = tl.load(grad_offsets_ptr + tl.load(row + COL_TENSOR))
    goff = tl.where(goff == _MISSING, 0, goff + tl.load(row + COL_START))
    return zeros_ptr + tl.multiple_of(goff, GRAD_ALIGN), tl.load(row + COL_NUMEL)


@triton.jit
def _sumsq_kernel(table_ptr, grad_offsets_ptr, zeros_ptr, partial_ptr, GRAD_ALIGN: tl.constexpr,
                  BLOCK: tl.constexpr):
    grad_ptr, n = _grad_row(table_ptr, grad_offsets_ptr, zeros_ptr, GRAD_ALIGN)
    offs = tl.arange(0, BLOCK)
    g = tl.load(grad_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(g * g, axis=0))


@triton.jit
def _finalize_kernel(partial_ptr, n_partials, scalars_ptr, step_ptr, skipped_ptr, norm_ptr,
                     scale_ptr, tracker_ptr, max_grad_norm, log2_beta1, log2_beta2,
                     growth_factor: tl.float64, backoff_factor: tl.float64, growth_interval,
                     HAS_SCALER: tl.constexpr, CLIP: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0)
    sumsq = tl.sum(acc, axis=0)
    finite = sumsq < float("inf")  # false for inf and nan (sumsq >= 0)

    if HAS_SCALER:  # loss_scale.update_rule: a product in fp64 rounded to the fp32 scale once, as torch's kernel
        scale = tl.load(scale_ptr)
        inv_scale = 1.0 / scale
        successful = tl.load(tracker_ptr) + 1
        grow = successful == growth_interval
        grown = (scale.to(tl.float64) * growth_factor).to(tl.float32)
        grown = tl.where(grow & (grown < float("inf")), grown, scale)
        backed_off = (scale.to(tl.float64) * backoff_factor).to(tl.float32)
        tl.store(scale_ptr, tl.where(finite, grown, backed_off))
        tl.store(tracker_ptr, tl.where(finite & ~grow, successful, 0))
    else:
        inv_scale = 1.0
    norm = tl.sqrt_rn(sumsq) * inv_scale
    mult = inv_scale
    if CLIP:
        mult = mult * tl.minimum(max_grad_norm / (norm + 1e-6), 1.0)

    step = tl.load(step_ptr) + finite.to(tl.float32)
    t = tl.maximum(step, 1.0)
    tl.store(step_ptr, step)
    tl.store(skipped_ptr, tl.load(skipped_ptr) + 1 - finite.to(tl.int32))
    tl.store(norm_ptr, norm)
    tl.store(scalars_ptr + GRAD_MULT, tl.where(finite, mult, 0.0))
    tl.store(scalars_ptr + NOT_SKIPPED, finite.to(tl.float32))
    tl.store(scalars_ptr + INV_BC1, 1.0 / (1.0 - tl.exp2(t * log2_beta1)))
    tl.store(scalars_ptr + INV_BC2_SQRT, 1.0 / tl.sqrt_rn(1.0 - tl.exp2(t * log2_beta2)))


@triton.jit
def _round_to_param(x, param_ptr):
    """fp32 -> param dtype, round to nearest even. bf16 is rounded with integer ops first, so the
    bits are the same on the GPU and in the Triton interpreter (whose float cast truncates); the
    cast that follows is then exact. ALU is free here; the kernel is bandwidth-bound."""
    if param_ptr.dtype.element_ty == tl.bfloat16:
        x = round_to_bf16_in_fp32(x)
    return x.to(param_ptr.dtype.element_ty)


@triton.jit
def _adamw_block(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, soff, poff, n, lr, wd,
                 grad_mult, inv_bc1, inv_bc2_sqrt, beta1, beta2, eps,
                 HAS_MASTER: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32) * grad_mult
    m = tl.load(m_ptr + soff + offs, mask=mask)
    v = tl.load(v_ptr + soff + offs, mask=mask)
    if HAS_MASTER:
        p = tl.load(master_ptr + soff + offs, mask=mask)
    else:
        p = tl.load(param_ptr + poff + offs, mask=mask).to(tl.float32)
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    p = p * (1.0 - lr * wd) - tl.div_rn(m, denom) * (lr * inv_bc1)
    tl.store(m_ptr + soff + offs, m, mask=mask)
    tl.store(v_ptr + soff + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + soff + offs, p, mask=mask)
    tl.store(param_ptr + poff + offs, _round_to_param(p, param_ptr), mask=mask)


@triton.jit
def _adamw_kernel(table_ptr, grad_offsets_ptr, zeros_ptr, param_ptr, master_ptr, m_ptr, v_ptr, lr_ptr, wd_ptr,
                  scalars_ptr, beta1, beta2, eps, HAS_MASTER: tl.constexpr,
                  PARAM_ALIGN: tl.constexpr, GRAD_ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(scalars_ptr + NOT_SKIPPED) != 0.0:
        grad_ptr, n = _grad_row(table_ptr, grad_offsets_ptr, zeros_ptr, GRAD_ALIGN)
        row = table_ptr + tl.program_id(0) * TABLE_COLUMNS
        soff = tl.multiple_of(tl.load(row + COL_STATE_OFFSET), 16)
        poff = tl.multiple_of(tl.load(row + COL_PARAM_OFFSET), PARAM_ALIGN)
        group = tl.load(row + COL_GROUP)
        lr = tl.load(lr_ptr + group)
        wd = tl.load(wd_ptr + group)
        grad_mult = tl.load(scalars_ptr + GRAD_MULT)
        inv_bc1 = tl.load(scalars_ptr + INV_BC1)
        inv_bc2_sqrt = tl.load(scalars_ptr + INV_BC2_SQRT)
        if n == BLOCK:
            _adamw_block(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, soff, poff, n, lr, wd,
                         grad_mult, inv_bc1, inv_bc2_sqrt, beta1, beta2, eps,
                         HAS_MASTER=HAS_MASTER, MASKED=False, BLOCK=BLOCK)
        else:
            _adamw_block(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, soff, poff, n, lr, wd,
                         grad_mult, inv_bc1, inv_bc2_sqrt, beta1, beta2, eps,
                         HAS_MASTER=HAS_MASTER, MASKED=True, BLOCK=BLOCK)


def finalize(partials, counters, scaler, max_grad_norm, betas, scalars):
    """Launch _finalize_kernel over a step's partial sums of squares: decision.decide_step's twin, updating
    `counters` and `scaler` in place and writing the step's scalars into `scalars` ([N_SCALARS] fp32)."""
    if scaler is None:
        scaling = (scalars, scalars, 1.0, 1.0, 1)  # placeholders, compiled out
    else:
        rule = scaler.rule
        scaling = (scaler.get_scale(), scaler.growth_tracker, rule.growth_factor, rule.backoff_factor,
                   rule.growth_interval)
    scale, tracker, growth, backoff, interval = scaling
    beta1, beta2 = betas
    _finalize_kernel[(1,)](
        partials, partials.numel(), scalars, counters.step, counters.skipped, counters.grad_norm,
        scale, tracker, float(max_grad_norm or 0.0), math.log2(beta1), math.log2(beta2), growth, backoff,
        interval, HAS_SCALER=scaler is not None, CLIP=bool(max_grad_norm), BLOCK=FINALIZE_BLOCK)


def _work_table(bucket):
    """The work table's rows, one per BLOCK-chunk of each tensor (columns COL_*). Param offsets count
    elements from the bucket's lowest param address, so they are >= 0; returns the table, that base
    param, and the alignment (elements) every param offset has."""
    base = min((p for p in bucket.params if p.numel()), key=lambda p: p.data_ptr())  # an empty shard has no address
    size = base.element_size()
    columns = {c: [] for c in (COL_STATE_OFFSET, COL_PARAM_OFFSET, COL_NUMEL, COL_GROUP, COL_TENSOR, COL_START)}
    align = 16 // size
    for tensor, (p, off, group) in enumerate(zip(bucket.params, bucket.layout.offsets, bucket.groups)):
        if not p.is_contiguous():
            raise ValueError("the fused optimizer needs contiguous parameters")
        delta = p.data_ptr() - base.data_ptr()
        if delta % 16:
            align = 1
        starts = range(0, p.numel(), BLOCK)
        columns[COL_STATE_OFFSET] += [off + start for start in starts]
        columns[COL_PARAM_OFFSET] += [delta // size + start for start in starts]
        columns[COL_NUMEL] += [min(BLOCK, p.numel() - start) for start in starts]
        columns[COL_GROUP] += [group] * len(starts)
        columns[COL_TENSOR] += [tensor] * len(starts)
        columns[COL_START] += list(starts)
    table = torch.empty(len(columns[COL_START]), TABLE_COLUMNS.value, dtype=torch.int64)
    for col, values in columns.items():
        table[:, col.value] = torch.tensor(values, dtype=torch.int64)
    return table.to(base.device), base, (align if base.data_ptr() % 16 == 0 else 1)


class _GradOffsets:
    """Where a bucket's gradients are this step, as element offsets from a zero block of their dtype,
    on the device. Re-uploaded (pinned, no sync) only when an address changed, which in training is
    every step (autograd makes new gradients after zero_grad): the host's work here is per tensor, so it
    runs through C-level maps and numpy, not a Python loop (thousands of tensors would cost milliseconds)."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.zeros = torch.zeros(BLOCK, dtype=bucket.grads.dtype, device=bucket.params[0].device)
        self.ptrs = self.offsets = self.align = None

    def __call__(self):
        grads = self.bucket.grads.tensors()
        try:
            ptrs = list(map(torch.Tensor.data_ptr, grads))
        except TypeError:  # a parameter without a gradient
            ptrs = [0 if g is None else g.data_ptr() for g in grads]
        if ptrs != self.ptrs:
            self._check([g for g in grads if g is not None] if 0 in ptrs else grads)
            base, size = self.zeros.data_ptr(), self.zeros.element_size()
            addresses = np.array(ptrs, dtype=np.int64)
            offsets = (addresses - base) // size
            offsets[addresses == 0] = _MISSING.value  # no tensor lives at address 0
            host = torch.from_numpy(offsets)
            self.offsets = host.pin_memory().to(self.zeros.device, non_blocking=True) if self.zeros.is_cuda else host
            aligned = base % 16 == 0 and not (addresses % 16).any()
            self.align = 16 // size if aligned else 1
            self.ptrs = ptrs
        return self.offsets, self.zeros, self.align

    def _check(self, grads):
        """Each gradient read in place must be contiguous. Its shape and dtype are its parameter's already:
        torch refuses any other p.grad, and a bucket holds the parameters of one dtype."""
        if all(map(torch.Tensor.is_contiguous, grads)):
            return
        p, g = next((p, g) for p, g in zip(self.bucket.params, grads) if not g.is_contiguous())
        raise ValueError(f"the fused optimizer reads gradients in place and needs each p.grad contiguous; got stride "
                         f"{g.stride()} for a parameter of shape {tuple(p.shape)}")


class NormPass:
    """The first phase of a fused step over some buckets: their work tables, built once, and the launches that
    read every gradient where it lies into one partial sum of squares per table row."""

    def __init__(self, buckets):
        assert ALIGN % 16 == 0  # the kernels promise 16-element-aligned state offsets
        self.plans = [(b, *_work_table(b)) for b in buckets]
        self.base_ptrs = [base.data_ptr() for _, _, base, _ in self.plans]
        self.grad_offsets = [_GradOffsets(b) for b in buckets]
        self.n_partials = [table.shape[0] for _, table, _, _ in self.plans]

    def __call__(self, partials):
        """Fill `partials` (fp32, one per table row); returns each bucket's (grad offsets, zero block, alignment)."""
        for (_, _, base, _), ptr in zip(self.plans, self.base_ptrs):
            if base.data_ptr() != ptr:
                raise RuntimeError("parameters moved since the optimizer was built; "
                                   "build the optimizer after moving the model")
        grads = [offsets() for offsets in self.grad_offsets]
        start = 0
        for (_, table, _, _), (offsets, zeros, align), n in zip(self.plans, grads, self.n_partials):
            _sumsq_kernel[(n,)](table, offsets, zeros, partials[start:], GRAD_ALIGN=align, BLOCK=BLOCK,
                                num_warps=NUM_WARPS)
            start += n
        return grads


class AdamWKernel:
    """The update phase of the fused AdamW over some buckets: one _adamw_kernel launch per bucket."""

    def __init__(self, buckets, betas, eps):
        self.buckets, self.betas, self.eps = buckets, betas, eps

    def __call__(self, plans, grads, lr, weight_decay, scalars):
        beta1, beta2 = self.betas
        for (b, table, base, align), (offsets, zeros, grad_align) in zip(plans, grads):
            state = b.state
            _adamw_kernel[(table.shape[0],)](
                table, offsets, zeros, base, state.master if state.master is not None else state.exp_avg,
                state.exp_avg, state.exp_avg_sq, lr, weight_decay, scalars,
                beta1, beta2, self.eps, HAS_MASTER=state.master is not None, PARAM_ALIGN=align,
                GRAD_ALIGN=grad_align, BLOCK=BLOCK, num_warps=NUM_WARPS)


class FusedStep:
    """The launch plan of one fused step over `sides` (updates, each with its `buckets`), built once: the norm
    pass over every side's gradients, one finalize, then each side's update (3 launches for AdamW alone)."""

    def __init__(self, sides, betas, max_grad_norm, reduce_sumsq):
        self.sides, self.betas, self.max_grad_norm, self.reduce_sumsq = sides, betas, max_grad_norm, reduce_sumsq
        buckets = [b for side in sides for b in side.buckets]
        device = buckets[0].params[0].device
        self.norms = NormPass(buckets)
        self.partials = torch.empty(sum(self.norms.n_partials), dtype=torch.float32, device=device)
        self.scalars = torch.empty(N_SCALARS.value, dtype=torch.float32, device=device)
        self.n_buckets = [len(side.buckets) for side in sides]

    def __call__(self, lr, weight_decay, counters, scaler):
        """One step. lr, weight_decay: [groups] fp32 device tensors; counters, scaler: updated in place."""
        grads = self.norms(self.partials)
        partials = self.partials
        if self.reduce_sumsq is not None:  # agree on one number across ranks, not on a partial per block
            partials = partials.sum(0, keepdim=True)
            self.reduce_sumsq(partials)
        finalize(partials, counters, scaler, self.max_grad_norm, self.betas, self.scalars)
        start = 0
        for side, n in zip(self.sides, self.n_buckets):
            side(self.norms.plans[start:start + n], grads[start:start + n], lr, weight_decay, self.scalars)
            start += n
