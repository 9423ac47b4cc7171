"""minitrain.tools.benchmarks.compile_vs_eager compares a recipe's first step eager against compiled: its
arithmetic, with a stand-in for torch.compile that computes a known other function (a real compile is the
GPU's business)."""

import pytest
import torch

from minitrain.tools.benchmarks import compile_vs_eager


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_a_compiled_step_that_computes_another_function_shows_in_loss_and_every_gradient(
        data_cache, monkeypatch, factor, tmp_path):
    monkeypatch.setattr(torch, "compile", lambda fn: lambda x, y: fn(x, y) * factor)
    overrides = [f"data.cache_dir={data_cache}", "model.block_size=32"]
    row = compile_vs_eager.compare("tiny", 2, "reference", overrides, str(tmp_path))
    assert row["compiled_loss"] == pytest.approx(factor * row["eager_loss"], rel=1e-5)
    assert row["grad_rel_err_median"] == pytest.approx(factor - 1, abs=1e-5)  # |2g - g| / |g| for every param
    assert len(row["grad_rel_err_worst"]) == compile_vs_eager.WORST_SHOWN
    assert all(w["rel_err"] == pytest.approx(factor - 1, abs=1e-5) for w in row["grad_rel_err_worst"])
