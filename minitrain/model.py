"""A GPT-2-style decoder, readable top to bottom.

Pre-LayerNorm blocks, GELU MLP, learned positions, causal attention through SDPA (flash attention on
the GPU), and the LM head tied to the token embedding. `forward_hidden` stops before the LM head so the
loss can fuse the head matmul with cross-entropy and never hold the tokens x vocab logits.

Given a `KVCache`, `forward_hidden` also runs the tokens at given positions of sequences whose earlier keys and
values the cache holds, writing theirs into it: a prompt once (prefill), then one token per step (decode), the
attention over fixed-size buffers under a mask, so a decode step has the same shapes at every position (what a
CUDA graph needs). minitrain/generate.py drives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .ops import gelu_tanh

# How a block runs: plainly, or wrapped by an activation-recomputation policy (recompute.py).
BlockRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, kv: Optional[LayerKV] = None) -> torch.Tensor:
        qkv = self.c_attn(x)
        return self.c_proj(self.attend(qkv) if kv is None else self.attend_cached(qkv, kv))

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, 3C) projections -> q, k, v as (B, n_head, T, C / n_head)."""
        B, T, C3 = qkv.shape
        return tuple(t.view(B, T, self.n_head, C3 // 3 // self.n_head).transpose(1, 2) for t in qkv.split(C3 // 3, 2))

    @staticmethod
    def merge(y: torch.Tensor) -> torch.Tensor:
        """(B, n_head, T, head size) -> (B, T, C), heads concatenated."""
        B, _, T, _ = y.shape
        return y.transpose(1, 2).contiguous().view(B, T, -1)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """(B, T, 3C) projections -> (B, T, C) causal attention output."""
        q, k, v = self.heads(qkv)
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         dropout_p=self.dropout if self.training else 0.0))

    def attend_cached(self, qkv: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """The tokens' keys and values written at their positions, then each query over the whole cache, the
        keys after its own position masked (those not written yet, and the later tokens of a prefill)."""
        q, k, v = self.heads(qkv)
        kv.k.index_copy_(2, kv.pos, k)
        kv.v.index_copy_(2, kv.pos, v)
        return self.merge(F.scaled_dot_product_attention(q, kv.k, kv.v, attn_mask=kv.mask))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.gelu_impl = cfg.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        return self.c_proj(tanh_gelu(h, self.fused_gelu(h)))

    def fused_gelu(self, h: torch.Tensor) -> bool:
        return self.gelu_impl.fused_on(h.device.type)


def tanh_gelu(h: torch.Tensor, fused: bool) -> torch.Tensor:
    """The Triton kernel (one memory pass each way, minitrain/ops/gelu.py) or torch's."""
    return gelu_tanh(h) if fused else F.gelu(h, approximate="tanh")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, kv: Optional[LayerKV] = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), kv))
        return x + self.dropout(self.mlp(self.ln_2(x)))


def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


@dataclass
class LayerKV:
    """What one attention layer reads and writes in a cached forward: its (B, n_head, length, head size) key and
    value buffers, the positions (T,) of this forward's tokens, and the (T, length) mask of the keys each sees."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor


class KVCache(nn.Module):
    """Keys and values of every layer for `batch` sequences of up to `length` positions. Buffers of a module of
    its own: no checkpoint of the model holds them, and they keep their addresses, which a CUDA graph replaying
    the decode step reads and writes."""

    def __init__(self, cfg: ModelConfig, batch: int, length: int, dtype: torch.dtype, device=None):
        super().__init__()
        if length > cfg.block_size:
            raise ValueError(f"a cache of {length} positions exceeds model.block_size={cfg.block_size}")
        self.length, self.n_layer = length, cfg.n_layer
        shape = (batch, cfg.n_head, length, cfg.n_embd // cfg.n_head)
        for i in range(cfg.n_layer):  # a buffer per layer: a compiled write into a view of one shared buffer
            # could copy the whole of it
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device))

    def layers(self, pos: torch.Tensor) -> list[LayerKV]:
        """Each layer's view for tokens at positions `pos`: a query sees the keys at or before its position."""
        mask = pos[:, None] >= torch.arange(self.length, device=pos.device)[None, :]
        return [LayerKV(getattr(self, f"k{i}"), getattr(self, f"v{i}"), pos, mask)
                for i in range(self.n_layer)]


def attention_flops_per_token(n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token of the attention scores and values, without the causal mask's saving (the
    MFU convention): forward 4 * n_layer * n_embd * seq_len, the backward twice that."""
    return 12 * n_layer * n_embd * seq_len


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size must be set (the trainer fills it from the tokenizer)")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # One runner per block; recompute.apply_policy swaps in recomputing ones.
        self.block_runners: list[BlockRunner] = [run_block] * cfg.n_layer
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's (head_vocab, n_embd) weight: the token embedding, tied; without its padding rows (when
        model.head_vocab is set), so that they take no probability in the loss nor in a sample."""
        rows = self.cfg.head_vocab
        return self.wte.weight if rows is None or rows == self.cfg.vocab_size else self.wte.weight[:rows]

    def forward_hidden(self, idx: torch.Tensor, cache: Optional[KVCache] = None,
                       pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final hidden states (B, T, n_embd), after the last LayerNorm, before the LM head. With `cache`: of the
        tokens at positions `pos` (T,), attending to the cached ones before them, their keys and values cached."""
        T = idx.shape[1]
        if cache is None:
            if T > self.cfg.block_size:
                raise ValueError(f"sequence of {T} tokens exceeds model.block_size={self.cfg.block_size}")
            pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        if cache is None:
            for block, runner in zip(self.blocks, self.block_runners):
                x = runner(block, x)
        else:
            for block, kv in zip(self.blocks, cache.layers(pos)):
                x = block(x, kv)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, head_vocab); the trainer uses forward_hidden + a loss over the head instead."""
        return F.linear(self.forward_hidden(idx), self.lm_head_weight)

    def num_params(self, exclude_positions: bool = True) -> int:
        """Parameter count; the tied head counts once. Positions are a lookup, not a matmul."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if exclude_positions else n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls (N without positions, tied head counted once)
        plus attention's scores and values (attention_flops_per_token)."""
        return 6 * self.num_params() + attention_flops_per_token(self.cfg.n_layer, self.cfg.n_embd, seq_len)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Decay matrices only; norms, biases and embeddings (the tied head too) keep their scale."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            is_matrix = p.dim() >= 2 and not name.startswith(("wte.", "wpe."))
            (decay if is_matrix else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def hidden_matrices(self) -> list[nn.Parameter]:
        """The 2-D weights inside the blocks (each block's four linears'): what Muon orthogonalizes. The embeddings
        (the tied head too) are lookups of single tokens, not hidden layers, and keep AdamW with the vectors."""
        return [p for p in self.blocks.parameters() if p.dim() == 2]

    def muon_param_groups(self, weight_decay: float) -> list[dict]:
        """param_groups for optimizer=muon: the hidden matrices first (`use_muon`), then AdamW's groups without
        them (an empty group dropped)."""
        hidden = self.hidden_matrices()
        taken = set(map(id, hidden))
        adamw = [{**g, "params": [p for p in g["params"] if id(p) not in taken]}
                 for g in self.param_groups(weight_decay)]
        return [{"params": hidden, "use_muon": True}] + [g for g in adamw if g["params"]]
