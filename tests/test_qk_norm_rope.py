"""The fused q/k norm and rotation (model.qk_kernel=fused) against nn.RMSNorm then model.rotate, kernels through the
Triton interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from minitrain.model import RMS_NORM_EPS, rotate  # noqa: E402
from minitrain.ops import qk_norm_rope, rope_tables  # noqa: E402

BASE = 100.0  # a small rope base: late features turn by large angles too
# (B, T, heads, head size): 2 * 37 * 3 = 222 (token, head) rows, three 64-row programs and a partial one; head size
# 24 is no power of 2 (the kernel pads its halves to 16), 64 is gpt2-124m's, 9 is odd (the norm alone: its parts 5
# and 4 wide).
SHAPES = [(2, 37, 3, 24), (1, 70, 2, 64)]
PARTS = [(True, True), (True, False), (False, True)]  # (qk_norm, rope)
CASES = [(shape, *parts) for shape in SHAPES for parts in PARTS] + [((2, 37, 3, 9), True, False)]


def make(shape, dtype, seed, scale=1.0):
    """c_attn's output (B, T, 3C), distinct q and k norm weights, and q's and k's incoming gradients: k's in the
    (B, heads, T, head size) memory that attention's backward gives."""
    B, T, H, D = shape
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    qkv = torch.randn(B, T, 3 * H * D, generator=g) * scale
    weights = [1.0 + 0.5 * torch.randn(D, generator=g) for _ in range(2)]
    dq = torch.randn(B, T, H, D, generator=g)
    dk = torch.randn(B, H, T, D, generator=g).transpose(1, 2)
    return [t.to(dtype) for t in (qkv, *weights, dq, dk)]


def run(fused, shape, qkv, q_weight, k_weight, dq, dk, norm, rope, pos):
    """q, k and the gradients of qkv and of both weights (None without the norm), by the op or by torch's modules."""
    B, T, H, D = shape
    qkv = qkv.detach().clone().requires_grad_()
    norms = [nn.RMSNorm(D, eps=RMS_NORM_EPS).to(w.dtype) for w in (q_weight, k_weight)]
    for n, w in zip(norms, (q_weight, k_weight)):
        n.weight.data.copy_(w)
    cos, sin = rope_tables(pos, D, BASE) if rope else (None, None)
    if fused:
        q, k = qk_norm_rope(qkv[..., : 2 * H * D], H, *((n.weight for n in norms) if norm else (None, None)),
                            RMS_NORM_EPS, cos, sin)
    else:
        q, k, _ = (t.view(B, T, H, D) for t in qkv.split(H * D, 2))
        if norm:
            q, k = norms[0](q), norms[1](k)
        if rope:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    torch.autograd.backward((q, k), (dq, dk))
    return q.detach(), k.detach(), qkv.grad, *((n.weight.grad for n in norms) if norm else (None, None))


def truth(shape, qkv, q_weight, k_weight, dq, dk, norm, rope, pos):
    """The definition in fp64: x / sqrt(mean(x^2) + eps) * weight, then pair (i, i + D/2) turned by the angle
    pos * BASE^(-2i/D)."""
    B, T, H, D = shape
    qkv, q_weight, k_weight = (t.double().requires_grad_() for t in (qkv, q_weight, k_weight))
    angle = pos.double()[:, None, None] * BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    out = []
    for x, w in zip(qkv.split(H * D, 2)[:2], (q_weight, k_weight)):
        x = x.reshape(B, T, H, D)
        if norm:
            x = x / torch.sqrt(x.square().mean(-1, keepdim=True) + RMS_NORM_EPS) * w
        if rope:
            x1, x2 = x.chunk(2, -1)
            x = torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), -1)
        out.append(x)
    torch.autograd.backward(out, (dq.double(), dk.double()))
    return out[0].detach(), out[1].detach(), qkv.grad, *((q_weight.grad, k_weight.grad) if norm else (None, None))


@pytest.mark.parametrize("shape, norm, rope", CASES)
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # 1e-3: rms^2 ~ eps, so where eps sits shows
def test_matches_an_fp64_truth_in_fp32(shape, norm, rope, scale):
    inputs = make(shape, torch.float32, seed=len(shape) + 7 * norm + 3 * rope, scale=scale)
    pos = torch.arange(5, 5 + shape[1])  # positions of a decode step, not 0..T-1
    got = run(True, shape, *inputs, norm, rope, pos)
    want = truth(shape, *inputs, norm, rope, pos)
    names = ("q", "k", "qkv.grad", "q_norm.weight.grad", "k_norm.weight.grad")
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5 * w.abs().max().item(), msg=name)
    B, T, H, D = shape
    assert got[2][..., 2 * H * D:].abs().max() == 0  # v's columns get nothing from q and k


@pytest.mark.parametrize("norm, rope", [(True, False), (False, True)])
def test_one_part_alone_in_bf16_is_torchs_to_the_bit(norm, rope):
    """With one part there is no rounding between two to differ in: the op's bf16 q and k are torch's exactly (and the
    rotation's gradient; the norm's backward rounds its own way in torch)."""
    shape = SHAPES[1]
    inputs = make(shape, torch.bfloat16, seed=11)
    pos = torch.arange(shape[1])
    got = run(True, shape, *inputs, norm, rope, pos)
    want = run(False, shape, *inputs, norm, rope, pos)
    for g, w in zip(got[:2] if norm else got[:3], want):
        assert torch.equal(g, w)


def test_both_parts_in_bf16_within_one_rounding_of_the_truth():
    """torch rounds the norm's output to bf16 before rotating it; the op does not, so it is nearer the truth."""
    shape = SHAPES[1]
    inputs = make(shape, torch.bfloat16, seed=12)
    pos = torch.arange(shape[1])
    got = run(True, shape, *inputs, True, True, pos)
    want = truth(shape, *inputs, True, True, pos)
    for g, w in zip(got, want):
        err = (g.double() - w).abs().max().item()
        assert err <= 2 ** -7 * w.abs().max().item(), err


def test_a_row_strided_input_that_is_not_c_attns_q_and_k_columns_is_refused():
    qk = torch.randn(2, 5, 4 * 4 * 6)[..., :: 2]
    with pytest.raises(ValueError, match="unit feature stride"):
        qk_norm_rope(qk, 4, None, None, RMS_NORM_EPS, None, None)
