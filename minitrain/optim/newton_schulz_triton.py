"""The two symmetric products of a Newton–Schulz step as batched Triton kernels that compute half of each:

  gram                   A = X Xᵀ of each wide matrix (rows <= columns), A = Xᵀ X of each tall one;
  symmetric_polynomial   B = b·A + c·A·A of each symmetric A.

Both results are symmetric, so one kernel computes only the output tiles on and above the diagonal and writes
each to both halves (its transpose below): X Xᵀ and A·A at about half their FLOPs, of a step whose third GEMM,
a·X + B·X, stays torch's (newton_schulz.orthogonalize, kernel="triton"). A·A is A Aᵀ for a symmetric A, so both
products are the one kernel `_syrk_kernel`: alpha·Y Yᵀ (+ beta·Z), fp32 accumulation, the output rounded once to
its dtype. A tall X is read through transposed strides: no copy of it is made. Within a diagonal tile the entries
below the diagonal are the transposes of those above it too, so every result is exactly symmetric, whatever order
the tensor cores sum in.

The tile shapes are autotuned on the GPU (a few configs that suit an H100 at GPT-2's sizes), except under
trainer.deterministic, where a config picked by timing could differ from run to run: there the first one runs. Under
Triton's CPU interpreter one fixed config runs, small enough that the tests' shapes cross tiles in every dimension.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.triton_runtime import dots_in_fp32, interpreted, round_to_bf16_in_fp32, rounds_bf16

# Square output tiles (a tile and its mirror), K steps of 32 or 64 bf16. A 128 x 128 fp32 tile takes 8 warps: with 4,
# sm90's compiles of the tall Gram and of the polynomial spill registers. 64 x 64 tiles: more programs at m = 768.
CONFIGS = [
    triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK": 128, "BLOCK_K": 32}, num_warps=8, num_stages=5),
    triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
]
INTERPRETER_CONFIG = triton.Config({"BLOCK": 64, "BLOCK_K": 32}, num_warps=4, num_stages=1)


@triton.jit
def _syrk_kernel(y_ptr, z_ptr, out_ptr, m, k, count, y_batch, y_row, y_col, z_batch, z_row, out_batch, out_row,
                 alpha, beta, ADD: tl.constexpr, DOT_IN_FP32: tl.constexpr, ROUND_BF16: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[b] = alpha·Y[b] Y[b]ᵀ (+ beta·Z[b] with ADD), Y[b] m x k with its (i, j) at y_batch·b + y_row·i +
    y_col·j, Z[b] and out[b] m x m with unit column strides (`count`, the matrices, only keys the autotuning).
    Program (ti, tj, b) computes output tile (ti, tj) of matrix b when ti <= tj and stores it there (the part on and
    above the diagonal) and its transpose at (tj, ti) (the part below)."""
    ti, tj, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if ti <= tj:
        rows = ti * BLOCK + tl.arange(0, BLOCK)
        cols = tj * BLOCK + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        y = y_ptr + b.to(tl.int64) * y_batch
        row_ok, col_ok = rows < m, cols < m
        acc = tl.zeros([BLOCK, BLOCK], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < k
            left = tl.load(y + rows[:, None] * y_row + kk[None, :] * y_col, mask=row_ok[:, None] & k_ok[None, :],
                           other=0.0)
            right = tl.load(y + cols[:, None] * y_row + kk[None, :] * y_col, mask=col_ok[:, None] & k_ok[None, :],
                            other=0.0)
            if DOT_IN_FP32:  # triton_runtime.dots_in_fp32
                left, right = left.to(tl.float32), right.to(tl.float32)
            acc = tl.dot(left, tl.trans(right), acc)
        acc *= alpha
        if ADD:
            tile = rows[:, None] * z_row + cols[None, :]
            acc += beta * tl.load(z_ptr + b.to(tl.int64) * z_batch + tile, mask=row_ok[:, None] & col_ok[None, :],
                                  other=0.0).to(tl.float32)
        if ROUND_BF16:
            acc = round_to_bf16_in_fp32(acc)
        acc = acc.to(out_ptr.dtype.element_ty)
        out = out_ptr + b.to(tl.int64) * out_batch
        upper = row_ok[:, None] & col_ok[None, :] & (rows[:, None] <= cols[None, :])
        tl.store(out + rows[:, None] * out_row + cols[None, :], acc, mask=upper)
        lower = col_ok[:, None] & row_ok[None, :] & (cols[:, None] > rows[None, :])
        tl.store(out + cols[:, None] * out_row + rows[None, :], tl.trans(acc), mask=lower)


# Tuned per shape, batch size, orientation (a tall X's Gram reads it along its columns) and product.
_syrk_autotuned = triton.autotune(configs=CONFIGS, key=["m", "k", "count", "y_row", "y_col", "ADD"])(_syrk_kernel)


def fixed_config() -> triton.Config | None:
    """The config the kernels launch with where it is chosen by rule, or None where they are autotuned: the
    interpreter's; under trainer.deterministic (torch's deterministic algorithms: minitrain/determinism.py) the first
    of CONFIGS."""
    if interpreted():
        return INTERPRETER_CONFIG
    return CONFIGS[0] if torch.are_deterministic_algorithms_enabled() else None


def _syrk(y: Tensor, row_dim: int, out: Tensor, alpha: float, z: Tensor | None = None, beta: float = 0.0) -> Tensor:
    """out = alpha·Y Yᵀ (+ beta·z) per matrix, Y the matrices of `y` (count, ·, ·) with rows along `row_dim` (1, or
    2 for their transposes)."""
    count, m, k = y.size(0), y.size(row_dim), y.size(3 - row_dim)
    if out.shape != (count, m, m) or out.dtype != y.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be ({count}, {m}, {m}) {y.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if z is not None and z.stride(2) != 1:
        raise ValueError(f"the added matrices need a unit column stride, got strides {z.stride()}")
    zz = out if z is None else z  # not read without ADD
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK"]), triton.cdiv(m, meta["BLOCK"]), count)  # noqa: E731
    config = fixed_config()
    kernel, meta = (_syrk_autotuned, {}) if config is None else (_syrk_kernel, config.all_kwargs())
    kernel[grid](y, zz, out, m, k, count, y.stride(0), y.stride(row_dim), y.stride(3 - row_dim), zz.stride(0),
                 zz.stride(1), out.stride(0), out.stride(1), alpha, beta, ADD=z is not None,
                 DOT_IN_FP32=dots_in_fp32(y.dtype), ROUND_BF16=rounds_bf16(out.dtype), **meta)
    return out


def gram(x: Tensor, out: Tensor) -> Tensor:
    """The Gram matrix of each matrix of `x` (count, rows, cols) along its short side into `out` (count, m, m), m =
    min(rows, cols): X Xᵀ of a wide matrix, Xᵀ X of a tall one (read transposed, not copied)."""
    return _syrk(x, 1 if x.size(1) <= x.size(2) else 2, out, 1.0)


def symmetric_polynomial(a: Tensor, b: float, c: float, out: Tensor) -> Tensor:
    """b·A + c·A·A of each symmetric matrix A of `a` (count, m, m) into `out` (as A·A = A Aᵀ: the rows of A are
    both operands' tiles)."""
    return _syrk(a, 1, out, c, z=a, beta=b)
