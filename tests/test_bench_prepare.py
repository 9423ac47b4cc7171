"""minitrain/tools/benchmarks/prepare.py: the ideal it times minitrain against does minitrain's job, and its
verdict holds minitrain to the targets."""

import os
from pathlib import Path

import numpy as np
import pytest

from minitrain.config import DataConfig
from minitrain.data import prepare_data
from minitrain.tools.benchmarks import prepare as bench_prepare

MODULES = ("textwrap", "string", "fnmatch", "glob", "shlex", "bisect", "colorsys", "keyword")


def documents(ids: np.ndarray, eot: int) -> list[tuple[int, ...]]:
    """A token stream cut after each EOT, as tuples (the EOT kept)."""
    ends = np.flatnonzero(ids == eot) + 1
    assert len(ends) and ends[-1] == len(ids)
    return [tuple(doc) for doc in np.split(ids, ends[:-1])]


def test_the_ideal_makes_minitrains_tokens(tmp_path):
    """The same BPE from the same sample, and every document's tokens the same: whatever the two runs' times
    differ by, it is not the work they do. (Each module's lines up to a chunk's length: the two cut longer texts
    differently.)"""
    (tmp_path / "text").mkdir()
    for name in MODULES:
        text = (Path(os.__file__).parent / f"{name}.py").read_text()
        (tmp_path / "text" / f"{name}.py").write_text(text[:text.rfind("\n", 0, bench_prepare.CHUNK) + 1])
    paths = str(tmp_path / "text" / "*.py")
    bench_prepare.ideal(paths, tmp_path / "ideal.bin", vocab_size=400, sample_mb=1)
    data = prepare_data(DataConfig(name="files", source="files", paths=paths, vocab_size=400, tokenizer_sample_mb=1,
                                   val_fraction=0.25, cache_dir=str(tmp_path / "cache")), progress=False)
    eot = data.tokenizer.token_to_id(bench_prepare.EOT)
    ideal = documents(np.fromfile(tmp_path / "ideal.bin", dtype=np.uint16), eot)
    ours = documents(data.train[:], eot) + documents(data.val[:], eot)
    assert len(ideal) == len(MODULES) and len(data.val) > 0
    assert sorted(ideal) == sorted(ours)


def test_leftovers_are_what_a_published_cache_does_not_hold(tmp_path):
    cache = tmp_path / "cache"
    (cache / "files-1").mkdir(parents=True)
    for name in ("index.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"):
        (cache / "files-1" / name).write_bytes(b"")
    (cache / "files-1.lock").write_bytes(b"")
    assert bench_prepare.leftovers(cache) == []
    (cache / "files-1" / "progress.json").write_bytes(b"")
    (cache / "files-2.tmp").mkdir()
    (cache / "stray.arrow").write_bytes(b"")
    assert sorted(bench_prepare.leftovers(cache)) == ["files-1/progress.json", "files-2.tmp", "stray.arrow"]


def runs(minitrain_s, ideal_s, peaks, leftovers=()):
    out = [{"layout": "many", "round": i, "kind": "ideal", "seconds": s, "cpu_seconds": 2 * s, "peak_gb": 0.5,
            "leftovers": []} for i, s in enumerate(ideal_s)]
    return out + [{"layout": "many", "round": i, "kind": "minitrain", "seconds": s, "cpu_seconds": 3 * s,
                   "peak_gb": p, "leftovers": list(leftovers) if i == 0 else []}
                  for i, (s, p) in enumerate(zip(minitrain_s, peaks))]


@pytest.mark.parametrize("minitrain_s, peaks, leftovers, ratio, met", [
    ([110, 500, 100], [1.0, 1.0, 1.0], (), 1.1, True),  # the median: one slow round does not decide
    ([111, 111, 90], [1.0, 1.0, 1.0], (), 1.11, False),
    ([100, 100, 100], [1.0, 2.0, 1.0], (), 1.0, False),  # the highest peak, not the median, is held to 2 GB
    ([100, 100, 100], [1.0, 1.0, 1.0], ("x.tmp",), 1.0, False),  # one run leaving files behind
])
def test_the_verdict_is_the_median_time_ratio_the_highest_peak_and_nothing_left(minitrain_s, peaks, leftovers,
                                                                                ratio, met):
    summary = bench_prepare.summary(runs(minitrain_s, [100, 90, 300], peaks, leftovers), "many")
    assert summary["time_ratio"] == pytest.approx(ratio)
    assert summary["cpu_ratio"] == pytest.approx(1.5 * ratio)  # the CPU seconds' own medians
    assert summary["met"] is met
    assert summary["minitrain"]["peak_gb"]["high"] == max(peaks)
