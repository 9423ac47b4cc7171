"""Muon's orthogonalization: the quintic Newton–Schulz iteration on a batch of matrices of one shape, in bf16 on
tensor cores, and how a job of several processes splits that work.

The iteration is torch.optim.Muon's (`_zeropower_via_newtonschulz`, Keller Jordan's): X = G / max(||G||_F, eps),
then `steps` times A = X Xᵀ, B = b·A + c·A·A, X = a·X + B·X, in bf16, on the wide orientation (rows <= columns).
torch transposes a tall matrix, iterates and transposes back; here a tall batch iterates on the right instead,
A = Xᵀ X, X = a·X + X·B, which is the same arithmetic (A and B are symmetric) with no transposed copies: on the
CPU the bits are torch's. Each step is two batched GEMMs in bf16 plus one on the small Gram matrix (baddbmm
folds the scalars into the GEMMs, as modded-nanogpt writes it): `kernel="cublas"`. A = X Xᵀ and B = b·A + c·A·A
are symmetric: `kernel="triton"` computes each of them as a Triton kernel that computes the tiles on and above the
diagonal only and mirrors them (newton_schulz_triton.py), about half their FLOPs; a·X + B·X stays torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import newton_schulz_triton

# torch.optim.Muon's defaults, from Keller Jordan's Muon (github.com/KellerJordan/Muon, muon.py): the quintic's
# coefficients, chosen for the largest slope at zero; five steps; the Frobenius norm's floor.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR = ("original", "match_rms_adamw")
NS_KERNELS = ("cublas", "triton")  # who computes X Xᵀ and b·A + c·A·A: torch's GEMMs, or the symmetric kernels


def orthogonalize(x: Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS,
                  kernel: str = "cublas") -> Tensor:
    """NS^{(a,b,c)}_steps of each matrix of `x`, (count, rows, cols) bf16, which it works in: the result is `x`
    itself or a buffer of its shape (the two alternate as each step's input and output, beside two Gram
    matrices, so that a step allocates nothing: workspace_bytes). `kernel`: one of NS_KERNELS, who computes the
    two symmetric products."""
    if kernel not in NS_KERNELS:
        raise ValueError(f"kernel must be one of {NS_KERNELS}, got {kernel!r}")
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    m = min(x.shape[-2:])
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_(min=eps))
    y = torch.empty_like(x)
    gram, poly = (torch.empty(x.size(0), m, m, dtype=x.dtype, device=x.device) for _ in range(2))
    for _ in range(steps):
        if kernel == "triton":
            newton_schulz_triton.gram(x, out=gram)
            newton_schulz_triton.symmetric_polynomial(gram, b, c, out=poly)
        else:
            torch.bmm(x.mT, x, out=gram) if tall else torch.bmm(x, x.mT, out=gram)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, x, poly, beta=a, out=y) if tall else torch.baddbmm(x, poly, x, beta=a, out=y)
        x, y = y, x
    return x


def lr_ratio(shape, adjust_lr: str) -> float:
    """What Muon multiplies the lr by for a matrix of `shape` (its whole shape, rows x cols), as torch.optim.Muon's
    `_adjust_lr`: `original` (Keller Jordan's) sqrt(max(1, rows/cols)), so that the update's RMS does not shrink on
    tall matrices; `match_rms_adamw` (Moonshot's) 0.2·sqrt(max(rows, cols)), the RMS of an AdamW update."""
    rows, cols = shape[:2]
    if adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


def flops(shape, steps: int = NS_STEPS, symmetric: bool = False) -> int:
    """The GEMM FLOPs of orthogonalizing one matrix of `shape`, m = min and n = max of its sides: per step
    2·m·m·n (X Xᵀ) + 2·m·m·m (A·A) + 2·m·m·n (B·X). The norm and the GEMMs' scalar epilogues (O(m·n)) are left
    out: they are the memory passes' share. `symmetric`: X Xᵀ and A·A counted on their m·(m + 1)/2 entries on and
    above the diagonal only, the least kernel="triton" computes."""
    m, n = sorted(shape[:2])
    if symmetric:
        return steps * (m * (m + 1) * (n + m) + 2 * m * m * n)
    return steps * (4 * m * m * n + 2 * m * m * m)


def workspace_bytes(shape, count: int) -> int:
    """The bf16 bytes `orthogonalize` holds beyond its input, for `count` matrices of `shape`: the second X and the
    two m x m matrices (the norms' 2 bytes a matrix are freed before they are made)."""
    m, n = sorted(shape[:2])
    return 2 * count * (m * n + 2 * m * m)


@dataclass(frozen=True)
class Batch:
    """Matrices of one bucket that are orthogonalized together: `count` consecutive tensors from `first`, of one
    whole `shape` (`local_shape` here: under fsdp a block of rows) and one param group, their lr multiplied by
    `ratio`; `rows`: their rows of the bucket's work table (BLOCK-chunks, adamw_triton)."""

    first: int
    count: int
    shape: tuple
    local_shape: tuple
    group: int
    ratio: float
    rows: slice


def batches(bucket, per_matrix: bool, adjust_lr: str, block: int) -> list[Batch]:
    """The bucket's matrices (ordered by shape and group: muon.py) in runs of one shape and group, or one matrix
    each (`per_matrix`: the loop implementation, as torch.optim.Muon)."""
    out, row = [], 0
    for i, (owner, p, group) in enumerate(zip(bucket.owners, bucket.params, bucket.groups)):
        rows = -(-p.numel() // block)
        key = (tuple(owner.shape), group)
        last = out[-1] if out else None
        if last is not None and not per_matrix and (last.shape, last.group) == key:
            out[-1] = Batch(last.first, last.count + 1, last.shape, last.local_shape, group, last.ratio,
                            slice(last.rows.start, row + rows))
        else:
            out.append(Batch(i, 1, key[0], tuple(p.shape), group, lr_ratio(key[0], adjust_lr), slice(row, row + rows)))
        row += rows
    return out


class Exchange:
    """Where each matrix of a batch is orthogonalized when several processes train: each rank owns a contiguous
    share of ceil(count / world) of the batch's matrices (the last shares padded with zero matrices, which
    orthogonalize to zero) and orthogonalizes those only.

      local       one process: every matrix here;
      replicated  ddp: every rank holds every matrix (and the same gradients); the owners' results are
                  all-gathered (bf16);
      sharded     fsdp: each rank holds a block of rows of each matrix (FSDP2's dim-0 chunks of ceil(rows / world)
                  rows, the last ranks' shorter or empty); an all-to-all sends each owner the row blocks of its
                  matrices, and after Newton–Schulz a second one sends each rank its rows of every result.

    `inputs` makes the buffer a batch's momentum pass writes its bf16 inputs into, zero-padded to what the exchange
    sends; `__call__` returns this rank's rows of each orthogonalized matrix, (count, local rows, cols), contiguous
    within each matrix."""

    def __init__(self, mode: str = "local", rank: int = 0, world: int = 1, coefficients=NS_COEFFICIENTS,
                 steps: int = NS_STEPS, eps: float = NS_EPS, kernel: str = "cublas"):
        if mode not in ("local", "replicated", "sharded"):
            raise ValueError(f"mode must be local, replicated or sharded, got {mode!r}")
        self.mode, self.rank, self.world = mode, rank, world
        self.coefficients, self.steps, self.eps, self.kernel = tuple(coefficients), steps, eps, kernel

    def _share(self, count: int) -> int:
        """The matrices of a batch each rank owns."""
        return -(-count // self.world)

    def inputs(self, count: int, local_shape, shape, device) -> Tensor:
        """The zero-padded bf16 buffer for `count` matrices whose local part is `local_shape` (of `shape` whole);
        matrix i's local rows are its [i, :local rows]."""
        rows, cols = shape[:2]
        if self.mode == "local":
            return torch.empty(count, rows, cols, dtype=torch.bfloat16, device=device)
        block = -(-rows // self.world) if self.mode == "sharded" else rows
        x = torch.empty(self._share(count) * self.world, block, cols, dtype=torch.bfloat16, device=device)
        x[count:].zero_()
        x[:count, local_shape[0]:].zero_()
        return x

    def __call__(self, x: Tensor, count: int, local_rows: int, shape) -> Tensor:
        if self.mode == "local":
            return self._orthogonalize(x)
        k = self._share(count)
        if self.mode == "replicated":
            out = torch.empty_like(x)
            dist.all_gather_single(out, self._orthogonalize(x[self.rank * k:(self.rank + 1) * k]))
            return out[:count]
        block, cols = x.shape[1:]
        owned = torch.empty_like(x)  # from each rank its row block of each matrix this rank owns
        dist.all_to_all_single(owned, x)
        whole = owned.view(self.world, k, block, cols).transpose(0, 1).reshape(k, self.world * block, cols)
        del owned  # the reshape of the transposed view is a copy
        o = self._orthogonalize(whole[:, :shape[0]].contiguous())
        del whole
        blocks = torch.zeros_like(x).view(self.world, k, block, cols)  # to each rank its rows of every result
        for r in range(self.world):
            mine = o[:, r * block:(r + 1) * block]
            blocks[r, :, :mine.size(1)] = mine
        del o
        back = torch.empty_like(x)  # from each owner this rank's rows of each of its results, in matrix order
        dist.all_to_all_single(back, blocks.view_as(x))
        return back[:count, :local_rows]

    def _orthogonalize(self, x: Tensor) -> Tensor:
        return orthogonalize(x, self.coefficients, self.steps, self.eps, self.kernel)
