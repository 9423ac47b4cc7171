"""Triton kernels of the fused AdamW step: three launches for any number of tensors.

  _sumsq_kernel     reads every gradient once, one program per row of the work table (below),
                    writing one partial sum of squares per row (no atomics: the norm is
                    deterministic).
  _finalize_kernel  one program: global norm, non-finite flag, clip coefficient, 1/scale, bias
                    corrections, step/skip counters and the loss-scaler update. Twin of
                    FusedAdamW._step_scalars.
  _adamw_kernel     one program per row of a work table, a row being one BLOCK-chunk of one
                    tensor: reads grad, master, m, v; writes master, m, v and the compute copy
                    (bf16/fp16 param) in the same pass. Exits at once on a skipped step.

Why a work table rather than making the params views of one flat buffer (the llm.c way): the
optimizer owns masters, m and v, so those are flat already and one offset addresses them. The
compute copy -- the model's own parameters -- lives elsewhere; it is addressed as (lowest param
pointer + element offset), so the table is plain integers, the kernel never casts an integer to
a pointer, and the model's storage is never re-pointed (module.to(), weight tying, state_dict
loading keep working). The table costs 48 B per BLOCK elements, is built once, and a row never
straddles two tensors, so full rows run unmasked and vectorised.

Gradients are read where autograd left them, not gathered into a flat buffer first (which cost a
memset and a copy, 6 B/param, and ~150 host calls per step): each step uploads one element
offset per tensor, from a zero-filled BLOCK of the grad dtype that also stands in for a missing
gradient. Steps whose gradients sit at the same addresses as the last one (the caching allocator
and CUDA graphs' pools make that the rule) upload nothing.
"""

import math

import torch
import triton
import triton.language as tl

from minitrain.ops._runtime import round_to_bf16_in_fp32

from .adamw import ALIGN

BLOCK = 4096        # elements per update program: 16 per thread at 8 warps, 4 x 128-bit fp32 loads
NUM_WARPS = 8
FINALIZE_BLOCK = 1024


_MISSING = tl.constexpr(-(2**62))  # grad offset of a parameter without a gradient: it reads the zero block


