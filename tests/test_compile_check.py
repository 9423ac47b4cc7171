"""The first compiled step is checked against the uncompiled forward (minitrain/compile_check.py). On a CPU the
compiled code is a stand-in for torch.compile that computes a known other function (a real compile's
departures are the GPU's business: scripts/compile_vs_eager.py)."""

import pytest
import torch

from minitrain import compile_check, distributed
from minitrain.compile_check import CompileMismatchError
from minitrain.trainer import Trainer


def test_the_eager_loss_is_the_mean_over_the_steps_micro_batches(make_cfg):
    trainer = Trainer(make_cfg("trainer.micro_batch=2"), progress=False)  # batch 8 in 4 micro-batches, eager
    try:
        eager = compile_check.eager_loss(trainer.eager_forward_loss, trainer.train_batches, 3, trainer.plan.grad_accum,
                                         trainer.dist)
        assert float(eager) == pytest.approx(float(trainer.train_step(3)), abs=1e-6)  # the same batches, same mean
    finally:
        trainer.close()


def _compiled_as(monkeypatch, factor):
    """torch.compile replaced by code that computes `factor` times the loss."""
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: lambda x, y: fn(x, y) * factor)


def test_a_compiled_step_that_matches_trains_and_says_so(make_cfg, monkeypatch, capsys):
    _compiled_as(monkeypatch, 1.0)
    trainer = Trainer(make_cfg("trainer.compile=true", "trainer.max_steps=3"), progress=False)
    assert trainer.plan.compiled
    trainer.fit()
    assert "compile check: first-step loss" in capsys.readouterr().out


def test_a_compiled_step_that_computes_another_function_stops_the_run_at_once(make_cfg, monkeypatch):
    _compiled_as(monkeypatch, 1.01)  # about 0.08 nats off at the tiny model's first loss
    trainer = Trainer(make_cfg("trainer.compile=true", "trainer.max_steps=3"), progress=False)
    steps = []
    real = trainer.train_step
    monkeypatch.setattr(trainer.parts, "train_step", lambda s: steps.append(s) or real(s))
    with pytest.raises(CompileMismatchError, match="trainer.compile=false"):
        trainer.fit()
    assert steps == [0]


@pytest.mark.parametrize("overrides", [["trainer.compile_check=false"], ["model.dropout=0.1"]])
def test_the_check_is_off_when_asked_or_when_dropout_makes_the_forwards_differ(make_cfg, monkeypatch, overrides):
    _compiled_as(monkeypatch, 1.01)
    Trainer(make_cfg("trainer.compile=true", "trainer.max_steps=2", *overrides), progress=False).fit()


def test_the_tolerance_is_inclusive_and_a_nan_fails():
    single = distributed.Dist()
    tol = compile_check.TOLERANCE
    assert "gap +0.0100" in compile_check.verify(torch.tensor(3.0 + tol), torch.tensor(3.0), single, "tiny")
    with pytest.raises(CompileMismatchError, match=r"loss 2\.9800 where the uncompiled model gives 3\.0000"):
        compile_check.verify(torch.tensor(3.0 - 2 * tol), torch.tensor(3.0), single, "tiny")
    with pytest.raises(CompileMismatchError):
        compile_check.verify(torch.tensor(float("nan")), torch.tensor(3.0), single, "tiny")


def test_every_rank_decides_on_the_means_over_ranks(monkeypatch):
    """A rank whose own losses differ decides as the others do: on the means (here the other ranks pull its
    departure back within the tolerance), so no rank stops while its peers wait in a collective."""
    monkeypatch.setattr(compile_check.distributed, "mean", lambda t, d: torch.tensor(3.0))
    line = compile_check.verify(torch.tensor(5.0), torch.tensor(3.0), distributed.Dist(world_size=2), "tiny")
    assert "gap +0.0000" in line
