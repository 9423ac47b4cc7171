"""DynamicLossScaler driven by FusedAdamW: the same scale trajectory as torch.amp.GradScaler."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from minitrain.amp import DynamicLossScaler
from minitrain.optim import FusedAdamW


def test_scale_and_state_dict_round_trip():
    scaler = DynamicLossScaler(init_scale=2.0**5, growth_interval=7)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss).item() == 3.0 * 2.0**5
    scaler.update(torch.tensor(1.0))
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale().item() == 2.0**4 and other.growth_interval == 7


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's scale * growth
@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("init_scale,growth", [(2.0**10, 2.0), (2.0**126, 4.0)])
def test_trajectory_matches_grad_scaler(impl, init_scale, growth):
    """Random overflow pattern; the second case grows past fp32 max, which GradScaler refuses."""
    torch.manual_seed(0)
    kw = dict(init_scale=init_scale, growth_factor=growth, backoff_factor=0.5, growth_interval=3)
    ours = DynamicLossScaler(**kw)
    theirs = torch.amp.GradScaler("cpu", **kw)
    p = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdamW([p], impl=impl)
    q = torch.nn.Parameter(torch.randn(5))
    sgd = torch.optim.SGD([q], lr=0.0)
    overflow = torch.rand(40) < 0.3
    for bad in overflow.tolist():
        g = torch.randn(5)
        if bad:
            g[torch.randint(5, ()).item()] = float("inf") if torch.rand(()) < 0.5 else float("nan")
        p.grad = g.clone()
        q.grad = g.clone()
        opt.step(scaler=ours)
        theirs.scale(torch.tensor(1.0))  # GradScaler creates its state lazily here
        theirs.step(sgd)
        theirs.update()
        assert ours.get_scale().item() == theirs.get_scale()
        assert ours.growth_tracker.item() == theirs._growth_tracker.item()
    assert opt.stats()["skipped_steps"].item() == overflow.sum().item()
