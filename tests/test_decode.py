"""The decode kernels (minitrain/ops/decode.py) against their references: each linear's prologue and epilogues
against torch, the cached attention against SDPA over the cache (and the cache it writes), the whole decode step
(minitrain/generate.py's decode_logits) against the model's own cached forward, and fused sampling against the unfused sampler's tokens."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.generate import Sampler, Sampling, decode_logits, generate
from minitrain.model import GPT, KVCache
from minitrain.model_config import ModelConfig
from minitrain.ops.decode import cached_attention, decode_linear

from conftest import TEST_DEVICE

DEVICE = torch.device(TEST_DEVICE)
# fp32 on the CPU (the interpreter multiplies in fp32); bf16 on a GPU, against torch's bf16 in fp32 arithmetic
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
TOL = dict(rtol=1e-5, atol=1e-5) if DTYPE == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def randn(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cpu") * scale).to(DEVICE, DTYPE)


def layer_norm(K, bias=True):
    ln = torch.nn.LayerNorm(K, bias=bias).to(DEVICE, DTYPE)
    with torch.no_grad():
        ln.weight.copy_(randn(K, seed=4))
        if ln.bias is not None:
            ln.bias.copy_(randn(K, seed=5))
    return ln


def composed(x, weight, b=None, ln=None, gelu=False, res=None):
    """decode_linear's reference: torch's LayerNorm, linear, tanh-GELU and residual add, in fp32."""
    normed = F.layer_norm(x.float(), (x.shape[1],), ln.weight.float(),
                          ln.bias.float() if ln.bias is not None else None, ln.eps) if ln else x.float()
    out = F.linear(normed, weight.float(), b.float() if b is not None else None)
    if gelu:
        out = F.gelu(out, approximate="tanh")
    return out + res.float() if res is not None else out


# The tiles (decode._tiles, 8 multiprocessors on a CPU): one row takes columns 16 at a time and K 256 at a time,
# so K = 200 is one K step (no split) and K = 300 two slices, each program normalising its row in the kernel;
# several rows take 16 rows, 64 columns and K 128 at a time, split into 2 (K = 200) or 3 slices (K = 300, the
# last one partial). N = 90 ends in a partial column tile either way; 17 rows fill more than one row tile.
@pytest.mark.parametrize("K", [200, 300])
@pytest.mark.parametrize("rows", [1, 3, 17])  # one sequence, a few, more than one program's ROWS
@pytest.mark.parametrize("norm, bias, gelu, residual", [
    (False, False, False, False), (True, True, False, False), (False, True, False, True),
    (True, True, True, False), ("no bias", False, True, True)])
def test_decode_linear_is_its_torch_composition(rows, K, norm, bias, gelu, residual):
    N = 90
    x, weight = randn(rows, K, seed=1, scale=3.0) + 1.5, randn(N, K, seed=2, scale=0.1)
    b = randn(N, seed=3) if bias else None
    ln = layer_norm(K, bias=norm != "no bias") if norm else None
    res = randn(rows, N, seed=6) if residual else None
    with torch.no_grad():
        expected = composed(x, weight, b, ln, gelu, res)
        got = decode_linear(x, weight, b, norm=ln, gelu=gelu, residual=res)
    assert got.dtype == DTYPE and got.shape == (rows, N)
    torch.testing.assert_close(got.float(), expected, **TOL)


@pytest.mark.skipif(DTYPE == torch.bfloat16, reason="the test above is this one on a GPU")
@pytest.mark.parametrize("rows", [1, 17])  # the reduction over K; tl.dot over row tiles
def test_decode_linear_in_bf16_is_its_torch_composition(rows):
    """The bf16 weights a GPU samples with, on the CPU too: the interpreter's tl.dot of bf16 tiles is not the GPU's
    (decode.py multiplies them in fp32 there), so only this test sees a bf16 slip in the kernel on the CPU."""
    K, N = 300, 90
    x = (torch.randn(rows, K, generator=torch.Generator().manual_seed(1)) * 3.0 + 1.5).bfloat16()
    weight = (torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.1).bfloat16()
    b = torch.randn(N, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        got = decode_linear(x, weight, b, gelu=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), composed(x, weight, b, gelu=True), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("K", [200, 300])  # one K step; two slices, each program normalising the row itself
@pytest.mark.parametrize("row", ["constant", "variance below eps"])
def test_decode_linear_layer_norm_prologue_keeps_eps(row, K):
    """A row of one value (variance 0) and one whose variance is a tenth of eps: LayerNorm's eps decides the
    scale of both; without it the first divides by zero (NaN out) and the second is scaled 3.3 times too far."""
    x = torch.full((1, K), 3.0, device=DEVICE, dtype=DTYPE) if row == "constant" else randn(1, K, seed=7) * 1e-3
    ln, weight = layer_norm(K), randn(90, K, seed=2, scale=0.1)
    with torch.no_grad():
        got = decode_linear(x, weight, norm=ln)
        expected = composed(x, weight, ln=ln)
    torch.testing.assert_close(got.float(), expected, **TOL)


# The kernel reads the cache BLOCK_L = 64 positions at a time, one program per (sequence, head): positions before the
# token fill none, one, a loop step but one, exactly one, one step and one more, and a second step partly.
@pytest.mark.parametrize("pos, scale", [(0, 1.0), (1, 1.0), (63, 1.0), (64, 1.0), (65, 1.0), (100, 1.0),
                                        (100, 40.0)])
def test_cached_attention_is_sdpa_over_the_cache_and_writes_the_token(pos, scale):
    """scale 40: scores in the hundreds and thousands, the new token's far above or below the cached ones': exp
    overflows unless the online softmax subtracts the running max at every step."""
    B, H, L, D = 2, 3, 112, 16
    k_cache, v_cache = randn(B, H, L, D, seed=1, scale=scale ** 0.5), randn(B, H, L, D, seed=2)
    qkv = randn(B, 3 * H * D, seed=3, scale=scale)
    q, k, v = (t.view(B, H, 1, D) for t in qkv.split(H * D, 1))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    k_expected[:, :, pos], v_expected[:, :, pos] = k[:, :, 0], v[:, :, 0]
    seen = torch.arange(L, device=DEVICE) <= pos
    expected = F.scaled_dot_product_attention(q.float(), k_expected.float(), v_expected.float(),
                                              attn_mask=seen[None, :]).reshape(B, H * D)
    stale = k_cache[:, :, pos + 1:].clone()
    got = cached_attention(qkv, k_cache, v_cache, torch.tensor([pos], device=DEVICE))
    torch.testing.assert_close(got.float(), expected, **TOL)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert torch.equal(k_cache[:, :, pos + 1:], stale)  # positions after the token are neither read nor written


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=96, vocab_size=320, head_vocab=300, bias=True)
    torch.manual_seed(0)
    gpt = GPT(cfg).eval()
    with torch.no_grad():  # wide weights, so that the tokens depend on every term
        for p in gpt.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return gpt.to(DEVICE, DTYPE)


def assert_close_at_scale(got, expected):
    """In bf16 (a GPU) a value near zero carries the rounding of the large ones it was summed from."""
    scale = dict(atol=1e-2 * expected.abs().max().item()) if DTYPE == torch.bfloat16 else {}
    torch.testing.assert_close(got.float(), expected.float(), **{**TOL, **scale})


@torch.no_grad()
def test_decode_logits_are_the_models_cached_forward_step_by_step(model):
    B, T = 3, 7
    prompt = torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE)
    ours, reference = (KVCache(model.cfg, B, 40, DTYPE, DEVICE) for _ in range(2))
    positions = torch.arange(40, device=DEVICE)
    for cache in (ours, reference):
        model.forward_hidden(prompt, cache, positions[:T])
    token = prompt[:, -1:]
    for i in range(T, T + 12):
        expected = F.linear(model.forward_hidden(token, reference, positions[i:i + 1])[:, -1], model.lm_head_weight)
        got = decode_logits(model, ours, token, positions[i:i + 1])
        assert got.shape == (B, 300)
        assert_close_at_scale(got, expected)
        for name, buffer in ours.named_buffers():
            assert_close_at_scale(buffer, reference.get_buffer(name))
        token = expected.argmax(-1, keepdim=True)


@torch.no_grad()
def test_fused_sampling_draws_the_unfused_samplers_tokens(model):
    prompt = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(2), device="cpu").to(DEVICE)
    drawn = [Sampling(temperature=0.8, top_k=50, top_p=0.9)] if DEVICE.type == "cpu" else []  # (inductor's
    for sampling in [Sampling(temperature=0), *drawn]:  # compiled draws take their own random stream)
        plain = generate(model, prompt, 12, sampling, seed=3).tokens
        sampler = Sampler(model, 2, 17, sampling, fused=True)
        assert sampler.fused
        assert torch.equal(sampler.generate(prompt, 12, seed=3).tokens, plain)
        if DEVICE.type == "cuda":
            assert torch.equal(sampler.generate(prompt, 12, seed=3).tokens, plain)  # the captured step, replayed
        assert len(set(plain[0, 5:].tolist())) > 4  # text, not one token repeated


def test_fused_by_default_when_graphed_and_only_with_the_cache(model):
    greedy = Sampling(temperature=0)
    assert Sampler(model, 1, 8, greedy, graphs=True).fused  # built only: capturing needs CUDA
    assert not Sampler(model, 1, 8, greedy, graphs=True, fused=False).fused
    assert not Sampler(model, 1, 8, greedy, graphs=False).fused
    assert Sampler(model, 1, 8, greedy, graphs=False, fused=True).fused
    assert not Sampler(model, 1, 8, greedy, kv_cache=False, fused=True).fused