@triton.jit
def _grad_row(table_ptr, grad_offsets_ptr, zeros_ptr, GRAD_ALIGN: tl.constexpr):
    """This program's table row: its gradient's pointer (into the zero block for a missing one) and its numel."""
    row = table_ptr + tl.program_id(0) * 6  # state offset, param offset, numel, group, tensor, start
    goff = tl.load(grad_offsets_ptr + tl.load(row + 4))
    goff = tl.where(goff == _MISSING, 0, goff + tl.load(row + 5))
    return zeros_ptr + tl.multiple_of(goff, GRAD_ALIGN), tl.load(row + 2)


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
                     growth_factor, backoff_factor, growth_interval,
                     HAS_SCALER: tl.constexpr, CLIP: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0)
    sumsq = tl.sum(acc, axis=0)
    finite = sumsq < float("inf")  # false for inf and nan (sumsq >= 0)

    if HAS_SCALER:  # torch._amp_update_scale_, i.e. GradScaler.update
        scale = tl.load(scale_ptr)
        inv_scale = 1.0 / scale
        successful = tl.load(tracker_ptr) + 1
        grow = successful == growth_interval
        grown = scale * growth_factor
        grown = tl.where(grow & (grown < float("inf")), grown, scale)
        tl.store(scale_ptr, tl.where(finite, grown, scale * backoff_factor))
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
    tl.store(scalars_ptr + 0, mult)
    tl.store(scalars_ptr + 1, finite.to(tl.float32))
    tl.store(scalars_ptr + 2, 1.0 / (1.0 - tl.exp2(t * log2_beta1)))
    tl.store(scalars_ptr + 3, 1.0 / tl.sqrt_rn(1.0 - tl.exp2(t * log2_beta2)))


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
def _adamw_kernel(table_ptr, grad_offsets_ptr, zeros_ptr, param_ptr, master_ptr, m_ptr, v_ptr, hyper_ptr,
                  scalars_ptr, n_groups, beta1, beta2, eps, HAS_MASTER: tl.constexpr,
                  PARAM_ALIGN: tl.constexpr, GRAD_ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(scalars_ptr + 1) != 0.0:  # not skipped
        grad_ptr, n = _grad_row(table_ptr, grad_offsets_ptr, zeros_ptr, GRAD_ALIGN)
        row = table_ptr + tl.program_id(0) * 6
        soff = tl.multiple_of(tl.load(row), 16)
        poff = tl.multiple_of(tl.load(row + 1), PARAM_ALIGN)
        group = tl.load(row + 3)
        lr = tl.load(hyper_ptr + group)
        wd = tl.load(hyper_ptr + n_groups + group)
        grad_mult = tl.load(scalars_ptr)
        inv_bc1 = tl.load(scalars_ptr + 2)
        inv_bc2_sqrt = tl.load(scalars_ptr + 3)
        if n == BLOCK:
            _adamw_block(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, soff, poff, n, lr, wd,
                         grad_mult, inv_bc1, inv_bc2_sqrt, beta1, beta2, eps,
                         HAS_MASTER=HAS_MASTER, MASKED=False, BLOCK=BLOCK)
        else:
            _adamw_block(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, soff, poff, n, lr, wd,
                         grad_mult, inv_bc1, inv_bc2_sqrt, beta1, beta2, eps,
                         HAS_MASTER=HAS_MASTER, MASKED=True, BLOCK=BLOCK)


def _work_table(bucket):
    """Rows (state offset, param offset, numel, group, tensor, start), one per BLOCK-chunk of each tensor
    (start: the chunk's first element in its tensor).
    Param offsets count elements from the bucket's lowest param address, so they are >= 0;
    returns the table, that base param, and the alignment (elements) every param offset has."""
    base = min((p for p in bucket.params if p.numel()), key=lambda p: p.data_ptr())  # an empty shard has no address
    size = base.element_size()
    rows, align = [], 16 // size
    for tensor, (p, off, group) in enumerate(zip(bucket.params, bucket.offsets, bucket.groups)):
        if not p.is_contiguous():
            raise ValueError("fused AdamW needs contiguous parameters")
        delta = p.data_ptr() - base.data_ptr()
        if delta % 16:
            align = 1
        for start in range(0, p.numel(), BLOCK):
            rows.append((off + start, delta // size + start, min(BLOCK, p.numel() - start), group, tensor, start))
    table = torch.tensor(rows, dtype=torch.int64).to(base.device)
    return table, base, (align if base.data_ptr() % 16 == 0 else 1)


class _GradOffsets:
    """Where a bucket's gradients are this step, as element offsets from a zero block of their dtype,
    on the device. Re-uploaded (pinned, no sync) only when an address changed."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.zeros = torch.zeros(BLOCK, dtype=bucket.grad_dtype, device=bucket.exp_avg.device)
        self.ptrs = self.offsets = self.align = None

    def __call__(self):
        grads = self.bucket.grad_tensors()
        try:
            ptrs = list(map(torch.Tensor.data_ptr, grads))
        except TypeError:  # a parameter without a gradient
            ptrs = [0 if g is None else g.data_ptr() for g in grads]
        if ptrs != self.ptrs:
            self._check(grads)
            base, size = self.zeros.data_ptr(), self.zeros.element_size()
            host = torch.tensor([_MISSING.value if g is None else (ptr - base) // size for g, ptr in zip(grads, ptrs)],
                                dtype=torch.int64, device="cpu")
            self.offsets = host.pin_memory().to(self.zeros.device, non_blocking=True) if self.zeros.is_cuda else host
            self.align = 16 // size if all(ptr % 16 == 0 for ptr in ptrs + [base]) else 1
            self.ptrs = ptrs
        return self.offsets, self.zeros, self.align

    def _check(self, grads):
        for p, g in zip(self.bucket.params, grads):
            if g is not None and (g.dtype != self.zeros.dtype or g.shape != p.shape or not g.is_contiguous()):
                raise ValueError(f"fused AdamW reads gradients in place and needs each p.grad contiguous, shaped "
                                 f"like p, in {self.zeros.dtype}; got {g.dtype} {tuple(g.shape)} "
                                 f"stride {g.stride()} for a parameter of shape {tuple(p.shape)}")


class FusedStep:
    """The launch plan of one FusedAdamW: work tables and scratch, built once."""

    def __init__(self, opt):
        assert ALIGN % 16 == 0  # the kernel promises 16-element-aligned state offsets
        self.opt = opt
        self.plans = [(b, *_work_table(b)) for b in opt.buckets]
        self.base_ptrs = [base.data_ptr() for _, _, base, _ in self.plans]
        self.grad_offsets = [_GradOffsets(b) for b in opt.buckets]
        self.n_partials = [table.shape[0] for _, table, _, _ in self.plans]
        self.partials = torch.empty(sum(self.n_partials), dtype=torch.float32, device=opt.device)
        self.scalars = torch.empty(4, dtype=torch.float32, device=opt.device)

    def __call__(self, scaler):
        opt = self.opt
        for (_, _, base, _), ptr in zip(self.plans, self.base_ptrs):
            if base.data_ptr() != ptr:
                raise RuntimeError("parameters moved since FusedAdamW was built; "
                                   "build the optimizer after moving the model")
        grads = [offsets() for offsets in self.grad_offsets]
        start = 0
        for (_, table, _, _), (offsets, zeros, align), n in zip(self.plans, grads, self.n_partials):
            _sumsq_kernel[(n,)](table, offsets, zeros, self.partials[start:], GRAD_ALIGN=align, BLOCK=BLOCK,
                                num_warps=NUM_WARPS)
            start += n
        partials = self.partials
        if opt.reduce_sumsq is not None:  # agree on one number across ranks, not on a partial per block
            partials = partials.sum(0, keepdim=True)
            opt.reduce_sumsq(partials)
        beta1, beta2 = opt.betas
        if scaler is None:
            scaling = (self.scalars, self.scalars, 1.0, 1.0, 1)  # placeholders, compiled out
        else:
            scaling = (scaler.get_scale(), scaler.growth_tracker, scaler.growth_factor,
                       scaler.backoff_factor, scaler.growth_interval)
        scale, tracker, growth, backoff, interval = scaling
        _finalize_kernel[(1,)](
            partials, partials.numel(), self.scalars, opt._step, opt._skipped,
            opt._grad_norm, scale, tracker, float(opt.max_grad_norm or 0.0),
            math.log2(beta1), math.log2(beta2), growth, backoff, interval,
            HAS_SCALER=scaler is not None, CLIP=bool(opt.max_grad_norm), BLOCK=FINALIZE_BLOCK)
        for (b, table, base, align), (offsets, zeros, grad_align) in zip(self.plans, grads):
            _adamw_kernel[(table.shape[0],)](
                table, offsets, zeros, base, b.master if b.master is not None else b.exp_avg,
                b.exp_avg, b.exp_avg_sq, opt._hyper, self.scalars, opt._hyper.shape[1],
                beta1, beta2, opt.eps, HAS_MASTER=b.master is not None, PARAM_ALIGN=align,
                GRAD_ALIGN=grad_align, BLOCK=BLOCK, num_warps=NUM_WARPS)
