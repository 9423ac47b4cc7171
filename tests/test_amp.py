"""DynamicLossScaler, the loss-scale rule's owner: the fused finalize kernel against it, the optimizers driving
it as torch.amp.GradScaler would, and its whole state through state_dict."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from minitrain.amp import DynamicLossScaler, LossScaling
from minitrain.optim import AdamW, Numerics, TorchAdamW
from minitrain.optim.decision import Counters
from minitrain.optim.adamw_triton import N_SCALARS, finalize

CASES = [(tracker, finite) for tracker in range(3) for finite in (True, False)]  # growth_interval 3


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's scale * growth
@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**127])
@pytest.mark.parametrize("tracker,finite", CASES)
def test_finalize_kernel_updates_the_scale_by_the_rule(tracker, finite, init_scale):
    """Every point of a growth cycle (tracker 0, 1, and 2: the growth boundary), with and without an overflow;
    2^127 grows past fp32's max, where the rule keeps the scale and still resets the tracker."""
    kw = dict(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    rule, kernel = DynamicLossScaler(**kw), DynamicLossScaler(**kw)
    for s in (rule, kernel):
        s.growth_tracker.fill_(tracker)
    rule.update(torch.tensor(0.0 if finite else 1.0))
    partials = torch.tensor([1.0, 2.0 if finite else float("inf")])
    finalize(partials, Counters.zeros(partials.device), kernel, None, (0.9, 0.95), torch.empty(N_SCALARS.value))
    assert kernel.get_scale().item() == rule.get_scale().item()
    assert kernel.growth_tracker.item() == rule.growth_tracker.item()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's scale * growth
@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("init_scale,growth", [(2.0**10, 2.0), (2.0**126, 4.0)])
def test_trajectory_matches_grad_scaler(impl, init_scale, growth):
    """Random overflow pattern; the second case grows past fp32 max, which GradScaler refuses."""
    torch.manual_seed(0)
    kw = dict(init_scale=init_scale, growth_factor=growth, backoff_factor=0.5, growth_interval=3)
    opt = AdamW([torch.nn.Parameter(torch.randn(5))], impl=impl, numerics=Numerics(loss_scaling=LossScaling(**kw)))
    ours = opt.loss_scaler
    theirs = torch.amp.GradScaler(ours.get_scale().device.type, **kw)
    q = torch.nn.Parameter(torch.randn(5))
    sgd = torch.optim.SGD([q], lr=0.0)
    overflow = torch.rand(40) < 0.3
    for bad in overflow.tolist():
        g = torch.randn(5)
        if bad:
            g[torch.randint(5, ()).item()] = float("inf") if torch.rand(()) < 0.5 else float("nan")
        opt.param_groups[0]["params"][0].grad = g.clone()
        q.grad = g.clone()
        opt.step()
        theirs.scale(torch.tensor(1.0))  # GradScaler creates its state lazily here
        theirs.step(sgd)
        theirs.update()
        assert ours.get_scale().item() == theirs.get_scale()
        assert ours.growth_tracker.item() == theirs._growth_tracker.item()
    assert opt.stats()["skipped_steps"].item() == overflow.sum().item()


def run(scaler, found_infs):
    for bad in found_infs:
        scaler.update(torch.tensor(float(bad)))
    return scaler.get_scale().item(), scaler.growth_tracker.item()


def test_state_dict_carries_the_whole_scaler():
    """Scale, growth tracker and factors: a scaler built with other settings continues exactly as the saved one.
    Two steps into a growth interval of 3, one more good step grows the scale only if the tracker came back."""
    saved = DynamicLossScaler(init_scale=2.0**5, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    run(saved, [1, 0, 0])
    loaded = DynamicLossScaler()
    loaded.load_state_dict(saved.state_dict())
    assert run(loaded, [0]) == run(saved, [0]) == (2.0**3 * 4.0, 0)
    assert run(loaded, [0, 1, 0, 0, 0, 0]) == run(saved, [0, 1, 0, 0, 0, 0])
    assert loaded.scale(torch.tensor(3.0)).item() == 3.0 * saved.get_scale().item()


def fp16_params():
    torch.manual_seed(1)
    return [torch.nn.Parameter(torch.randn(7).half()), torch.nn.Parameter(torch.randn(3, 4).half())]


@pytest.mark.parametrize("impl", ["foreach", "fused", "torch"])
def test_optimizer_state_dict_carries_its_scaler(impl):
    """The optimizer owns its scaler, and its state_dict carries it: resumed two good steps into a growth
    interval of 3, the next good step grows the scale as in the run that never stopped."""
    def build(params, scaling):
        if impl == "torch":  # GradScaler unscales fp32 grads only
            return TorchAdamW([p.float().detach().requires_grad_() for p in params], loss_scaling=scaling)
        return AdamW(params, impl=impl, numerics=Numerics(loss_scaling=scaling))

    kept = build(fp16_params(), LossScaling(init_scale=2.0**10, growth_interval=3))
    resumed = build(fp16_params(), LossScaling(init_scale=1.0, growth_interval=2000))  # what a checkpoint replaces

    def step(opt):
        opt.scale(sum(p.float().sum() for g in opt.param_groups for p in g["params"])).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step(kept)
    resumed.load_state_dict(kept.state_dict())
    for opt in (kept, resumed):
        step(opt)
    assert resumed.stats()["loss_scale"].item() == kept.stats()["loss_scale"].item() == 2.0**11


def test_optimizer_with_a_scaler_refuses_a_state_without_one():
    params = fp16_params()
    unscaled = AdamW(params, impl="foreach")
    scaled = AdamW(params, impl="foreach", numerics=Numerics(loss_scaling=LossScaling()))
    with pytest.raises(ValueError, match="no loss-scaler state"):
        scaled.load_state_dict(unscaled.state_dict())
