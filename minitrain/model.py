"""A GPT decoder, readable top to bottom: GPT-2's block by default, today's choices one setting each.

GPT-2: pre-LayerNorm blocks, a GELU MLP, learned positions, causal attention through SDPA (flash attention on the
GPU), and the LM head tied to the token embedding. Each model.* block option (minitrain/model_config.py's
ModelConfig) swaps one part: rotary positions on q and k (`rotate`), RMSNorm (`make_norm`), an RMSNorm of each
head's q and k, a ReLU^2 or SwiGLU MLP (`activate`), a head of its own, zero-initialised output projections, and a
soft-cap on the logits (`soft_cap`, which the fused loss applies inside its kernels). `forward_hidden` stops before
the LM head so the loss can fuse the head matmul with cross-entropy and never hold the tokens x vocab logits.

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

from .model_config import MlpActivation, ModelConfig, NormKind, PositionEncoding
from .ops import gelu_tanh, qk_norm_rope, rope_tables, soft_cap

# How a block runs: plainly, or wrapped by an activation-recomputation policy (recompute.py).
BlockRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]

RMS_NORM_EPS = 1e-6  # transformers' LlamaConfig.rms_norm_eps (LayerNorm keeps torch's 1e-5, GPT-2's)


def make_norm(cfg: ModelConfig, width: int) -> nn.Module:
    """model.norm over the last `width` features: LayerNorm (with a bias as model.bias says) or RMSNorm (torch's,
    F.rms_norm: a weight, no bias)."""
    if cfg.norm == NormKind.rmsnorm:
        return nn.RMSNorm(width, eps=RMS_NORM_EPS)
    return nn.LayerNorm(width, bias=cfg.bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding: (B, T, n_head, D) queries or keys, feature pair (i, i + D/2) turned by the angle
    whose cos and sin (T, D/2) are given: pos * base^(-2i/D) at each token's position (ops/rope.py's tables;
    transformers' Llama layout, rotate_half's). In fp32 (the angles of late positions need it), returned in x's
    dtype. Applied before the heads are transposed, so that q and k reach attention in the projection's own layout,
    as v does."""
    cos, sin = cos[:, None], sin[:, None]  # (T, 1, D/2): the same angle for every head
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        head = cfg.n_embd // cfg.n_head
        # model.qk_norm: q and k of each head at unit RMS (times a learned weight) however large the residual
        # stream grows, so the attention logits stay bounded.
        self.q_norm = nn.RMSNorm(head, eps=RMS_NORM_EPS) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(head, eps=RMS_NORM_EPS) if cfg.qk_norm else None
        self.rope_base = cfg.rope_base if cfg.position == PositionEncoding.rope else None
        self.fuses_qk_on = cfg.fuses_qk_on

    def forward(self, x: torch.Tensor, kv: Optional[LayerKV] = None) -> torch.Tensor:
        qkv = self.c_attn(x)
        return self.c_proj(self.attend(qkv) if kv is None else self.attend_cached(qkv, kv))

    def heads(self, qkv: torch.Tensor, pos: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, 3C) projections of the tokens at positions `pos` (T,) (None: 0 .. T-1) -> q, k, v as
        (B, n_head, T, C / n_head), q and k normalised (qk_norm), then rotated (rope): by the fused op (model.qk_kernel)
        for a whole sequence, by torch's modules for a KV cache's tokens, which the compiled decode step fuses."""
        B, T, C3 = qkv.shape
        head = C3 // 3 // self.n_head
        cos = sin = None
        if self.rope_base is not None:
            cos, sin = rope_tables(torch.arange(T, device=qkv.device) if pos is None else pos, head, self.rope_base)
        if pos is None and self.fuses_qk_on(qkv.device.type):  # q and k one view: one gradient concatenation with v's
            qk, v = qkv.split((2 * C3 // 3, C3 // 3), 2)
            q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            q, k = qk_norm_rope(qk, self.n_head, q_weight, k_weight, RMS_NORM_EPS, cos, sin)
            v = v.view(B, T, self.n_head, head)
        else:
            q, k, v = (t.view(B, T, self.n_head, head) for t in qkv.split(C3 // 3, 2))
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if cos is not None:
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

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
        q, k, v = self.heads(qkv, kv.pos)
        kv.k.index_copy_(2, kv.pos, k)
        kv.v.index_copy_(2, kv.pos, v)
        return self.merge(F.scaled_dot_product_attention(q, kv.k, kv.v, attn_mask=kv.mask))


class MLP(nn.Module):
    """c_fc, the activation, c_proj. SwiGLU's gate and up projections are one matrix, c_fc (gate rows first, as
    Megatron-LM's gated linear unit): one GEMM, and a block's linears keep their names (precision.float8_linears)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, self.kind = cfg.mlp_hidden, cfg.mlp
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.kind == MlpActivation.swiglu else 1) * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.gelu_impl = cfg.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(x)))

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """c_fc's output -> c_proj's input."""
        return activate(h, self.kind, self.fused_gelu(h))

    def fused_gelu(self, h: torch.Tensor) -> bool:
        return self.gelu_impl.fused_on(h.device.type)


