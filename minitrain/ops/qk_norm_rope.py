"""q's and k's RMSNorm (model.qk_norm) and rotation (model.position=rope) in one Triton pass each way.

Why: written as torch ops (nn.RMSNorm, then `model.rotate`), Inductor makes several kernels of them in the forward
and more in the backward, each reading and writing q and k again (docs/benchmarks.md, "Time to target"). Here the
forward reads q and k from c_attn's output once and writes them normalised and rotated; the backward reads their
gradients and c_attn's output once, recomputes each row's rms, and writes the gradient of c_attn's q and k columns
and a per-program share of the norms' weight gradients (summed by torch). Nothing but c_attn's output (which
attention keeps anyway) and the rope tables is saved. All math is fp32, with no rounding between the norm and the
rotation; results are stored in c_attn's dtype. A custom op, so torch.compile keeps it opaque.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.triton_runtime import check_runnable, round_to_bf16_in_fp32, rounds_bf16

_BLOCK_ROWS = 64  # (token, head) rows per program, for q and for k
_NUM_WARPS = 4


@triton.jit
def _normed_rotated(x1, x2, w_ptr, cos, sin, eps, HEAD: tl.constexpr, HALF: tl.constexpr,
                    HALF_BLOCK: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr):
    """A tile of rows' two halves, each row scaled to unit rms times the weight (NORM), then turned (ROPE)."""
    if NORM:
        d = tl.arange(0, HALF_BLOCK)[None, :]
        w = w_ptr + d
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD + eps)[:, None]
        x1 = x1 * rstd * tl.load(w, mask=d < HALF, other=0.0).to(tl.float32)
        x2 = x2 * rstd * tl.load(w + HALF, mask=d < HEAD - HALF, other=0.0).to(tl.float32)
    if ROPE:
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return x1, x2


