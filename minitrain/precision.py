"""What a precision means, decided once: the dtypes every part of the step reads.

`precision=<name>` in the config picks a preset (`configs/precision/<name>.yaml`); `precision=auto`
picks one for the device — bf16 params + fp32 masters on a GPU with bf16, fp16 + dynamic loss scaling
on one without, fp32 on a CPU (where bf16 and fp16 matmuls run far slower than fp32); never fp8, which changes
the numerics and is the user's choice (`precision=fp8`: bf16 params whose blocks' linears multiply in float8,
minitrain/fp8.py). `resolve_precision`
turns the config into a `Precision`; the model, the optimizer, the memory model and the distributed
wrappers read that object and never re-decode the config's fields.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
from omegaconf import OmegaConf

from .config import CONFIG_DIR, Float8Kernels, Float8Recipe, PrecisionConfig, check_optimizer_precision
from .errors import ConfigError
from .loss_scale import LossScaling
from .optimizer_config import OptimizerImpl

AUTO = "auto"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The fields a preset sets; with precision=auto they come from the preset the device gets.
PRESET_FIELDS = ("param_dtype", "autocast_dtype", "master_weights", "loss_scaling", "float8")


@dataclass(frozen=True)
class Precision:
    """A resolved precision (never `auto`)."""

    name: str
    param_dtype: torch.dtype  # the model's weights: the compute copy the matmuls read
    autocast_dtype: Optional[torch.dtype]  # torch.autocast around forward + loss (fp32 params only)
    master_weights: bool  # fp32 master copy in the optimizer (low-precision params)
    grad_dtype: torch.dtype  # what the optimizer reads: the param dtype, or fp32 main grads
    loss_scaling: bool  # dynamic loss scaling (fp16's range)
    tf32: bool  # fp32 matmuls on tensor cores (CUDA only; TF32 keeps fp32's range, rounds the mantissa)
    float8: Float8Recipe = Float8Recipe.none  # the blocks' linears multiply in float8, params unchanged
    float8_kernels: Float8Kernels = Float8Kernels.minitrain  # whose casts and GEMMs
    float8_linears: Optional[tuple[str, ...]] = None  # None: torchao's shape filter picks them
    loss_scale: LossScaling = LossScaling()  # the dynamic loss scaler's parameters (with loss_scaling)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype

    @property
    def fp32_main_grads(self) -> bool:
        return self.grad_dtype != self.param_dtype

    @property
    def mfu_dtype(self) -> str:
        """The peak-FLOPs column MFU divides by: the compute dtype, fp32 matmuls under TF32 as tf32. Float8
        matmuls count against the bf16 peak, so an fp8 run's MFU reads beside its bf16 twin's."""
        name = DTYPE_NAMES[self.compute_dtype]
        return "tf32" if name == "fp32" and self.tf32 else name

    def stored_param_dtype(self, sharded: bool) -> torch.dtype:
        """The dtype the model's parameters are stored in: under FSDP with masters the fp32 shards ARE the
        masters (FSDP's mixed-precision policy gathers them in param_dtype for compute)."""
        return torch.float32 if sharded and self.master_weights else self.param_dtype

    def apply_matmul_precision(self) -> None:
        """TF32 for fp32 matmuls and convolutions (process-wide torch flags; no-op without CUDA)."""
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        short = DTYPE_NAMES
        parts = [f"{short[self.param_dtype]} params"]
        if self.autocast_dtype is not None:
            parts.append(f"{short[self.autocast_dtype]} autocast")
        if self.master_weights:
            parts.append("fp32 masters")
        if self.fp32_main_grads:
            parts.append("fp32 main grads")
        if self.loss_scaling:
            parts.append("dynamic loss scaling")
        if self.float8 != Float8Recipe.none:
            parts.append(f"float8 matmuls ({self.float8.value} scales, {self.float8_kernels.value}'s kernels)")
        if self.compute_dtype == torch.float32:
            parts.append("TF32 matmuls" if self.tf32 else "true fp32 matmuls")
        return ", ".join(parts)


def preset(name: str) -> PrecisionConfig:
    """The named preset as the config would compose it."""
    path = CONFIG_DIR / "precision" / f"{name}.yaml"
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), OmegaConf.load(path)))


def auto_name(device: torch.device) -> str:
    """bf16 where the GPU computes in it, fp16 (with loss scaling) on an older GPU, fp32 on a CPU."""
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def resolve_precision(cfg: PrecisionConfig, device: torch.device, tf32: bool = True,
                      optimizer_impl: OptimizerImpl = OptimizerImpl.auto) -> Precision:
    """The config's precision for `device`. `tf32`: the user's trainer.tf32 (it only acts on CUDA)."""
    if cfg.name == AUTO:
        default = PrecisionConfig()
        changed = [f for f in PRESET_FIELDS if getattr(cfg, f) != getattr(default, f)]
        if changed:
            raise ConfigError(f"precision.{changed[0]}: precision=auto chooses it per device; pick a named "
                              "precision to set it (e.g. precision=bf16 precision.grad_dtype=fp32)")
        chosen = preset(auto_name(device))
        # replace() reruns the config's checks: the combination (e.g. grad_dtype=fp32 needs masters) for the preset
        cfg = replace(cfg, name=chosen.name, **{f: getattr(chosen, f) for f in PRESET_FIELDS})
        check_optimizer_precision(optimizer_impl, cfg)
    return Precision(
        name=cfg.name, param_dtype=cfg.param_dtype.torch,
        autocast_dtype=cfg.autocast_dtype.torch if cfg.autocast_dtype else None,
        master_weights=cfg.master_weights,
        grad_dtype=(cfg.grad_dtype or cfg.param_dtype).torch,
        loss_scaling=cfg.loss_scaling, tf32=tf32 and device.type == "cuda", float8=cfg.float8,
        float8_kernels=cfg.float8_kernels,
        float8_linears=None if cfg.float8_linears is None else tuple(cfg.float8_linears),
        loss_scale=LossScaling(cfg.init_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval))
