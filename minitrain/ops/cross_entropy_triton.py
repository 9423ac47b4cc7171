"""The two softmax kernels of the fused linear cross-entropy, over logits a cuBLAS GEMM just wrote.

_cross_entropy_rows_kernel   whole rows (all V columns): online max / log-sum-exp, the row's loss
                             and log-sum-exp, and, when gradients are wanted, d(loss)/d(logits)
                             written in place (two streaming reads, one write; one read when the
                             block holds the whole row, which then stays on chip between the passes).
_logit_grad_block_kernel     a block of columns of every row, given each row's log-sum-exp:
                             d(loss)/d(logits) in place (one read, one write).

All math is fp32 whatever the logits' dtype. With a soft-cap c (SOFTCAP) each logit z the GEMM wrote is scored as
x = c tanh(z / c) as it is read, and the gradient written is d(loss)/dz = d(loss)/dx (1 - (x / c)^2): the capped
logits exist only in registers.
"""

import functools

import torch
import triton
import triton.language as tl

from minitrain.triton_runtime import round_to_bf16_in_fp32, rounds_bf16

ROWS_PER_SM = 8
"""Rows the row kernel streams at once per multiprocessor (0: one program per row, all at once). Tuned on
an H200 (scripts/tune_cross_entropy_rows.py, docs/results/history.md) with 4 warps and 4096-column blocks."""


@triton.jit
def _soft_capped(x, valid, softcap, SOFTCAP: tl.constexpr):
    """The logits the loss scores: softcap * tanh(x / softcap) where `valid` (masked lanes keep their fill), tanh as
    1 - 2 / (1 + e^(2u)) in one exp2: e^(2u) overflowing to inf or flushing to 0 gives +-1, never NaN."""
    if SOFTCAP:  # e^(2u) = exp2(2 log2(e) u), u = x / softcap
        x = tl.where(valid, softcap - 2.0 * softcap / (1.0 + tl.exp2(x * (2.8853900817779268 / softcap))), x)
    return x


@triton.jit
def _logit_grad(x, cols, target, lse, scale, V, label_smoothing, z_loss, softcap, SOFTCAP: tl.constexpr,
                ROUND_BF16: tl.constexpr):
    """scale * d(loss)/d(x_j) = scale * (p_j (1 + 2 z lse) - eps / V - (1 - eps) [j == target]); soft-capped,
    x is the capped logit and the gradient is the raw logit's, times tanh' = 1 - (x / softcap)^2."""
    g = tl.exp(x - lse) * (1.0 + 2.0 * z_loss * lse) - label_smoothing / V
    g = (g - tl.where(cols == target, 1.0 - label_smoothing, 0.0)) * scale
    if SOFTCAP:
        t = x / softcap
        g = g * (1.0 - t * t)
    if ROUND_BF16:
        g = round_to_bf16_in_fp32(g)
    return g


@triton.jit
def _cross_entropy_row(row_ptr, row, cols, targets_ptr, loss_ptr, lse_ptr, grad_scale_ptr, scale_stride, V,
                       ignore_index, label_smoothing, z_loss, softcap, SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
                       ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    target = tl.load(targets_ptr + row)
    if target == ignore_index:
        # Ignored rows skip the exp passes; their zero gradient row makes them
        # contribute nothing to either matmul that follows.
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, V, BLOCK):
                offs = start + cols
                tl.store(row_ptr + offs, tl.zeros([BLOCK], row_ptr.dtype.element_ty), mask=offs < V)
    else:
        # The target's logit is read before pass 1's block-wide reductions, whose barriers order the read before
        # any warp's gradient store: read after them, a lagging warp could find the gradient in its place (a
        # race: now and then a row's loss was wrong, and the logged loss differed from run to run).
        x_target = _soft_capped(tl.load(row_ptr + target).to(tl.float32), True, softcap, SOFTCAP)
        if ONE_BLOCK:
            # The whole row in one block: read once; the gradient below comes from the same registers.
            x = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            x = _soft_capped(x, cols < V, softcap, SOFTCAP)
            m = tl.max(x, axis=0)
            lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
            x_sum = tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        else:
            # Pass 1: online max / sum-exp (and the plain sum that label smoothing needs).
            m = -float("inf")
            s = 0.0
            x_sum = 0.0
            for start in range(0, V, BLOCK):
                offs = start + cols
                x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
                x = _soft_capped(x, offs < V, softcap, SOFTCAP)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
                if label_smoothing > 0:
                    x_sum += tl.sum(tl.where(offs < V, x, 0.0), axis=0)
            lse = m + tl.log(s)
        loss = lse - (1.0 - label_smoothing) * x_target - label_smoothing * x_sum / V + z_loss * lse * lse
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)

        if WRITE_GRAD:
            scale = tl.load(grad_scale_ptr + row * scale_stride)
            if ONE_BLOCK:
                g = _logit_grad(x, cols, target, lse, scale, V, label_smoothing, z_loss, softcap, SOFTCAP,
                                ROUND_BF16)
                tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=cols < V)
            else:
                for start in range(0, V, BLOCK):  # pass 2
                    offs = start + cols
                    x = tl.load(row_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
                    x = _soft_capped(x, offs < V, softcap, SOFTCAP)
                    g = _logit_grad(x, offs, target, lse, scale, V, label_smoothing, z_loss, softcap, SOFTCAP,
                                    ROUND_BF16)
                    tl.store(row_ptr + offs, g.to(row_ptr.dtype.element_ty), mask=offs < V)


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,  # (M, V) workspace; overwritten with d(loss_row)/d(logits) if WRITE_GRAD
    stride_row,
    targets_ptr,  # (M,) int64
    loss_ptr,  # (M,) fp32 out: per-row loss, 0 for ignored rows
    lse_ptr,  # (M,) fp32 out: per-row log-sum-exp, 0 for ignored rows
    grad_scale_ptr,  # fp32 factor of each gradient row: one scalar (stride 0) or one per row
    scale_stride,
    M,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,  # > 0 with SOFTCAP
    SOFTCAP: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,  # BLOCK >= V: the row is read once
):
    cols = tl.arange(0, BLOCK)
    # Rows in a grid-stride loop: how many rows stream at once is the grid's choice (see the launcher).
    for row in range(tl.program_id(0).to(tl.int64), M, tl.num_programs(0)):
        _cross_entropy_row(logits_ptr + row * stride_row, row, cols, targets_ptr, loss_ptr, lse_ptr, grad_scale_ptr,
                           scale_stride, V, ignore_index, label_smoothing, z_loss, softcap, SOFTCAP, WRITE_GRAD,
                           ROUND_BF16, BLOCK, ONE_BLOCK)


