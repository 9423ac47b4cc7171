"""Fused linear cross-entropy: the LM head's logits never exist in full.

The logits of one batch (tokens x vocab) are the largest activation of a GPT
and are used once. Here they live only in one reused chunk-sized workspace:

    for each chunk of rows:
        workspace = h_chunk @ W.T                  cuBLAS, input dtype
        loss rows, workspace <- dloss/dlogits      Triton, fp32 math, in place
        grad_h[chunk] = workspace @ W              cuBLAS
        grad_W       += workspace.T @ h_chunk      cuBLAS, fp32 accumulator

The logit gradient is computed in the forward pass (no recompute), so
backward is two scalings by grad_output. Everything stays on the device: the
mean's 1/n_valid is a tensor, no host sync. reduction="none" is the
exception: a per-row grad_output cannot be folded into grad_W after the sum
over rows, so its backward reruns the loop with the rows pre-scaled.

Ignored rows cost their share of the matmuls (dropping them without knowing
their count on the host would need a sync) but skip the softmax passes and
contribute exact zeros.
"""

import functools
import os

import torch
from torch import Tensor

from minitrain.ops.cross_entropy_triton import cross_entropy_rows

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""Logit workspace budget (2560 rows at V=50304 bf16). Not yet tuned on the GPU:
sweep with `scripts/bench_cross_entropy.py --chunk-mib`."""

_REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(chunk_bytes: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk so that a (rows, vocab) workspace fits the byte budget.

    Rounded down to a multiple of 128 when possible so every chunk's GEMM
    tiles evenly.
    """
    rows = max(1, chunk_bytes // (vocab * dtype.itemsize))
    return rows - rows % 128 if rows >= 128 else rows


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


def _accumulate_fp32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with acc fp32, without an fp32 temporary of acc's size."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_has_fp32_out(acc.device.type, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        # CPU / older torch: fp32 copies of the chunk operands (workspace-sized,
        # not V x H) and an fp32 GEMM; slower, equally exact.
        acc.addmm_(a.float(), b.float())


def _chunked_loss_and_grads(hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, rows, grads):
    """Per-row losses (fp32) and, if `grads`, grad_hidden and fp32 grad_weight times `grad_scale`."""
    n = hidden.shape[0]
    w = weight.to(hidden.dtype)
    losses = torch.empty(n, device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if grads else None
    workspace = hidden.new_empty(min(rows, n), weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, n, rows):
            chunk = slice(start, min(start + rows, n))
            h = hidden[chunk]
            logits = workspace[: h.shape[0]]
            torch.mm(h, w.T, out=logits)
            cross_entropy_rows(
                logits,
                targets[chunk],
                losses[chunk],
                grad_scale[chunk] if grad_scale.dim() else grad_scale,
                ignore_index=ignore_index,
                label_smoothing=label_smoothing,
                z_loss=z_loss,
                write_grad=grads,
            )
            if grads:
                torch.mm(logits, w, out=grad_hidden[chunk])
                _accumulate_fp32(grad_weight, logits.T, h)
    return losses, grad_hidden, grad_weight


def _reduction_scale(targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """1/n_valid for mean (1 if no row is valid, so the loss is 0, never NaN), else 1."""
    if reduction == "mean":
        return 1.0 / (targets != ignore_index).sum().clamp_min(1).float()
    return torch.ones((), device=targets.device)


def _scale_in_forward(dtype: torch.dtype) -> bool:
    """Whether the mean's 1/n_valid goes into the logit gradient in forward.

    It saves grad_hidden a second rounding (bf16 is then exactly as close to the
    truth as naive autograd), but fp16's range cannot hold softmax/n_valid
    (1e-9 at GPT-2 scale): there it waits for backward and the loss scale.
    """
    return dtype != torch.float16


@torch.library.custom_op("minitrain::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    rows: int,
    grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (loss, grad_hidden, grad_weight_fp32); grads lack grad_output and are empty unless computed."""
    grads = grads and reduction != "none"
    scale = _reduction_scale(targets, ignore_index, reduction)
    grad_scale = scale if _scale_in_forward(hidden.dtype) else torch.ones_like(scale)
    losses, grad_hidden, grad_weight = _chunked_loss_and_grads(
        hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, rows, grads
    )
    if reduction != "none":
        losses = losses.sum() * scale
    if not grads:
        grad_hidden, grad_weight = hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return losses, grad_hidden, grad_weight


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, ignore_index, reduction, label_smoothing, z_loss, rows, grads):
    grads = grads and reduction != "none"
    loss = hidden.new_empty(hidden.shape[:1] if reduction == "none" else (), dtype=torch.float32)
    if not grads:
        return loss, hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return loss, torch.empty_like(hidden), weight.new_empty(weight.shape, dtype=torch.float32)


@torch.library.custom_op("minitrain::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    grad_scale: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    rows: int,
) -> tuple[Tensor, Tensor]:
    """reduction="none" backward: the forward loop again, each gradient row scaled by `grad_scale`."""
    _, grad_hidden, grad_weight = _chunked_loss_and_grads(
        hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, rows, True
    )
    return grad_hidden, grad_weight


@_linear_cross_entropy_backward.register_fake
def _(hidden, weight, targets, grad_scale, ignore_index, label_smoothing, z_loss, rows):
    return torch.empty_like(hidden), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, reduction, label_smoothing, z_loss, rows, _ = inputs
    _, grad_hidden, grad_weight = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.set_materialize_grads(False)  # else autograd hands backward zeros as large as those two outputs
    # mean/sum keep only the finished gradients; "none" needs the inputs to rerun the loop.
    ctx.save_for_backward(*(hidden, weight) if reduction == "none" else (grad_hidden, grad_weight), targets)
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss, rows)
    ctx.weight_dtype = weight.dtype


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    first, second, targets = ctx.saved_tensors
    ignore_index, reduction, label_smoothing, z_loss, rows = ctx.args
    if reduction == "none":
        # Rows are scaled by grad/max|grad| (so |scale| <= 1 and an fp16 workspace
        # cannot overflow under a loss scale); max|grad| is applied below.
        scale = grad_loss.abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny)
        grad_hidden, grad_weight = _linear_cross_entropy_backward(
            first, second, targets, grad_loss.float() / scale, ignore_index, label_smoothing, z_loss, rows
        )
    else:
        grad_hidden, grad_weight = first, second
        scale = grad_loss.float()
        if not _scale_in_forward(grad_hidden.dtype):
            scale = scale * _reduction_scale(targets, ignore_index, reduction)
    return (grad_hidden * scale, _scaled_cast(grad_weight, scale, ctx.weight_dtype, rows),
            None, None, None, None, None, None, None)


def _scaled_cast(src: Tensor, scale: Tensor, dtype: torch.dtype, rows: int) -> Tensor:
    """src * scale in `dtype`, rounded once. A mixed-dtype `out=` makes TensorIterator compute into an
    fp32 temporary of the output's size before casting; row slices keep that temporary chunk-sized
    instead of a second V x H fp32 buffer beside the accumulator."""
    out = torch.empty_like(src, dtype=dtype)
    for start in range(0, src.shape[0], rows):
        torch.mul(src[start:start + rows], scale, out=out[start:start + rows])
    return out


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def _check_runnable(hidden: Tensor) -> None:
    if hidden.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "fused_linear_cross_entropy runs Triton kernels: on CPU set TRITON_INTERPRET=1 "
            "before importing minitrain.ops (tests), or use loss.impl=torch."
        )


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_bytes: int | None = None,
) -> Tensor:
    """cross_entropy(hidden @ weight.T, targets) + z_loss * logsumexp^2, logits never materialised.

    hidden (N, H), weight (V, H), targets (N,) int64. Matmuls run in hidden's
    dtype (the autocast dtype under autocast); softmax math is fp32; the weight
    gradient is accumulated in fp32 and returned in weight's dtype. `chunk_bytes`
    bounds the logit workspace (default DEFAULT_CHUNK_BYTES).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_runnable(hidden)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    rows = chunk_rows(chunk_bytes or DEFAULT_CHUNK_BYTES, weight.shape[0], hidden.dtype)
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _, _ = _linear_cross_entropy(
        hidden.contiguous(),
        weight.contiguous(),
        targets.contiguous(),
        ignore_index,
        reduction,
        float(label_smoothing),
        float(z_loss),
        rows,
        grads,
    )
    return loss
