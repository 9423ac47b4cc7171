"""The plan: config + device, resolved once into everything the step will do, before anything is allocated.

Every `auto` is settled here — device, precision, TF32, compile mode and CUDA graphs, the loss /
optimizer / GELU implementations, the micro-batch and gradient accumulation, the checkpointing policy,
the warmup — and the memory model predicts the step's peak against the device's memory. A run that
cannot fit stops here, in a second, naming the setting to change; it does not die in the allocator.
With `trainer.micro_batch=auto` and `checkpointing=auto` the plan picks the pair with the highest
predicted throughput that fits `trainer.memory_budget`. Everything downstream reads the Plan.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import torch

from . import fp8, memory
from .recompute import recomputed_blocks
from .config import BLOCK_LINEARS, CheckpointingConfig, CheckpointPolicy, Config, DistributedMode, Float8Kernels, \
    Float8Recipe, TrainerConfig
from .errors import ConfigError
from .memory import GB, Candidate, MemoryEstimate
from .model import GPT
from .model_config import SCRATCH, KernelImpl, ModelConfig, padded_vocab
from .optimizer_config import OptimizerImpl, OptimizerName
from .precision import Precision, resolve_precision
from .schedule import LRSchedule, default_warmup

# The throughput model the auto-fit ranks candidates with. A micro-batch of n tokens runs at
# n / (n + HALF_RATE_TOKENS) of the device's large-batch rate (per-micro-batch fixed costs: launches,
# the optimizer's share, small GEMMs); recomputation costs a fraction of the step per policy, full
# recompute of every block RECOMPUTE_COST["full"] (every_k: that times the share of blocks rerun).
# Measured on gpt2-124m, bf16, one H200: docs/benchmarks.md ("The plan's auto-fit").
HALF_RATE_TOKENS = 1024
RECOMPUTE_COST = {"none": 0.0, "selective": 0.03, "full": 0.17}
EVERY_K_CANDIDATES = (4, 2)  # every_k policies the auto-fit tries between selective and full
CLOSE_TO_BUDGET = 0.95  # an explicit setting predicted above this share of the budget gets a warning
CPUINFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86: AVX512-BF16, AMX-BF16; Arm: BF16


def cpu_has_bf16() -> bool:
    """Whether this CPU lists bf16 matmul instructions in /proc/cpuinfo, where bf16 runs faster than fp32 (without
    them, many times slower). False where there is no /proc/cpuinfo (not Linux): unknown."""
    try:
        return bool(BF16_CPU_FLAGS & set(CPUINFO.read_text().split()))
    except OSError:
        return False
DETERMINISM = {True: "yes: two runs of this config compute the same bits",
               False: "no: the fastest kernels, whose sums may round differently from run to run"}


class PlanError(ConfigError):
    """The step as configured cannot run on this device (it does not fit); the message says what to change."""


@dataclass(frozen=True)
class Plan:
    device: torch.device
    device_name: str
    world_size: int
    distributed: DistributedMode
    model: ModelConfig  # vocab settled, gelu resolved
    precision: Precision
    compile_mode: Optional[str]  # None: eager
    loss_impl: str  # fused | torch
    optimizer_impl: str  # fused | foreach | loop | torch
    batch_size: int  # global sequences per optimizer step
    micro_batch: int  # sequences per forward on each rank
    checkpointing: CheckpointingConfig
    schedule: LRSchedule
    max_skipped_steps: int
    memory: MemoryEstimate
    memory_budget: int  # bytes
    device_memory: int  # bytes: the device's total (CUDA) or the RAM available at start (CPU)
    deterministic: bool  # trainer.deterministic: bit-identical runs (minitrain/determinism.py)
    placement: dict[str, Any]  # where this process runs: placement()
    auto: tuple[str, ...] = ()  # the settings resolved from `auto`
    notes: tuple[str, ...] = field(default=())
    float8_linears: tuple[str, ...] = ()  # precision.float8: each block's linears that multiply in float8
    float8_all_gather: bool = False  # fsdp: those linears' weights are all-gathered in float8
    optimizer: OptimizerName = OptimizerName.adamw
    muon_lr: Optional[float] = None  # optimizer=muon: its lr at the schedule's peak (trainer.lr)

    @property
    def compiled(self) -> bool:
        return self.compile_mode is not None

    @property
    def cuda_graphs(self) -> bool:
        """The compiled step replays CUDA graphs: their memory comes from a pool the allocated counter misses."""
        return self.device.type == "cuda" and self.compile_mode in ("reduce-overhead", "max-autotune")

    @property
    def grad_accum(self) -> int:
        return self.batch_size // (self.micro_batch * self.world_size)

    def _qk_kernel(self) -> str:
        return f" qk={self.model.qk_kernel.value}" if self.model.remakes_qk else ""

    def _tag(self, key: str) -> str:
        return " (auto)" if key in self.auto else ""

    def describe(self) -> str:
        """The block printed at start: what the step will do, and the memory it is predicted to take."""
        T = self.model.block_size
        on = f"{self.world_size} x {self.device_name} ({self.distributed.value})" if self.world_size > 1 \
            else self.device_name
        policy = self.checkpointing.policy.value + (f" (k={self.checkpointing.every_k})"
                                                    if self.checkpointing.policy == CheckpointPolicy.every_k else "")
        ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
        compiled = "eager" if not self.compiled else f"torch.compile mode={self.compile_mode}" + \
            (" (CUDA graphs)" if self.cuda_graphs else "")
        lines = [
            f"plan: {self.model.name} on {on}",
            f"  block          {self.model.describe_block()}",
            f"  precision      {self.precision.name}{self._tag('precision')}: {self.precision.describe()}"
            + (f" in each block's {', '.join(self.float8_linears)}" if self.float8_linears else "")
            + (", gathered in float8" if self.float8_all_gather else ""),
            f"  compile        {compiled}{self._tag('compile')}",
            f"  kernels        loss={self.loss_impl} optimizer={self.optimizer_impl}"
            f"{' muon' if self.optimizer == OptimizerName.muon else ''} "
            f"gelu={self.model.gelu.value}{self._qk_kernel()}{self._tag('kernels')}",
            f"  batch          {self.batch_size} x {T} = {self.batch_size * T:,} tokens/step: micro-batch "
            f"{self.micro_batch} x {self.grad_accum} accumulation{ranks}{self._tag('micro_batch')}",
            f"  checkpointing  {policy}{self._tag('checkpointing')}",
            f"  schedule       lr {self.schedule.lr:g} -> {self.schedule.min_lr:g}"
            + (f" (Muon's {self.muon_lr:g} -> {self.muon_lr * self.schedule.min_lr / self.schedule.lr:g})"
               if self.muon_lr is not None else "")
            + f", warmup {self.schedule.warmup_steps} of {self.schedule.max_steps} steps{self._tag('warmup')}",
            f"  memory         predicted peak {self.memory.peak / GB:.2f} GB of a {self.memory_budget / GB:.1f} GB "
            f"budget ({self.memory_budget / self.device_memory:.0%} of {self.device_memory / GB:.1f} GB"
            f"{' available' if self.device.type == 'cpu' else ''})",
            f"  deterministic  {DETERMINISM[self.deterministic]}",
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def as_dict(self) -> dict[str, Any]:
        """Flat values for the wandb config and metrics.jsonl's first record."""
        return {"device": self.device_name, "world_size": self.world_size, "distributed": self.distributed.value,
                "precision": self.precision.name, "param_dtype": str(self.precision.param_dtype),
                "float8": self.precision.float8.value, "float8_linears": list(self.float8_linears),
                "float8_all_gather": self.float8_all_gather,
                "tf32": self.precision.tf32, "compile_mode": self.compile_mode or "eager",
                "cuda_graphs": self.cuda_graphs, "loss": self.loss_impl, "optimizer": self.optimizer_impl,
                "optimizer_name": self.optimizer.value, "muon_lr": self.muon_lr,
                "gelu": self.model.gelu.value, "qk_kernel": self.model.qk_kernel.value,
                "batch_size": self.batch_size, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "checkpointing": self.checkpointing.policy.value,
                "every_k": self.checkpointing.every_k, "warmup_steps": self.schedule.warmup_steps,
                "max_skipped_steps": self.max_skipped_steps, "predicted_peak_gb": self.memory.peak / GB,
                "memory_budget_gb": self.memory_budget / GB, "deterministic": self.deterministic,
                **self.placement, "auto": list(self.auto)}


