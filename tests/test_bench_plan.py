"""The auto-fit benchmark's choice of points and its arithmetic (minitrain.tools.benchmarks.plan), which run
without a GPU: the plans are made for an H200's memory, passed to the plan as a number."""

import json

import pytest

from minitrain.tools.benchmarks import plan

H200 = int(150.1e9)


def test_a_cell_that_fits_without_recompute_is_checked_against_half_its_micro_batch():
    chosen, alternatives = plan.cell_points("gpt2-124m", 16, device_memory_bytes=H200)
    assert chosen == (16, "none")
    assert alternatives == [(8, "none")]  # recompute at the same micro-batch can only be slower: not measured


def test_a_cell_the_plan_splits_is_checked_against_recompute_at_a_larger_micro_batch():
    chosen, alternatives = plan.cell_points("gpt2-1.5b", 64, device_memory_bytes=H200)
    assert chosen == (32, "none")
    assert (16, "none") in alternatives
    (micro, policy), = [a for a in alternatives if a[1] != "none"]
    assert micro > 32 and policy == "selective"
    assert plan.plan_of("gpt2-1.5b", 64, str(micro), policy, device_memory_bytes=H200) is not None  # it fits
    assert plan.plan_of("gpt2-1.5b", 64, "64", "none", device_memory_bytes=H200) is None  # what the plan could not take


def test_a_cells_rate_counts_every_micro_batch_and_one_optimizer_step():
    point = {"micro": 8, "block_size": 100, "micro_ms": 10.0, "optimizer_ms": 4.0}
    assert plan.tokens_per_s(point, 32) == pytest.approx(32 * 100 / ((4 * 10.0 + 4.0) / 1e3))


def test_a_cell_is_set_beside_its_fastest_measured_option_and_its_budget():
    """The best is the fastest option measured, the plan's own included; an option that failed is no option."""
    point = {"block_size": 100, "optimizer_ms": 4.0, "peak_reserved_gb": 50.0, "predicted_gb": 49.0}
    measured = {("m", 16, "none"): {**point, "micro": 16, "micro_ms": 20.0},
                ("m", 8, "none"): {**point, "micro": 8, "micro_ms": 9.0},
                ("m", 32, "selective"): {"error": ["torch.OutOfMemoryError: ..."]}}
    cells = {("m", 32): ((16, "none"), [(8, "none"), (32, "selective")])}
    (row,) = plan.cell_rows(cells, measured, budget_gb=49.5)
    assert row["best"] == (8, "none") and row["ratio"] == pytest.approx((4 * 9.0 + 4) / (2 * 20.0 + 4))
    assert set(row["rates"]) == {"16:none", "8:none"} and not row["fits"]
    assert plan.report([row])[1].endswith("OVER BUDGET")


def test_a_grid_goes_on_from_an_earlier_run_but_not_from_the_points_it_left(tmp_path):
    measured = {"key": ["gpt2-124m", 16, "none"], "micro_ms": 30.0}
    failed = {"key": ["gpt2-124m", 32, "none"], "error": ["torch.OutOfMemoryError: ..."]}
    left = {"key": ["gpt2-124m", 8, "none"], "error": plan.NOT_MEASURED}
    (tmp_path / "run1.json").write_text(json.dumps({"points": [measured, failed, left], "cells": []}))
    earlier = plan.earlier_points([str(tmp_path / "run1.json")])
    assert earlier == {("gpt2-124m", 16, "none"): measured, ("gpt2-124m", 32, "none"): failed}
