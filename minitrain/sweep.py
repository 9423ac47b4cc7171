"""The end of a `-m` sweep: how many cells ran, which could not and why, and the command that compares them.

A cell that cannot run (a bad value, data too short, a step that does not fit) returns its message instead of
raising: Hydra would stop at the first such failure's traceback and name no other. This callback collects the
cells as they end, prints one block when the sweep ends, and then exits non-zero if any cell failed. A cell
that crashes (a bug) still raises, and Hydra prints its traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

FAILED_CELL_EXIT_CODE = 2  # as a single run that cannot run


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.cells: list[tuple[int, str, str | None]] | None = None  # in a sweep: (job number, overrides,
        # the failure's message or None) per cell that ended

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.cells = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.cells is None:  # a single run: it speaks for itself
            return
        failure = job_return.return_value if job_return.status is JobStatus.COMPLETED else None
        self.cells.append((config.hydra.job.num, " ".join(job_return.overrides or []), failure))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        print(summary(self.cells, sweep_dir), file=sys.stderr)
        if any(failure is not None for *_, failure in self.cells):
            sys.exit(FAILED_CELL_EXIT_CODE)


def summary(cells: list[tuple[int, str, str | None]], sweep_dir: Path) -> str:
    failed = [cell for cell in sorted(cells) if cell[2] is not None]
    lines = [f"sweep {sweep_dir}: {len(cells)} cells, {len(cells) - len(failed)} ran"
             + (f", {len(failed)} could not:" if failed else "")]
    lines += [f"  {i} ({overrides}): {failure}" for i, overrides, failure in failed]
    lines.append(f"compare them: python scripts/report.py {sweep_dir}")
    return "\n".join(lines)
