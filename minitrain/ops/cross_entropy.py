"""Fused linear cross-entropy: the LM head's logits never exist in full.

The logits of one batch (tokens x vocab) are the largest activation of a GPT
and are used once. Here they only ever exist one slice at a time, in a
workspace whose size comes from a byte budget (`chunk_bytes`):

    row chunks (all V columns):
        chunk  = h[rows] @ W.T                     cuBLAS
        loss, lse of the rows; chunk <- dloss/dlogits        Triton, fp32 math
        grad_h[rows] = chunk @ W                   cuBLAS, one GEMM over all of V
        default:     acc_W += chunk.T @ h[rows]    cuBLAS, into an fp32 V x H accumulator

    low_memory: no accumulator; then vocab blocks (all N rows):
        block  = h @ W[cols].T                     cuBLAS (the logits again)
        block <- dloss/dlogits from lse            Triton, fp32 math
        grad_W[cols] = block.T @ h                 cuBLAS, one GEMM over all N rows

With a soft-cap (`softcap`, c) the loss scores c tanh(z / c) of each logit z: the Triton kernels cap the
logits as they read them and write the raw logits' gradient (tanh's derivative applied), so the capped logits
are never stored either.

The weight gradient sums over every row. Summing chunk by chunk in bf16
would round at every chunk, so the default keeps an fp32 accumulator (4 V H
bytes) and rounds once. low_memory rounds once too, without that state: each
block of grad_W is one GEMM whose fp32 accumulation covers all N rows. It
pays a fourth GEMM (the logits are recomputed) and gains the memory of the
accumulator. Before pass B, the row chunks use the memory that grad_W and
pass B's workspace take later: beyond the two gradients it holds one
workspace, by default as large as `hidden`. Measured trade-off: docs/benchmarks.md.

The gradients are computed in the forward pass; backward scales them by
grad_output in place. Everything stays on the device: the mean's 1/n_valid is
a tensor, no host sync. reduction="none" is the exception: a per-row
grad_output cannot be applied to grad_W after the sum over rows, so its
backward reruns the passes with the rows pre-scaled.

Ignored rows cost their share of the matmuls (dropping them without knowing
their count on the host would need a sync) but skip the softmax passes and
contribute exact zeros.
"""

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from minitrain.triton_runtime import check_runnable
from minitrain.ops.cross_entropy_triton import cross_entropy_rows, logit_grad_block

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""Row-chunk workspace of the default schedule (2560 rows at V=50304 bf16): every chunk also reads
and writes the fp32 accumulator, so fewer, larger chunks are faster (docs/benchmarks.md)."""

_REDUCTIONS = ("mean", "sum", "none")


def default_chunk_bytes(hidden: Tensor, low_memory: bool) -> int:
    """low_memory: as large as `hidden`, so pass B's blocks have H columns, wide enough for the GEMMs
    to be compute-bound; else DEFAULT_CHUNK_BYTES."""
    return hidden.numel() * hidden.element_size() if low_memory else DEFAULT_CHUNK_BYTES


def fitting(chunk_bytes: int, length: int, dtype: torch.dtype) -> int:
    """Rows (or columns) of `length` elements that fit the byte budget, at least one.

    Rounded down to a multiple of 128 when possible so every chunk's GEMM tiles evenly.
    """
    count = max(1, chunk_bytes // (length * dtype.itemsize))
    return count - count % 128 if count >= 128 else count


def _weight_grad_alpha(n: int, dtype: torch.dtype) -> float:
    """Factor folded into grad_W before it is rounded to the input dtype: a power of two >= 1/n for
    fp16, whose range cannot hold an unscaled sum over n rows; 1 otherwise. Exact, undone in backward."""
    return 2.0 ** -math.ceil(math.log2(n)) if dtype == torch.float16 and n > 1 else 1.0


@functools.cache
def _addmm_has_fp32_out(device_type: str, dtype: torch.dtype) -> bool:
    """Whether addmm can add low-precision products straight into an fp32 tensor.

    `addmm(out_dtype=float32)` is a CUDA-only overload (torch >= 2.8), and some
    versions still insist that `self` has the inputs' dtype; probe once.
    """
    acc = torch.zeros(2, 2, device=device_type)
    a = torch.ones(2, 2, device=device_type, dtype=dtype)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return True


def _accumulate_fp32(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b if `first`: no zero-fill, no read) with acc fp32, without an fp32
    temporary of acc's size."""
    beta = 0.0 if first else 1.0
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif _addmm_has_fp32_out(acc.device.type, a.dtype):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # CPU / older torch: fp32 copies of the chunk operands (workspace-sized,
        # not V x H) and an fp32 GEMM; slower, equally exact.
        acc.addmm_(a.float(), b.float(), beta=beta)


