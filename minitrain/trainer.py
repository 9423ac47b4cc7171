"""The run, put together: the plan, the parts it names, a checkpoint resumed into them, the loop.

    plan = make_plan(cfg, device)        everything `auto` settled once; refuses a step that cannot fit
    parts = build(plan, cfg, ...)        model (float8 linears, recompute policy), loss, optimizer (+ loss scaler),
                                         batches, progress
    resume                               every part's state, checked against the saved config (checkpoint.py)
    fit(parts, run)                      step -> log / eval / save; a diverged run stops (loop.py)

The run directory has one owner at a time (rundir.py); Ctrl-C or SIGTERM saves a checkpoint after the current
step, a second Ctrl-C aborts (interrupts.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from . import checkpoint, determinism, distributed, divergence, files, hf, loop
from .compat import set_allocator_settings
from .config import Config, resolve
from .data import prepare_data
from .divergence import Kept
from .interrupts import TrainingInterrupted
from .logger import RunLogger
from .parts import Parts, build
from .plan import make_plan, pick_device
from .rundir import RunDirLock, RunInfo, make_run_dir
from .step import Phase, record_function


def set_expandable_segments(on: bool) -> None:
    """trainer.expandable_segments, for the segments the CUDA allocator makes from now on (before the model's first
    tensor, the run's all); PYTORCH_CUDA_ALLOC_CONF's other settings stay."""
    set_allocator_settings(f"expandable_segments:{on}")


class Trainer:
    def __init__(self, cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True,
                 phase: Phase = record_function, device_memory_bytes: Optional[int] = None):
        self.cfg = cfg = hf.with_weights_shape(resolve(cfg))
        device = pick_device(cfg.trainer.device.value)
        if device.type == "cuda":
            set_expandable_segments(cfg.trainer.expandable_segments)
        self.dist, self.device = distributed.init(cfg, device)
        if self.device.type == "cuda":  # each job of a multirun reports its own peaks
            torch.cuda.reset_peak_memory_stats(self.device)
        self.show_progress, self.run, self.kept = progress and self.dist.is_main, run, None
        self.out_dir = make_run_dir(Path(cfg.trainer.out_dir).expanduser())
        self.lock = RunDirLock(self.out_dir) if self.dist.is_main else None
        if self.lock is not None:
            self.lock.acquire()
        try:
            self._build(cfg, phase, device_memory_bytes)
            self._resume(cfg)
        except BaseException:
            self.close(refused=True)
            raise

    def _build(self, cfg: Config, phase: Phase, device_memory_bytes: Optional[int]) -> None:
        torch.manual_seed(cfg.trainer.seed)
        with distributed.main_first(self.dist):  # one rank builds the data cache, the others read it
            self.data = prepare_data(cfg.data, cfg.model.block_size, progress=self.show_progress)
        self.plan = make_plan(cfg, self.data.vocab_size, self.device, self.dist.world_size, device_memory_bytes)
        self.plan.precision.apply_matmul_precision()
        determinism.apply(self.plan.deterministic)  # before the first GEMM
        self.parts: Parts = build(self.plan, cfg, self.data, self.dist, phase)
        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)

    def _resume(self, cfg: Config) -> None:
        """Every part's state from trainer.resume's checkpoint (or a fresh start), then the logger and the run's
        record: a fresh start begins metrics.jsonl again from step 0 (a run that died here before its first
        checkpoint leaves records no step of this one continues)."""
        t, p = cfg.trainer, self.progress
        loaded = checkpoint.load_checkpoint(t.resume, self.out_dir, template=self._state(),
                                            per_rank=self.parts.per_rank(), rank=self.dist.rank,
                                            world_size=self.dist.world_size)
        if loaded is not None:
            for name, part in self.parts.stateful().items():
                part.load_state_dict(loaded.state[name])
            self.kept = Kept(loaded.path, p.step, p.last_global_loss())
        elif t.resume == "none" and checkpoint.holds_checkpoint(self.out_dir):
            raise checkpoint.CheckpointError(
                f"{self.out_dir} already holds the checkpoints of a run; trainer.resume=none would overwrite them. "
                "Continue it with trainer.resume=auto, or start in a new run dir (hydra.run.dir=...)")
        self.logger = RunLogger(cfg.logger, self.out_dir, self.config_dict, run_id=p.wandb_id, group=self.run.group,
                                name=self.run.name, enabled=self.dist.is_main, resume_step=p.step)
        p.wandb_id = self.logger.run_id
        if self.dist.is_main:
            self.run.write(self.out_dir, self.config_dict)
            # the run's tokenizer, for sample.py, export_hf.py and eval.py
            files.atomic_write(self.out_dir / "tokenizer.json", self.data.tokenizer.to_str(pretty=True))
        self.logger.print(self.plan.describe())
        if self.parts.init_weights is not None and loaded is None:
            self.logger.print(f"weights: {cfg.model.init_from} ({self.parts.init_weights})")
        self.logger.log_plan(self.plan.as_dict())
        for note in loaded.notes if loaded is not None else ():
            self.logger.print(note)
        if loaded is not None:
            self.logger.print(f"resumed from {loaded.path} at step {p.step}")
        elif self.logger.dropped_records:
            self.logger.print(f"metrics.jsonl: dropped {self.logger.dropped_records} log record(s) of an earlier run "
                              "here that saved no checkpoint; this run starts the file again from step 0")

    # The parts, as benchmarks and tests reach them.
    model = property(lambda self: self.parts.model)
    optimizer = property(lambda self: self.parts.optimizer)
    train_step = property(lambda self: self.parts.train_step)
    forward_loss = property(lambda self: self.parts.forward_loss)
    eager_forward_loss = property(lambda self: self.parts.eager_forward_loss)
    train_batches = property(lambda self: self.parts.train_batches)
    val_batches = property(lambda self: self.parts.val_batches)
    progress = property(lambda self: self.parts.progress)
    step = property(lambda self: self.parts.progress.step)

    def _identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint: the config, and what the plan resolved from it (the
        float8 linears come from torchao's shape filter, which a torchao upgrade may move)."""
        p = self.plan
        param_dtype = str(p.precision.stored_param_dtype(self.dist.sharded)).removeprefix("torch.")
        return {**self.config_dict, "plan": {"precision": p.precision.name, "world_size": p.world_size,
                                             "distributed": p.distributed.value, "vocab_size": p.model.vocab_size,
                                             "param_dtype": param_dtype, "float8_linears": list(p.float8_linears)}}

    def _state(self) -> dict[str, Any]:
        return {**{name: part.state_dict() for name, part in self.parts.stateful().items()},
                "config": self._identity()}

    def save(self) -> Path:
        """Publish every part's state as the latest checkpoint; never a diverged one (it would replace the last
        checkpoint worth resuming from): a divergence since the last log step stops the run here instead."""
        divergence.check(self.progress, self.plan, self.dist, self.kept, self.cfg.trainer)
        path = checkpoint.save_checkpoint(self._state(), self.out_dir, per_rank=self.parts.per_rank(),
                                          rank=self.dist.rank, world_size=self.dist.world_size,
                                          mode=self.dist.mode.value)
        self.kept = Kept(path, self.progress.step, self.progress.last_global_loss())
        return path

    def fit(self) -> dict[str, Any]:
        return loop.fit(self.parts, self)

    def evaluate(self) -> float:
        return loop.evaluate(self.parts, self)

    def throughput(self):
        return loop.throughput(self.parts, self)

    def close(self, refused: bool = False) -> None:
        """Release the run dir; refused (the run stopped before its first step): with the lock file it made."""
        if self.lock is not None:
            self.lock.release(remove_file=refused)
            self.lock = None


def train(cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True) -> dict[str, Any]:
    """Build everything from `cfg` and train; returns the last logged record. Under torchrun a failing
    rank names itself on stderr and leaves the process group, so its peers fail too instead of waiting."""
    trainer = None
    try:
        trainer = Trainer(cfg, run, progress)
        record = trainer.fit()
        distributed.teardown(finished=True)
        return record
    except BaseException as e:
        if torch.distributed.is_initialized() and not isinstance(e, TrainingInterrupted):
            print(f"minitrain: rank {torch.distributed.get_rank()} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        distributed.teardown()
