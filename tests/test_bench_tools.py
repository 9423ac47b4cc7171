"""minitrain.tools.bench, what every benchmark shares: rounds that alternate what they compare, the median and
spread of a figure, the printed table, the result header; and docs/results/, where measured runs are kept."""

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO
from minitrain.tools import bench


class _Clock:
    """Stands in for CUDA events: a clock that runs only while a run works, so each run's time is its own."""

    now = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = _Clock.now

    def elapsed_time(self, end):
        return end.at - self.at


def test_rounds_alternate_the_order_and_time_each_call(monkeypatch):
    """A machine that drifts slows every run alike only if none is always first: the order turns each round."""
    monkeypatch.setattr(torch.cuda, "Event", _Clock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    order = []

    def run(name, ms):
        def call():
            order.append(name)
            _Clock.now += ms
        return call

    ms = bench.alternating_rounds({"a": run("a", 2.0), "b": run("b", 3.0), "c": run("c", 5.0)}, rounds=3, calls=2)
    assert ms == {"a": [2.0] * 3, "b": [3.0] * 3, "c": [5.0] * 3}  # per call, one figure per round
    assert order == ["a", "a", "b", "b", "c", "c", "c", "c", "b", "b", "a", "a", "a", "a", "b", "b", "c", "c"]


def test_a_spread_is_the_median_with_the_extreme_rounds():
    spread = bench.Spread.of([31.0, 30.2, 45.0, 30.8])  # one slow round does not move the median far
    assert (spread.median, spread.low, spread.high) == (pytest.approx(30.9), 30.2, 45.0)
    assert spread.format(".1f") == "30.9 (30.2-45.0)"


def test_a_table_aligns_numbers_right_text_left_and_marks_what_is_missing():
    columns = (bench.Column("name", "name"), bench.Column("ms", "ms", ".2f"),
               bench.Column("share", lambda r: r["ms"] / 10 if "ms" in r else None, ".0%"))
    rows = [{"name": "fused", "ms": 1.0}, {"name": "a longer name", "ms": 12.345}, {"name": "off", "error": "OOM"}]
    assert bench.table(rows, columns, note=lambda r: r.get("error", "")) == [
        "name             ms share",
        "fused          1.00   10%",
        "a longer name 12.35  123%",
        f"off               {bench.MISSING}     {bench.MISSING}  OOM"]


def test_a_result_file_says_when_where_and_how_it_was_measured(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["scripts/bench_gelu.py", "--shape", "16x8"])
    bench.write_results(tmp_path / "out.json", {"rows": [{"ms": 1.0}]})
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["command"] == "python scripts/bench_gelu.py --shape 16x8" and written["rows"] == [{"ms": 1.0}]
    assert written["torch"] == torch.__version__ and len(written["date"]) == 10 and written["gpu"]


RECORD_KEYS = {"date", "gpu", "torch", "command", "figures"}


@pytest.mark.parametrize("path", sorted((REPO / "docs" / "results").glob("*.jsonl")), ids=lambda p: p.name)
def test_every_recorded_run_names_its_date_gpu_torch_and_command(path: Path):
    """docs/results/ keeps every measured run, one JSON record a line, so that a figure of docs/benchmarks.md
    can be traced to the runs it summarises."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        record = json.loads(line)
        assert RECORD_KEYS <= set(record), f"{path.name}:{number} lacks {RECORD_KEYS - set(record)}"
        assert record["date"][:4] == "2026" and record["figures"], f"{path.name}:{number}"
