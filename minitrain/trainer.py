"""The training loop: forward, loss, backward, optimizer step; eval, logging, checkpoints.

The step depends on interfaces only — `loss_fn(hidden, weight, targets)`, `scaler.scale(loss)`,
`optimizer.step(scaler=...)`, `optimizer.stats()` — so the fused kernels and the plain-PyTorch parts
swap behind config switches without touching the loop. Nothing in the step reads a device value on
the host: losses, grad norms and the non-finite flag are read at log steps only.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.profiler import record_function

from . import checkpointing, distributed, memory, resume
from .config import Config, ConfigError, KernelImpl, OptimizerImpl, resolve
from .data import Batches, TokenData, prepare_data
from .logger import RunLogger
from .metrics import Throughput, memory_stats, peak_flops
from .model import GPT

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteLossError(RuntimeError):
    """The loss went inf/NaN without loss scaling to absorb it; the last good checkpoint is kept."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def model_config_for(cfg: Config, tokenizer_vocab: int):
    """The model config with vocab_size settled against the tokenizer."""
    from dataclasses import replace

    if cfg.model.vocab_size is None:
        return replace(cfg.model, vocab_size=-(-tokenizer_vocab // 64) * 64)
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}, from data.vocab_size={cfg.data.vocab_size})")
    return cfg.model


def loss_impl(cfg: Config, device: torch.device) -> str:
    """`loss.impl` with `auto` settled: the Triton kernel on CUDA, the reference on CPU."""
    if cfg.loss.impl == KernelImpl.auto:
        return "fused" if device.type == "cuda" else "torch"
    return cfg.loss.impl.value


def optimizer_impl(cfg: Config, device: torch.device) -> str:
    """`optimizer.impl` with `auto` settled: the fused Triton kernel on CUDA, foreach on CPU."""
    if cfg.optimizer.impl == OptimizerImpl.auto:
        return "fused" if device.type == "cuda" else "foreach"
    return cfg.optimizer.impl.value


def build_loss(cfg: Config, device: torch.device) -> LossFn:
    """`loss.impl`: the fused linear cross-entropy (logits never in HBM) or F.cross_entropy on full logits."""
    from .ops import fused_linear_cross_entropy, linear_cross_entropy_reference

    if loss_impl(cfg, device) == "torch":
        return linear_cross_entropy_reference
    chunk_bytes, low_memory = cfg.loss.chunk_bytes, cfg.loss.low_memory
    return lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_bytes=chunk_bytes, low_memory=low_memory)


def build_optimizer(cfg: Config, model: GPT, device: torch.device, sharded: bool = False):
    """AdamW (fused / foreach / loop, or torch's own) and the loss scaler the precision asks for.
    sharded: the params are FSDP2 shards; the grad norm and overflow flag are agreed across ranks."""
    from .amp import DynamicLossScaler
    from .optim import FusedAdamW, TorchAdamW

    o, p = cfg.optimizer, cfg.precision
    groups = model.param_groups(o.weight_decay)
    common = dict(lr=cfg.trainer.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                  max_grad_norm=o.max_grad_norm or None)
    if o.impl == OptimizerImpl.torch:
        scaler = torch.amp.GradScaler(device.type, init_scale=p.init_scale, growth_factor=p.growth_factor,
                                      backoff_factor=p.backoff_factor, growth_interval=p.growth_interval) \
            if p.loss_scaling else None
        if sharded:
            raise ConfigError("optimizer.impl=torch: distributed=fsdp runs minitrain's own AdamW on the local "
                              "shards; use optimizer.impl=auto|fused|foreach|loop")
        return TorchAdamW(groups, **common), scaler
    optimizer = FusedAdamW(groups, impl=optimizer_impl(cfg, device), master_weights=p.master_weights,
                           grad_dtype=p.grad_dtype.torch if p.grad_dtype else None,
                           reduce_sumsq=distributed.all_reduce_sum_ if sharded else None, **common)
    scaler = DynamicLossScaler(init_scale=p.init_scale, growth_factor=p.growth_factor,
                               backoff_factor=p.backoff_factor, growth_interval=p.growth_interval,
                               device=device) if p.loss_scaling else None
    return optimizer, scaler


