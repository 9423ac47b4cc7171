"""Fused linear cross-entropy against an fp64 truth, kernels through the Triton interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minitrain.tools.live_bytes import LiveBytes  # noqa: E402
from minitrain.ops import fused_linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402

N, H, V = 47, 31, 123  # V is not a multiple of any block size


def make_inputs(seed, n=N, h=H, v=V, ignore_fraction=0.25, dtype=torch.float32):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignore_fraction] = -100
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets, grad_output=None, **kwargs):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = fn(hidden, weight, targets, **kwargs)
    loss.backward(grad_output)
    return loss.detach(), hidden.grad, weight.grad


def truth(hidden, weight, targets, grad_output=None, **kwargs):
    go = None if grad_output is None else grad_output.double()
    return loss_and_grads(linear_cross_entropy_reference, hidden.double(), weight.double(), targets, go, **kwargs)


def assert_close_to_truth(hidden, weight, targets, grad_output=None, atol=1e-5, **kwargs):
    got = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, grad_output, **kwargs)
    want = truth(hidden, weight, targets, grad_output,
                 **{k: v for k, v in kwargs.items() if k not in ("chunk_bytes", "low_memory")})
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == (torch.float32 if name == "loss" else hidden.dtype), name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("rows", [1, 5, 16, N])
def test_chunk_budgets(rows):
    hidden, weight, targets = make_inputs(rows)
    assert_close_to_truth(hidden, weight, targets, chunk_bytes=rows * V * 4)


@pytest.mark.parametrize("programs", [1, 3, N])
@pytest.mark.parametrize("block", [32, 256])  # rows of V = 123 columns in four blocks, or in one (read once)
def test_row_kernel_any_number_of_programs(programs, block):
    """The row kernel's programs stride over the rows: any grid covers every row exactly once, and its
    losses and gradients are the truth's, whether a row streams in blocks or sits in one."""
    from minitrain.ops.cross_entropy_triton import cross_entropy_rows

    hidden, weight, targets = make_inputs(programs)
    logits = hidden @ weight.T
    outs = []
    for grid in (programs, None):
        grad, losses, lse = logits.clone(), torch.full((N,), float("nan")), torch.full((N,), float("nan"))
        cross_entropy_rows(grad, targets, losses, lse, torch.tensor(0.5), ignore_index=-100, label_smoothing=0.1,
                           z_loss=1e-3, write_grad=True, programs=grid, block=block)
        outs.append((grad, losses, lse))
    assert not any(t.isnan().any() for t in outs[0])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    exact = logits.double().requires_grad_()
    want = F.cross_entropy(exact, targets, reduction="none", label_smoothing=0.1)
    valid = targets != -100
    want = torch.where(valid, want + 1e-3 * exact.logsumexp(1) ** 2, 0.0)
    (0.5 * want.sum()).backward()
    torch.testing.assert_close(outs[0][1].double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][2][valid].double(), exact.detach()[valid].logsumexp(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][0].double(), exact.grad, rtol=1e-5, atol=1e-7)


