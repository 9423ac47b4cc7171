"""Triton kernels of Muon's side of the fused step: two memory passes around each batch's Newton–Schulz GEMMs.

  _momentum_kernel  one program per row of a batch's rows of the bucket's work table (adamw_triton's: a row is
                    one BLOCK-chunk of one tensor): reads the gradient where autograd left it and the fp32
                    momentum buffer; writes the buffer and the bf16 Newton–Schulz input (the Nesterov mix) in
                    the same pass. A skipped step selects the buffer as the gradient (not a multiply: an inf or
                    NaN gradient cannot leak), so the buffer lerps to itself exactly and the input is finite.
  _update_kernel    the same rows: reads the fp32 master (the param itself without one) and the orthogonalized
                    bf16 update; writes the master and the compute copy. Exits at once on a skipped step.

Both read the step's scalars (the unscale and clip multiplier, the skip flag) that adamw_triton's finalize
kernel wrote from the one sum of squares of every gradient, AdamW's side included, and the per-group lr and
weight decay from the optimizer's device table: no host sync, and replayable under CUDA graphs.
"""

import numpy as np
import triton
import triton.language as tl

from .adamw_triton import (BLOCK, COL_GROUP, COL_NUMEL, COL_PARAM_OFFSET, COL_START, COL_STATE_OFFSET, COL_TENSOR,
                           GRAD_MULT, NOT_SKIPPED, NUM_WARPS, TABLE_COLUMNS, _grad_row, _round_to_param)
from .newton_schulz import batches

BF16_ALIGN = 8  # bf16 elements in 16 bytes: the vector width of the Newton–Schulz buffers' loads and stores


def fused_bytes_per_param(param_dtype, grad_dtype, master_weights: bool) -> int:
    """HBM bytes Muon's memory passes move per parameter, beside its Newton–Schulz GEMMs: the gradient read twice
    (the norm pass, then the momentum pass), the momentum read and written, the bf16 input written, read by the
    norm, read and written by the division, the orthogonalized update read, the fp32 master read and written
    (without one, the param read instead) and the param written."""
    passes = 2 * grad_dtype.itemsize + 2 * 4 + 2 * 5
    return passes + 4 * (2 if master_weights else 0) + param_dtype.itemsize * (1 if master_weights else 2)


def lerp_coefficient(weight: float) -> tuple[float, bool]:
    """torch.lerp(start, end, weight) as ATen vectorizes it is one fused multiply-add, coefficient·(end - start)
    + base: the base is `start` and the coefficient the fp32 weight when |weight| < 0.5, else `end` and weight - 1
    (so that each end is exact). Returns (the coefficient, exact in fp32, whether the base is start): computed
    here once, in fp32, as ATen does, so that the kernels' bits are torch's."""
    w = np.float32(weight)
    small = bool(abs(w) < 0.5)
    return float(w if small else w - np.float32(1.0)), small


@triton.jit
def _lerp(start, end, coefficient, SMALL: tl.constexpr):
    if SMALL:
        return tl.fma(coefficient, end - start, start)
    return tl.fma(coefficient, end - start, end)


