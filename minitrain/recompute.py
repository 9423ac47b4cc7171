"""Activation checkpointing: trade recompute for the activation term of peak memory.

A policy decides, block by block, what backward finds saved. `none` keeps everything (fast, the most
memory); `full` and `every_k` keep only a block's input and rerun the whole block in backward (one extra
block forward, a fraction of the memory); `selective` keeps the matmul and attention outputs — the
expensive FLOPs — and reruns only the cheap norms and the MLP's activation (GELU, ReLU^2, SwiGLU). Eager, each
norm and the activation is fused with the linear layer it feeds into one autograd function (no per-op dispatch,
whose Python per op made torch's selective checkpointing slow in eager mode: docs/benchmarks.md); the q/k norms and
rotary positions (model.qk_norm, model.position=rope) run as they do without a policy, SDPA keeping the q and k they
make. Compiled, torch's selective checkpointing tags the ops Inductor's partitioner must save (all of these are
recomputed there). Gradients are the same for every policy.
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy as SavePolicy, checkpoint, create_selective_checkpoint_contexts

from .compat import FUSED_ATTENTION_OPS
from .config import CheckpointingConfig, CheckpointPolicy
from .model import GPT, Block, run_block
from .model_config import MlpActivation, ModelConfig

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


class _RecomputedThenLinear(torch.autograd.Function):
    """linear(f(x, *f_params)) saving x and f's params, not f's output: backward reruns f (a norm, the MLP's
    activation: elementwise passes) and differentiates it with autograd. The norm's output is C per token, the
    activation's 4C; their inputs are the block's residual (kept anyway) and c_fc's output (which the activation's
    own backward needs)."""

    @staticmethod
    def forward(ctx, f, x, weight, bias, *f_params):
        ctx.f, ctx.dtype, ctx.has_bias = f, _matmul_dtype(x, weight), bias is not None
        ctx.save_for_backward(x, weight, *f_params)
        return F.linear(f(x, *f_params), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, *f_params = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_() for t in (x, *f_params)]
            y = ctx.f(*leaves)
        grad_y, grad_weight, grad_bias = _linear_grads(grad_out, y.detach(), weight, ctx.has_bias, ctx.dtype)
        found = iter(torch.autograd.grad(y, [t for t in leaves if t is not None], grad_y))
        grad_x, *grad_params = [None if t is None else next(found) for t in leaves]
        return None, grad_x, grad_weight, grad_bias, *grad_params


def _norm_then_linear(norm: torch.nn.Module, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """linear(norm(x)) keeping x, not the norm's output: model.norm's LayerNorm or RMSNorm as a function of x and
    its params."""
    if isinstance(norm, torch.nn.RMSNorm):
        f = partial(_rms_norm, shape=norm.normalized_shape, eps=norm.eps)
        return _RecomputedThenLinear.apply(f, x, linear.weight, linear.bias, norm.weight)
    f = partial(_layer_norm, shape=norm.normalized_shape, eps=norm.eps)
    return _RecomputedThenLinear.apply(f, x, linear.weight, linear.bias, norm.weight, norm.bias)


def _rms_norm(x, weight, *, shape, eps):
    return F.rms_norm(x, shape, weight, eps)


def _layer_norm(x, weight, bias, *, shape, eps):
    return F.layer_norm(x, shape, weight, bias, eps)


def _forward_recomputing_elementwise(block: Block, x: torch.Tensor) -> torch.Tensor:
    """Block.forward, step for step, with each norm and the MLP's activation fused into the linear layer after it
    as one autograd function that keeps its input, not its output. Saved per token: the block input and the
    residual after attention, q/k/v (with qk_norm or rope, SDPA's normalised, rotated q and k beside c_attn's
    output), the attention output and its logsumexp, c_fc's output; rerun in backward: two norms and an activation
    (elementwise passes, no matmul)."""
    attn, mlp = block.attn, block.mlp
    qkv = _norm_then_linear(block.ln_1, x, attn.c_attn)
    x = x + block.dropout(attn.c_proj(attn.attend(qkv)))
    h = _norm_then_linear(block.ln_2, x, mlp.c_fc)
    return x + block.dropout(_RecomputedThenLinear.apply(mlp.activation, h, mlp.c_proj.weight, mlp.c_proj.bias))


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

    A rerun block costs its forward: 2 FLOPs per matmul weight (4·n_embd² in attention, the MLP's 8·n_embd², or
    SwiGLU's 3·n_embd·mlp_hidden) plus attention's scores and values (4·n_embd·T). `selective` reruns no matmul, so
    its cost counts as 0 (its norms, activations, rotations and adds are memory-bound, not FLOPs).
    """
    H = model_cfg.n_embd
    mlp = (3 if model_cfg.mlp == MlpActivation.swiglu else 2) * model_cfg.mlp_hidden * H
    per_block = 2 * (4 * H * H + mlp) + 4 * H * seq_len
    return per_block * sum(recomputed_blocks(cfg, model_cfg.n_layer))
