"""Typed configuration: one dataclass per Hydra config group, holding every default.

The dataclasses are registered in Hydra's ConfigStore as the schema of `configs/config.yaml`, which picks one
option per group; an option's file sets only what makes it that option, so each default is written once, here (the
model group's in minitrain/model_config.py, the optimizer group's in minitrain/optimizer_config.py). OmegaConf
validates against this schema: while Hydra composes, and before that on the command line (minitrain/cli.py), where
what it refuses is said in one line naming the key (for an unknown one, the closest settings). Checks that need more
than a type (ranges, combinations) live in `__post_init__`, which runs when `resolve()` turns the composed config
into these objects, before any work starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import List, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from .errors import ConfigError, require
from .loss_scale import LossScaling
from .model_config import SCRATCH, SHAPE_KEYS, KernelImpl, ModelConfig
from .optimizer_config import OptimizerConfig, OptimizerImpl


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"

    @property
    def torch(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


class Float8Recipe(str, Enum):
    """torchao's float8 training recipes: how each cast to float8 is scaled (minitrain/fp8.py)."""

    none = "none"  # every matmul in the param dtype
    tensorwise = "tensorwise"  # one scale per tensor: cuBLAS's fp8 GEMM, the fastest
    rowwise = "rowwise"  # one scale per row: kinder to outliers, costlier casts and GEMMs


# Each block's linears by their names inside it (minitrain/model.py's Block), in its order.
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class Float8Kernels(str, Enum):
    """Whose kernels cast to float8 and multiply (minitrain/fp8.py)."""

    minitrain = "minitrain"  # Triton casts in two memory passes around cuBLAS's float8 GEMM (tensorwise only)
    torchao = "torchao"  # torchao's Float8Linear: its casts fused by torch.compile; rowwise and FSDP2 float8 gathers


class CheckpointPolicy(str, Enum):
    auto = "auto"  # the plan picks the cheapest policy that fits trainer.memory_budget
    none = "none"
    full = "full"
    every_k = "every_k"
    selective = "selective"


class DataSource(str, Enum):
    stdlib = "stdlib"
    packages = "packages"
    files = "files"
    hub = "hub"


class LoggerMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DistributedMode(str, Enum):
    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"