def _matmul_into(out: Tensor, a: Tensor, b: Tensor, alpha: float) -> None:
    """out = alpha * a @ b, rounded once into out's dtype (a block-sized temporary if it differs)."""
    if out.dtype != a.dtype:
        out.copy_(torch.mm(a, b) if alpha == 1.0 else torch.addmm(a.new_empty(()), a, b, beta=0, alpha=alpha))
    elif alpha == 1.0:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)


def _loss_and_grads(hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, softcap, chunk_bytes,
                    grads, low_memory):
    """Per-row losses (fp32) and, if `grads`, grad_hidden and alpha * grad_weight times `grad_scale`."""
    n, (vocab, _) = hidden.shape[0], weight.shape
    dtype = hidden.dtype
    w = weight.to(dtype)
    losses = torch.empty(n, device=hidden.device, dtype=torch.float32)
    lse = torch.empty_like(losses)
    softmax_args = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    grad_hidden = grad_weight = accumulator = None
    if grads:
        grad_hidden = torch.empty_like(hidden)
        alpha = _weight_grad_alpha(n, dtype)
        if not low_memory:
            accumulator = torch.empty(weight.shape, device=weight.device, dtype=torch.float32)
    cols = min(vocab, fitting(chunk_bytes, n, dtype))  # low_memory's pass B: vocab columns per block
    if grads and low_memory:
        # Until pass B neither grad_W nor pass B's workspace exists: the row chunks use their memory
        # (a single allocation, so the peak is pass B's), about H (V + N) / V rows at a time.
        scratch = hidden.new_empty((weight.numel() * weight.element_size()) // dtype.itemsize + n * cols)
    else:
        scratch = hidden.new_empty(min(n, fitting(chunk_bytes, vocab, dtype)) * vocab)
    rows = min(n, scratch.numel() // vocab)
    if low_memory:  # as many chunks, of even size: no small last chunk
        rows = math.ceil(n / math.ceil(n / rows))
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, n, rows):
            chunk = slice(start, min(start + rows, n))
            logits = scratch[: (chunk.stop - start) * vocab].view(-1, vocab)
            torch.mm(hidden[chunk], w.T, out=logits)
            cross_entropy_rows(logits, targets[chunk], losses[chunk], lse[chunk],
                               grad_scale[chunk] if grad_scale.dim() else grad_scale, write_grad=grads,
                               **softmax_args)
            if grads:
                torch.mm(logits, w, out=grad_hidden[chunk])
            if accumulator is not None:
                _accumulate_fp32(accumulator, logits.T, hidden[chunk], first=start == 0)
        del scratch, logits  # (the last chunk's view too) the allocator hands this memory to pass B
        if accumulator is not None:
            # Rounded once into weight's dtype (made now, not beside the workspace); row slices keep
            # the fp32 temporary of a mixed-dtype `out=` mul chunk-sized (copy_ casts without one).
            grad_weight = torch.empty_like(weight)
            if alpha == 1.0:
                grad_weight.copy_(accumulator)
            else:
                for start in range(0, vocab, rows):
                    torch.mul(accumulator[start:start + rows], alpha, out=grad_weight[start:start + rows])
        elif grads:
            grad_weight = torch.empty_like(weight)
            workspace = hidden.new_empty(n * cols)
            for col0 in range(0, vocab, cols):
                block_cols = slice(col0, min(col0 + cols, vocab))
                block = workspace[: n * (block_cols.stop - col0)].view(n, -1)
                torch.mm(hidden, w[block_cols].T, out=block)
                logit_grad_block(block, col0, vocab, targets, lse, grad_scale, **softmax_args)
                _matmul_into(grad_weight[block_cols], block.T, hidden, alpha)
    return losses, grad_hidden, grad_weight


def _reduction_scale(targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """1/n_valid for mean (1 if no row is valid, so the loss is 0, never NaN), else 1."""
    if reduction == "mean":
        return 1.0 / (targets != ignore_index).sum().clamp_min(1).float()
    return torch.ones((), device=targets.device)


def _headroom(dtype: torch.dtype, reduction: str) -> float:
    """Power of two the gradients carry from forward until backward divides it out (exactly).

    The mean's 1/n_valid goes into the logit gradient in forward, so grad_hidden
    is rounded as often as naive autograd rounds it. fp16's range cannot hold
    softmax/n_valid (1e-9 at GPT-2 scale), so there the mean's gradients are
    kept 2^14 times larger, as a loss scale would (and still below fp16's max:
    |d loss/d logits| <= 2/n_valid per row).
    """
    return 2.0**14 if dtype == torch.float16 and reduction == "mean" else 1.0


@torch.library.custom_op("minitrain::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    chunk_bytes: int,
    low_memory: bool,
    grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (loss, grad_hidden, grad_weight); grads lack grad_output and are empty unless computed."""
    grads = grads and reduction != "none"
    scale = _reduction_scale(targets, ignore_index, reduction)
    grad_scale = scale * _headroom(hidden.dtype, reduction)
    losses, grad_hidden, grad_weight = _loss_and_grads(
        hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, softcap, chunk_bytes, grads,
        low_memory
    )
    if reduction != "none":
        losses = losses.sum() * scale
    if not grads:
        grad_hidden, grad_weight = hidden.new_empty(0), weight.new_empty(0)
    return losses, grad_hidden, grad_weight


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_bytes, low_memory,
      grads):
    grads = grads and reduction != "none"
    loss = hidden.new_empty(hidden.shape[:1] if reduction == "none" else (), dtype=torch.float32)
    if not grads:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight)


@torch.library.custom_op("minitrain::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    grad_scale: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    chunk_bytes: int,
    low_memory: bool,
) -> tuple[Tensor, Tensor]:
    """reduction="none" backward: both passes again, each gradient row scaled by `grad_scale`."""
    _, grad_hidden, grad_weight = _loss_and_grads(
        hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, softcap, chunk_bytes, True,
        low_memory
    )
    return grad_hidden, grad_weight


@_linear_cross_entropy_backward.register_fake
def _(hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, softcap, chunk_bytes, low_memory):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_bytes, low_memory, _ = \
        inputs
    _, grad_hidden, grad_weight = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.set_materialize_grads(False)  # else autograd hands backward zeros as large as those two outputs
    # mean/sum keep only the finished gradients; "none" needs the inputs to rerun both passes.
    ctx.save_for_backward(*(hidden, weight) if reduction == "none" else (grad_hidden, grad_weight), targets)
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_bytes, low_memory)


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    first, second, targets = ctx.saved_tensors
    ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_bytes, low_memory = ctx.args
    if reduction == "none":
        # Rows are scaled by grad/max|grad| (so |scale| <= 1 and an fp16 workspace
        # cannot overflow under a loss scale); max|grad| is applied below.
        scale = grad_loss.abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny)
        grad_hidden, grad_weight = _linear_cross_entropy_backward(
            first, second, targets, grad_loss.float() / scale, ignore_index, label_smoothing, z_loss, softcap,
            chunk_bytes, low_memory,
        )
        dtype = first.dtype
    else:
        grad_hidden, grad_weight = first, second
        dtype = grad_hidden.dtype
        scale = grad_loss.float() / _headroom(dtype, reduction)
        if torch.compiler.is_compiling():
            # Traced: the compiler plans the buffers, and an in-place op on saved tensors would be copied.
            grad_hidden, grad_weight = grad_hidden.clone(), grad_weight.clone()
        # Eager scales the saved gradients in place: a second backward (retain_graph) then fails
        # autograd's version check instead of scaling twice.
    weight_scale = scale / _weight_grad_alpha(grad_hidden.shape[0], dtype)
    return (grad_hidden.mul_(scale), grad_weight.mul_(weight_scale), *[None] * 9)


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_bytes: int | None = None,
    low_memory: bool = False,
    softcap: float | None = None,
) -> Tensor:
    """cross_entropy(logits, targets) + z_loss * logsumexp^2 with logits = hidden @ weight.T, soft-capped to
    softcap * tanh(logits / softcap) when `softcap` is given, logits never materialised.

    hidden (N, H), weight (V, H), targets (N,) int64. Matmuls run in hidden's
    dtype (the autocast dtype under autocast); softmax math is fp32; the weight
    gradient is accumulated in fp32 and returned in weight's dtype. `chunk_bytes`
    bounds the logit workspace; `low_memory` trades a fourth GEMM for the fp32
    V x H accumulator (see the module docstring).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    check_runnable(hidden, "fused_linear_cross_entropy", "loss.impl=torch")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _, _ = _linear_cross_entropy(
        hidden.contiguous(),
        weight.contiguous(),
        targets.contiguous(),
        ignore_index,
        reduction,
        float(label_smoothing),
        float(z_loss),
        None if softcap is None else float(softcap),
        chunk_bytes or default_chunk_bytes(hidden, low_memory),
        low_memory,
        grads,
    )
    return loss