@dataclass
class RunInfo:
    """Where this run sits in a Hydra sweep (for wandb grouping); empty for a plain run."""

    group: Optional[str] = None
    name: Optional[str] = None

    @staticmethod
    def from_hydra() -> "RunInfo":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return RunInfo()
        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return RunInfo(name=Path(hc.runtime.output_dir).name)
        sweep = Path(hc.sweep.dir)
        return RunInfo(group=f"{sweep.parent.name}_{sweep.name}",
                       name=hc.job.override_dirname or f"job{hc.job.num}")


class Trainer:
    def __init__(self, cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True):
        self.cfg = cfg = resolve(cfg)
        self.dist, self.device = distributed.init(cfg, pick_device(cfg.trainer.device.value))
        if self.device.type == "cuda":  # each job of a multirun reports its own peaks
            torch.cuda.reset_peak_memory_stats(self.device)
        self.progress = progress and self.dist.is_main
        self.out_dir = Path(cfg.trainer.out_dir).expanduser()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.trainer.seed)

        with distributed.main_first(self.dist):  # one rank builds the data cache, the others read it
            self.data: TokenData = prepare_data(cfg.data, cfg.model.block_size, progress=self.progress)
        self.model_cfg = model_config_for(cfg, self.data.vocab_size)
        with torch.device(self.device):
            self.model = GPT(self.model_cfg)
        self.model.to(dtype=distributed.param_dtype(cfg.precision, self.dist))
        checkpointing.apply_policy(self.model, cfg.checkpointing, compiled=cfg.trainer.compile)
        self.loss_fn = build_loss(cfg, self.device)
        self.loss_module = distributed.wrap(self.model, self.loss_fn, cfg.precision, cfg.distributed, self.dist)
        self.optimizer, self.scaler = build_optimizer(cfg, self.model, self.device, sharded=self.dist.sharded)

        # Each rank takes its slices of the global batch: micro-batch m of rank r is part r*accum + m.
        t, world = cfg.trainer, self.dist.world_size
        self.micro_batch = t.batch_size // (t.grad_accum * world)
        self.train_batches = Batches(self.data.train, self.model_cfg.block_size, t.batch_size, t.seed, self.device)
        self.val_batches = Batches(self.data.val, self.model_cfg.block_size, self.micro_batch * world, t.seed + 1,
                                   self.device)
        self.compute_loss = torch.compile(self._compute_loss, mode=t.compile_mode) if t.compile else self._compute_loss
        self.memory_estimate = memory.predict(
            self.model_cfg, cfg.precision, cfg.checkpointing, self.micro_batch, self.model_cfg.block_size,
            loss_impl(cfg, self.device), cfg.loss.chunk_bytes, loss_low_memory=cfg.loss.low_memory,
            grad_accum=t.grad_accum, world_size=world,
            sharded=self.dist.sharded, device=self.device.type, optimizer_impl=optimizer_impl(cfg, self.device),
            fsdp_unit_blocks=cfg.distributed.fsdp_unit_blocks,
            reshard_after_forward=cfg.distributed.reshard_after_forward)

        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
        self.step, self.wandb_id = 0, None
        ckpt_path = resume.find_checkpoint(t.resume, self.out_dir, sharded=self.dist.enabled)
        if ckpt_path is not None:
            self._load_state(resume.load_sharded(ckpt_path, self._state(), self.dist.rank) if self.dist.enabled
                             else resume.load(ckpt_path, self.device))
        self.logger = RunLogger(cfg.logger, self.out_dir, self.config_dict, run_id=self.wandb_id,
                                group=run.group, name=run.name, enabled=self.dist.is_main)
        self.wandb_id = self.logger.run_id
        if ckpt_path is not None:
            self.logger.print(f"resumed from {ckpt_path} at step {self.step}")

    # -- the step ---------------------------------------------------------------------------------
    def _autocast(self):
        dtype = self.cfg.precision.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype.torch)

    def _compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.loss_module(x, y)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step over the global batch; returns this rank's mean loss as a device tensor."""
        accum, rank, world = self.cfg.trainer.grad_accum, self.dist.rank, self.dist.world_size
        total = torch.zeros((), device=self.device)
        # record_function: the phases by name in a profiler trace (bench_step.py --profile attributes GPU idle
        # time to them); ~6 us of host time each when no profiler runs (3 per micro-batch + 1 per step).
        for micro in range(accum):
            with record_function("minitrain.data"):
                x, y = self.train_batches.get(step, rank * accum + micro, world * accum)
            with distributed.grad_sync(self.loss_module, sync=micro == accum - 1):
                with record_function("minitrain.forward"):
                    loss = self.compute_loss(x, y)
                    scaled = loss / accum
                with record_function("minitrain.backward"):
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                    if micro == 0 and accum > 1 and self.cfg.trainer.cuda_graphs:
                        self._own_gradients()
            total += loss.detach().float()
        with record_function("minitrain.optimizer"):
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.trainer.lr_at(step)
            self.optimizer.step(scaler=self.scaler)
            self.optimizer.zero_grad(set_to_none=True)
        return total / accum

    def _own_gradients(self) -> None:
        """Under CUDA graphs the first micro-batch's gradients are graph outputs, in the pool the next replay
        overwrites: copied out once, the later micro-batches add into the copies."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad = p.grad.clone()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        rank, world = self.dist.rank, self.dist.world_size
        # clone: under CUDA graphs a call's output lives in memory that the next call's replay overwrites
        losses = torch.stack([self.compute_loss(*self.val_batches.get(i, rank, world)).float().clone()
                              for i in range(self.cfg.trainer.eval_batches)])
        self.model.train()
        return distributed.mean(losses.mean(), self.dist).item()

    # -- checkpoints ------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step,
            "rng": resume.rng_state(),
            "data": {"seed": self.cfg.trainer.seed, "next_step": self.step},
            "wandb_id": self.wandb_id,
            "config": self.config_dict,
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.wandb_id = state["step"], state["wandb_id"]
        resume.set_rng_state(state["rng"])

    def save(self) -> Path:
        if self.dist.enabled:
            path = resume.checkpoint_dir(self.out_dir) / resume.LATEST_SHARDED
            resume.save_sharded(self._state(), path, self.dist.rank)
        else:
            path = resume.checkpoint_dir(self.out_dir) / resume.LATEST
            resume.save_atomic(self._state(), path)
        return path

    # -- the loop ---------------------------------------------------------------------------------
    def _check_finite(self, nonfinite: torch.Tensor) -> None:
        if self.cfg.precision.loss_scaling:
            return  # overflow is the scaler's business: the step was skipped, nothing corrupted
        if distributed.mean(nonfinite, self.dist).item():
            raise NonFiniteLossError(
                f"the training loss became inf/NaN by step {self.step} ({self.cfg.precision.name}); "
                f"stopping with the last good checkpoint kept in {resume.checkpoint_dir(self.out_dir)} — "
                "try a lower trainer.lr, or precision=fp16 with loss scaling only if fp16 overflow is the cause")

    def _log_record(self, loss_sum: torch.Tensor, n: int, throughput: Throughput) -> dict[str, Any]:
        stats = self.optimizer.stats()
        loss = distributed.mean(loss_sum / max(n, 1), self.dist)
        record = {"step": self.step, "tokens": self.step * self.cfg.trainer.batch_size * self.model_cfg.block_size,
                  "train/loss": loss.item(), "opt/lr": self.cfg.trainer.lr_at(self.step - 1),
                  "opt/grad_norm": float(stats["grad_norm"]),
                  "amp/loss_scale": float(stats["loss_scale"]), "amp/skipped_steps": float(stats["skipped_steps"])}
        record.update(throughput.read())
        record.update(memory_stats(self.device))
        if self.dist.enabled:  # every rank's peak: under fsdp they should match, under imbalance they do not
            key = "mem/peak_allocated_gb" if self.device.type == "cuda" else "mem/rss_gb"
            for rank, value in enumerate(distributed.gather(record[key], self.dist)):
                record[f"mem/rank{rank}/{key[4:]}"] = value
        return record

    def fit(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        t = self.cfg.trainer
        compute = self.cfg.precision.compute_dtype.value
        peak = t.peak_flops or peak_flops(self.device, compute)
        T = self.model_cfg.block_size
        tokens_per_step = t.batch_size * T
        model_flops = self.model.flops_per_token(T)
        recompute = checkpointing.recompute_flops_per_token(self.model_cfg, self.cfg.checkpointing, T)
        throughput = Throughput(tokens_per_step, model_flops, model_flops + recompute,
                                peak and peak * self.dist.world_size)  # global tokens/s over all devices' peak
        on = f"{self.dist.world_size} x {self.device.type} ({self.dist.mode.value})" if self.dist.enabled else self.device
        self.logger.print(
            f"minitrain: {self.model_cfg.name} ({self.model.num_params() / 1e6:.2f}M params) on {on} | "
            f"precision={self.cfg.precision.name} checkpointing={self.cfg.checkpointing.policy.value} | "
            f"{tokens_per_step:,} tokens/step | run dir {self.out_dir}")
        self.logger.print(self.memory_estimate.table())
        self.logger.summary(self.memory_estimate.as_dict())
        compared = False
        loss_sum = torch.zeros((), device=self.device)
        nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        n_since_log, record = 0, {}
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", disable=not self.progress,
                   dynamic_ncols=True)
        try:
            while self.step < t.max_steps:
                loss = self.train_step(self.step)
                self.step += 1
                loss_sum += loss
                nonfinite |= ~torch.isfinite(loss)
                n_since_log += 1
                throughput.step()
                bar.update(1)
                is_last = self.step == t.max_steps
                logging, evaluating = self.step % t.log_every == 0 or is_last, self.step % t.eval_every == 0 or is_last
                saving = self.step % t.save_every == 0 or is_last
                if logging:
                    self._check_finite(nonfinite)
                    record = self._log_record(loss_sum, n_since_log, throughput)
                    loss_sum.zero_()
                    n_since_log = 0
                    if not compared and self.device.type == "cuda":
                        self.logger.print(self._memory_comparison())
                        compared = True
                if evaluating:
                    record = record if logging else {"step": self.step}
                    record["val/loss"] = self.evaluate()
                if logging or evaluating:
                    self.logger.log(record)
                    bar.set_postfix(loss=f"{record.get('train/loss', float('nan')):.3f}")
                if saving:
                    self._check_finite(nonfinite)
                    self.save()
                if logging or evaluating or saving:
                    throughput.restart()  # eval and saving are not training time
            bar.close()
            if self.dist.is_main:
                self._write_memory_json(record)
            record["sample"] = self.sample()
            self.logger.summary({k: v for k, v in record.items() if k != "step"})
            self.logger.finish()
        except BaseException:
            bar.close()
            self.logger.finish(exit_code=1)
            raise
        return record

    def _memory_comparison(self) -> str:
        s = torch.cuda.memory_stats(self.device)
        return memory.compare(self.memory_estimate, s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"],
                              cuda_graphs=self.cfg.trainer.cuda_graphs)

    def _write_memory_json(self, record: dict[str, Any]) -> None:
        """Predicted terms beside the measured peaks: what scripts/report.py reads per sweep cell."""
        measured = {k: v for k, v in record.items() if k.startswith("mem/")}
        (self.out_dir / "memory.json").write_text(json.dumps({**self.memory_estimate.as_dict(), **measured}, indent=1))

    def sample(self) -> str:
        """A short continuation of a fixed prompt: a human-readable check of what the model learned."""
        n = self.cfg.trainer.sample_tokens
        if n == 0:
            return ""
        prompt = "def "
        ids = torch.tensor([self.data.tokenizer.encode(prompt).ids], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.trainer.seed)
        self.model.eval()
        with self._autocast():  # on every rank: under fsdp each forward all-gathers the weights
            out = self.model.generate(ids, n, generator=gen)
        self.model.train()
        text = self.data.decode(out[0].tolist())
        if self.dist.is_main:
            (self.out_dir / "sample.txt").write_text(text)
        self.logger.print(f"sample:\n{text}")
        return text


def train(cfg: Config | DictConfig, run: RunInfo = RunInfo(), progress: bool = True) -> dict[str, Any]:
    """Build everything from `cfg` and train; returns the last logged record. Under torchrun a failing
    rank names itself on stderr and leaves the process group, so its peers fail too instead of waiting."""
    try:
        return Trainer(cfg, run, progress).fit()
    except BaseException as e:
        if torch.distributed.is_initialized():
            print(f"minitrain: rank {torch.distributed.get_rank()} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        raise
    finally:
        distributed.teardown()
