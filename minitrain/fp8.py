"""Float8 matmuls in the blocks' linear layers (`precision=fp8`): minitrain's float8 linear, or torchao's.

Why: fp8 tensor cores have twice bf16's peak rate (docs/benchmarks.md measures what a step gets), but every float8
matmul first casts its operands (an amax, a scale, the cast, a transposed copy: memory passes), which eats the
gain on narrow layers. torchao's `Float8Linear` casts input, weight and output gradient with a dynamic scale per
matmul and multiplies with torch's float8 GEMM (compat.scaled_mm). Its weight stays the ordinary parameter it was (bf16 over fp32
masters in minitrain's AdamW), cast per matmul: the optimizer, the checkpoints and the 16 B/param floor do not
change.

By default (`precision.float8_kernels=minitrain`) minitrain's Float8Linear is swapped in instead
(minitrain/ops/float8_linear.py): the same tensorwise recipe, its casts two Triton passes, which is where torchao's
loses what the float8 GEMMs gain (docs/benchmarks.md, fp8); torchao's stays for rowwise scales and FSDP2's float8
all-gather, and decides which linears to convert.

What is converted: each block's linears that torchao's shape filter expects to gain (narrower ones stay bf16), or
those that precision.float8_linears names. The LM head is the tied embedding inside the fused loss, not a linear:
it stays bf16. The plan decides the list once (`float8_linears`); the memory model and `convert` read it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn

from .compat import auto_filter_for_recipe
from .config import Float8Kernels, Float8Recipe
from .model_config import ModelConfig

FP8_COMPUTE_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: the first NVIDIA GPUs with fp8 tensor cores
INSTALL = "pip install 'minitrain[fp8]'"


def unavailable_reason(device: torch.device) -> Optional[str]:
    """Why float8 training cannot run on `device` (None: it can): no fp8 tensor cores, or no torchao."""
    if device.type != "cuda":
        return (f"float8 matmuls need an NVIDIA GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper, "
                f"Blackwell), not a {device.type.upper()}; use precision=bf16 here")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_COMPUTE_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no fp8 tensor cores "
                "(8.9+: Ada, Hopper, Blackwell); use precision=bf16")
    if importlib.util.find_spec("torchao") is None:
        return f"float8 training runs on torchao, which is not installed: {INSTALL}"
    return None


def float8_linears(model_cfg: ModelConfig, recipe: Float8Recipe) -> tuple[str, ...]:
    """The linears of a block (names inside it, e.g. `mlp.c_fc`) that torchao's filter for `recipe` converts: dims
    divisible by 16 and wide enough for the GEMM's gain to outrun the casts (its thresholds were measured on an
    H100)."""
    if recipe == Float8Recipe.none:
        return ()
    from .model import Block

    gains = auto_filter_for_recipe(recipe.value, filter_fqns=[])
    with torch.device("meta"):
        block = Block(model_cfg)
    return tuple(name for name, m in block.named_modules() if isinstance(m, nn.Linear) and gains(m, name))


def float8_config(recipe: Float8Recipe, fsdp_all_gather: bool = False):
    """torchao's config for `recipe`; `fsdp_all_gather` (tensorwise under FSDP2 only): each weight is cast to
    float8 on its shard and all-gathered as such."""
    from torchao.float8 import Float8LinearConfig

    return replace(Float8LinearConfig.from_recipe_name(recipe.value), enable_fsdp_float8_all_gather=fsdp_all_gather)


def convert(blocks: nn.ModuleList, linears: tuple[str, ...], recipe: Float8Recipe,
            kernels: Float8Kernels = Float8Kernels.minitrain, fsdp_all_gather: bool = False) -> None:
    """Swap the named linears of every block for a float8 linear (minitrain's or torchao's Float8Linear), in place,
    before any wrapper (checkpointing policy, DDP, FSDP2) sees the model. Each keeps its weight and bias Parameters,
    so the optimizer's and the checkpoint's tensors stay the ones they were (with `fsdp_all_gather`, torchao wraps
    the weight in a tensor subclass whose data is still that parameter's)."""
    if not linears:
        return
    if kernels == Float8Kernels.minitrain:
        from .ops import Float8Linear

        for block in blocks:
            for name in linears:
                parent, _, child = name.rpartition(".")
                owner = block.get_submodule(parent)
                setattr(owner, child, Float8Linear.taking_over(getattr(owner, child)))
        return
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(blocks, config=float8_config(recipe, fsdp_all_gather),
                               module_filter_fn=lambda module, fqn: fqn.partition(".")[2] in linears)
