"""Activation checkpointing: trade recompute for the activation term of peak memory.

A policy decides, block by block, what backward finds saved. `none` keeps everything (fast, the most
memory); `full` and `every_k` keep only a block's input and rerun the whole block in backward (one extra
block forward, a fraction of the memory); `selective` keeps the matmul and attention outputs — the
expensive FLOPs — and reruns only the cheap norms and GELU. Eager, each norm and the GELU is fused with
the linear layer it feeds into one autograd function (no per-op dispatch, whose Python per op made torch's
selective checkpointing slow in eager mode: docs/benchmarks.md); compiled, torch's selective checkpointing tags the ops
Inductor's partitioner must save. Gradients are the same for every policy.
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy as SavePolicy, checkpoint, create_selective_checkpoint_contexts

from .compat import FUSED_ATTENTION_OPS
from .config import CheckpointingConfig, CheckpointPolicy, ModelConfig
from .model import GPT, Block, run_block, tanh_gelu
from .ops import gelu_tanh_backward

aten = torch.ops.aten

# Ops whose outputs compiled `selective` keeps. Linear layers reach the dispatcher as mm/addmm (torchao's float8
# ones as mm on its float8 tensors; minitrain's as one op, whose outputs besides the product are what its backward
# reads); SDPA as one fused op per backend (CUDA: flash / efficient / cuDNN; CPU: flash_for_cpu), or, on its math
# path (CPU with dropout), as bmm + softmax, where the bmm outputs are kept and the softmax is recomputed.
SAVED_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default, torch.ops.minitrain.float8_linear.default,
    *FUSED_ATTENTION_OPS,
))


def _save_matmuls(ctx, op, *args, **kwargs) -> SavePolicy:
    return SavePolicy.MUST_SAVE if op in SAVED_OPS else SavePolicy.PREFER_RECOMPUTE


def recompute_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Save only the block's input; rerun the block in backward."""
    return checkpoint(block, x, use_reentrant=False)