def placement(device: torch.device) -> dict[str, Any]:
    """Where this process runs, so that the cells of a sweep (and the ranks of a torchrun) can be told apart in
    their records: the host, the process id, the devices CUDA lets it see and the index of the one it uses."""
    index = None
    if device.type == "cuda":  # an unnumbered "cuda" is torch's current device: 0 (only torchrun's ranks set theirs)
        index = 0 if device.index is None else device.index
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "device_index": index}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def device_memory(device: torch.device) -> int:
    """What one process may fill: the GPU's total memory, or the RAM available now on a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().available


def model_config_for(cfg: Config, tokenizer_vocab: int, device: torch.device) -> ModelConfig:
    """The model config with vocab_size settled against the tokenizer and the `auto` of model.gelu and model.qk_kernel
    resolved. Rows fewer than the tokenizer's ids are refused, naming the setting that fixes it: a token past the
    head's rows would index no row (or padding the head never scores)."""
    gelu, qk = (KernelImpl.fused if impl.fused_on(device.type) else KernelImpl.torch
                for impl in (cfg.model.gelu, cfg.model.qk_kernel))
    model = replace(cfg.model, vocab_size=cfg.model.vocab_size or padded_vocab(tokenizer_vocab), gelu=gelu,
                    qk_kernel=qk)
    rows, key = (model.head_vocab, "model.head_vocab") if model.head_vocab else (model.vocab_size, "model.vocab_size")
    if rows < tokenizer_vocab:
        source = f"data.vocab_size={cfg.data.vocab_size}" if cfg.data.tokenizer == "train" else \
            f"data.tokenizer={cfg.data.tokenizer}"
        smaller = f"is smaller than the tokenizer's vocabulary ({tokenizer_vocab}, from {source})"
        if cfg.model.init_from == SCRATCH:
            raise ConfigError(f"{key}={rows} {smaller}; {key}=null sizes it to the tokenizer")
        fix = "name it in data.tokenizer" if cfg.data.tokenizer == cfg.model.init_from else \
            "leave data.tokenizer out (it follows model.init_from) or name that one"
        raise ConfigError(f"{key}={rows} (model.init_from={cfg.model.init_from}'s vocab) {smaller}; the weights need "
                          f"the tokenizer they were trained with: {fix}")
    return model


