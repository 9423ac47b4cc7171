"""The loop's own state, a checkpoint part like the model: where the run is, and what it has seen since its last
log step, so that a resumed run logs what an unbroken one logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import distributed
from .distributed import Dist


@dataclass
class Progress:
    """The step, the wandb run id, the losses summed since the last log step, the run of skipped steps, and the
    last step's loss (the one a checkpoint's weights were trained to: a diverged run's message names it). All
    device tensors but the counts the host keeps anyway: `record` never syncs."""

    device: torch.device
    dist: Dist = field(default_factory=Dist)
    step: int = 0
    wandb_id: Optional[str] = None
    loss_sum: torch.Tensor = None
    steps_since_log: int = 0
    nonfinite_loss: torch.Tensor = None
    skipped_seen: torch.Tensor = None  # the optimizer's skipped-step count after the last step
    skip_run: torch.Tensor = None  # optimizer steps skipped in a row, ending at the last step
    longest_skip_run: torch.Tensor = None
    last_loss: torch.Tensor = None

    def __post_init__(self):
        zeros = lambda dtype=torch.float32: torch.zeros((), dtype=dtype, device=self.device)  # noqa: E731
        self.loss_sum, self.last_loss, self.nonfinite_loss = zeros(), zeros(), zeros(torch.bool)
        self.skipped_seen, self.skip_run, self.longest_skip_run = (zeros(torch.int32) for _ in range(3))

    def record(self, loss: torch.Tensor, skipped_total: torch.Tensor) -> None:
        """After a step, on the device: no host sync."""
        self.step += 1
        self.steps_since_log += 1
        self.loss_sum += loss
        self.last_loss.copy_(loss)
        self.nonfinite_loss |= ~torch.isfinite(loss)
        skipped_now = skipped_total - self.skipped_seen  # 0 or 1
        self.skip_run.add_(1).mul_(skipped_now)
        torch.maximum(self.longest_skip_run, self.skip_run, out=self.longest_skip_run)
        self.skipped_seen.copy_(skipped_total)

    def take_mean_loss(self) -> torch.Tensor:
        mean = self.loss_sum / max(self.steps_since_log, 1)
        self.loss_sum.zero_()
        self.steps_since_log = 0
        return mean

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "wandb_id": self.wandb_id, "loss_sum": self.loss_sum,
                "steps_since_log": self.steps_since_log, "nonfinite_loss": self.nonfinite_loss,
                "skipped_seen": self.skipped_seen, "skip_run": self.skip_run,
                "longest_skip_run": self.longest_skip_run, "last_loss": self.last_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.wandb_id, self.steps_since_log = state["step"], state["wandb_id"], state["steps_since_log"]
        for key in ("loss_sum", "nonfinite_loss", "skipped_seen", "skip_run", "longest_skip_run"):
            getattr(self, key).copy_(state[key])
        # A checkpoint saved before the last loss was recorded: unknown (NaN), said so if the run diverges.
        self.last_loss.copy_(state.get("last_loss", torch.tensor(float("nan"))))

    @staticmethod
    def combine_ranks(states: list[dict[str, Any]]) -> dict[str, Any]:
        """The progress a rank of a job of another size resumes with: the saved ranks' mean loss sums (the log step
        averages over ranks, and a mean of means is the mean), a non-finite loss if any rank saw one; the step and
        the skip counts are every rank's alike."""
        mean = lambda key: torch.stack([s[key] for s in states]).mean()  # noqa: E731
        return {**states[0], "loss_sum": mean("loss_sum"), "last_loss": mean("last_loss"),
                "nonfinite_loss": torch.stack([s["nonfinite_loss"] for s in states]).any()}

    def last_global_loss(self) -> float:
        """The last step's training loss over all ranks: the loss a checkpoint taken now was trained to."""
        return distributed.mean(self.last_loss, self.dist).item()