def recompute_elementwise(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """selective under torch.compile: the block with torch's selective checkpointing, whose per-op save
    tags Inductor's partitioner follows. (Eager, its per-op dispatch mode halved throughput; the
    partitioner would re-decide what the autograd functions below save.)"""
    return checkpoint(block, x, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


def _matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear multiplies in here: autocast's (fp32 params under amp), else the weight's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _linear_grads(grad_out, inp, weight, has_bias, dtype):
    """F.linear's backward in `dtype` (as autocast ran it), without its forward output: (grad_in, grad_weight,
    grad_bias) in the dtypes of inp and weight."""
    g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
    flat = inp.reshape(-1, inp.shape[-1]).to(dtype)
    grad_weight = (g.T @ flat).to(weight.dtype)
    grad_bias = g.sum(0).to(weight.dtype) if has_bias else None
    grad_in = (g @ weight.to(dtype)).reshape(inp.shape).to(inp.dtype)
    return grad_in, grad_weight, grad_bias


class _NormThenLinear(torch.autograd.Function):
    """linear(layer_norm(x)) saving x, not the norm's output (C per token): backward reruns the norm."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps: float, weight, bias):
        ctx.eps, ctx.dtype, ctx.has_bias = eps, _matmul_dtype(x, weight), bias is not None
        ctx.save_for_backward(x, norm_weight, norm_bias, weight)
        return F.linear(F.layer_norm(x, x.shape[-1:], norm_weight, norm_bias, eps), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, norm_weight, norm_bias, weight = ctx.saved_tensors
        y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], norm_weight, norm_bias, ctx.eps)
        grad_y, grad_weight, grad_bias = _linear_grads(grad_out, y, weight, ctx.has_bias, ctx.dtype)
        grad_x, grad_norm_weight, grad_norm_bias = torch.ops.aten.native_layer_norm_backward(
            grad_y, x, x.shape[-1:], mean, rstd, norm_weight, norm_bias,
            [True, norm_weight is not None, norm_bias is not None])
        return grad_x, grad_norm_weight, grad_norm_bias, None, grad_weight, grad_bias


class _GeluThenLinear(torch.autograd.Function):
    """linear(gelu_tanh(h)) saving h (GELU's backward needs it anyway), not GELU's output (4C per token)."""

    @staticmethod
    def forward(ctx, h, weight, bias, fused: bool):
        ctx.fused, ctx.dtype, ctx.has_bias = fused, _matmul_dtype(h, weight), bias is not None
        ctx.save_for_backward(h, weight)
        return F.linear(tanh_gelu(h, fused), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        grad_a, grad_weight, grad_bias = _linear_grads(grad_out, tanh_gelu(h, ctx.fused), weight, ctx.has_bias,
                                                       ctx.dtype)
        grad_h = gelu_tanh_backward(grad_a, h) if ctx.fused else torch.ops.aten.gelu_backward(grad_a, h,
                                                                                              approximate="tanh")
        return grad_h, grad_weight, grad_bias, None


def _forward_recomputing_elementwise(block: Block, x: torch.Tensor) -> torch.Tensor:
    """Block.forward, step for step, with each norm and the GELU fused into the linear layer after it as
    one autograd function that keeps its input, not its output. Saved per token: the block input and
    the residual after attention, q/k/v, the attention output and its logsumexp, the MLP's hidden;
    rerun in backward: two norms and a GELU (elementwise passes, no matmul)."""
    attn, mlp, ln_1, ln_2 = block.attn, block.mlp, block.ln_1, block.ln_2
    qkv = _NormThenLinear.apply(x, ln_1.weight, ln_1.bias, ln_1.eps, attn.c_attn.weight, attn.c_attn.bias)
    x = x + block.dropout(attn.c_proj(attn.attend(qkv)))
    h = _NormThenLinear.apply(x, ln_2.weight, ln_2.bias, ln_2.eps, mlp.c_fc.weight, mlp.c_fc.bias)
    return x + block.dropout(_GeluThenLinear.apply(h, mlp.c_proj.weight, mlp.c_proj.bias, mlp.fused_gelu(h)))


def recomputed_blocks(cfg: CheckpointingConfig, n_layer: int) -> list[bool]:
    """Which blocks rerun their whole forward in backward (`selective` reruns only elementwise ops)."""
    if cfg.policy in (CheckpointPolicy.none, CheckpointPolicy.selective):
        return [False] * n_layer
    if cfg.policy == CheckpointPolicy.full:
        return [True] * n_layer
    if cfg.policy == CheckpointPolicy.every_k:
        return [(i + 1) % cfg.every_k == 0 for i in range(n_layer)]
    raise NotImplementedError(f"checkpointing.policy={cfg.policy.value} is not implemented")


def apply_policy(model: GPT, cfg: CheckpointingConfig, compiled: bool = False) -> None:
    """`compiled`: the step runs under torch.compile (trainer.compile), which needs `selective` as save tags. So
    do blocks whose linears are not plain nn.Linear (torchao's float8 ones): the autograd functions below call
    F.linear on the weights, which would bypass the modules' own matmuls."""
    model.block_runners = [recompute_block if r else run_block
                           for r in recomputed_blocks(cfg, model.cfg.n_layer)]
    if cfg.policy != CheckpointPolicy.selective:
        return
    plain = all(type(m) is torch.nn.Linear for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    if compiled or not plain:
        model.block_runners = [recompute_elementwise] * model.cfg.n_layer
        return
    # The block's own forward, so block(x) still runs the hooks DDP and FSDP put on the block.
    for block in model.blocks:
        block.forward = types.MethodType(_forward_recomputing_elementwise, block)


def recompute_flops_per_token(model_cfg: ModelConfig, cfg: CheckpointingConfig, seq_len: int) -> int:
    """Extra forward FLOPs per token that recomputation costs (for HFU; MFU never counts them).

    A rerun block costs its forward: 2 FLOPs per matmul weight (12·n_embd² weights) plus attention's
    scores and values (4·n_embd·T). `selective` reruns no matmul, so its cost counts as 0 (its norms,
    GELU and adds are memory-bound, not FLOPs).
    """
    H = model_cfg.n_embd
    per_block = 2 * 12 * H * H + 4 * H * seq_len
    return per_block * sum(recomputed_blocks(cfg, model_cfg.n_layer))
