"""Activation checkpointing: trade recompute for the activation term of peak memory.

A policy decides, block by block, what backward finds saved. `none` keeps everything (fast, the most
memory); `full` and `every_k` keep only a block's input and rerun the whole block in backward (one extra
block forward, a fraction of the memory); `selective` keeps the matmul and attention outputs — the
expensive FLOPs — and reruns only the cheap norms, GELU and adds from them. Gradients are the same for
every policy.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy as SavePolicy, checkpoint, create_selective_checkpoint_contexts

from .config import CheckpointingConfig, CheckpointPolicy, ModelConfig
from .model import GPT, run_block

aten = torch.ops.aten

# Ops whose outputs `selective` keeps. Linear layers reach the dispatcher as mm/addmm; SDPA as one fused
# op per backend (CUDA: flash / efficient / cuDNN; CPU: flash_for_cpu), or, on its math path (CPU with
# dropout), as bmm + softmax, where the bmm outputs are kept and the softmax is recomputed.
SAVED_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
))


def _save_matmuls(ctx, op, *args, **kwargs) -> SavePolicy:
    return SavePolicy.MUST_SAVE if op in SAVED_OPS else SavePolicy.PREFER_RECOMPUTE


def recompute_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Save only the block's input; rerun the block in backward."""
    return checkpoint(block, x, use_reentrant=False)


def recompute_elementwise(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Save the block's input and its matmul/attention outputs; rerun the rest in backward."""
    return checkpoint(block, x, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


def recomputed_blocks(cfg: CheckpointingConfig, n_layer: int) -> list[bool]:
    """Which blocks rerun their whole forward in backward (`selective` reruns only elementwise ops)."""
    if cfg.policy in (CheckpointPolicy.none, CheckpointPolicy.selective):
        return [False] * n_layer
    if cfg.policy == CheckpointPolicy.full:
        return [True] * n_layer
    if cfg.policy == CheckpointPolicy.every_k:
        return [(i + 1) % cfg.every_k == 0 for i in range(n_layer)]
    raise NotImplementedError(f"checkpointing.policy={cfg.policy.value} is not implemented")


def apply_policy(model: GPT, cfg: CheckpointingConfig) -> None:
    if cfg.policy == CheckpointPolicy.selective:
        model.block_runners = [recompute_elementwise] * model.cfg.n_layer
        return
    model.block_runners = [recompute_block if r else run_block
                           for r in recomputed_blocks(cfg, model.cfg.n_layer)]


def recompute_flops_per_token(model_cfg: ModelConfig, cfg: CheckpointingConfig, seq_len: int) -> int:
    """Extra forward FLOPs per token that recomputation costs (for HFU; MFU never counts them).

    A rerun block costs its forward: 2 FLOPs per matmul weight (12·n_embd² weights) plus attention's
    scores and values (4·n_embd·T). `selective` reruns no matmul, so its cost counts as 0 (its norms,
    GELU and adds are memory-bound, not FLOPs).
    """
    H = model_cfg.n_embd
    per_block = 2 * 12 * H * H + 4 * H * seq_len
    return per_block * sum(recomputed_blocks(cfg, model_cfg.n_layer))