@triton.jit
def _momentum_block(grad_ptr, m_ptr, x_ptr, soff, xoff, n, grad_mult, keep, buffer_coef, nesterov_coef,
                    BUFFER_SMALL: tl.constexpr, NESTEROV_SMALL: tl.constexpr, NESTEROV: tl.constexpr,
                    MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    buf = tl.load(m_ptr + soff + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32) * grad_mult
    g = tl.where(keep, g, buf)
    buf = _lerp(buf, g, buffer_coef, BUFFER_SMALL)
    tl.store(m_ptr + soff + offs, buf, mask=mask)
    if NESTEROV:
        x = _lerp(g, buf, nesterov_coef, NESTEROV_SMALL)
    else:
        x = buf
    tl.store(x_ptr + xoff + offs, _round_to_param(x, x_ptr), mask=mask)


@triton.jit
def _momentum_kernel(table_ptr, grad_offsets_ptr, zeros_ptr, m_ptr, x_ptr, scalars_ptr, first_tensor, x_stride,
                     buffer_coef, nesterov_coef, BUFFER_SMALL: tl.constexpr, NESTEROV_SMALL: tl.constexpr,
                     NESTEROV: tl.constexpr, GRAD_ALIGN: tl.constexpr, X_ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    grad_ptr, n = _grad_row(table_ptr, grad_offsets_ptr, zeros_ptr, GRAD_ALIGN)
    row = table_ptr + tl.program_id(0) * TABLE_COLUMNS
    soff = tl.multiple_of(tl.load(row + COL_STATE_OFFSET), 16)
    xoff = tl.multiple_of((tl.load(row + COL_TENSOR) - first_tensor) * x_stride + tl.load(row + COL_START), X_ALIGN)
    keep = tl.load(scalars_ptr + NOT_SKIPPED) != 0.0
    grad_mult = tl.load(scalars_ptr + GRAD_MULT)
    if n == BLOCK:
        _momentum_block(grad_ptr, m_ptr, x_ptr, soff, xoff, n, grad_mult, keep, buffer_coef, nesterov_coef,
                        BUFFER_SMALL=BUFFER_SMALL, NESTEROV_SMALL=NESTEROV_SMALL, NESTEROV=NESTEROV, MASKED=False,
                        BLOCK=BLOCK)
    else:
        _momentum_block(grad_ptr, m_ptr, x_ptr, soff, xoff, n, grad_mult, keep, buffer_coef, nesterov_coef,
                        BUFFER_SMALL=BUFFER_SMALL, NESTEROV_SMALL=NESTEROV_SMALL, NESTEROV=NESTEROV, MASKED=True,
                        BLOCK=BLOCK)


@triton.jit
def _update_block(param_ptr, master_ptr, o_ptr, soff, poff, ooff, n, lr, wd, ratio,
                  HAS_MASTER: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    if HAS_MASTER:
        p = tl.load(master_ptr + soff + offs, mask=mask)
    else:
        p = tl.load(param_ptr + poff + offs, mask=mask).to(tl.float32)
    o = tl.load(o_ptr + ooff + offs, mask=mask).to(tl.float32)
    p = p * (1.0 - lr * wd) - (lr * ratio) * o
    if HAS_MASTER:
        tl.store(master_ptr + soff + offs, p, mask=mask)
    tl.store(param_ptr + poff + offs, _round_to_param(p, param_ptr), mask=mask)


@triton.jit
def _update_kernel(table_ptr, param_ptr, master_ptr, o_ptr, lr_ptr, wd_ptr, scalars_ptr, first_tensor, o_stride,
                   ratio, HAS_MASTER: tl.constexpr, PARAM_ALIGN: tl.constexpr, O_ALIGN: tl.constexpr,
                   BLOCK: tl.constexpr):
    if tl.load(scalars_ptr + NOT_SKIPPED) != 0.0:
        row = table_ptr + tl.program_id(0) * TABLE_COLUMNS
        soff = tl.multiple_of(tl.load(row + COL_STATE_OFFSET), 16)
        poff = tl.multiple_of(tl.load(row + COL_PARAM_OFFSET), PARAM_ALIGN)
        ooff = tl.multiple_of((tl.load(row + COL_TENSOR) - first_tensor) * o_stride + tl.load(row + COL_START), O_ALIGN)
        n = tl.load(row + COL_NUMEL)
        group = tl.load(row + COL_GROUP)
        lr = tl.load(lr_ptr + group)
        wd = tl.load(wd_ptr + group)
        if n == BLOCK:
            _update_block(param_ptr, master_ptr, o_ptr, soff, poff, ooff, n, lr, wd, ratio,
                          HAS_MASTER=HAS_MASTER, MASKED=False, BLOCK=BLOCK)
        else:
            _update_block(param_ptr, master_ptr, o_ptr, soff, poff, ooff, n, lr, wd, ratio,
                          HAS_MASTER=HAS_MASTER, MASKED=True, BLOCK=BLOCK)


def _alignment(t, stride: int) -> int:
    """The element alignment every offset `stride`·k + a multiple of BLOCK has from bf16 tensor `t`'s address."""
    return BF16_ALIGN if t.data_ptr() % 16 == 0 and stride % BF16_ALIGN == 0 else 1


class MuonKernels:
    """The update phase of the fused Muon over some buckets, built once: per batch of one shape, the momentum pass,
    Newton–Schulz through `exchange` (newton_schulz.Exchange), the update pass."""

    def __init__(self, buckets, momentum: float, nesterov: bool, exchange, adjust_lr: str):
        self.buckets, self.exchange, self.nesterov = buckets, exchange, nesterov
        (buffer_coef, buffer_small), (nesterov_coef, nesterov_small) = map(lerp_coefficient, (1 - momentum, momentum))
        self.coefficients = (buffer_coef, nesterov_coef)
        self.small = dict(BUFFER_SMALL=buffer_small, NESTEROV_SMALL=nesterov_small)
        self.batches = [batches(b, per_matrix=False, adjust_lr=adjust_lr, block=BLOCK) for b in buckets]

    def __call__(self, plans, grads, lr, weight_decay, scalars):
        for (b, table, base, align), (offsets, zeros, grad_align), runs in zip(plans, grads, self.batches):
            state = b.state
            for batch in runs:
                rows = table[batch.rows]
                n_rows = rows.shape[0]
                x = self.exchange.inputs(batch.count, batch.local_shape, batch.shape, table.device)
                if n_rows:
                    _momentum_kernel[(n_rows,)](
                        rows, offsets, zeros, state.momentum, x, scalars, batch.first, x.stride(0), *self.coefficients,
                        **self.small, NESTEROV=self.nesterov, GRAD_ALIGN=grad_align, X_ALIGN=_alignment(x, x.stride(0)),
                        BLOCK=BLOCK, num_warps=NUM_WARPS)
                o = self.exchange(x, batch.count, batch.local_shape[0], batch.shape)
                del x
                if n_rows:
                    _update_kernel[(n_rows,)](
                        rows, base, state.master if state.master is not None else state.momentum, o, lr,
                        weight_decay, scalars, batch.first, o.stride(0), float(np.float32(batch.ratio)),
                        HAS_MASTER=state.master is not None, PARAM_ALIGN=align, O_ALIGN=_alignment(o, o.stride(0)),
                        BLOCK=BLOCK, num_warps=NUM_WARPS)
                del o  # before the next batch's buffers are made
