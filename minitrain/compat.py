"""Every private hook minitrain takes from a library, and only here.

A private name (a leading underscore anywhere in a library's dotted path) may change or vanish in any release,
silently. Each one minitrain needs is named here for what it does, with the versions it was checked on and the
reason no public API does instead; tests/test_compat.py checks each against a reference computation, so that an
upgrade that breaks one fails there, and scans minitrain/ and scripts/ for private names used anywhere else. Where
a public equivalent behaves the same it is used instead (torch.compiler.reset for torch._dynamo.reset; submitit's
`setup` option, not a patched controller, for a sweep's Ctrl-C: minitrain/sweep.py).

Each hook says the versions it was checked on: torch 2.13 on a CPU by tests/test_compat.py (with torchao 0.18), and
torch 2.11 on CUDA (an H100) where the GPU runs recorded in docs/results/ went through it.
"""

from __future__ import annotations

import operator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: F401 (exported)
from torch.utils._pytree import tree_leaves  # noqa: F401 (exported)

# torch.utils._python_dispatch and torch.utils._pytree: a dispatch mode sees every op a piece of code runs, and the
# tensors in its arguments (tools/live_bytes.py counts the bytes they hold). torch has no public module for either
# (torch.utils.pytree does not exist in 2.13). Checked: torch 2.13 (CPU).

# torch._foreach_*: one op over a list of tensors, a launch per op instead of one per tensor: the foreach
# optimizers' whole step and the copies of grads, masters and params. torch.optim's own foreach code calls them;
# there is no public alias. Aliases, not wrappers: called in every step, they cost what torch's names cost.
# Checked: torch 2.13 (CPU); 2.11 (CUDA: docs/results/optimizer.jsonl).
foreach_add_ = torch._foreach_add_
foreach_addcmul_ = torch._foreach_addcmul_
foreach_copy_ = torch._foreach_copy_
foreach_div = torch._foreach_div
foreach_lerp = torch._foreach_lerp
foreach_lerp_ = torch._foreach_lerp_
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
foreach_sqrt = torch._foreach_sqrt
foreach_sub_ = torch._foreach_sub_
foreach_zero_ = torch._foreach_zero_

# torch._scaled_mm(a, b, scale_a, scale_b, bias=, out_dtype=): a float8 GEMM, a row-major and b column-major, the
# scales the inverse of the casts' (ops/float8_linear.py). torch.nn.functional.scaled_mm is its public successor,
# with another signature (scale recipes), and is missing from the older torch pyproject.toml allows.
# Checked: torch 2.13 (CPU kernel); 2.11 (CUDA: docs/results/fp8.jsonl).
scaled_mm = torch._scaled_mm

# torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval): the
# loss-scale rule (minitrain/loss_scale.py) in one kernel, in place on 0-d device tensors, no host sync.
# torch.amp.GradScaler.update runs it on GradScaler's own state only. Checked: torch 2.13 (CPU).
amp_update_scale_ = torch._amp_update_scale_

# DTensor._local_tensor: this rank's shard of a DTensor, the tensor itself. DTensor.to_local() is not the same: with
# grad enabled it is an autograd op, and for a Parameter (torch 2.13) a new view each call; the optimizer needs the
# shard it can write in place and compare by identity. attrgetter: called per tensor in a step, at C speed.
# Checked: torch 2.13 (CPU, gloo); 2.11 (CUDA: docs/results/distributed.jsonl, fsdp).
dtensor_local_tensor = operator.attrgetter("_local_tensor")

# torchao's WeightWithDynamicFloat8CastTensor._tensor: the plain tensor a float8 all-gather weight (precision=fp8
# under FSDP) wraps, which kernels that take pointers must see. Checked: torchao 0.18 (torch 2.13, CPU).
float8_weight_tensor = operator.attrgetter("_tensor")

# The fused attention ops F.scaled_dot_product_attention dispatches to, one per backend (CUDA: flash, efficient,
# cuDNN; CPU: flash_for_cpu): what compiled `selective` checkpointing saves (minitrain/recompute.py). aten names
# with no public alias; a new backend's op would be recomputed, not saved. Checked: torch 2.13 (CPU: flash_for_cpu);
# 2.11 (CUDA: docs/results/step.jsonl, selective checkpointing compiled).
FUSED_ATTENTION_OPS = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def set_allocator_settings(settings: str) -> None:
    """torch._C._accelerator_setAllocatorSettings: change the CUDA caching allocator's settings (`expandable_segments:
    True`) inside a running process, for the segments it makes from then on. The public PYTORCH_ALLOC_CONF is read
    once, when CUDA starts, so two runs of one process (a test session, a sweep's basic launcher) could not differ.
    Checked: torch 2.13 (CPU); 2.11 (CUDA: docs/results/memory.jsonl, trainer.expandable_segments=true,false)."""
    torch._C._accelerator_setAllocatorSettings(settings)


def grad_scaler_found_infs(scaler: torch.amp.GradScaler, optimizer) -> list[torch.Tensor]:
    """GradScaler._found_inf_per_device: the 0-d flags (1.0 = an inf/NaN) that scaler.unscale_(optimizer) found, on
    the device, as GradScaler.step reads them to skip a step. Public alternatives sync (GradScaler.get_scale) or
    differ (a non-finite clip_grad_norm_ also flags finite gradients whose norm overflows). Checked: torch 2.13
    (CPU)."""
    return list(scaler._found_inf_per_device(optimizer).values())


def auto_filter_for_recipe(recipe: str, filter_fqns: list[str]):
    """torchao.float8._auto_filter_for_recipe: torchao's filter (module, fqn) -> bool of the linears wide enough for
    float8 `recipe` ("tensorwise", "rowwise") to gain (thresholds measured on an H100). torchao exports it in
    torchao.float8.__all__ under its private name; no public one. torchao is optional: imported when called.
    Checked: torchao 0.18 (torch 2.13, CPU; torch 2.11, CUDA: docs/results/fp8.jsonl)."""
    from torchao.float8 import _auto_filter_for_recipe

    return _auto_filter_for_recipe(recipe, filter_fqns=filter_fqns)


def mark_static_address(t: torch.Tensor) -> None:
    """torch._dynamo.mark_static_address: tell torch.compile that `t` keeps its address between calls (a buffer that
    CUDA graphs replay in place), so it is not copied into the graph's inputs. No public alias in torch.compiler.
    Reached when called: importing dynamo takes a second. Checked: torch 2.13 (CPU); 2.11 (CUDA:
    docs/results/sample.jsonl)."""
    torch._dynamo.mark_static_address(t)


def inductor_counter(name: str) -> int:
    """torch._dynamo.utils.counters["inductor"][name]: how often inductor did `name` in this process (cudagraph_skips:
    graphs it left ungraphed). torch.compiler has no public counters. Checked: torch 2.13 (CPU); 2.11 (CUDA:
    docs/results/sample.jsonl)."""
    from torch._dynamo.utils import counters

    return dict(counters["inductor"]).get(name, 0)
