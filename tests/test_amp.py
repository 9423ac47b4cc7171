"""The loss-scale rule (minitrain/loss_scale.py) and its two device implementations: DynamicLossScaler.update
(torch's kernel) and the fused finalize kernel, each held to the rule over a table of cases; the defaults, written
once; the optimizers driving the scaler as torch.amp.GradScaler would, and its whole state through state_dict."""

import inspect
import os
from dataclasses import fields, replace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from minitrain.amp import DynamicLossScaler
from minitrain.config import PrecisionConfig
from minitrain.loss_scale import LossScaling, to_fp32, update_rule
from minitrain.optim import AdamW, Numerics, TorchAdamW
from minitrain.optim.decision import Counters
from minitrain.optim.adamw_triton import N_SCALARS, finalize
from minitrain.optim.decision import Counters
from minitrain.precision import preset, resolve_precision

EVERY_3 = LossScaling(growth_interval=3)
# (what the case shows, the rule, the scale, the growth tracker, whether the step found an inf/NaN)
RULE_CASES = [
    ("a good step counts", EVERY_3, 2.0**10, 0, False),
    ("the step before the interval's last counts", EVERY_3, 2.0**10, 1, False),
    ("the interval's last good step grows the scale", EVERY_3, 2.0**10, 2, False),
    ("a tracker past the interval counts on, never grows", EVERY_3, 2.0**10, 3, False),
    ("an overflow backs off", EVERY_3, 2.0**10, 1, True),
    ("an overflow on the interval's last step backs off", EVERY_3, 2.0**10, 2, True),
    ("interval 1: every good step grows", LossScaling(growth_interval=1), 2.0**10, 0, False),
    ("growth to fp32's largest power of 2", EVERY_3, 2.0**126, 2, False),
    ("growth past fp32's max keeps the scale", EVERY_3, 2.0**127, 2, False),
    ("fp16's max caps nothing: the scale is fp32", EVERY_3, 65504.0, 2, False),
    ("a backoff below fp32's smallest subnormal is 0", EVERY_3, 2.0**-149, 0, True),
    ("a growth factor with no exact fp32: the product in double", LossScaling(growth_factor=1.1, growth_interval=1),
     1002.0, 0, False),
    ("a backoff factor with no exact fp32: the product in double", LossScaling(backoff_factor=0.3), 1001.0, 0, True),
    ("other factors", LossScaling(growth_factor=4.0, backoff_factor=0.25, growth_interval=2), 2.0**5, 1, False),
    ("the defaults at the end of an interval", LossScaling(), 2.0**16, 1999, False),
]


def torch_update(scaler, found_inf):
    scaler.update(torch.tensor(float(found_inf)))


def kernel_update(scaler, found_inf):
    """The fused step's finalize kernel, whose found_inf is a non-finite sum of squares."""
    partials = torch.tensor([1.0, float("inf") if found_inf else 2.0])
    finalize(partials, Counters.zeros(partials.device), scaler, None, (0.9, 0.95), torch.empty(N_SCALARS.value))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's scale * growth
@pytest.mark.parametrize("update", [torch_update, kernel_update], ids=["torch", "finalize_kernel"])
@pytest.mark.parametrize("rule,scale,tracker,found_inf", [case[1:] for case in RULE_CASES],
                         ids=[case[0].replace(" ", "_") for case in RULE_CASES])
def test_each_device_update_follows_the_rule(update, rule, scale, tracker, found_inf):
    """DynamicLossScaler.update and the fused finalize kernel, from the same state, end where the rule says: twins
    of each other through it."""
    scaler = DynamicLossScaler(replace(rule, init_scale=scale))
    scaler.growth_tracker.fill_(tracker)
    update(scaler, found_inf)
    assert (scaler.get_scale().item(), scaler.growth_tracker.item()) == update_rule(rule, scale, tracker, found_inf)


def test_the_rule_table_reaches_each_branch_and_edge():
    """The table is worth its cases: each of the rule's outcomes occurs, and the double-precision products differ
    from fp32 ones, so a kernel computing them in fp32 fails."""
    outcomes = {(rule, scale, tracker, found_inf): update_rule(rule, scale, tracker, found_inf)
                for _, rule, scale, tracker, found_inf in RULE_CASES}
    kinds = {("backed off" if found_inf else "grew" if new > scale else "held" if new_tracker == 0 else "counted")
             for (rule, scale, tracker, found_inf), (new, new_tracker) in outcomes.items()}
    assert kinds == {"backed off", "grew", "held", "counted"}
    assert update_rule(LossScaling(growth_factor=1.1, growth_interval=1), 1002.0, 0, False)[0] != \
        to_fp32(to_fp32(1002.0) * to_fp32(1.1))
    assert update_rule(LossScaling(backoff_factor=0.3), 1001.0, 0, True)[0] != to_fp32(to_fp32(1001.0) * to_fp32(0.3))


def test_the_defaults_are_written_once_and_are_torchs():
    """LossScaling's defaults are GradScaler's, the config's precision.* defaults are LossScaling's, and a resolved
    precision carries the config's values."""
    grad_scaler = inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert LossScaling() == LossScaling(**{f.name: grad_scaler[f.name].default for f in fields(LossScaling)})
    config = PrecisionConfig()
    assert LossScaling() == LossScaling(config.init_scale, config.growth_factor, config.backoff_factor,
                                        config.growth_interval)
    fp16 = replace(preset("fp16"), init_scale=2.0**9, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    assert resolve_precision(fp16, torch.device("cpu")).loss_scale == LossScaling(2.0**9, 4.0, 0.25, 7)


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
    saved = DynamicLossScaler(LossScaling(init_scale=2.0**5, growth_factor=4.0, backoff_factor=0.25, growth_interval=3))
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
