"""Row-wise cross-entropy kernel over a chunk of logits already in HBM.

The matmuls stay in cuBLAS; this kernel is the only pass that touches the
logits after they are written: two streaming reads (online max/log-sum-exp,
then softmax) and, when gradients are wanted, one in-place write of
d(loss)/d(logits). All math is fp32 whatever the logits' dtype.
"""

import os

import torch
import triton
import triton.language as tl

# The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even;
# round explicitly there so CPU tests see the GPU's numerics.
_ROUND_BF16 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_bf16_in_fp32(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,  # (M, V) workspace; overwritten with d(loss_row)/d(logits) if WRITE_GRAD
    stride_row,
    targets_ptr,  # (M,) int64
    loss_ptr,  # (M,) fp32 out: per-row loss, 0 for ignored rows
    grad_scale_ptr,  # fp32 factor of each gradient row: one scalar (stride 0) or one per row
    scale_stride,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    WRITE_GRAD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)

    if target == ignore_index:
        # Ignored rows skip the exp passes; their zero gradient row makes them
        # contribute nothing to either matmul that follows.
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, V, BLOCK):
                offs = start + cols
                tl.store(row_ptr + offs, tl.zeros([BLOCK], logits_ptr.dtype.element_ty), mask=offs < V)
    else:
        # Pass 1: online max / sum-exp (and the plain sum that label smoothing needs).
        m = -float("inf")
        s = 0.0
        x_sum = 0.0
        for start in range(0, V, BLOCK):
            offs = start + cols
            x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
            if label_smoothing > 0:
                x_sum += tl.sum(tl.where(offs < V, x, 0.0), axis=0)
        lse = m + tl.log(s)
        x_target = tl.load(row_ptr + target).to(tl.float32)
        loss = lse - (1.0 - label_smoothing) * x_target - label_smoothing * x_sum / V + z_loss * lse * lse
        tl.store(loss_ptr + row, loss)

        if WRITE_GRAD:
            # d/dx_j = p_j * (1 + 2 z lse) - eps / V - (1 - eps) [j == target]
            p_coef = 1.0 + 2.0 * z_loss * lse
            uniform = label_smoothing / V
            scale = tl.load(grad_scale_ptr + row * scale_stride)
            for start in range(0, V, BLOCK):
                offs = start + cols
                x = tl.load(row_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) * p_coef - uniform - tl.where(offs == target, 1.0 - label_smoothing, 0.0)
                g = g * scale
                if ROUND_BF16:
                    g = _round_to_bf16_in_fp32(g)
                tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=offs < V)


def cross_entropy_rows(logits, targets, losses, grad_scale, *, ignore_index, label_smoothing, z_loss, write_grad):
    """Per-row loss into `losses`; if `write_grad`, `logits` becomes its gradient times `grad_scale`.

    `grad_scale` is a 0-dim or (M,) fp32 device tensor (no host sync).
    """
    rows, vocab = logits.shape
    block = min(triton.next_power_of_2(vocab), 4096)
    _cross_entropy_rows_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        grad_scale,
        grad_scale.stride(0) if grad_scale.dim() else 0,
        vocab,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        WRITE_GRAD=write_grad,
        ROUND_BF16=_ROUND_BF16 and logits.dtype == torch.bfloat16,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
