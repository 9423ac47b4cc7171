"""The run: a plan, the parts it names, and the loop around the step — eval, logs, checkpoints, sample.

    plan = make_plan(cfg, device)        everything `auto` settled once; refuses a step that cannot fit
    parts from the plan                  model, checkpointing policy, loss, optimizer (+ loss scaler), batches
    resume                               every part's state_dict, checked against the saved config
    loop: step -> log / eval / save      device values read at log steps only; a diverged run stops

A checkpoint is the state_dict of every part (`Trainer.parts()`), so adding a part adds it to the
checkpoint by construction. The run directory has one owner at a time (a lock); Ctrl-C or SIGTERM saves
a checkpoint after the current step, a second Ctrl-C aborts.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from . import checkpoint, compile_check, files, determinism, distributed, hf, memory, recompute
from .config import SCRATCH, Config, ConfigError, resolve
from .data import DeviceBatches, TokenData, prepare_data
from .generate import Sampler, Sampling
from .logger import RunLogger
from .metrics import Throughput, memory_stats, peak_flops
from .model import GPT
from .plan import Plan, make_plan, pick_device
from .rundir import RunDirLock, RunInfo, make_run_dir
from .step import Phase, TrainStep, record_function


# Steps of each process that tokens/s leaves out (metrics.Throughput): a compiled step compiles on its first
# call and warms up and records its CUDA graphs on the next two; any step's first run makes the allocator's
# first requests.
UNTIMED_STEPS_COMPILED, UNTIMED_STEPS_EAGER = 3, 1


class NonFiniteLossError(RuntimeError):
    """The run diverged (inf/NaN loss, or gradients skipped step after step). Nothing from after the divergence was
    saved; the message names the checkpoint kept, with its step and that step's training loss, or says there is
    none (a finite loss can be an exploded one too: the user judges it from the number)."""


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM: a checkpoint was saved; the message says where. `main`: raised on the rank that
    reports it (under torchrun every rank stops, one says so); `exit_code`: 128 + the signal's number."""

    def __init__(self, message: str, main: bool = True, exit_code: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.main, self.exit_code = main, exit_code


def build_loss(plan: Plan, cfg: Config):
    """`loss_fn(hidden, weight, targets)`: the fused linear cross-entropy (logits never in HBM) or
    F.cross_entropy on full logits."""
    from .ops import fused_linear_cross_entropy, linear_cross_entropy_reference

    if plan.loss_impl == "torch":
        return linear_cross_entropy_reference
    chunk_bytes, low_memory = cfg.loss.chunk_bytes, cfg.loss.low_memory
    return lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_bytes=chunk_bytes, low_memory=low_memory)


def build_optimizer(plan: Plan, cfg: Config, model: GPT, sharded: bool = False):
    """AdamW (fused / foreach / loop, or torch's own) with the loss scaler the precision asks for.
    sharded: the params are FSDP2 shards; the grad norm and overflow flag are agreed across ranks."""
    from .optim import build_adamw

    o = cfg.optimizer
    return build_adamw(model.param_groups(o.weight_decay), impl=plan.optimizer_impl, precision=plan.precision,
                       lr=plan.schedule.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                       max_grad_norm=o.max_grad_norm or None,
                       reduce_sumsq=distributed.all_reduce_sum_ if sharded else None)


@dataclass
class Progress:
    """The loop's own state, checkpointed with the parts so a resumed run logs what an unbroken one logs:
    the step, the wandb run id, the losses summed since the last log step, and the run of skipped steps; and
    the last step's loss, the one a checkpoint's weights were trained to (a diverged run's message names it)."""

    device: torch.device
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