def _surplus_vocab_note(cfg: Config, model: ModelConfig, tokenizer_vocab: int) -> Optional[str]:
    """A model whose head scores more rows than the tokenizer has ids, beyond their padding (a GPT-2 preset's 50304
    over a corpus's 4096-token BPE): logits of tokens that never occur, computed every step. Said with their share
    of the step's FLOPs (MFU's count: the head's matmul is 6 x n_embd FLOPs per row and token) and the setting that
    sizes the vocabulary to the tokenizer. Weights' rows (model.init_from) are theirs to keep."""
    fitted, head = padded_vocab(tokenizer_vocab), model.head_vocab or model.vocab_size
    if cfg.model.init_from != SCRATCH or head <= fitted:
        return None
    with torch.device("meta"):
        step = GPT(model).flops_per_token(model.block_size)
    share = 6 * model.n_embd * (head - fitted) / step
    key, fix = ("model.head_vocab", "model.vocab_size=null model.head_vocab=null") if model.head_vocab else \
        ("model.vocab_size", "model.vocab_size=null")
    return (f"{key}={head} scores {head - fitted:,} rows more than the tokenizer's {tokenizer_vocab:,} ids need "
            f"(padded to {fitted:,}): logits of tokens that never occur, {share:.1%} of the step's FLOPs; "
            f"{fix} sizes the vocabulary to the tokenizer")


