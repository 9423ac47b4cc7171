"""The run's checkpointer: when it saves, what it kept, the guard that no checkpoint holds a diverged run, and the
resume that fills every part from trainer.resume's checkpoint. The format, its files and its checks are
checkpoint.py's; the divergence rule is divergence.py's.

It saves every trainer.save_every steps and at the run's last step (trainer.max_steps, or the evaluation that reached
trainer.target_loss), and on a stop request (the loop's). It keeps the last checkpoint it loaded or saved (`kept`):
the one a diverged run names to resume from. The guard reads the loss and skip counts on the host, so it runs where
the host reads anyway — at log steps, and before every save — at most once a step: a step that logs and saves reads
them once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from . import checkpoint, divergence
from .checkpoint import CheckpointError
from .config import TrainerConfig, schema_defaults
from .distributed import Dist
from .divergence import Kept
from .parts import Parts
from .plan import Plan


def identity(config: dict[str, Any], plan: Plan, dist: Dist) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint: the config, and what the plan resolved from it (the
    float8 linears come from torchao's shape filter, which a torchao upgrade may move)."""
    p = plan
    param_dtype = str(p.precision.stored_param_dtype(dist.sharded)).removeprefix("torch.")
    return {**config, "plan": {"precision": p.precision.name, "world_size": p.world_size,
                               "distributed": p.distributed.value, "vocab_size": p.model.vocab_size,
                               "param_dtype": param_dtype, "float8_linears": list(p.float8_linears)}}


class Checkpointer:
    """Every stateful part of `parts` (Parts.stateful), saved into and resumed from `out_dir`'s checkpoints.
    `config`: the run's resolved config, which a checkpoint records and a resume compares."""

    def __init__(self, out_dir: Path, t: TrainerConfig, plan: Plan, dist: Dist, parts: Parts, config: dict[str, Any]):
        self.out_dir, self.t, self.plan, self.dist = Path(out_dir), t, plan, dist
        self.stateful, self.per_rank, self.progress = parts.stateful(), parts.per_rank(), parts.progress
        self.identity = identity(config, plan, dist)
        self.kept: Optional[Kept] = None
        self._guarded_step: Optional[int] = None

    @property
    def saves(self) -> bool:
        """False with trainer.save_every=0: the run writes no checkpoint, not even on a stop request."""
        return self.t.save_every > 0

    def due(self, step: int, ending: bool = False) -> bool:
        """Whether the step that made the count `step` ends with a save: every trainer.save_every, and the run's
        last — trainer.max_steps, or a step `ending` it (its target reached, a stop request)."""
        return self.saves and (ending or step % self.t.save_every == 0 or step == self.t.max_steps)

    def guard(self) -> None:
        """Stop a diverged run, naming the checkpoint kept (divergence.check, which reads device values): once a
        step, however many callers ask."""
        if self._guarded_step != self.progress.step:
            divergence.check(self.progress, self.plan, self.dist, self.kept, self.t)
            self._guarded_step = self.progress.step

    def save(self) -> Path:
        """Publish every part's state as the latest checkpoint; never a diverged one (it would replace the last
        checkpoint worth resuming from): a divergence since the last guard stops the run here instead."""
        self.guard()
        path = checkpoint.save_checkpoint(self._state(), self.out_dir, per_rank=self.per_rank, rank=self.dist.rank,
                                          world_size=self.dist.world_size, mode=self.dist.mode.value)
        self.kept = Kept(path, self.progress.step, self.progress.last_global_loss())
        return path

    def resume(self) -> list[str]:
        """Every part's state from trainer.resume's checkpoint, checked against this run; returns the lines that say
        where from (and what changed since), none at a fresh start — which is refused where it would overwrite the
        checkpoints of a run (trainer.resume=none in its dir)."""
        loaded = checkpoint.load_checkpoint(self.t.resume, self.out_dir, template=self._state(),
                                            per_rank=self.per_rank, rank=self.dist.rank,
                                            world_size=self.dist.world_size, defaults=schema_defaults())
        if loaded is None:
            if self.t.resume == "none" and checkpoint.holds_checkpoint(self.out_dir):
                raise CheckpointError(
                    f"{self.out_dir} already holds the checkpoints of a run; trainer.resume=none would overwrite "
                    "them. Continue it with trainer.resume=auto, or start in a new run dir (hydra.run.dir=...)")
            return []
        for name, part in self.stateful.items():
            part.load_state_dict(loaded.state[name])
        self.kept = Kept(loaded.path, self.progress.step, self.progress.last_global_loss())
        return [*loaded.notes, f"resumed from {loaded.path} at step {self.progress.step}"]

    def _state(self) -> dict[str, Any]:
        return {**{name: part.state_dict() for name, part in self.stateful.items()}, "config": self.identity}