@dataclass
class DataConfig:
    name: str = "stdlib"
    source: DataSource = DataSource.stdlib
    # source=files: a glob of local text files (recursive `**` allowed).
    paths: Optional[str] = None
    # source=hub: a Hugging Face dataset by name (or a local copy's directory), streamed.
    hub_name: Optional[str] = None
    hub_config: Optional[str] = None
    hub_split: str = "train"
    text_column: str = "text"
    # train: a byte-level BPE of data.vocab_size tokens trained on the corpus; else a pretrained one: a Hugging
    # Face name (gpt2) or a directory holding tokenizer.json (or vocab.json + merges.txt) (minitrain/data/tokenizer.py).
    # With model.init_from the command line makes it follow model.init_from unless given (minitrain/cli.py).
    tokenizer: str = "train"
    vocab_size: int = 4096  # tokenizer=train only
    # tokenizer=train learns its merges from at most this many MB of the corpus (evenly spaced over local files,
    # the first MB of a hub stream), so its memory and time do not grow with the corpus.
    tokenizer_sample_mb: int = 64
    # Each document goes to validation with this probability, decided by a hash of its text.
    val_fraction: float = 0.005
    shard_tokens: int = 1 << 26  # tokens per shard file (the last of each split holds the rest)
    cache_dir: str = "~/.cache/minitrain"

    def __post_init__(self):
        if self.tokenizer == "train":
            require(self.vocab_size >= 260, "data.vocab_size",
                    f"a byte-level BPE needs >= 260 tokens (256 bytes + specials), got {self.vocab_size}")
        require(self.tokenizer.strip() != "", "data.tokenizer",
                "train, or a pretrained tokenizer's name (gpt2) or directory, got ''")
        require(self.tokenizer_sample_mb >= 1, "data.tokenizer_sample_mb",
                f"must be >= 1, got {self.tokenizer_sample_mb}")
        require(0.0 < self.val_fraction < 0.5, "data.val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        require(self.shard_tokens >= 1024, "data.shard_tokens", f"must be >= 1024, got {self.shard_tokens}")
        if self.source == DataSource.files:
            require(bool(self.paths), "data.paths", "source=files needs a glob of text files, e.g. data.paths='corpus/**/*.txt'")
        if self.source == DataSource.hub:
            require(bool(self.hub_name), "data.hub_name", "source=hub needs a dataset name, e.g. data.hub_name=roneneldan/TinyStories")


@dataclass
class PrecisionConfig:
    name: str = "auto"  # auto: a preset chosen per device (minitrain/precision.py)
    param_dtype: DType = DType.fp32  # dtype of the model's weights (the compute copy)
    autocast_dtype: Optional[DType] = None  # torch.autocast around forward + loss (fp32 params only)
    master_weights: bool = False  # fp32 master copy in the optimizer (for bf16/fp16 params)
    grad_dtype: Optional[DType] = None  # None: gradients in param dtype; fp32: fp32 main grads
    loss_scaling: bool = False  # dynamic loss scaling (fp16 range)
    float8: Float8Recipe = Float8Recipe.none  # the blocks' linears multiply in float8, cast from bf16
    float8_kernels: Float8Kernels = Float8Kernels.minitrain  # whose casts and GEMMs (precision.float8 != none)
    # null: torchao's shape filter picks the linears wide enough to gain; a list: exactly these of BLOCK_LINEARS
    # (with precision.float8 != none)
    float8_linears: Optional[List[str]] = None
    # the dynamic loss scaler's parameters (with precision.loss_scaling): minitrain/loss_scale.py, torch's defaults
    init_scale: float = LossScaling.init_scale
    growth_factor: float = LossScaling.growth_factor
    backoff_factor: float = LossScaling.backoff_factor
    growth_interval: int = LossScaling.growth_interval

    def __post_init__(self):
        require(self.init_scale > 0 and self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0,
                "precision.init_scale/growth_factor/backoff_factor",
                "need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1")
        require(self.growth_interval >= 1, "precision.growth_interval", f"must be >= 1, got {self.growth_interval}")
        if self.name == "auto":  # the combination is checked once the device's preset is filled in
            return
        low = self.param_dtype != DType.fp32
        require(not (self.master_weights and not low), "precision.master_weights",
                "fp32 params need no fp32 master copy; set precision.master_weights=false")
        require(self.autocast_dtype is None or not low, "precision.autocast_dtype",
                f"autocast is for fp32 params; params are already {self.param_dtype.value}")
        require(self.autocast_dtype != DType.fp32, "precision.autocast_dtype", "use null, not fp32, for no autocast")
        require(self.grad_dtype is None or self.grad_dtype == DType.fp32, "precision.grad_dtype",
                f"must be null (param dtype) or fp32, got {self.grad_dtype}")
        require(self.grad_dtype is None or self.master_weights, "precision.grad_dtype",
                "fp32 main grads go with fp32 master weights (precision.master_weights=true)")
        require(self.float8 == Float8Recipe.none or self.param_dtype == DType.bf16, "precision.float8",
                f"float8 matmuls cast from bf16 params (precision=fp8); got precision.param_dtype="
                f"{self.param_dtype.value}")
        require(self.float8 != Float8Recipe.rowwise or self.float8_kernels == Float8Kernels.torchao,
                "precision.float8_kernels", "minitrain's float8 kernels scale per tensor; rowwise runs on torchao")
        if self.float8_linears is not None:  # without float8 it is not read, as float8_kernels (a sweep sets both)
            require(len(self.float8_linears) > 0, "precision.float8_linears",
                    "is empty: every matmul in bf16 is precision=bf16")
            unknown = [name for name in self.float8_linears if name not in BLOCK_LINEARS]
            require(not unknown, "precision.float8_linears",
                    f"{', '.join(map(repr, unknown))} is not one of a block's linears: {', '.join(BLOCK_LINEARS)}")


@dataclass
class CheckpointingConfig:
    policy: CheckpointPolicy = CheckpointPolicy.auto
    every_k: int = 2  # policy=every_k: recompute every k-th block


@dataclass
class LossConfig:
    impl: KernelImpl = KernelImpl.auto
    chunk_bytes: Optional[int] = None  # fused: logit workspace budget in bytes (None: the kernel's default)
    low_memory: bool = False  # fused: no fp32 V x H weight-grad accumulator, for a fourth GEMM

    def __post_init__(self):
        require(self.chunk_bytes is None or self.chunk_bytes > 0, "loss.chunk_bytes",
                f"must be a positive number of bytes or null, got {self.chunk_bytes}")


@dataclass
class LoggerConfig:
    mode: LoggerMode = LoggerMode.offline
    project: str = "minitrain"
    group: Optional[str] = None  # None: the sweep's name under -m, else no group
    name: Optional[str] = None  # None: the job's overrides under -m, else the run dir's name
    tags: List[str] = field(default_factory=list)


@dataclass
class DistributedConfig:
    mode: DistributedMode = DistributedMode.none
    timeout_s: int = 600  # a rank that stops answering takes the job down after this long
    # fsdp only. Consecutive blocks sharded as one unit (one all-gather, one reduce-scatter each way): FSDP2's
    # hooks cost host time per unit and step, so one unit per block left the GPUs idle; 4 measured best on
    # 2 H200s (docs/benchmarks.md, "Distributed"), at 6 more blocks gathered at once.
    fsdp_unit_blocks: int = 4
    # fsdp only. false keeps each unit's gathered params from forward to backward (no second all-gather,
    # ZeRO-2-like: + the compute-dtype params at the peak).
    reshard_after_forward: bool = True
    # fsdp with precision.float8=tensorwise on torchao's kernels only. The float8 linears' weights are cast to float8
    # on their shard and all-gathered as such (torchao's float8 all-gather: half the bytes of bf16, one cast per
    # weight and step).
    fsdp_float8_all_gather: bool = True

    def __post_init__(self):
        require(self.timeout_s >= 1, "distributed.timeout_s", f"must be >= 1, got {self.timeout_s}")
        require(self.fsdp_unit_blocks >= 1, "distributed.fsdp_unit_blocks", f"must be >= 1, got {self.fsdp_unit_blocks}")


SWITCHES = ("auto", "true", "false")
COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainerConfig:
    max_steps: int = 300
    batch_size: int = 32  # global batch, sequences per optimizer step
    # Sequences per forward on each rank: auto (the plan picks what fits trainer.memory_budget, with
    # checkpointing=auto) or a number dividing batch_size / world size; the rest is gradient accumulation.
    micro_batch: str = "auto"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: Optional[int] = None  # linear warmup, then cosine decay; None: 10% of max_steps
    eval_every: int = 100
    eval_batches: int = 10
    # Stop after the first evaluation whose validation loss (val/loss) is at or below this, as at max_steps (its
    # checkpoint saved, its record marked: loop.TARGET_REACHED); null: off. A resume goes on to the next evaluation.
    target_loss: Optional[float] = None
    # HellaSwag accuracy at every eval: null (off), hub (its validation set from the Hugging Face hub, needs
    # network once), or a local copy's path (hellaswag_val.jsonl: activity_label, ctx_a, ctx_b, endings, label per line).
    eval_hellaswag: Optional[str] = None
    eval_hellaswag_examples: Optional[int] = None  # the first N examples; null: all (10042 in the validation set)
    log_every: int = 10
    save_every: int = 100  # and at the last step; 0: no checkpoints at all (a benchmark's run)
    sample_tokens: int = 64
    seed: int = 1337
    out_dir: str = MISSING  # configs/config.yaml: the run dir Hydra made (runs/<date>/<time>/, or hydra.run.dir)
    resume: str = "none"  # none | auto (latest checkpoint in out_dir) | a checkpoint path
    device: Device = Device.auto
    # torch.compile of forward + loss: auto (on for CUDA, off on a CPU) | true | false
    compile: str = "auto"
    # auto: reduce-overhead (CUDA graphs) in one process on CUDA, default under ddp/fsdp;
    # or default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    compile_mode: str = "auto"
    # The first compiled step's loss against the uncompiled forward's on the same batch; a run whose compiled
    # code computes another function stops there (minitrain/compile_check.py). Not with dropout (the two
    # forwards draw different masks).
    compile_check: bool = True
    tf32: bool = True  # fp32 matmuls on TF32 tensor cores (CUDA only)
    # Two runs of one config compute the same bits, a resumed run those of an unbroken one: kernels whose sums
    # run in a varying order are swapped for ordered ones (minitrain/determinism.py). Costs tokens/s on a GPU.
    deterministic: bool = False
    # CUDA's caching allocator grows segments in place instead of caching fixed blocks: a run reserves little
    # beyond what its tensors hold, so the measured peak is the memory model's (minitrain/memory.py). false: the
    # allocator's default, or PYTORCH_CUDA_ALLOC_CONF's setting.
    expandable_segments: bool = True
    memory_budget: float = 0.9  # fraction of the device's memory (a CPU: of available RAM) the plan may fill
    # A run stops after this many optimizer steps skipped in a row (inf/NaN gradients); None: 3 without
    # loss scaling (a diverged run), 25 with it (fp16 backs off once per skip; 25 halvings is a diverged run).
    max_skipped_steps: Optional[int] = None
    # Peak FLOP/s of one device for MFU; None: looked up by GPU name and compute dtype.
    peak_flops: Optional[float] = None

    def __post_init__(self):
        for key in ("max_steps", "batch_size", "log_every", "eval_every", "eval_batches"):
            require(getattr(self, key) >= 1, f"trainer.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.save_every >= 0, "trainer.save_every", f"must be >= 0 (0: no checkpoints), got {self.save_every}")
        self.compile = self.compile.lower()
        require(self.compile in SWITCHES, "trainer.compile", f"one of {SWITCHES}, got {self.compile!r}")
        require(self.micro_batch == "auto" or (self.micro_batch.isdigit() and int(self.micro_batch) >= 1),
                "trainer.micro_batch", f"auto or a positive number of sequences, got {self.micro_batch!r}")
        if self.micro_batch != "auto":
            require(int(self.micro_batch) <= self.batch_size, "trainer.micro_batch",
                    f"{self.micro_batch} is larger than the global batch, trainer.batch_size={self.batch_size}")
            require(self.batch_size % int(self.micro_batch) == 0, "trainer.micro_batch",
                    f"{self.micro_batch} does not divide trainer.batch_size={self.batch_size}")
        require(self.lr > 0, "trainer.lr", f"must be > 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, "trainer.min_lr",
                f"need 0 <= min_lr <= trainer.lr={self.lr}, got {self.min_lr}")
        # The batches' windows are drawn from NumPy generators seeded with (seed, step), which take no negative seed.
        require(self.seed >= 0, "trainer.seed", f"must be >= 0, got {self.seed}")
        require(self.warmup_steps is None or 0 <= self.warmup_steps <= self.max_steps, "trainer.warmup_steps",
                f"must be in [0, trainer.max_steps={self.max_steps}], got {self.warmup_steps}")
        require(self.sample_tokens >= 0, "trainer.sample_tokens", f"must be >= 0, got {self.sample_tokens}")
        require(self.eval_hellaswag_examples is None or self.eval_hellaswag_examples >= 1,
                "trainer.eval_hellaswag_examples", f"must be >= 1 or null, got {self.eval_hellaswag_examples}")
        # An empty path is the current directory: the run's files would land among the user's own.
        require(self.out_dir.strip() != "", "trainer.out_dir",
                f"must name the run's directory, got {self.out_dir!r} (leave it out for runs/<date>/<time>/)")
        require(self.resume.strip() != "", "trainer.resume", "none, auto or a checkpoint's path, got ''")
        require(self.peak_flops is None or self.peak_flops > 0, "trainer.peak_flops", "must be > 0")
        require(self.compile_mode in COMPILE_MODES, "trainer.compile_mode",
                f"one of {COMPILE_MODES}, got {self.compile_mode!r}")
        require(0 < self.memory_budget <= 1, "trainer.memory_budget",
                f"a fraction of the device's memory in (0, 1], got {self.memory_budget}")
        require(self.max_skipped_steps is None or self.max_skipped_steps >= 1, "trainer.max_skipped_steps",
                f"must be >= 1 or null, got {self.max_skipped_steps}")
        # A validation loss (a cross-entropy) is above 0 in any real run: a target at or below 0 never stops one.
        require(self.target_loss is None or self.target_loss > 0, "trainer.target_loss",
                f"must be a validation loss > 0 or null, got {self.target_loss}")


def check_optimizer_precision(impl: OptimizerImpl, precision: PrecisionConfig) -> None:
    """torch.optim.AdamW (the plain-PyTorch baseline) cannot run every precision."""
    if impl != OptimizerImpl.torch:
        return
    require(not precision.master_weights, "optimizer.impl",
            "torch.optim.AdamW keeps no fp32 master weights; use optimizer.impl=fused|foreach|loop "
            f"with precision={precision.name}, or a precision without masters (fp32, amp_bf16)")
    require(not (precision.loss_scaling and precision.param_dtype != DType.fp32), "optimizer.impl",
            "torch.amp.GradScaler cannot unscale fp16 gradients; use fp16 autocast over fp32 params")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self):
        for key in SHAPE_KEYS if self.model.init_from == SCRATCH else ():
            require(getattr(self.model, key) is not None, f"model.{key}",
                    "needs a value to build a model from scratch (a model preset sets it, e.g. model=tiny), "
                    "or weights to take it from (model.init_from=gpt2)")
        ck = self.checkpointing
        if ck.policy == CheckpointPolicy.every_k and self.model.n_layer is not None:  # else once init_from's is known
            require(1 <= ck.every_k <= self.model.n_layer, "checkpointing.every_k",
                    f"must be in [1, model.n_layer={self.model.n_layer}], got {ck.every_k}")
        if self.precision.name != "auto":  # else once the device's preset is known (precision.py)
            check_optimizer_precision(self.optimizer.impl, self.precision)
        graphs = self.trainer.compile_mode in ("reduce-overhead", "max-autotune")
        require(not (graphs and self.distributed.mode != DistributedMode.none), "trainer.compile_mode",
                f"{self.trainer.compile_mode} replays CUDA graphs, which minitrain supports on one process only "
                "(not validated with DDP's or FSDP's hooks and collectives); "
                f"use trainer.compile_mode=auto or default with distributed={self.distributed.mode.value}")


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def register_configs() -> None:
    """Make the dataclasses the schema Hydra validates `configs/` against (and the launcher's: minitrain/sweep.py)."""
    from .sweep import register_launcher

    ConfigStore.instance().store(name="config_schema", node=Config)
    register_launcher()


def schema_keys(schema: type = Config, prefix: str = "") -> list[str]:
    """Every setting of the typed config as a dotted key (model.n_layer, ...), depth first."""
    keys = []
    for name, hint in get_type_hints(schema).items():
        keys.append(prefix + name)
        if is_dataclass(hint):
            keys += schema_keys(hint, f"{prefix}{name}.")
    return keys


def schema_defaults() -> dict:
    """Every setting's default, nested as the configs are (enums by name): what a checkpoint saved before the
    setting existed was trained with (checkpoint.config_changes)."""
    return OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)


def resolve(cfg: DictConfig | Config) -> Config:
    """The composed config as typed objects, with every value check run (raises ConfigError)."""
    if isinstance(cfg, Config):
        return cfg
    # Merging onto the schema also rejects keys that a `+key=value` override slipped past Hydra.
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:  # ${oc.env:UNSET}, ${trainer.nope}: one line, not a traceback
        raise ConfigError(f"{e.full_key}: {str(e).splitlines()[0]}") from None
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), plain))
    _require_finite(config)
    return config


def _require_finite(node, prefix: str = "") -> None:
    """Every float setting is a finite number: `inf` passes a `> 0` check (optimizer.eps=inf would make every
    update zero without a word), so one rule here covers them all."""
    for f in fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if is_dataclass(value):
            _require_finite(value, key + ".")
        elif isinstance(value, float):
            require(math.isfinite(value), key, f"must be a finite number, got {value}")
