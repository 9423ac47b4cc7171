"""The decode step in five launches a block: one token per sequence through the model, each weight read once.

Why: at batch 1 a decode step is a chain of small matrix-vector products, and its time is the launches and the
weights' bytes. The compiled step runs a block as about thirteen kernels (cuBLAS GEMVs, LayerNorms, the cache
writes, the attention and its mask); here each linear layer is one kernel that also does what comes before it
(the LayerNorm, recomputed per program from the row's few kilobytes) and after it (bias, GELU, the residual add),
and the attention writes the token's key and value into the cache as it reads the cache:

    ln_1 + c_attn + bias -> attention (+ the cache write) -> c_proj + bias + residual
    ln_2 + c_fc + bias + GELU -> mlp.c_proj + bias + residual          ... then ln_f + the LM head

`decode_logits` is that forward; minitrain/generate.py captures it, with the draw, as one CUDA graph. Its
reference is the model's own cached forward (GPT.forward_hidden with a KVCache): tests/test_decode.py holds
them equal.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.ops.gelu import _Z1, _Z3, tanh_gelu_fp32
from minitrain.triton_runtime import check_runnable

ROWS = 16  # sequences per program: tl.dot's smallest tile (a batch of 1 runs masked to it)
BLOCK_K = 128
BLOCK_L = 64  # cached positions per step of the attention's loop


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, ln_w_ptr, ln_b_ptr, res_ptr, out_ptr, M, N, K, eps,
                   LN: tl.constexpr, LN_BIAS: tl.constexpr, BIAS: tl.constexpr, GELU: tl.constexpr,
                   RESIDUAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   Z1: tl.constexpr, Z3: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = epilogue(sum_k prologue(x)[m, k] * w[n, k]) for ROWS rows and BLOCK_N columns: w (N, K) is read
    once per program, coalesced along K; the rows of x (M, K) are few and stay in cache."""
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K
    if LN:  # the rows' mean and inverse deviation, two passes over x (as torch's LayerNorm, in fp32)
        total = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            total += tl.sum(tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
                            .to(tl.float32), 1)
        mean = total / K
        squares = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            ok = row_ok[:, None] & (k < K)[None, :]
            d = tl.where(ok, tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32) - mean[:, None], 0.0)
            squares += tl.sum(d * d, 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    w_cols = w_ptr + cols[None, :].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if LN:
            gain = tl.load(ln_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x - mean[:, None]) * rstd[:, None] * gain[None, :]
            if LN_BIAS:
                x += tl.load(ln_b_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        acc += tl.dot(x.to(w.dtype), w, input_precision=DOT_PRECISION)
    if BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = tanh_gelu_fp32(acc, Z1, Z3)
    out_offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + out_offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _block_n(n: int) -> int:
    """Columns per program: the widest tile that still gives every SM of a large GPU a program or two."""
    return next((b for b in (64, 32) if triton.cdiv(n, b) >= 256), 16)


def decode_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                  norm: Optional[torch.nn.LayerNorm] = None, gelu: bool = False,
                  residual: Optional[Tensor] = None) -> Tensor:
    """(M, K) rows -> (M, N) = [norm ->] x @ weight.T [+ bias] [-> tanh-GELU] [+ residual], one kernel; fp32 weights
    multiply in fp32, not TF32, as an fp32 decode is meant to."""
    check_runnable(x, "decode_linear", "the model's own cached forward")
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_n = _block_n(N)
    ln_w, ln_b = (norm.weight, norm.bias) if norm is not None else (None, None)
    _linear_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, ROWS))](
        x, weight, *(t if t is not None else out for t in (bias, ln_w, ln_b, residual)), out, M, N, K,
        norm.eps if norm is not None else 0.0, LN=norm is not None, LN_BIAS=ln_b is not None,
        BIAS=bias is not None, GELU=gelu, RESIDUAL=residual is not None,
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", Z1=_Z1, Z3=_Z3,
        ROWS=ROWS, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4)
    return out


@triton.jit
def _cached_attention_kernel(qkv_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, n_head, length, C, scale,
                             D: tl.constexpr, BLOCK_L: tl.constexpr):
    """One (sequence, head): its new key and value into the cache at `pos`, then softmax(q k / sqrt(D)) v over the
    cached positions before `pos` (online, BLOCK_L at a time) and the new token itself, from registers: no
    position is read back after this program wrote it."""
    b, h = tl.program_id(0), tl.program_id(1)
    pos = tl.load(pos_ptr)
    d = tl.arange(0, D)
    token = qkv_ptr + b.to(tl.int64) * 3 * C + h * D
    q = tl.load(token + d).to(tl.float32) * scale
    k_new = tl.load(token + C + d)
    v_new = tl.load(token + 2 * C + d)
    head = (b.to(tl.int64) * n_head + h) * length * D
    tl.store(k_ptr + head + pos * D + d, k_new)
    tl.store(v_ptr + head + pos * D + d, v_new)
    m = tl.sum(q * k_new.to(tl.float32), 0)  # the running max starts at the new token's score
    total = 1.0
    acc = v_new.to(tl.float32)
    ls = tl.arange(0, BLOCK_L)
    for l0 in range(0, pos, BLOCK_L):
        l = l0 + ls
        ok = l < pos
        offsets = head + l[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(k * q[None, :], 1), -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(out_ptr + b.to(tl.int64) * C + h * D + d, (acc / total).to(out_ptr.dtype.element_ty))


def cached_attention(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor) -> Tensor:
    """(B, 3C) projections of one token per sequence at position `pos` (a 1-element tensor, read on the device) ->
    (B, C) attention output over the (B, n_head, length, head size) caches, which gain the token's key and value."""
    check_runnable(qkv, "cached_attention", "the model's own cached forward")
    B, n_head, length, D = k_cache.shape
    C = n_head * D
    out = torch.empty((B, C), dtype=qkv.dtype, device=qkv.device)
    _cached_attention_kernel[(B, n_head)](qkv, k_cache, v_cache, pos, out, n_head, length, C, D ** -0.5,
                                          D=D, BLOCK_L=BLOCK_L, num_warps=4)
    return out


def decode_logits(model, cache, token: Tensor, pos: Tensor) -> Tensor:
    """The LM head's logits (B, head_vocab) of one token per sequence (B, 1) at position `pos` (1,): what
    F.linear(GPT.forward_hidden(token, cache, pos)[:, -1], GPT.lm_head_weight) computes, the cache written alike."""
    x = (model.wte(token[:, 0]) + model.wpe(pos)).contiguous()
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        qkv = decode_linear(x, attn.c_attn.weight, attn.c_attn.bias, norm=block.ln_1)
        y = cached_attention(qkv, getattr(cache, f"k{i}"), getattr(cache, f"v{i}"), pos)
        x = decode_linear(y, attn.c_proj.weight, attn.c_proj.bias, residual=x)
        h = decode_linear(x, mlp.c_fc.weight, mlp.c_fc.bias, norm=block.ln_2, gelu=True)
        x = decode_linear(h, mlp.c_proj.weight, mlp.c_proj.bias, residual=x)
    return decode_linear(x, model.lm_head_weight, norm=model.ln_f)