def _compile_mode(cfg: Config, device: torch.device) -> Optional[str]:
    """auto: compiled on CUDA (CUDA graphs in one process; hooks and collectives of ddp/fsdp are not
    validated under graphs), eager on a CPU, where compiling a short run costs more than it saves."""
    t = cfg.trainer
    on = device.type == "cuda" if t.compile == "auto" else t.compile == "true"
    if not on:
        return None
    if t.compile_mode != "auto":
        return t.compile_mode
    one_process = cfg.distributed.mode == DistributedMode.none
    return "reduce-overhead" if device.type == "cuda" and one_process else "default"


def _policies(cfg: CheckpointingConfig, n_layer: int) -> list[CheckpointingConfig]:
    """The policies to try, cheapest recompute first."""
    if cfg.policy != CheckpointPolicy.auto:
        return [cfg]
    every_k = [CheckpointingConfig(CheckpointPolicy.every_k, k) for k in EVERY_K_CANDIDATES if k <= n_layer]
    return [CheckpointingConfig(CheckpointPolicy.none), CheckpointingConfig(CheckpointPolicy.selective), *every_k,
            CheckpointingConfig(CheckpointPolicy.full)]


def _float8_linears(precision: Precision, model: ModelConfig, device: torch.device) -> tuple[str, ...]:
    """The blocks' linears that precision.float8 converts; a device that cannot multiply in float8 stops here."""
    if precision.float8 == Float8Recipe.none:
        return ()
    reason = fp8.unavailable_reason(device)
    if reason is not None:
        raise PlanError(f"precision={precision.name}: {reason}")
    if precision.float8_linears is not None:  # the user's, in the block's order
        if model.n_embd % 16:  # every block linear has n_embd as one of its two dimensions
            raise PlanError(f"precision.float8_linears: float8 GEMMs need dimensions in multiples of 16, and "
                            f"{model.name} has n_embd={model.n_embd}")
        return tuple(name for name in BLOCK_LINEARS if name in precision.float8_linears)
    return fp8.float8_linears(model, precision.float8)


def recompute_cost(policy: CheckpointingConfig, n_layer: int) -> float:
    if policy.policy == CheckpointPolicy.selective:
        return RECOMPUTE_COST["selective"]
    return RECOMPUTE_COST["full"] * sum(recomputed_blocks(policy, n_layer)) / n_layer


def predicted_rate(micro_tokens: int, policy: CheckpointingConfig, n_layer: int) -> float:
    """Relative tokens/s of a candidate (only its ranking matters)."""
    return micro_tokens / (micro_tokens + HALF_RATE_TOKENS) / (1 + recompute_cost(policy, n_layer))