def test_row_kernel_bf16_logits_at_the_edge_of_fp32s_exp():
    """bf16 logits in the thousands, rows streamed in four blocks: exp overflows fp32 unless each block is taken
    relative to the running max, and the sum of the exps is rescaled when a later block raises the max. Rows' largest
    logits sit in the first block, at the start and at the end of the last (partial) one, at the end of the one
    before; one row is ignored (its gradient zeroed in every block)."""
    from minitrain.ops.cross_entropy_triton import cross_entropy_rows

    g = torch.Generator(torch.get_default_device()).manual_seed(16)
    rows, block = 6, 32
    logits = (torch.randn(rows, V, generator=g) * 3000).bfloat16()
    for row, col in enumerate((0, V - 1, 3 * block, 3 * block - 1)):
        logits[row, col] = 3e4
    targets = torch.randint(0, V, (rows,), generator=g)
    targets[4] = -100
    scale = torch.rand(rows, generator=g)
    grad, losses, lse = logits.clone(), torch.empty(rows), torch.empty(rows)
    cross_entropy_rows(grad, targets, losses, lse, scale, ignore_index=-100, label_smoothing=0.1, z_loss=1e-6,
                       write_grad=True, programs=3, block=block)
    exact = logits.double().requires_grad_()
    want = F.cross_entropy(exact, targets, reduction="none", label_smoothing=0.1, ignore_index=-100)
    want = torch.where(targets != -100, want + 1e-6 * exact.logsumexp(1) ** 2, 0.0)
    (scale.double() * want).sum().backward()
    torch.testing.assert_close(losses.double(), want.detach(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(lse.double()[targets != -100], exact.detach().logsumexp(1)[targets != -100],
                               rtol=1e-6, atol=0)
    assert grad.dtype == torch.bfloat16 and torch.equal(grad[4], torch.zeros_like(grad[4]))
    # fp32 math rounded once to nearest: within one bf16 step of the truth's rounding, and nearly always on it
    torch.testing.assert_close(grad.double(), exact.grad, rtol=2 ** -8, atol=0)
    assert (grad == exact.grad.bfloat16()).float().mean() > 0.99


@pytest.mark.parametrize("tile", [(4, 32), None])
def test_logit_grad_block_tiles_cover_every_row_and_column(tile):
    """Columns [col0, col0 + C) of every row become their gradient from the rows' log-sum-exp: 4 x 32 tiles make
    12 x 4 programs (the last of each partial), the default tile for C = 100 (16 x 128) 3 x 1. Rows 0-7 are
    ignored, two whole 4-row tiles; each row has its own gradient scale (reduction="none")."""
    from minitrain.ops.cross_entropy_triton import logit_grad_block

    hidden, weight, targets = make_inputs(14)
    targets[:8] = -100
    targets[10], targets[11] = 23, 122  # targets in the block's first and last columns
    logits = hidden @ weight.T
    valid = targets != -100
    scale = torch.rand(N, generator=torch.Generator(torch.get_default_device()).manual_seed(14))
    exact = logits.double().requires_grad_()
    lse = torch.where(valid, exact.detach().logsumexp(1), 0.0).float()
    want = F.cross_entropy(exact, targets, reduction="none", label_smoothing=0.1) + 1e-3 * exact.logsumexp(1) ** 2
    (scale.double() * torch.where(valid, want, 0.0)).sum().backward()
    col0, C = 23, 100
    block = logits[:, col0:col0 + C].contiguous()
    logit_grad_block(block, col0, V, targets, lse, scale, ignore_index=-100, label_smoothing=0.1, z_loss=1e-3,
                     tile=tile)
    torch.testing.assert_close(block.double(), exact.grad[:, col0:col0 + C], rtol=1e-5, atol=1e-7)
    assert torch.equal(block[:8], torch.zeros(8, C))


def test_low_memory_vocab_blocks_cross_the_gradient_kernels_tiles():
    """V = 400 in vocab blocks of 384 columns: the gradient kernel's default tile there is 16 rows x 128 columns
    (384's largest power-of-two divisor), 3 x 3 programs, and the second block is 16 columns wide."""
    hidden, weight, targets = make_inputs(15, v=400)
    assert_close_to_truth(hidden, weight, targets, label_smoothing=0.1, z_loss=1e-3, chunk_bytes=N * 384 * 4,
                          low_memory=True)


# low_memory: the row chunks use the memory of grad_weight and pass B's workspace; the vocab blocks are
# as wide as the budget allows: one row / one column up to everything in one chunk.
@pytest.mark.parametrize("h, columns", [(1, 1), (5, 7), (H, 64), (N + 3, V)])
def test_low_memory_chunk_budgets(h, columns):
    hidden, weight, targets = make_inputs(h, h=h)
    assert_close_to_truth(hidden, weight, targets, chunk_bytes=N * columns * 4, low_memory=True)


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions(reduction, low_memory):
    hidden, weight, targets = make_inputs(1)
    grad_output = torch.randn(N) if reduction == "none" else torch.tensor(3.0)
    assert_close_to_truth(hidden, weight, targets, grad_output, reduction=reduction, chunk_bytes=8 * V * 4,
                          low_memory=low_memory)


def test_in_range_ignore_index():
    hidden, weight, targets = make_inputs(2, ignore_fraction=0.0)
    targets[::3] = 7
    assert_close_to_truth(hidden, weight, targets, ignore_index=7, chunk_bytes=8 * V * 4)


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_is_zero_not_nan(reduction, low_memory):
    hidden, weight, targets = make_inputs(3, ignore_fraction=1.0)
    loss, grad_hidden, grad_weight = loss_and_grads(
        fused_linear_cross_entropy, hidden, weight, targets, torch.ones(N) if reduction == "none" else None,
        reduction=reduction, low_memory=low_memory,
    )
    for t in (loss, grad_hidden, grad_weight):
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_label_smoothing_and_z_loss(reduction, low_memory):
    hidden, weight, targets = make_inputs(4)
    grad_output = torch.randn(N) if reduction == "none" else None
    assert_close_to_truth(
        hidden, weight, targets, grad_output, reduction=reduction, label_smoothing=0.1, z_loss=1e-2,
        chunk_bytes=8 * V * 4, low_memory=low_memory,
    )


def test_large_common_logit_offset():
    """A constant feature with a weight of 300 adds 300 to every logit: softmax must not overflow."""
    hidden, weight, targets = make_inputs(5)
    hidden = torch.cat([hidden, torch.ones(N, 1)], dim=1)
    weight = torch.cat([weight, torch.full((V, 1), 300.0)], dim=1)
    assert_close_to_truth(hidden, weight, targets, z_loss=1e-4, atol=2e-4, chunk_bytes=8 * V * 4)


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("dtype, grad_output", [(torch.bfloat16, 1.0), (torch.float16, 1024.0)])
def test_low_precision_no_worse_than_naive(dtype, grad_output, low_memory):
    """bf16, and fp16 under a loss scale."""
    hidden, weight, targets = make_inputs(6, n=96, h=64, v=257, dtype=dtype)
    grad_output = torch.tensor(grad_output)

    def naive(h, w, y):
        return F.cross_entropy((h @ w.T).float(), y)

    want = truth(hidden, weight, targets, grad_output)
    fused = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, grad_output, chunk_bytes=32 * 257 * 2,
                           low_memory=low_memory)
    plain = loss_and_grads(naive, hidden, weight, targets, grad_output)
    for name, f, p, t in zip(("loss", "grad_hidden", "grad_weight"), fused, plain, want):
        assert f.dtype == p.dtype, name
        err_fused, err_naive = (f.double() - t).norm(), (p.double() - t).norm()
        assert err_fused <= 1.05 * err_naive + 1e-6, (name, err_fused.item(), err_naive.item())


@pytest.mark.parametrize("low_memory", [False, True])
def test_accumulates_into_existing_weight_grad_in_weight_dtype(low_memory):
    """Tied embedding under autocast-style mixed precision: bf16 hidden, fp32 weight."""
    hidden, weight, targets = make_inputs(7)
    weight = weight.requires_grad_()
    earlier = torch.randn(V, H)
    weight.grad = earlier.clone()
    fused_linear_cross_entropy(hidden.bfloat16().requires_grad_(), weight, targets, low_memory=low_memory).backward()
    _, _, grad_weight = truth(hidden.bfloat16(), weight.detach(), targets)
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad.double(), earlier.double() + grad_weight, rtol=0, atol=2e-3)


