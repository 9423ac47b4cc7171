"""How long scripts/train.py takes to refuse a mistyped setting, beside `import torch` alone on the same machine
(`scripts/bench_refusal.py` is its command line).

minitrain/cli.py checks the command line against the schema before torch, Hydra's composing or the trainer load,
so a typo costs the interpreter, OmegaConf and Hydra's override parser. The two commands take turns, each a fresh
interpreter, in the order reversed every round (a shared machine's load moves both alike); each is timed by the
wall clock, its CPU seconds (user + system) beside, and summed up as medians over the rounds.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from minitrain.tools.bench import Spread, take_turns

REPO = Path(__file__).resolve().parents[3]
NAMES = ("refusal", "import torch")
REFUSED = "error: trainer.no_such_key is not a setting of trainer"  # what the refusal must say, or it timed a crash
TARGET_S, TARGET_AFTER_TORCH_S = 1.5, 0.5  # refused within 1.5 s, or within 0.5 s of `import torch` alone


def commands(repo: Path) -> dict[str, list[str]]:
    """The two commands, the refusal of `repo`'s scripts/train.py (another checkout's: its figure before a change)."""
    return {"refusal": [sys.executable, str(repo / "scripts" / "train.py"), "trainer.no_such_key=1"],
            "import torch": [sys.executable, "-c", "import torch"]}


def timed(cmd: list[str], refusal: bool, cwd: Path, repo: Path, cpu_seconds: list[float]) -> float:
    """Wall seconds of one run of `cmd` in `cwd` (its CPU seconds appended to cpu_seconds). The refusal must end as
    a user would see it: exit code 2, its one line and no run dir."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    expected = (2, REFUSED) if refusal else (0, "")
    if (out.returncode, out.stderr[: len(expected[1])]) != expected or any(cwd.iterdir()):
        raise SystemExit(f"{' '.join(cmd)} ended with exit code {out.returncode} (expected {expected[0]}), leaving "
                         f"{sorted(p.name for p in cwd.iterdir())} in {cwd}:\n{out.stderr[-2000:]}")
    cpu_seconds.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return seconds


def measure(rounds: int, cwd: Path, repo: Path = REPO) -> dict[str, Any]:
    """Both commands `rounds` times, taking turns, in the empty directory `cwd`; the medians (lowest-highest),
    the verdict, and the machine's cores and load (1-minute average) before and after."""
    cmds, cpu = commands(repo), {name: [] for name in NAMES}
    load_before = os.getloadavg()[0]
    wall = take_turns({name: lambda name=name: timed(cmds[name], name == "refusal", cwd, repo, cpu[name])
                       for name in NAMES}, rounds)
    summary = {name: {"wall_s": Spread.of(wall[name]).__dict__, "cpu_s": Spread.of(cpu[name]).__dict__}
               for name in NAMES}
    return {"repo": str(repo), "rounds": rounds, "cores": os.cpu_count(), "load": [load_before, os.getloadavg()[0]],
            "wall_s": wall, "cpu_s": cpu, "summary": summary,
            "met": met(*(summary[name]["wall_s"]["median"] for name in NAMES))}


def met(refusal_s: float, torch_s: float) -> bool:
    """The target: refused within TARGET_S, or (a machine where the interpreter alone is slow) no later than
    TARGET_AFTER_TORCH_S after `import torch` alone."""
    return refusal_s <= TARGET_S or refusal_s <= torch_s + TARGET_AFTER_TORCH_S


def report(result: dict[str, Any]) -> list[str]:
    """The printed lines: each command's medians, then the verdict against the target."""
    lines = [f"{result['cores']} cores, load {result['load'][0]:.1f} before and {result['load'][1]:.1f} after"]
    for name, s in result["summary"].items():
        wall, cpu = Spread(**s["wall_s"]), Spread(**s["cpu_s"])
        lines.append(f"{name:12} wall {wall.format('.2f')} s   CPU {cpu.format('.2f')} s   ({result['rounds']} runs)")
    refusal, torch_alone = (result["summary"][name]["wall_s"]["median"] for name in NAMES)
    lines.append(f"refused in {refusal:.2f} s, {refusal / torch_alone:.2f}x `import torch` alone "
                 f"({torch_alone:.2f} s); target <= {TARGET_S} s or <= {TARGET_AFTER_TORCH_S} s after it: "
                 f"{'met' if result['met'] else 'MISSED'}")
    return lines