def make_plan(cfg: Config, tokenizer_vocab: int, device: torch.device, world_size: int = 1,
              device_memory_bytes: Optional[int] = None) -> Plan:
    """device_memory_bytes: what the budget is a fraction of, in place of the device's own (a benchmark plans
    for a GPU it is not on, or lets the allocator decide what fits)."""
    t = cfg.trainer
    precision = resolve_precision(cfg.precision, device, tf32=t.tf32, optimizer_impl=cfg.optimizer.impl)
    compile_mode = _compile_mode(cfg, device)
    model = model_config_for(cfg, tokenizer_vocab, device)
    float8_linears = _float8_linears(precision, model, device)
    loss_impl, optimizer_impl = _kernels(cfg, device)
    auto = _resolved_from_auto(cfg, compile_mode)
    notes = _precision_notes(precision, model, float8_linears, device)
    if (surplus := _surplus_vocab_note(cfg, model, tokenizer_vocab)) is not None:
        notes.append(surplus)
    if t.batch_size % world_size:
        raise ConfigError(f"trainer.batch_size: the global batch of {t.batch_size} sequences does not split "
                          f"into {world_size} ranks")
    per_rank = t.batch_size // world_size
    sharded = cfg.distributed.mode == DistributedMode.fsdp
    float8_all_gather = sharded and precision.float8 == Float8Recipe.tensorwise and bool(float8_linears) \
        and precision.float8_kernels == Float8Kernels.torchao and cfg.distributed.fsdp_float8_all_gather
    total = device_memory(device) if device_memory_bytes is None else device_memory_bytes
    budget = int(t.memory_budget * total)

    step = Candidate(model, precision, per_rank, cfg.checkpointing, loss_impl=loss_impl,
                     chunk_bytes=cfg.loss.chunk_bytes, loss_low_memory=cfg.loss.low_memory,
                     optimizer=cfg.optimizer.name, optimizer_impl=optimizer_impl, device=device.type,
                     compiled=compile_mode is not None, float8_linears=float8_linears, world_size=world_size,
                     sharded=sharded, fsdp_unit_blocks=cfg.distributed.fsdp_unit_blocks,
                     reshard_after_forward=cfg.distributed.reshard_after_forward, float8_all_gather=float8_all_gather)

    def predict(micro: int, policy: CheckpointingConfig) -> MemoryEstimate:
        return memory.predict(replace(step, micro_batch=micro, policy=policy, grad_accum=per_rank // micro))

    candidates = _candidates(cfg.checkpointing, model, _micro_batches(t, per_rank, world_size))
    micro, policy, estimate = _fit(candidates, predict, cfg, precision, budget, total, device)
    if not {"micro_batch", "checkpointing"} & set(auto) and estimate.peak > CLOSE_TO_BUDGET * budget:
        notes.append(f"the predicted peak is {estimate.peak / budget:.0%} of trainer.memory_budget")

    warmup = default_warmup(t.max_steps) if t.warmup_steps is None else t.warmup_steps
    max_skipped = t.max_skipped_steps or (25 if precision.loss_scaling else 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else device.type
    return Plan(device=device, device_name=name, world_size=world_size, distributed=cfg.distributed.mode,
                model=model, precision=precision, compile_mode=compile_mode, loss_impl=loss_impl,
                optimizer_impl=optimizer_impl, batch_size=t.batch_size, micro_batch=micro, checkpointing=policy,
                schedule=LRSchedule(t.lr, t.min_lr, warmup, t.max_steps), max_skipped_steps=max_skipped,
                memory=estimate, memory_budget=budget, device_memory=total, deterministic=t.deterministic,
                placement=placement(device), auto=auto, notes=tuple(notes), float8_linears=float8_linears,
                float8_all_gather=float8_all_gather, optimizer=cfg.optimizer.name,
                muon_lr=cfg.optimizer.muon.lr if cfg.optimizer.name == OptimizerName.muon else None)


def _kernels(cfg: Config, device: torch.device) -> tuple[str, str]:
    """The loss's and the optimizer's implementations; `auto` is the fused kernel where it runs."""
    loss_impl = "fused" if cfg.loss.impl.fused_on(device.type) else "torch"
    optimizer_impl = cfg.optimizer.impl.value
    if cfg.optimizer.impl == OptimizerImpl.auto:
        optimizer_impl = "fused" if device.type == "cuda" else "foreach"
    return loss_impl, optimizer_impl


def _resolved_from_auto(cfg: Config, compile_mode: Optional[str]) -> tuple[str, ...]:
    """The settings the plan chose (describe() tags them): those left at `auto`."""
    t = cfg.trainer
    chosen = {"device": t.device.value == "auto", "precision": cfg.precision.name == "auto",
              "compile": t.compile == "auto" or (compile_mode is not None and t.compile_mode == "auto"),
              "kernels": KernelImpl.auto in (cfg.loss.impl, cfg.model.gelu) or cfg.optimizer.impl == OptimizerImpl.auto
                         or (cfg.model.remakes_qk and cfg.model.qk_kernel == KernelImpl.auto),
              "micro_batch": t.micro_batch == "auto",
              "checkpointing": cfg.checkpointing.policy == CheckpointPolicy.auto,
              "warmup": t.warmup_steps is None}
    return tuple(setting for setting, is_auto in chosen.items() if is_auto)


def _precision_notes(precision: Precision, model: ModelConfig, float8_linears: tuple[str, ...],
                     device: torch.device) -> list[str]:
    """A precision that runs, but many times slower than fp32 on this CPU or exactly as bf16 does, is named."""
    notes = []
    if device.type == "cpu" and precision.compute_dtype == torch.float16:
        notes.append(f"precision={precision.name} on a CPU: fp16 matmuls run tens of times slower than fp32 "
                     "there (precision=auto picks fp32 on a CPU)")
    elif device.type == "cpu" and precision.compute_dtype == torch.bfloat16 and not cpu_has_bf16():
        notes.append(f"precision={precision.name} on a CPU without bf16 instructions (AVX512-BF16, AMX): bf16 "
                     "matmuls run many times slower than fp32 here (precision=auto picks fp32)")
    if precision.float8 != Float8Recipe.none and not float8_linears:
        notes.append(f"precision={precision.name}: no linear of {model.name} is wide enough for float8 to gain "
                     "(torchao's filter); every matmul runs in bf16")
    return notes


def _micro_batches(t: TrainerConfig, per_rank: int, world_size: int) -> list[int]:
    """The micro-batches to try: with `auto`, every divisor of the rank's share of the batch."""
    if t.micro_batch == "auto":
        return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
    micro = int(t.micro_batch)
    if per_rank % micro:
        raise ConfigError(f"trainer.micro_batch={micro} does not divide the {per_rank} sequences of each of "
                          f"{world_size} ranks (trainer.batch_size={t.batch_size})")
    return [micro]


def _candidates(checkpointing: CheckpointingConfig, model: ModelConfig,
                micro_batches: list[int]) -> list[tuple[int, CheckpointingConfig]]:
    """(micro-batch, policy) pairs, fastest first (sorting is stable: on a tie the cheaper policy, then the larger
    micro-batch)."""
    return sorted(((m, p) for p in _policies(checkpointing, model.n_layer) for m in micro_batches),
                  key=lambda c: predicted_rate(c[0] * model.block_size, c[1], model.n_layer), reverse=True)


def _fit(candidates: list[tuple[int, CheckpointingConfig]],
         predict: Callable[[int, CheckpointingConfig], MemoryEstimate], cfg: Config, precision: Precision,
         budget: int, total: int, device: torch.device) -> tuple[int, CheckpointingConfig, MemoryEstimate]:
    """The first candidate whose predicted peak is within the budget: they come fastest first, so only those faster
    than the plan are predicted. When none fits, the error shows the smallest."""
    too_big = []
    for micro, policy in candidates:
        if (estimate := predict(micro, policy)).peak <= budget:
            return micro, policy, estimate
        too_big.append((estimate, micro))
    raise PlanError(_no_fit_message(cfg, precision, *min(too_big, key=lambda c: c[0].peak), budget, total,
                                    device))


def _no_fit_message(cfg: Config, precision: Precision, smallest: MemoryEstimate, micro: int, budget: int,
                    total: int, device: torch.device) -> str:
    where = "of the RAM available" if device.type == "cpu" else "of the device's memory"
    tried = []
    if cfg.trainer.micro_batch != "auto":
        tried.append("trainer.micro_batch=auto")
    if cfg.checkpointing.policy != CheckpointPolicy.auto:
        tried.append("checkpointing=auto")
    needed = math.ceil(smallest.peak / total * 100) / 100  # the budget fraction the smallest step needs
    if cfg.trainer.memory_budget < needed <= 1:
        tried.append(f"trainer.memory_budget={needed:g}")
    if device.type == "cuda" and precision.param_dtype == torch.float32:
        tried.append("precision=bf16")  # 2-byte params and activations
    advice = ", ".join(tried + ["a smaller model", "or distributed=fsdp over more devices"])
    return (f"the step does not fit: its smallest predicted peak is {smallest.peak / GB:.2f} GB (micro-batch "
            f"{micro}), over trainer.memory_budget={cfg.trainer.memory_budget} {where} "
            f"({budget / GB:.2f} of {total / GB:.2f} GB). Try {advice}.\n{smallest.table()}")
