"""scripts/bench_refusal.py: a mistyped setting's refusal timed beside `import torch` alone, each run checked to be
what it claims."""

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

from minitrain.tools.benchmarks import refusal


def test_the_refusal_is_timed_beside_import_torch_and_judged_against_the_target(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_refusal.py"), "--rounds", "1", "--out",
                          str(tmp_path / "refusal.json")], capture_output=True, text=True, timeout=300)
    result = json.loads((tmp_path / "refusal.json").read_text())
    assert out.returncode == (0 if result["met"] else 1), out.stderr[-2000:]
    assert result["rounds"] == 1 and result["repo"] == str(REPO) and result["cores"] >= 1
    medians = {name: result["summary"][name]["wall_s"]["median"] for name in ("refusal", "import torch")}
    assert medians == {name: result["wall_s"][name][0] for name in medians}
    assert all(0 < result["cpu_s"][name][0] for name in medians)
    assert result["met"] == refusal.met(medians["refusal"], medians["import torch"])
    assert out.stdout.splitlines()[-1].startswith(f"refused in {medians['refusal']:.2f} s, ")


def test_the_target_is_1_5_s_or_half_a_second_after_import_torch():
    assert refusal.met(1.5, 0.3) and not refusal.met(1.51, 0.3)
    assert refusal.met(2.5, 2.0) and not refusal.met(2.51, 2.0)


@pytest.mark.parametrize("train_py, said", [
    ("", "ended with exit code 0 (expected 2), leaving []"),  # not refused: a crash or a run is not a refusal
    ("import sys\nopen('runs', 'w')\nprint('error: trainer.no_such_key is not a setting of trainer', file=sys.stderr)\n"
     "sys.exit(2)", "ended with exit code 2 (expected 2), leaving ['runs']"),  # refused, but it made a run dir
])
def test_a_command_that_is_not_the_refusal_is_not_timed(tmp_path, train_py, said):
    (tmp_path / "other" / "scripts").mkdir(parents=True)
    (tmp_path / "other" / "scripts" / "train.py").write_text(train_py)
    (tmp_path / "cwd").mkdir()
    with pytest.raises(SystemExit, match=re.escape(said)):
        refusal.measure(1, tmp_path / "cwd", tmp_path / "other")