def test_no_grad_forward_matches():
    hidden, weight, targets = make_inputs(8)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_bytes=8 * V * 4)
    torch.testing.assert_close(loss.double(), truth(hidden, weight, targets)[0], rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph():
    """The custom op and its autograd trace without a graph break (aot_eager: no C++ build on CPU)."""
    hidden, weight, targets = make_inputs(9)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(h, w, y):
        return fused_linear_cross_entropy(torch.tanh(h), w, y, chunk_bytes=8 * V * 4)

    got = loss_and_grads(step, hidden, weight, targets)
    want = loss_and_grads(
        lambda h, w, y: linear_cross_entropy_reference(torch.tanh(h), w, y), hidden.double(), weight.double(), targets
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_cpu_without_interpreter_raises(monkeypatch):
    from minitrain import triton_runtime

    monkeypatch.setattr(triton_runtime, "interpreted", lambda: False)  # as if TRITON_INTERPRET was unset at import
    hidden, weight, targets = (t.cpu() for t in make_inputs(10))
    with pytest.raises(RuntimeError, match="loss.impl=torch"):
        fused_linear_cross_entropy(hidden, weight, targets)


@pytest.mark.parametrize("low_memory", [True, False])
def test_peak_memory_beyond_the_gradients(monkeypatch, low_memory):
    """Live storages at their peak, beyond the two gradients and the rows' loss and log-sum-exp.
    low_memory: one workspace as large as hidden (the row chunks use the memory that grad_weight and
    pass B's workspace take later). Default: the fp32 accumulator; the row-chunk workspace (smaller than
    grad_weight here) is gone before grad_weight is made. Backward scales the gradients in place."""
    from minitrain.ops import cross_entropy

    # The custom op hides its inside from the mode, so the passes are called directly, with the softmax
    # kernels (which write in place) stubbed: the interpreter's copies of their arguments do not count.
    monkeypatch.setattr(cross_entropy, "cross_entropy_rows", lambda *args, **kwargs: None)
    monkeypatch.setattr(cross_entropy, "logit_grad_block", lambda *args, **kwargs: None)
    hidden, weight, targets = make_inputs(11, dtype=torch.bfloat16)
    chunk_bytes = cross_entropy.default_chunk_bytes(hidden, low_memory=True) if low_memory else 8 * V * 2
    gradients = V * H * 2 + N * H * 2
    with LiveBytes() as passes:
        cross_entropy._loss_and_grads(hidden, weight, targets, torch.tensor(1.0), -100, 0.0, 0.0, None, chunk_bytes,
                                      grads=True, low_memory=low_memory)
    assert passes.peak == gradients + (N * H * 2 if low_memory else V * H * 4) + 2 * N * 4
    monkeypatch.undo()
    hidden.requires_grad_()
    weight.requires_grad_()
    with LiveBytes() as op:
        fused_linear_cross_entropy(hidden, weight, targets, chunk_bytes=chunk_bytes, low_memory=low_memory).backward()
    assert op.peak <= gradients + 64, op.peak
    assert weight.grad.dtype == torch.bfloat16


def test_second_backward_raises_instead_of_rescaling():
    hidden, weight, targets = make_inputs(12)
    loss = fused_linear_cross_entropy(hidden.requires_grad_(), weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_fp16_sum_gradients_stay_in_range():
    """reduction="sum" has no 1/n_valid to protect: its fp16 gradients carry no headroom (x 2^14 would
    overflow grad_hidden here)."""
    hidden, weight, targets = make_inputs(13, dtype=torch.float16)
    weight = weight * 8
    got = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, reduction="sum")
    want = truth(hidden, weight, targets, reduction="sum")
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=name)
