"""scripts/bench_plan.py's choice of points and its arithmetic, which run without a GPU."""

import importlib.util
import json
from unittest import mock

import pytest
import torch

from conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_plan", REPO / "scripts" / "bench_plan.py")
bench_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_plan)

H200_GB = 150.1


@pytest.fixture
def h200():
    with mock.patch.object(bench_plan.planning, "device_memory", lambda device: int(H200_GB * 1e9)), \
            mock.patch("torch.cuda.get_device_name", lambda device=None: "dry run"):
        yield


def test_a_cell_that_fits_without_recompute_is_checked_against_half_its_micro_batch(h200):
    chosen, alternatives = bench_plan.cell_points("gpt2-124m", 16)
    assert chosen == (16, "none")
    assert alternatives == [(8, "none")]  # recompute at the same micro-batch can only be slower: not measured


def test_a_cell_the_plan_splits_is_checked_against_recompute_at_a_larger_micro_batch(h200):
    chosen, alternatives = bench_plan.cell_points("gpt2-1.5b", 64)
    assert chosen == (32, "none")
    assert (16, "none") in alternatives
    (micro, policy), = [a for a in alternatives if a[1] != "none"]
    assert micro > 32 and policy == "selective"
    assert bench_plan.plan_of("gpt2-1.5b", 64, str(micro), policy) is not None  # it fits
    assert bench_plan.plan_of("gpt2-1.5b", 64, "64", "none") is None  # what the plan could not take


def test_a_cells_rate_counts_every_micro_batch_and_one_optimizer_step():
    point = {"micro": 8, "block_size": 100, "micro_ms": 10.0, "optimizer_ms": 4.0}
    assert bench_plan.tokens_per_s(point, 32) == pytest.approx(32 * 100 / ((4 * 10.0 + 4.0) / 1e3))


def test_a_grid_goes_on_from_an_earlier_run_but_not_from_the_points_it_left(tmp_path):
    measured = {"key": ["gpt2-124m", 16, "none"], "micro_ms": 30.0}
    failed = {"key": ["gpt2-124m", 32, "none"], "error": ["torch.OutOfMemoryError: ..."]}
    left = {"key": ["gpt2-124m", 8, "none"], "error": bench_plan.NOT_MEASURED}
    (tmp_path / "run1.json").write_text(json.dumps({"points": [measured, failed, left], "cells": []}))
    earlier = bench_plan.earlier_points([str(tmp_path / "run1.json")])
    assert earlier == {("gpt2-124m", 16, "none"): measured, ("gpt2-124m", 32, "none"): failed}
