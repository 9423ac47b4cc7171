"""When a run has diverged, and what it says: checked at log steps and before every save (host reads happen
there only), so that no checkpoint holds a diverged state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import distributed
from .config import TrainerConfig
from .distributed import Dist
from .plan import Plan
from .progress import Progress


class NonFiniteLossError(RuntimeError):
    """The run diverged (inf/NaN loss, or gradients skipped step after step). Nothing from after the divergence was
    saved; the message names the checkpoint kept, with its step and that step's training loss, or says there is
    none (a finite loss can be an exploded one too: the user judges it from the number)."""


@dataclass(frozen=True)
class Kept:
    """The last checkpoint this run loaded or saved: the one a diverged run leaves to resume from."""

    path: Path
    step: int
    loss: float  # the training loss of its step, over all ranks


def check(progress: Progress, plan: Plan, dist: Dist, kept: Optional[Kept], t: TrainerConfig) -> None:
    """Stop a run whose loss went inf/NaN without loss scaling to absorb it, or whose optimizer skipped
    max_skipped_steps steps in a row: raises NonFiniteLossError."""
    nonfinite = bool(distributed.mean(progress.nonfinite_loss.float(), dist).item()) \
        and not plan.precision.loss_scaling
    longest = int(progress.longest_skip_run.item())
    if nonfinite or longest >= plan.max_skipped_steps:
        what = "the training loss became inf/NaN" if nonfinite else \
            f"{longest} optimizer steps in a row were skipped (inf/NaN gradients)"
        raise NonFiniteLossError(
            f"{what} by step {progress.step} (precision={plan.precision.name}); stopping, {_kept(kept, t)}"
            " — try a lower trainer.lr"
            + (", or precision=fp16 only if fp16 overflow is the cause" if not plan.precision.loss_scaling else ""))


def _kept(kept: Optional[Kept], t: TrainerConfig) -> str:
    """Which checkpoint a diverged run leaves, with the loss it was trained to: a finite loss can still be an
    exploded one, which the user judges from the number."""
    if kept is None and t.save_every == 0:
        return "with no checkpoint saved (trainer.save_every=0)"
    if kept is None:
        first = f"{t.save_every}" if t.save_every < t.max_steps else f"{t.max_steps}, the last"
        return f"with no checkpoint saved (the first was due at step {first})"
    return (f"keeping the checkpoint of step {kept.step} ({kept.path}), whose training loss at that step was "
            f"{kept.loss:.4g}")
