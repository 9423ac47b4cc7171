"""The loss benchmark's check against the fp32 reference (minitrain.tools.benchmarks.cross_entropy), which runs
without a GPU."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.ops import linear_cross_entropy_reference
from minitrain.tools.benchmarks import cross_entropy as bench


@pytest.fixture(scope="module")
def inputs():
    hidden, weight, targets = bench.make_inputs(256, 64, 512, "cpu")
    return hidden, weight, targets, bench.fp32_reference(hidden, weight, targets)


def _scale_grad(tensor, factor):
    """`tensor` in forward; its gradient times `factor` in backward."""
    view = tensor.view_as(tensor)
    view.register_hook(lambda grad: grad * factor)
    return view


def test_inputs_ignore_a_seventh_of_the_targets(inputs):
    _, _, targets, _ = inputs
    assert (targets == bench.IGNORE_INDEX).sum() == -(-len(targets) // bench.IGNORED_EVERY)


@pytest.mark.parametrize("loss_fn", [linear_cross_entropy_reference, bench.naive], ids=["reference", "naive"])
def test_correct_bf16_losses_pass(inputs, loss_fn):
    hidden, weight, targets, reference = inputs
    check = bench.check_against_reference(loss_fn, hidden, weight, targets, reference)
    assert check["ok"] and check["failed"] == []
    assert 0 < check["grad_hidden_err"] <= bench.GRAD_TOL and 0 < check["grad_weight_err"] <= bench.GRAD_TOL
    assert hidden.grad is None and weight.grad is None  # the timed calls start from empty gradients


def test_torchs_linear_cross_entropy_row_has_gradients_within_tolerance(inputs):
    """The row to time beside ours where torch has it; its loss comes back in bf16, outside the loss tolerance
    (flagged in the table, the row still timed), its gradients within."""
    loss_fn = bench.torch_linear_cross_entropy()
    if loss_fn is None:
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    hidden, weight, targets, reference = inputs
    check = bench.check_against_reference(loss_fn, hidden, weight, targets, reference)
    assert check["failed"] in ([], ["loss_err"]) and check["loss_err"] < 1e-2
    assert loss_fn(hidden, weight, targets).dtype == torch.bfloat16
    hidden.grad = weight.grad = None


def _off_loss(hidden, weight, targets):
    loss = linear_cross_entropy_reference(hidden, weight, targets)
    return loss + 2 * bench.LOSS_TOL * loss.detach()


@pytest.mark.parametrize(
    "wrong_loss, failed",
    [
        (lambda h, w, y: F.cross_entropy((h @ w.T).float(), y.clamp_min(0)),
         ["loss_err", "grad_hidden_err", "grad_weight_err"]),  # ignored rows counted
        (lambda h, w, y: linear_cross_entropy_reference(_scale_grad(h, 1.01), w, y), ["grad_hidden_err"]),
        (lambda h, w, y: linear_cross_entropy_reference(h, _scale_grad(w, 1.01), y), ["grad_weight_err"]),
        (_off_loss, ["loss_err"]),
        (lambda h, w, y: linear_cross_entropy_reference(h, w, y) * float("nan"),
         ["loss_err", "grad_hidden_err", "grad_weight_err"]),
    ],
    ids=["ignore-index-ignored", "grad-hidden-1.01x", "grad-weight-1.01x", "loss-off", "nan"],
)
def test_wrong_losses_fail_on_what_is_wrong(inputs, wrong_loss, failed):
    hidden, weight, targets, reference = inputs
    check = bench.check_against_reference(wrong_loss, hidden, weight, targets, reference)
    assert not check["ok"] and check["failed"] == failed


def test_relative_error_is_measured_against_the_reference():
    ref = torch.tensor([3.0, 4.0])
    assert bench.relative_error(2 * ref.bfloat16(), ref) == pytest.approx(1.0)


@pytest.mark.parametrize("n_gemms", [3, 4])
def test_matmul_floor_does_the_schedules_whole_work(n_gemms):
    """The floor is only a floor if it does every FLOP of the schedule: 2*N*H*V per GEMM, and the products
    a loss's gradients come from."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, _ = bench.make_inputs(64, 16, 96, "cpu", dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        grad_hidden, grad_weight = bench.schedule_matmuls(hidden, weight, n_gemms)
    assert counter.get_total_flops() == 2 * n_gemms * 64 * 16 * 96
    logits = hidden.detach() @ weight.detach().T
    torch.testing.assert_close(grad_hidden, logits @ weight.detach())
    torch.testing.assert_close(grad_weight, logits.T @ hidden.detach())


def test_table_sets_the_floors_beside_the_target():
    shape = {"N": 8, "H": 4, "V": 16}
    timed = {"gpu_ms": 9.0, "tflops": 1.0, "extra_gb": 1.0, "loss_err": 0.0, "grad_hidden_err": 0.0,
             "grad_weight_err": 0.0, "loss_off": False}
    results = [{"impl": "naive+compile", **shape, "ms": 10.0, **timed}, {"impl": "ours", **shape, "ms": 11.0, **timed},
               {"impl": "ours-lowmem", **shape, "ms": 12.0, **timed},
               {"impl": "3 GEMMs only", **shape, "floor": True, "ms": 6.5, "tflops": 2.0},
               {"impl": "4 GEMMs only", **shape, "floor": True, "ms": 8.25, "tflops": 2.0}]
    lines = bench.report(results)
    assert "8x4x16: 0.8x naive+compile 8.00 ms; the matmuls alone, whole: 3 GEMMs 6.50 ms, 4 GEMMs 8.25 ms" in lines
    naive_compiled = lines[1].split()
    assert naive_compiled[:5] == ["8", "4", "16", "naive+compile", "10.00"]
    assert naive_compiled[-6:] == ["1.10x", "1.00x", "1.00x", "1.20x", "1.00x", "1.00x"]  # ours / this, lowmem / this


def test_a_row_is_timed_only_if_its_gradients_pass(inputs, monkeypatch):
    """A fast wrong loss is no result; a loss value off in its last digits (bf16) is flagged and still timed,
    since training uses the gradients and only logs the value."""
    hidden, weight, targets, reference = inputs
    timed = []
    monkeypatch.setattr(bench, "measure", lambda fn, *args: timed.append(fn) or {"ms": 1.0})

    def wrong_grad(h, w, y):
        return linear_cross_entropy_reference(_scale_grad(h, 1.01), w, y)

    row = bench.measure_row("wrong", wrong_grad, (hidden, weight, targets), reference)
    assert row["skipped"] == "failed: grad_hidden_err" and "ms" not in row and timed == []
    row = bench.measure_row("off", _off_loss, (hidden, weight, targets), reference)
    assert row["loss_off"] and row["ms"] == 1.0 and timed == [_off_loss]
    assert bench.measure_row("absent", None, (hidden, weight, targets), reference)["skipped"] == "not available"
