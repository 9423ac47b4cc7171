"""A `-m` sweep: each cell in a process of its own, on a device of its own, and one block at the end.

The default launcher (`configs/hydra/launcher/cells.yaml`, submitit's local launcher) starts a fresh process per
cell, so that a cell's peak memory, compiled graphs and allocator cache are its own and not what earlier cells left
in one shared process. `hydra.sweeper.max_batch_size` cells run at a time (1 by default); CellDevices gives each
of them one of the GPUs the sweep started with.

Hydra calls a callback's on_job_* hooks in the process that runs the cell and its on_multirun_* hooks in the one
that started the sweep, so each cell appends its outcome to `<sweep dir>/cells.jsonl` and the sweep's end reads
them back: how many cells ran, which could not and why, and the command that compares them; then it exits non-zero
if any could not. This holds for any launcher, Hydra's in-process basic one (`hydra/launcher=basic`) included.

A cell that cannot run (a bad value, data too short, a step that does not fit) returns its message instead of
raising: Hydra would stop at the first such failure and name no other. A cell that crashes (a bug) still raises,
and the sweep stops with its traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf
from omegaconf import DictConfig, OmegaConf

FAILED_CELL_EXIT_CODE = 2  # as a single run that cannot run
OUTCOMES = "cells.jsonl"  # in the sweep dir: one line per cell that ended, written by the cell's process
# What the process that starts a sweep tells its cells' processes, through their environment (every launcher's
# processes inherit it): the GPUs the sweep may use, and where the sweep runs (host:pid).
DEVICES_ENV, STARTER_ENV = "MINITRAIN_SWEEP_DEVICES", "MINITRAIN_SWEEP_STARTER"


def outcomes_path(config: DictConfig) -> Path:
    return Path(config.hydra.sweep.dir) / OUTCOMES


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """In the process that starts the sweep. A SIGTERM (a scheduler's stop, `timeout`'s) ends it as Ctrl-C does,
        through stop_cells() (scripts/train.py): its default action would leave the cells' processes running."""
        outcomes_path(config).unlink(missing_ok=True)  # a sweep dir used again: its earlier cells are not this sweep's
        signal.signal(signal.SIGTERM, signal.default_int_handler)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:  # a single run speaks for itself
            return
        failure = job_return.return_value if job_return.status is JobStatus.COMPLETED else None
        outcome = {"num": config.hydra.job.num, "overrides": " ".join(job_return.overrides or []), "failure": failure}
        path = outcomes_path(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # one write of one line: cells that end together do not interleave
            f.write(json.dumps(outcome) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        cells = read_outcomes(outcomes_path(config))
        print(summary(cells, sweep_dir), file=sys.stderr)
        if any(failure is not None for *_, failure in cells):
            sys.exit(FAILED_CELL_EXIT_CODE)


def read_outcomes(path: Path) -> list[tuple[int, str, Optional[str]]]:
    """(job number, overrides, the failure's message or None) of each cell that ended, in job order."""
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted((o["num"], o["overrides"], o["failure"]) for o in map(json.loads, lines))


def summary(cells: list[tuple[int, str, Optional[str]]], sweep_dir: Path) -> str:
    failed = [cell for cell in cells if cell[2] is not None]
    lines = [f"sweep {sweep_dir}: {len(cells)} cells, {len(cells) - len(failed)} ran"
             + (f", {len(failed)} could not:" if failed else "")]
    lines += [f"  {i} ({overrides}): {failure}" for i, overrides, failure in failed]
    lines.append(f"compare them: python scripts/report.py {sweep_dir}")
    return "\n".join(lines)


class CellDevices(Callback):
    """One GPU per cell when cells run side by side (`hydra.sweeper.max_batch_size`), from the GPUs visible where
    the sweep started (submitit's local launcher would give every cell the same ones). A cell that runs in the
    sweep's own process (the basic launcher: CUDA is set up once there) or on another host (a cluster's scheduler
    assigns its devices) is left as it is."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            import torch

            visible = ",".join(map(str, range(torch.cuda.device_count())))
        os.environ[DEVICES_ENV] = visible
        os.environ[STARTER_ENV] = f"{socket.gethostname()}:{os.getpid()}"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """In the cell's process, before anything there touches CUDA."""
        devices = [d for d in os.environ.get(DEVICES_ENV, "").split(",") if d.strip()]
        host, _, pid = os.environ.get(STARTER_ENV, "").partition(":")
        if config.hydra.mode != RunMode.MULTIRUN:  # a single run started from a cell's environment
            return
        if not devices or host != socket.gethostname() or pid == str(os.getpid()):
            return
        at_a_time = OmegaConf.select(config, "hydra.sweeper.max_batch_size")
        os.environ["CUDA_VISIBLE_DEVICES"] = cell_device(devices, config.hydra.job.num, at_a_time)


# Ctrl-C is the cells' to handle, not submitit's. A terminal's Ctrl-C reaches every process of the sweep, and the
# local launcher's controllers (a process per cell, waiting on it) would each end in a traceback. So they start with
# it ignored: submitit's local executor runs its `setup` commands in the shell that starts a controller, and an
# ignored signal is what a started process keeps (POSIX). The cell stops itself, saving a checkpoint, and its
# controller ends with it; the cell, which inherits the ignored signal, takes Ctrl-C back (CtrlCToCells).
IGNORE_CTRL_C = "trap '' INT"


@dataclass
class CellsLauncherConf(LocalQueueConf):
    """The schema of configs/hydra/launcher/cells.yaml: submitit's local launcher, plus its executor's `setup`
    option (which the plugin's own schema leaves out), by default ignoring Ctrl-C in the cells' controllers."""

    setup: List[str] = field(default_factory=lambda: [IGNORE_CTRL_C])


def register_launcher() -> None:
    ConfigStore.instance().store(group="hydra/launcher", name="cells_schema", node=CellsLauncherConf,
                                 provider="minitrain")


class CtrlCToCells(Callback):
    """A sweep's cell takes back the Ctrl-C its controller started with ignored (IGNORE_CTRL_C), before its job
    starts."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and config.hydra.mode == RunMode.MULTIRUN:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def cell_device(devices: list[str], job_num: int, at_a_time: Optional[int]) -> str:
    """The device of cell `job_num`. Hydra launches a sweep's cells in batches of `at_a_time` consecutive job
    numbers (None: all at once), so the cells of a batch take distinct devices while there are enough, and share
    them round robin when there are not (several cells on one GPU: each process's allocator counts its own)."""
    slot = job_num % at_a_time if at_a_time else job_num
    return devices[slot % len(devices)]


def stop_cells(grace_s: float = 3.0, stop_s: float = 60.0) -> None:
    """After Ctrl-C in the process that started the sweep: its cells' processes end before it does. A terminal's
    Ctrl-C reaches them all (submitit then gives a cell a second to save its checkpoint before it kills it); a
    SIGINT to the starting process alone is passed on once `grace_s` shows that it was not."""
    import psutil

    _, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=grace_s)
    for process in alive:
        try:
            process.send_signal(signal.SIGINT)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=stop_s)
    for process in alive:
        process.kill()