@triton.jit
def _logit_grad_block_kernel(
    logits_ptr,  # (M, C) workspace: the logits of vocab columns [col0, col0 + C); overwritten with their gradient
    M,
    C,
    col0,
    targets_ptr,
    lse_ptr,  # (M,) fp32, from _cross_entropy_rows_kernel
    grad_scale_ptr,
    scale_stride,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    SOFTCAP: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    # 2-D tiles: a block is H columns wide (768 at GPT-2 scale), so a one-row program would mask
    # a quarter of its power-of-two lanes.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = (rows[:, None] < M) & (cols[None, :] < C)
    ptrs = logits_ptr + rows[:, None] * C + cols[None, :]
    target = tl.load(targets_ptr + rows, mask=rows < M, other=ignore_index)
    lse = tl.load(lse_ptr + rows, mask=rows < M, other=0.0)
    scale = tl.load(grad_scale_ptr + rows * scale_stride, mask=rows < M, other=0.0)
    x = _soft_capped(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask, softcap, SOFTCAP)
    g = _logit_grad(x, col0 + cols[None, :], target[:, None], lse[:, None], scale[:, None], V, label_smoothing,
                    z_loss, softcap, SOFTCAP, ROUND_BF16)
    g = tl.where(target[:, None] == ignore_index, 0.0, g)  # ignored rows: exact zeros (their lse is 0)
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def cross_entropy_rows(logits, targets, losses, lse, grad_scale, *, ignore_index, label_smoothing, z_loss,
                       write_grad, softcap=None, programs=None, block=4096, num_warps=4):
    """Per-row loss and log-sum-exp into `losses`, `lse` (of the logits soft-capped when `softcap` is given); if
    `write_grad`, `logits` becomes its gradient times `grad_scale`, a 0-dim or (M,) fp32 device tensor (no host sync).

    How many rows stream at once (`programs`; default ROWS_PER_SM per multiprocessor) trades memory
    parallelism against L2 hits when the gradient pass rereads a row; measured, not derived. The last
    three arguments are there for scripts/tune_cross_entropy_rows.py.
    """
    rows, vocab = logits.shape
    block = min(triton.next_power_of_2(vocab), block)
    if programs is None:
        programs = ROWS_PER_SM * _multiprocessors(logits.device) if logits.is_cuda and ROWS_PER_SM else rows
    programs = min(rows, programs)
    _cross_entropy_rows_kernel[(programs,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        lse,
        grad_scale,
        grad_scale.stride(0) if grad_scale.dim() else 0,
        rows,
        vocab,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap or 1.0),
        SOFTCAP=softcap is not None,
        WRITE_GRAD=write_grad,
        ROUND_BF16=rounds_bf16(logits.dtype),
        BLOCK=block,
        ONE_BLOCK=block >= vocab,
        num_warps=num_warps,
    )


def logit_grad_block(logits, col0, vocab, targets, lse, grad_scale, *, ignore_index, label_smoothing, z_loss,
                     softcap=None, tile=None, num_warps=4):
    """`logits` (M, C) contiguous, vocab columns [col0, col0 + C) of every row, becomes its gradient
    times `grad_scale`, from the rows' log-sum-exp (of the capped logits, with `softcap`).

    Default tile (rows, columns): 2048 elements, as wide as divides C evenly (up to 1024), so no lane
    is masked: 8 x 256 for C = 768, 2 x 1024 for C = 2048 (tuned with scripts/tune_cross_entropy_rows.py;
    figures in docs/results/history.md).
    """
    rows, cols = logits.shape
    if tile is None:
        tile_cols = min(1024, cols & -cols)  # the largest power of two dividing C
        if tile_cols < 64:
            tile_cols = min(1024, triton.next_power_of_2(cols))
        tile = (max(1, 2048 // tile_cols), tile_cols)
    tile_rows, tile_cols = tile
    tile_cols = min(triton.next_power_of_2(cols), tile_cols)
    _logit_grad_block_kernel[(triton.cdiv(rows, tile_rows), triton.cdiv(cols, tile_cols))](
        logits,
        rows,
        cols,
        col0,
        targets,
        lse,
        grad_scale,
        grad_scale.stride(0) if grad_scale.dim() else 0,
        vocab,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap or 1.0),
        SOFTCAP=softcap is not None,
        ROUND_BF16=rounds_bf16(logits.dtype),
        ROWS=tile_rows,
        COLS=tile_cols,
        num_warps=num_warps,
    )
