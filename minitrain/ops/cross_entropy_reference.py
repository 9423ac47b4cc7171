"""Plain-PyTorch linear cross-entropy on full logits: the `loss.impl=torch` path and the tests' truth."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def soft_cap(logits: Tensor, cap: float) -> Tensor:
    """cap * tanh(logits / cap) (Gemma 2's logit soft-capping): about the identity for |logits| << cap, never beyond
    +-cap, smooth everywhere."""
    return cap * torch.tanh(logits / cap)


def linear_cross_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
) -> Tensor:
    """Per valid row: cross_entropy (with label smoothing) + z_loss * logsumexp(logits)^2, of the logits soft-capped
    (`soft_cap`) when `softcap` is given.

    Ignored rows contribute 0; "mean" divides by the number of valid rows (a
    batch with none gives 0, not NaN). Logits are upcast to at least fp32 (before the cap).
    """
    logits = hidden @ weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        logits = soft_cap(logits, softcap)
    losses = F.cross_entropy(
        logits, targets, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = targets != ignore_index
    if z_loss:
        losses = losses + z_loss * torch.logsumexp(logits, dim=-1).square() * valid
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().clamp_min(1)
