"""The attention benchmark's check and FLOP count (minitrain.tools.benchmarks.attention), which run without a
GPU."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.tools.benchmarks import attention as bench_attention


def test_causal_flops_are_the_mfu_count_halved():
    # gpt2-124m at B=16: forward 2 * (2 * T * T * d) per head for scores and values, halved by the mask; x3
    b, h, t, d = 16, 12, 1024, 64
    assert bench_attention.causal_flops(b, h, t, d) == 3 * (4 * b * h * t * t * d) / 2


def test_the_check_passes_the_same_function_and_fails_another():
    q, k, v, grad_out = (torch.randn(2, 3, 16, 8) for _ in range(4))
    want = bench_attention.forward_backward(q.double(), k.double(), v.double(), grad_out.double())
    assert bench_attention.relative_error(bench_attention.forward_backward(q, k, v, grad_out), want) < 1e-5

    def full_attention(q, k, v, grad_out):  # the mask forgotten
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(grad_out)
        return out, q.grad, k.grad, v.grad

    assert bench_attention.relative_error(full_attention(q, k, v, grad_out), want) > bench_attention.TOLERANCE
    wrong_grad = list(bench_attention.forward_backward(q, k, v, grad_out))
    wrong_grad[2] = wrong_grad[2] * 1.1  # one gradient off by 10%: the largest error counts
    assert bench_attention.relative_error(wrong_grad, want) == pytest.approx(0.1, rel=1e-3)
    wrong_grad[1] = torch.full_like(wrong_grad[1], float("nan"))
    assert not bench_attention.relative_error(wrong_grad, want) <= bench_attention.TOLERANCE