class _Interrupts:
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler's or `kill`'s stop, which torchrun forwards) during fit: the
    first asks for a checkpoint, a second one (a moment later) aborts at once. A terminal's Ctrl-C under
    torchrun reaches every worker twice, from the terminal and forwarded by torchrun: copies within
    SAME_INTERRUPT_S of the first are that one interrupt."""

    SAME_INTERRUPT_S = 1.0
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, say, when: str):
        self.requested, self.say, self.when, self.previous, self.first = False, say, when, {}, 0.0
        self.signum = signal.SIGINT

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self.first < self.SAME_INTERRUPT_S:
                return
            raise KeyboardInterrupt
        self.requested, self.first, self.signum = True, time.monotonic(), signum
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        self.say(f"{what}: saving a checkpoint {self.when} (Ctrl-C again to abort without one)")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Trainer:
    def __init__(self, cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True,
                 phase: Phase = record_function, device_memory_bytes: Optional[int] = None):
        self.cfg = cfg = hf.with_weights_shape(resolve(cfg))
        self.dist, self.device = distributed.init(cfg, pick_device(cfg.trainer.device.value))
        if self.device.type == "cuda":  # each job of a multirun reports its own peaks
            torch.cuda.reset_peak_memory_stats(self.device)
        self.show_progress = progress and self.dist.is_main
        self.run = run
        self.out_dir = make_run_dir(Path(cfg.trainer.out_dir).expanduser())
        self.lock = RunDirLock(self.out_dir) if self.dist.is_main else None
        if self.lock is not None:
            self.lock.acquire()
        try:
            self._build(cfg, run, phase, device_memory_bytes)
        except BaseException:
            self.close(refused=True)
            raise

    def _build(self, cfg: Config, run: RunInfo, phase: Phase, device_memory_bytes: Optional[int]) -> None:
        torch.manual_seed(cfg.trainer.seed)
        with distributed.main_first(self.dist):  # one rank builds the data cache, the others read it
            self.data: TokenData = prepare_data(cfg.data, cfg.model.block_size, progress=self.show_progress)
        self.plan = plan = make_plan(cfg, self.data.vocab_size, self.device, self.dist.world_size, device_memory_bytes)
        self.model_cfg = plan.model
        plan.precision.apply_matmul_precision()
        determinism.apply(plan.deterministic)  # before the first GEMM

        with torch.device(self.device):
            self.model = GPT(plan.model)
        weights = hf.load_weights(self.model) if cfg.model.init_from != SCRATCH else None
        self.model.to(dtype=plan.precision.stored_param_dtype(self.dist.sharded))
        recompute.apply_policy(self.model, plan.checkpointing, compiled=plan.compiled)
        self.loss_module = distributed.wrap(self.model, build_loss(plan, cfg), plan.precision, cfg.distributed,
                                            self.dist)
        self.optimizer = build_optimizer(plan, cfg, self.model, sharded=self.dist.sharded)
        t, world = cfg.trainer, self.dist.world_size
        checked = dict(vocab_size=self.data.vocab_size, cache_path=self.data.path)
        self.train_batches = DeviceBatches(self.data.train, plan.model.block_size, t.batch_size, t.seed, self.device,
                                           grad_accum=plan.grad_accum, **checked)
        self.val_batches = DeviceBatches(self.data.val, plan.model.block_size, plan.micro_batch * world, t.seed + 1,
                                         self.device, **checked)
        self.eager_forward_loss = self._forward_loss  # uncompiled: what the compile check compares the step with
        self.forward_loss = torch.compile(self._forward_loss, mode=plan.compile_mode) if plan.compiled \
            else self._forward_loss
        self.train_step = TrainStep(self.forward_loss, self.loss_module, self.optimizer, self.train_batches,
                                    plan.schedule, plan.grad_accum, self.dist, plan.cuda_graphs, phase)
        self.progress = Progress(self.device)

        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
        loaded = checkpoint.load_checkpoint(t.resume, self.out_dir, self.device, template=self._state(),
                                        sharded=self.dist.enabled, rank=self.dist.rank)
        self.kept: Optional[tuple[Path, int, float]] = None  # the last checkpoint loaded or saved: path, step, loss
        if loaded is not None:
            self._load_state(loaded.state)
            self.kept = (loaded.path, self.progress.step, self._last_loss())
        elif t.resume == "none" and checkpoint.holds_checkpoint(self.out_dir):
            raise checkpoint.CheckpointError(
                f"{self.out_dir} already holds the checkpoints of a run; trainer.resume=none would overwrite them. "
                "Continue it with trainer.resume=auto, or start in a new run dir (hydra.run.dir=...)")
        # A fresh start resumes from step 0: the records of a run that died here before its first checkpoint
        # are dropped, not continued by this run's own steps.
        self.logger = RunLogger(cfg.logger, self.out_dir, self.config_dict, run_id=self.progress.wandb_id,
                                group=run.group, name=run.name, enabled=self.dist.is_main,
                                resume_step=self.progress.step)
        self.progress.wandb_id = self.logger.run_id
        if self.dist.is_main:
            run.write(self.out_dir, self.config_dict)
            files.atomic_write(self.out_dir / "tokenizer.json", self.data.tokenizer.to_str(pretty=True))  # sample.py, export_hf.py
        self.logger.print(plan.describe())
        if weights is not None and loaded is None:
            self.logger.print(f"weights: {cfg.model.init_from} ({weights})")
        self.logger.log_plan(plan.as_dict())
        if loaded is not None:
            for note in loaded.notes:
                self.logger.print(note)
            self.logger.print(f"resumed from {loaded.path} at step {self.progress.step}")
        elif self.logger.dropped_records:
            self.logger.print(f"metrics.jsonl: dropped {self.logger.dropped_records} log record(s) of an earlier run "
                              "here that saved no checkpoint; this run starts the file again from step 0")

    @property
    def step(self) -> int:
        return self.progress.step

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.plan.precision.autocast(self.device.type):
            return self.loss_module(x, y)

    # -- checkpoints ------------------------------------------------------------------------------
    def parts(self) -> dict[str, Any]:
        """Everything a checkpoint restores, each with state_dict / load_state_dict."""
        return {"model": self.model, "optimizer": self.optimizer, "rng": checkpoint.RandomState(),
                "progress": self.progress}

    def _identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint: the config, and what the plan resolved from it."""
        p = self.plan
        return {**self.config_dict, "plan": {"precision": p.precision.name, "world_size": p.world_size,
                                             "distributed": p.distributed.value, "vocab_size": p.model.vocab_size}}

    def _state(self) -> dict[str, Any]:
        return {**{name: part.state_dict() for name, part in self.parts().items()}, "config": self._identity()}

    def _load_state(self, state: dict[str, Any]) -> None:
        for name, part in self.parts().items():
            part.load_state_dict(state[name])

    def save(self) -> Path:
        """Publish every part's state as the latest checkpoint; never a diverged one (it would replace the last
        checkpoint worth resuming from): a divergence since the last log step stops the run here instead."""
        self._check_diverged()
        if self.dist.enabled:
            path = checkpoint.save_sharded(self._state(), self.out_dir, self.dist.rank, mode=self.dist.mode.value)
        else:
            path = checkpoint.save_checkpoint(self._state(), self.out_dir)
        self.kept = (path, self.progress.step, self._last_loss())
        return path

    def _last_loss(self) -> float:
        """The last step's training loss (over all ranks): the loss a checkpoint taken now was trained to."""
        return distributed.mean(self.progress.last_loss, self.dist).item()

    # -- the loop ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        rank, world = self.dist.rank, self.dist.world_size
        # clone: under CUDA graphs a call's output lives in memory that the next call's replay overwrites
        losses = torch.stack([self.forward_loss(*self.val_batches.get(i, rank, world)).float().clone()
                              for i in range(self.cfg.trainer.eval_batches)])
        self.model.train()
        return distributed.mean(losses.mean(), self.dist).item()

    def _check_diverged(self) -> None:
        """At log and save steps (host reads happen there only): stop a run whose loss went inf/NaN without loss
        scaling to absorb it, or whose optimizer skipped max_skipped_steps steps in a row."""
        p = self.progress
        nonfinite = bool(distributed.mean(p.nonfinite_loss.float(), self.dist).item()) \
            and not self.plan.precision.loss_scaling
        longest = int(p.longest_skip_run.item())
        if nonfinite or longest >= self.plan.max_skipped_steps:
            what = "the training loss became inf/NaN" if nonfinite else \
                f"{longest} optimizer steps in a row were skipped (inf/NaN gradients)"
            raise NonFiniteLossError(
                f"{what} by step {p.step} (precision={self.plan.precision.name}); stopping, {self._kept_checkpoint()}"
                " — try a lower trainer.lr"
                + (", or precision=fp16 only if fp16 overflow is the cause" if not self.plan.precision.loss_scaling
                   else ""))

    def _kept_checkpoint(self) -> str:
        """Which checkpoint a diverged run leaves to resume from, with the loss it was trained to: a finite loss
        can still be an exploded one, which the user judges from the number."""
        if self.kept is None:
            t = self.cfg.trainer
            first = f"{t.save_every}" if t.save_every < t.max_steps else f"{t.max_steps}, the last"
            return f"with no checkpoint saved (the first was due at step {first})"
        path, step, loss = self.kept
        return f"keeping the checkpoint of step {step} ({path}), whose training loss at that step was {loss:.4g}"

    def _log_record(self, throughput: Throughput) -> dict[str, Any]:
        stats = self.optimizer.stats()
        loss = distributed.mean(self.progress.take_mean_loss(), self.dist)
        step = self.progress.step
        record = {"step": step, "tokens": step * self.plan.batch_size * self.model_cfg.block_size,
                  "train/loss": loss.item(), "opt/lr": self.plan.schedule(step - 1),
                  "opt/grad_norm": float(stats["grad_norm"]), "amp/skipped_steps": float(stats["skipped_steps"])}
        if "loss_scale" in stats:  # dynamic loss scaling (fp16) only: without it there is no scale to show
            record["amp/loss_scale"] = float(stats["loss_scale"])
        record.update(throughput.read())
        record.update(memory_stats(self.device))
        if self.dist.enabled:  # every rank's peak: under fsdp they should match, under imbalance they do not
            key = "mem/peak_allocated_gb" if self.device.type == "cuda" else "mem/peak_rss_gb"
            for rank, value in enumerate(distributed.gather(record[key], self.dist)):
                record[f"mem/rank{rank}/{key[4:]}"] = value
        return record

    def throughput(self) -> Throughput:
        """A meter of this run's tokens/s, MFU and HFU (recompute counted) over all devices' peak, from the
        first step after this process's warm-up ones."""
        T = self.model_cfg.block_size
        peak = self.cfg.trainer.peak_flops or peak_flops(self.device, self.plan.precision.mfu_dtype)
        model_flops = self.model.flops_per_token(T)
        extra = recompute.recompute_flops_per_token(self.model_cfg, self.plan.checkpointing, T)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        return Throughput(self.plan.batch_size * T, model_flops, model_flops + extra,
                          peak and peak * self.dist.world_size,  # global tokens/s over all devices' peak
                          untimed_steps=UNTIMED_STEPS_COMPILED if self.plan.compiled else UNTIMED_STEPS_EAGER,
                          sync=sync)

    def fit(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        t, p = self.cfg.trainer, self.progress
        if p.step >= t.max_steps:  # a finished run started again: its record (memory.json, sample) stays as it is
            return self._nothing_to_train()
        self.logger.print(f"minitrain: {self.model_cfg.name} ({self.model.num_params() / 1e6:.2f}M params) | "
                          f"run dir {self.out_dir}")
        self.logger.print(self.plan.memory.table())
        self.logger.summary(self.plan.memory.as_dict())
        throughput, compared, record = self.throughput(), False, {}
        if self.plan.compiled:  # a big model's compile takes minutes, with the bar standing at its first step
            self.logger.print(f"compiling: the first {throughput.untimed_steps} steps build the compiled step"
                              f"{' and record its CUDA graphs' if self.plan.cuda_graphs else ''}; tokens/s "
                              "leaves them out")
        checking = self.plan.compiled and t.compile_check and self.model_cfg.dropout == 0
        bar = tqdm(total=t.max_steps, initial=p.step, desc="train", unit="step", disable=not self.show_progress,
                   dynamic_ncols=True)
        try:
            when = "at the next log step (all ranks stop together)" if self.dist.enabled else "after this step"
            with _Interrupts(self.logger.print, when) as interrupts:
                while p.step < t.max_steps:
                    if checking:  # the first step of this process: eager first, on the same params and batch
                        expected = compile_check.eager_loss(self._forward_loss, self.train_batches, p.step,
                                                            self.plan.grad_accum, self.dist)
                    loss = self.train_step(p.step)
                    if checking:
                        setting = f"{self.model_cfg.name}, precision={self.plan.precision.name}, " \
                                  f"torch.compile mode={self.plan.compile_mode}"
                        self.logger.print(compile_check.verify(loss, expected, self.dist, setting))
                        checking = False
                    p.record(loss, self.optimizer.stats()["skipped_steps"])
                    throughput.step()
                    bar.update(1)
                    is_last = p.step == t.max_steps
                    logging = p.step % t.log_every == 0 or is_last
                    evaluating = p.step % t.eval_every == 0 or is_last
                    saving = p.step % t.save_every == 0 or is_last
                    if logging:
                        self._check_diverged()
                        record = self._log_record(throughput)
                        if not compared and self.device.type == "cuda":
                            self.logger.print(self._memory_comparison())
                            compared = True
                    if evaluating:
                        record = record if logging else {"step": p.step}
                        record["val/loss"] = self.evaluate()
                    if logging or evaluating:
                        self.logger.log(record)
                        bar.set_postfix(loss=f"{record.get('train/loss', float('nan')):.3f}")
                    stop = self._interrupt_agreed(interrupts, logging)
                    if saving or stop:
                        path = self.save()
                    if stop:
                        raise TrainingInterrupted(
                            f"stopped at step {p.step} of {t.max_steps}; checkpoint saved to {path} — continue "
                            f"with: {self.run.continue_command(self.out_dir, self.dist.enabled)}",
                            main=self.dist.is_main,
                            exit_code=interrupts.exit_code)
                    if logging or evaluating or saving:
                        throughput.restart()  # eval and saving are not training time
            bar.close()
            if self.dist.is_main:
                self._write_memory_json(record)
            record["sample"] = self.sample()
            self.logger.print(self._finished_line(record, path))
            self.logger.summary({k: v for k, v in record.items() if k != "step"})
            self.logger.finish()
        except BaseException as e:
            bar.close()
            self.logger.finish(exit_code=e.exit_code if isinstance(e, TrainingInterrupted) else
                               130 if isinstance(e, KeyboardInterrupt) else 1)
            raise
        finally:
            self.close()  # the run dir is free for the next run (a resume in this process included)
        return record

    def _nothing_to_train(self) -> dict[str, Any]:
        """A resumed run already at (or past) trainer.max_steps: say so instead of running no step in silence."""
        step, max_steps = self.progress.step, self.cfg.trainer.max_steps
        self.logger.print(f"nothing to train: the checkpoint is at step {step} and trainer.max_steps={max_steps}; "
                          f"raise trainer.max_steps to train further (this run's files in {self.out_dir} are "
                          "left as they were)")
        self.logger.finish()
        self.close()
        return {"step": step}

    def _finished_line(self, record: dict[str, Any], checkpoint: Path) -> str:
        """The run's last console line: where it ended and where its results are."""
        losses = ", ".join(f"{label} {record[key]:.4f}" for key, label in (("train/loss", "loss"), ("val/loss", "val"))
                           if record.get(key) is not None)
        return (f"finished: step {self.progress.step} of {self.cfg.trainer.max_steps}, {losses} | checkpoint "
                f"{checkpoint} | metrics {self.out_dir / 'metrics.jsonl'}")

    def _interrupt_agreed(self, interrupts: _Interrupts, logging: bool) -> bool:
        """One process stops at once; under torchrun every rank must stop at the same step, so the ranks
        agree at log steps (where they synchronise anyway)."""
        if not self.dist.enabled:
            return interrupts.requested
        if not logging:
            return False
        flag = torch.tensor(float(interrupts.requested), device=self.device)
        return bool(distributed.mean(flag, self.dist).item())

    def _memory_comparison(self) -> str:
        s = torch.cuda.memory_stats(self.device)
        return memory.compare(self.plan.memory, s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"],
                              cuda_graphs=self.plan.cuda_graphs)

    def _write_memory_json(self, record: dict[str, Any]) -> None:
        """Predicted terms beside the measured peaks: what scripts/report.py reads per sweep cell."""
        measured = {k: v for k, v in record.items() if k.startswith("mem/")}
        files.atomic_write(self.out_dir / "memory.json", json.dumps({**self.plan.memory.as_dict(), **measured}, indent=1))

    def sample(self) -> str:
        """A short continuation of a fixed prompt (at most what fits model.block_size): a human-readable check of
        what the model learned. Without the KV cache: the training model may be sharded, or its blocks' forwards
        swapped by a recompute policy, and a short sample costs little."""
        ids = torch.tensor([self.data.tokenizer.encode("def ").ids], device=self.device)
        n = min(self.cfg.trainer.sample_tokens, self.model_cfg.block_size - ids.shape[1])
        if n <= 0:
            return ""
        sampling = Sampling(temperature=0.8, top_k=50, vocab=self.data.vocab_size)
        self.model.eval()
        with self.plan.precision.autocast(self.device.type):  # on every rank: under fsdp each forward all-gathers
            sampler = Sampler(self.model, 1, ids.shape[1] + n, sampling, kv_cache=False)
            out = sampler.generate(ids, n, seed=self.cfg.trainer.seed)
        self.model.train()
        text = self.data.decode(out.tokens[0].tolist())
        if self.dist.is_main:
            files.atomic_write(self.out_dir / "sample.txt", text)
        self.logger.print(f"sample:\n{text}")
        return text

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
