"""The decode step in five launches a block: one token per sequence through the model, each weight read once.

Why: at batch 1 a decode step is a chain of small matrix-vector products, and its time is the launches and the
weights' bytes. The compiled step runs a block as about thirteen kernels (cuBLAS GEMVs, LayerNorms, the cache
writes, the attention and its mask); here each linear layer is one kernel that also does what comes before it
(the LayerNorm or RMSNorm, recomputed per program from the row's few kilobytes) and after it (bias, GELU, the
residual add), and the attention writes the token's key and value into the cache as it reads the cache:

    ln_1 + c_attn + bias -> attention (+ the cache write) -> c_proj + bias + residual
    ln_2 + c_fc + bias + GELU -> mlp.c_proj + bias + residual          ... then ln_f + the LM head

minitrain/generate.py's `decode_logits` is the model's decode step in these kernels, captured with the draw as one
CUDA graph; the block options no kernel fuses (qk_norm, rope, ReLU^2, SwiGLU, the soft-cap) run there as the model's
own torch ops between the launches. Their references: torch's LayerNorm, RMSNorm, linear, GELU and attention over
the cache, and for the whole step the model's own cached forward (GPT.forward_hidden with a KVCache);
tests/test_decode.py and tests/test_generate_modern.py hold them equal.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from minitrain.ops.gelu import _Z1, _Z3, tanh_gelu_fp32
from minitrain.triton_runtime import check_runnable, dots_in_fp32

ROWS = 16  # sequences per program when there are several: tl.dot's smallest tile (fewer run masked to it)
WAVES = 4  # programs per SM a linear aims for: enough weight loads in flight to keep HBM busy
BLOCK_L = 64  # cached positions per step of the attention's loop


@triton.jit
def _row_stats(x_rows, row_ok, K, eps, STAT_K: tl.constexpr, RMS: tl.constexpr):
    """The rows' LayerNorm mean and inverse deviation, two passes over x in fp32 (as torch's LayerNorm); RMS: a
    mean of zero and the inverse root mean square, one pass (torch's RMSNorm)."""
    ks = tl.arange(0, STAT_K)
    total = tl.zeros(row_ok.shape, tl.float32)
    if not RMS:
        for k0 in range(0, K, STAT_K):
            k = k0 + ks
            total += tl.sum(tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
                            .to(tl.float32), 1)
    mean = total / K
    squares = tl.zeros_like(mean)
    for k0 in range(0, K, STAT_K):
        k = k0 + ks
        ok = row_ok[:, None] & (k < K)[None, :]
        d = tl.where(ok, tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32) - mean[:, None], 0.0)
        squares += tl.sum(d * d, 1)
    return mean, 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _epilogue(acc, rows, cols, row_ok, col_ok, bias_ptr, res_ptr, out_ptr, N,
              BIAS: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr, Z1: tl.constexpr, Z3: tl.constexpr):
    if BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = tanh_gelu_fp32(acc, Z1, Z3)
    out_offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + out_offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, ln_w_ptr, ln_b_ptr, res_ptr, out_ptr, partial_ptr, arrivals_ptr,
                   M, N, K, K_SPLIT, eps,
                   LN: tl.constexpr, RMS: tl.constexpr, LN_BIAS: tl.constexpr, BIAS: tl.constexpr,
                   GELU: tl.constexpr, RESIDUAL: tl.constexpr, DOT_PRECISION: tl.constexpr, Z1: tl.constexpr,
                   Z3: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAT_K: tl.constexpr,
                   SPLIT: tl.constexpr, PDL: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """out[m, n] = epilogue(sum_k prologue(x)[m, k] * w[n, k]) (the prologue a LayerNorm, with RMS an RMSNorm) for
    ROWS rows, BLOCK_N columns and the K_SPLIT wide slice `program_id(1)` of K: w (N, K) is read once in all,
    coalesced along K; the rows of x (M, K) are few and stay in cache. With SPLIT slices, each program leaves its
    fp32 sum in `partial` and the last to arrive at a tile adds them in slice order (the same bits whichever it
    is), runs the epilogue and re-arms the tile's counter for the next launch. With PDL the launch may start
    before the one it follows has finished: it waits on the GPU before reading anything, and lets the next one
    launch once its weights are read."""
    n_tile, split, m_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = m_tile * ROWS + tl.arange(0, ROWS)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K
    if PDL:
        tl.extra.cuda.gdc_wait()
    if LN:
        mean, rstd = _row_stats(x_rows, row_ok, K, eps, STAT_K, RMS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    w_cols = w_ptr + cols[None, :].to(tl.int64) * K
    k_start = split * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if LN:
            gain = tl.load(ln_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x - mean[:, None]) * rstd[:, None] * gain[None, :]
            if LN_BIAS:
                x += tl.load(ln_b_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if ROWS == 1:  # a matrix-vector product: too narrow for tl.dot, a reduction over K
            acc += tl.sum(tl.reshape(x.to(w.dtype).to(tl.float32), [BLOCK_K, 1]) * w.to(tl.float32), 0)[None, :]
        else:
            xw = x.to(w.dtype)
            if DOT_IN_FP32:  # triton_runtime.dots_in_fp32
                xw, w = xw.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(xw, w, input_precision=DOT_PRECISION)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT == 1:
        _epilogue(acc, rows, cols, row_ok, col_ok, bias_ptr, res_ptr, out_ptr, N, BIAS, GELU, RESIDUAL, Z1, Z3)
    else:
        tile_ok = row_ok[:, None] & col_ok[None, :]
        tile_offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(partial_ptr + split * M * N + tile_offsets, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial sum stored before the arrival is counted
        counter = arrivals_ptr + m_tile * tl.num_programs(0) + n_tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(partial_ptr + s * M * N + tile_offsets, mask=tile_ok, other=0.0, volatile=True)
            tl.atomic_xchg(counter, 0)
            _epilogue(acc, rows, cols, row_ok, col_ok, bias_ptr, res_ptr, out_ptr, N, BIAS, GELU, RESIDUAL, Z1, Z3)


def _dependent_launch(device: torch.device) -> dict:
    """Programmatic dependent launch where the GPU has it (sm90 on): a kernel's launch and start overlap the end
    of the one before, which matters in a step of 5 launches a block (docs/results/history.md, Sampling)."""
    pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


_arrivals: dict[torch.device, Tensor] = {}


def _arrival_counters(device: torch.device, tiles: int) -> Tensor:
    """Split-K's per-tile arrival counters: zero between launches (each tile's last program re-arms its own), so
    one buffer per device serves every launch in stream order; allocated before any graph capture needs it."""
    counters = _arrivals.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _arrivals[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return counters


def _tiles(M: int, N: int, K: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(rows, columns, K step, slices of K, slice width) per program: one row at batch 1 (a reduction over a
    long K step, no tl.dot padding), and K cut into slices until the GPU has about WAVES programs per SM, every
    slice a whole number of K steps. The shapes are the best of a sweep over gpt2-1.5b's linears."""
    rows, block_n, block_k = (1, 16, 256) if M == 1 else (ROWS, 64, 128)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, rows)
    split = max(1, min(triton.cdiv(K, block_k), WAVES * sms // tiles))
    width = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    return rows, block_n, block_k, triton.cdiv(K, width), width


def decode_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                  norm: Optional[torch.nn.LayerNorm | torch.nn.RMSNorm] = None, gelu: bool = False,
                  residual: Optional[Tensor] = None) -> Tensor:
    """(M, K) rows -> (M, N) = [norm ->] x @ weight.T [+ bias] [-> tanh-GELU] [+ residual], one kernel (the
    LayerNorm or RMSNorm its own above one row); fp32 weights multiply in fp32, not TF32, as an fp32 decode is
    meant to."""
    check_runnable(x, "decode_linear", "the model's own cached forward")
    M, K = x.shape
    N = weight.shape[0]
    if norm is not None and M > 1:  # every program would re-read its rows whole for their statistics: once, apart
        x, norm = norm(x), None
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rows, block_n, block_k, split, width = _tiles(M, N, K, x.device)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, rows))
    partial = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    arrivals = _arrival_counters(x.device, grid[0] * grid[2])
    rms = isinstance(norm, torch.nn.RMSNorm)
    dot_in_fp32 = dots_in_fp32(weight.dtype)
    ln_w, ln_b = (norm.weight, getattr(norm, "bias", None)) if norm is not None else (None, None)
    _linear_kernel[grid](
        x, weight, *(t if t is not None else out for t in (bias, ln_w, ln_b, residual)), out, partial, arrivals,
        M, N, K, width, norm.eps if norm is not None else 0.0, LN=norm is not None, RMS=rms,
        LN_BIAS=ln_b is not None, BIAS=bias is not None, GELU=gelu, RESIDUAL=residual is not None,
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 or dot_in_fp32 else "tf32", Z1=_Z1, Z3=_Z3,
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, STAT_K=triton.next_power_of_2(K),
        SPLIT=split, DOT_IN_FP32=dot_in_fp32, num_warps=4, num_stages=4, **_dependent_launch(x.device))
    return out


@triton.jit
def _cached_attention_kernel(qkv_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, n_head, length, C, scale,
                             D: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, head): its new key and value into the cache at `pos`, then softmax(q k / sqrt(D)) v over the
    cached positions before `pos` (online, BLOCK_L at a time) and the new token itself, from registers: no
    position is read back after this program wrote it."""
    b, h = tl.program_id(0), tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
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
                                          D=D, BLOCK_L=BLOCK_L, num_warps=4, **_dependent_launch(qkv.device))
    return out