def activate(h: torch.Tensor, kind: MlpActivation, fused_gelu: bool) -> torch.Tensor:
    """model.mlp's nonlinearity: tanh-GELU, relu(h)^2, or silu(gate) * up of h's two halves."""
    if kind == MlpActivation.relu2:
        return F.relu(h).square()
    if kind == MlpActivation.swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return tanh_gelu(h, fused_gelu)


def tanh_gelu(h: torch.Tensor, fused: bool) -> torch.Tensor:
    """The Triton kernel (one memory pass each way, minitrain/ops/gelu.py) or torch's."""
    return gelu_tanh(h) if fused else F.gelu(h, approximate="tanh")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg, cfg.n_embd)
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
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position == PositionEncoding.learned else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, cfg.n_embd)
        self.lm_head = None if cfg.tie_head else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # One runner per block; recompute.apply_policy swaps in recomputing ones.
        self.block_runners: list[BlockRunner] = [run_block] * cfg.n_layer
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.zero_init_proj:
            for p in self.output_projections():
                nn.init.zeros_(p)

    def output_projections(self) -> list[nn.Parameter]:
        """The weights whose outputs join the residual stream or are the logits: each block's attn.c_proj and
        mlp.c_proj, and the untied head (model.zero_init_proj starts them at zero; the tied head is the embedding)."""
        heads = [] if self.lm_head is None else [self.lm_head.weight]
        return [p for name, p in self.blocks.named_parameters() if name.endswith("c_proj.weight")] + heads

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's (head_vocab, n_embd) weight: the token embedding when tied, else the head's own; without its
        padding rows (when model.head_vocab is set), so that they take no probability in the loss nor in a sample."""
        rows, weight = self.cfg.head_vocab, self.wte.weight if self.lm_head is None else self.lm_head.weight
        return weight if rows is None or rows == self.cfg.vocab_size else weight[:rows]

    def forward_hidden(self, idx: torch.Tensor, cache: Optional[KVCache] = None,
                       pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final hidden states (B, T, n_embd), after the last LayerNorm, before the LM head. With `cache`: of the
        tokens at positions `pos` (T,), attending to the cached ones before them, their keys and values cached."""
        T = idx.shape[1]
        if cache is None:
            if T > self.cfg.block_size:
                raise ValueError(f"sequence of {T} tokens exceeds model.block_size={self.cfg.block_size}")
            pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) if self.wpe is None else self.wte(idx) + self.wpe(pos)  # rope: positions in attention
        x = self.drop(x)
        if cache is None:
            for block, runner in zip(self.blocks, self.block_runners):
                x = runner(block, x)
        else:
            for block, kv in zip(self.blocks, cache.layers(pos)):
                x = block(x, kv)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, head_vocab), soft-capped as the loss scores them (model.logit_softcap); the trainer uses
        forward_hidden + a loss over the head instead."""
        return self.soft_capped(F.linear(self.forward_hidden(idx), self.lm_head_weight))

    def soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's raw logits as the model scores them: model.logit_softcap's cap (in fp32) when set, for the
        forward and for every sampler's step alike."""
        cap = self.cfg.logit_softcap
        return logits if cap is None else soft_cap(logits.float(), cap).to(logits.dtype)

    def num_params(self, exclude_positions: bool = True) -> int:
        """Parameter count; the tied head counts once. Positions are a lookup, not a matmul."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if exclude_positions and self.wpe is not None else n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls (N without positions, the tied head counted once; an untied
        head is the matmul, and the token embedding a lookup) plus attention's scores and values
        (attention_flops_per_token)."""
        lookups = 0 if self.lm_head is None else self.wte.weight.numel()
        return 6 * (self.num_params() - lookups) + attention_flops_per_token(self.cfg.n_layer, self.cfg.n_embd,
                                                                               seq_len)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Decay matrices only (an untied head is one); norms, biases and embeddings (the tied head too) keep their
        scale."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            is_matrix = p.dim() >= 2 and not name.startswith(("wte.", "wpe."))
            (decay if is_matrix else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def hidden_matrices(self) -> list[nn.Parameter]:
        """The 2-D weights inside the blocks (each block's four linears'): what Muon orthogonalizes. The embeddings
        (the tied head too) are lookups of single tokens, not hidden layers, and keep AdamW with the vectors; so does
        an untied head (the speedrun's choice: the head is the output layer, not a hidden one)."""
        return [p for p in self.blocks.parameters() if p.dim() == 2]

    def muon_param_groups(self, weight_decay: float) -> list[dict]:
        """param_groups for optimizer=muon: the hidden matrices first (`use_muon`), then AdamW's groups without
        them (an empty group dropped)."""
        hidden = self.hidden_matrices()
        taken = set(map(id, hidden))
        adamw = [{**g, "params": [p for p in g["params"] if id(p) not in taken]}
                 for g in self.param_groups(weight_decay)]
        return [{"params": hidden, "use_muon": True}] + [g for g in adamw if g["params"]]
