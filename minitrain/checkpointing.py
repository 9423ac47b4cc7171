"""Activation checkpointing: trade recompute for the activation term of peak memory.

A policy decides, block by block, whether backward finds the block's activations saved (fast, the
most memory) or recomputes them from the block's input (one extra block forward, a fraction of the
memory). Gradients are the same either way.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .config import CheckpointingConfig, CheckpointPolicy
from .model import GPT, run_block


def recompute_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Save only the block's input; rerun the block in backward."""
    return checkpoint(block, x, use_reentrant=False)


def recomputed_blocks(cfg: CheckpointingConfig, n_layer: int) -> list[bool]:
    """Which blocks recompute under the policy."""
    if cfg.policy == CheckpointPolicy.none:
        return [False] * n_layer
    if cfg.policy == CheckpointPolicy.full:
        return [True] * n_layer
    if cfg.policy == CheckpointPolicy.every_k:
        return [(i + 1) % cfg.every_k == 0 for i in range(n_layer)]
    raise NotImplementedError(f"checkpointing.policy={cfg.policy.value} is not implemented yet")


def apply_policy(model: GPT, cfg: CheckpointingConfig) -> None:
    model.block_runners = [recompute_block if r else run_block
                           for r in recomputed_blocks(cfg, model.cfg.n_layer)]
