"""The run, put together: the plan (every `auto` settled once), the parts it names (parts.py), the services around
them — run dir (rundir.py), checkpointer (checkpointer.py), logger — and the loop over them (loop.py)."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from . import determinism, distributed, hf, loop
from .checkpointer import Checkpointer
from .compat import set_allocator_settings
from .config import Config, resolve
from .data import prepare_data
from .interrupts import TrainingInterrupted
from .logger import RunLogger
from .parts import build
from .plan import make_plan, pick_device
from .rundir import RunDir, RunInfo
from .step import Phase, record_function


def set_expandable_segments(on: bool) -> None:
    """trainer.expandable_segments, for the segments the CUDA allocator makes from now on (before the model's first
    tensor, the run's all); PYTORCH_CUDA_ALLOC_CONF's other settings stay."""
    set_allocator_settings(f"expandable_segments:{on}")


class Trainer:
    """The run's parts and services, composed from the config, its checkpoint resumed into them; `fit` runs the loop
    over them. It holds the run dir from construction to `fit`'s end (or `close`)."""

    def __init__(self, cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True,
                 phase: Phase = record_function, device_memory_bytes: Optional[int] = None):
        self.cfg = cfg = hf.with_weights_shape(resolve(cfg))
        device = pick_device(cfg.trainer.device.value)
        if device.type == "cuda":
            set_expandable_segments(cfg.trainer.expandable_segments)
        self.dist, self.device = distributed.init(cfg, device)
        if self.device.type == "cuda":  # each job of a multirun reports its own peaks
            torch.cuda.reset_peak_memory_stats(self.device)
        self.show_progress = progress and self.dist.is_main
        self._held = ExitStack()  # the run dir, from here to fit's end (or close)
        self.run_dir = self._held.enter_context(RunDir(Path(cfg.trainer.out_dir).expanduser(), run,
                                                       owner=self.dist.is_main))
        try:
            torch.manual_seed(cfg.trainer.seed)
            with distributed.main_first(self.dist):  # one rank builds the data cache, the others read it
                self.data = prepare_data(cfg.data, cfg.model.block_size, progress=self.show_progress)
            self.plan = make_plan(cfg, self.data.vocab_size, self.device, self.dist.world_size, device_memory_bytes)
            self.plan.precision.apply_matmul_precision()
            determinism.apply(self.plan.deterministic)  # before the first GEMM
            self.parts = build(self.plan, cfg, self.data, self.dist, phase)
            self._start(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True))
        except BaseException:
            self.close()  # refused before its first step: the run dir as it was found (RunDir)
            raise

    def _start(self, config: dict[str, Any]) -> None:
        """Every part's state from trainer.resume's checkpoint, the logger, the run's record; how it starts, said."""
        p, plan = self.parts.progress, self.plan
        self.checkpointer = Checkpointer(self.run_dir.path, self.cfg.trainer, plan, self.dist, self.parts, config)
        resumed = self.checkpointer.resume()  # the lines that say so; none at a fresh start
        self.logger = RunLogger.from_config(self.cfg.logger, plan, self.run_dir, config, p, enabled=self.dist.is_main)
        p.wandb_id = self.logger.run_id
        self.run_dir.record(config, self.data.tokenizer.to_str(pretty=True))
        said = [plan.describe()]
        if not resumed and self.parts.init_weights is not None:
            said.append(f"weights: {self.cfg.model.init_from} ({self.parts.init_weights})")
        if not resumed and self.logger.dropped_records:
            said.append(f"metrics.jsonl: dropped {self.logger.dropped_records} log record(s) of an earlier run here "
                        "that saved no checkpoint; this run starts the file again from step 0")
        self.logger.print("\n".join(said + resumed))

    # The parts, as benchmarks and tests reach them.
    model = property(lambda self: self.parts.model)
    optimizer = property(lambda self: self.parts.optimizer)
    train_step = property(lambda self: self.parts.train_step)
    forward_loss = property(lambda self: self.parts.forward_loss)
    eager_forward_loss = property(lambda self: self.parts.eager_forward_loss)
    train_batches = property(lambda self: self.parts.train_batches)
    val_batches = property(lambda self: self.parts.val_batches)
    step = property(lambda self: self.parts.progress.step)
    out_dir = property(lambda self: self.run_dir.path)
    settings = property(lambda self: loop.Settings(self.plan, self.cfg.trainer, self.dist, self.show_progress))

    def fit(self) -> dict[str, Any]:
        """Train to trainer.max_steps (or trainer.target_loss), then free the run dir (for a resume here too)."""
        with self._held:
            return loop.fit(self.parts, loop.Services(self.run_dir, self.logger, self.checkpointer), self.settings)

    def evaluate(self) -> float:
        return loop.evaluate(self.parts, self.settings)

    def throughput(self):
        return loop.throughput(self.parts, self.settings)

    def close(self) -> None:
        """Free the run dir without training."""
        self._held.close()


def train(cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True) -> dict[str, Any]:
    """Build everything from `cfg` and train; returns the last logged record. Under torchrun a failing
    rank names itself on stderr and leaves the process group, so its peers fail too instead of waiting."""
    try:
        record = Trainer(cfg, run, progress).fit()
        distributed.teardown(finished=True)
        return record
    except BaseException as e:
        if torch.distributed.is_initialized() and not isinstance(e, TrainingInterrupted):
            print(f"minitrain: rank {torch.distributed.get_rank()} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        raise
    finally:
        distributed.teardown()