@triton.jit
def _forward_kernel(qk_ptr, q_ptr, k_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, rows, T, token_stride, eps,
                    H: tl.constexpr, HEAD: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                    NORM: tl.constexpr, ROPE: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token, head = r // H, r % H
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask, mask2 = (r < rows)[:, None] & (d < HALF), (r < rows)[:, None] & (d < HEAD - HALF)
    cos, sin = 0.0, 0.0
    if ROPE:  # one angle table row per token, shared by q and k and by every head
        t = (token % T)[:, None] * HALF + d
        cos = tl.load(cos_ptr + t, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + t, mask=mask, other=0.0)
    src = qk_ptr + (token * token_stride + head * HEAD)[:, None] + d
    dst = r[:, None] * HEAD + d
    for which in tl.static_range(2):  # q, then k: columns [0, C) and [C, 2C) of each token
        x1 = tl.load(src + which * H * HEAD, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + which * H * HEAD + HALF, mask=mask2, other=0.0).to(tl.float32)
        if which == 0:
            w_ptr, out_ptr = q_w_ptr, q_ptr + dst
        else:
            w_ptr, out_ptr = k_w_ptr, k_ptr + dst
        y1, y2 = _normed_rotated(x1, x2, w_ptr, cos, sin, eps, HEAD, HALF, HALF_BLOCK, NORM, ROPE)
        if ROUND_BF16:
            y1, y2 = round_to_bf16_in_fp32(y1), round_to_bf16_in_fp32(y2)
        tl.store(out_ptr, y1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + HALF, y2.to(q_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _backward_kernel(dq_ptr, dk_ptr, qk_ptr, d_qk_ptr, q_w_ptr, k_w_ptr, dw_ptr, cos_ptr, sin_ptr, rows, T,
                     token_stride, eps, dq_b, dq_t, dq_h, dk_b, dk_t, dk_h,
                     H: tl.constexpr, HEAD: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                     NORM: tl.constexpr, ROPE: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token, head = r // H, r % H
    b, t = token // T, token % T
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask, mask2 = (r < rows)[:, None] & (d < HALF), (r < rows)[:, None] & (d < HEAD - HALF)
    cos, sin = 0.0, 0.0
    if ROPE:
        td = t[:, None] * HALF + d
        cos = tl.load(cos_ptr + td, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + td, mask=mask, other=0.0)
    src = qk_ptr + (token * token_stride + head * HEAD)[:, None] + d
    dst = d_qk_ptr + (token * 2 * H * HEAD + head * HEAD)[:, None] + d
    for which in tl.static_range(2):
        if which == 0:
            g_ptr, w_ptr = dq_ptr + (b * dq_b + t * dq_t + head * dq_h)[:, None] + d, q_w_ptr
        else:
            g_ptr, w_ptr = dk_ptr + (b * dk_b + t * dk_t + head * dk_h)[:, None] + d, k_w_ptr
        g1 = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + HALF, mask=mask2, other=0.0).to(tl.float32)
        if ROPE:  # the rotation's transpose: turned back by the same angle
            g1, g2 = g1 * cos + g2 * sin, g2 * cos - g1 * sin
        if NORM:  # y = n * w, n = x * rstd: dx = rstd * (dn - n * mean(dn * n)), dn = dy * w; dw = sum(dy * n)
            x1 = tl.load(src + which * H * HEAD, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + which * H * HEAD + HALF, mask=mask2, other=0.0).to(tl.float32)
            rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD + eps)[:, None]
            n1, n2 = x1 * rstd, x2 * rstd
            w = w_ptr + d
            w1 = tl.load(w, mask=d < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w + HALF, mask=d < HEAD - HALF, other=0.0).to(tl.float32)
            dw = dw_ptr + (pid * 2 + which) * HEAD + tl.arange(0, HALF_BLOCK)
            tl.store(dw, tl.sum(g1 * n1, 0), mask=tl.arange(0, HALF_BLOCK) < HALF)
            tl.store(dw + HALF, tl.sum(g2 * n2, 0), mask=tl.arange(0, HALF_BLOCK) < HEAD - HALF)
            dn1, dn2 = g1 * w1, g2 * w2
            mean = ((tl.sum(dn1 * n1, 1) + tl.sum(dn2 * n2, 1)) / HEAD)[:, None]
            g1, g2 = rstd * (dn1 - n1 * mean), rstd * (dn2 - n2 * mean)
        if ROUND_BF16:
            g1, g2 = round_to_bf16_in_fp32(g1), round_to_bf16_in_fp32(g2)
        out = dst + which * H * HEAD
        tl.store(out, g1.to(d_qk_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, g2.to(d_qk_ptr.dtype.element_ty), mask=mask2)


def _check(qk: Tensor, n_head: int, cos: Optional[Tensor]) -> tuple[int, int, int, int, dict]:
    """B, T, the head size, the (token, head) rows, and the kernels' shape constants: each row is read as two parts,
    ceil(head / 2) wide and the rest (rope's pairs; the norm's sum), each padded to a power of 2."""
    B, T, C2 = qk.shape
    head = C2 // 2 // n_head
    if C2 % (2 * n_head) or (cos is not None and head % 2) or qk.stride(2) != 1:
        raise ValueError(f"qk_norm_rope needs (B, T, 2C) with unit feature stride (and an even head size to rotate), "
                         f"got {tuple(qk.shape)} strides {qk.stride()} with {n_head} heads")
    half = (head + 1) // 2
    return B, T, head, B * T * n_head, dict(H=n_head, HEAD=head, HALF=half, HALF_BLOCK=triton.next_power_of_2(half))


@torch.library.custom_op("minitrain::qk_norm_rope", mutates_args=())
def _qk_norm_rope(qk: Tensor, n_head: int, q_weight: Optional[Tensor], k_weight: Optional[Tensor], eps: float,
                  cos: Optional[Tensor], sin: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    B, T, head, rows, shape = _check(qk, n_head, cos)
    q = qk.new_empty(B, T, n_head, head)
    k = torch.empty_like(q)
    _forward_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
        qk, q, k, q_weight, k_weight, cos, sin, rows, T, qk.stride(1), eps, **shape, NORM=q_weight is not None,
        ROPE=cos is not None, ROUND_BF16=rounds_bf16(qk.dtype), BLOCK_ROWS=_BLOCK_ROWS, num_warps=_NUM_WARPS)
    return q, k


@_qk_norm_rope.register_fake
def _(qk, n_head, q_weight, k_weight, eps, cos, sin):
    B, T, C2 = qk.shape
    q = qk.new_empty(B, T, n_head, C2 // 2 // n_head)
    return q, torch.empty_like(q)


@torch.library.custom_op("minitrain::qk_norm_rope_backward", mutates_args=())
def _qk_norm_rope_backward(dq: Tensor, dk: Tensor, qk: Tensor, n_head: int, q_weight: Optional[Tensor],
                           k_weight: Optional[Tensor], eps: float, cos: Optional[Tensor], sin: Optional[Tensor]
                           ) -> tuple[Tensor, Tensor]:
    """The gradient of qk (contiguous, qk's dtype) and of the weights, q's and k's rows of one (2, head size) fp32
    tensor (empty without them)."""
    B, T, head, rows, shape = _check(qk, n_head, cos)
    dq, dk = (g if g.stride(3) == 1 else g.contiguous() for g in (dq, dk))
    programs = triton.cdiv(rows, _BLOCK_ROWS)
    d_qk = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    partial = qk.new_empty((programs, 2, head) if q_weight is not None else (0,), dtype=torch.float32)
    _backward_kernel[(programs,)](
        dq, dk, qk, d_qk, q_weight, k_weight, partial, cos, sin, rows, T, qk.stride(1), eps, dq.stride(0), dq.stride(1),
        dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2), **shape, NORM=q_weight is not None,
        ROPE=cos is not None, ROUND_BF16=rounds_bf16(qk.dtype), BLOCK_ROWS=_BLOCK_ROWS, num_warps=_NUM_WARPS)
    return d_qk, partial.sum(0) if q_weight is not None else partial


@_qk_norm_rope_backward.register_fake
def _(dq, dk, qk, n_head, q_weight, k_weight, eps, cos, sin):
    head = qk.shape[2] // 2 // n_head
    return torch.empty_like(qk, memory_format=torch.contiguous_format), \
        qk.new_empty((2, head) if q_weight is not None else (0,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    qk, n_head, q_weight, k_weight, eps, cos, sin = inputs
    ctx.save_for_backward(qk, q_weight, k_weight, cos, sin)
    ctx.n_head, ctx.eps = n_head, eps


def _backward(ctx, dq, dk):
    qk, q_weight, k_weight, cos, sin = ctx.saved_tensors
    d_qk, d_weights = _qk_norm_rope_backward(dq, dk, qk, ctx.n_head, q_weight, k_weight, ctx.eps, cos, sin)
    if q_weight is None:
        return d_qk, None, None, None, None, None, None
    return d_qk, None, d_weights[0].to(q_weight.dtype), d_weights[1].to(k_weight.dtype), None, None, None


_qk_norm_rope.register_autograd(_backward, setup_context=_setup_context)


def qk_norm_rope(qk: Tensor, n_head: int, q_weight: Optional[Tensor], k_weight: Optional[Tensor], eps: float,
                 cos: Optional[Tensor], sin: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """q and k, each (B, T, n_head, head size), from qk = c_attn's (B, T, 2C) q and k columns (a view of its output):
    each head's row scaled to unit rms (eps inside the root) times q_weight or k_weight (none: not normalised), then
    feature pair (i, i + head size / 2) turned by the angle whose cos and sin (T, head size / 2, fp32: ops/rope.py's
    tables) are given (none: not rotated). The same function as nn.RMSNorm then `model.rotate`."""
    check_runnable(qk, "qk_norm_rope", "model.qk_kernel=torch")
    return _qk_norm_rope(qk, n_head, q_weight, k_weight, eps, cos, sin)
