"""The run directory: one owner at a time, its record, and what a run refused at start leaves (nothing).

Two runs in one directory would interleave their metrics and overwrite each other's checkpoints, so a run takes
the directory's lock (`RunDirLock`) before it writes anything there; a second run is refused, naming the holder.
The run that holds the lock is the directory's only writer: temporaries found there at that moment belong to
writers that died, and go.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from . import files
from .errors import unusable_run_dir

# What a run directory holds, by name (every module that writes or reads one of them names it from here).
LOCK = ".lock"  # the flock (minitrain/files.py)
HOLDER = ".lock.holder"  # the holder's pid and host, for the message a second run gets
CHECKPOINTS = "checkpoints"  # the run's checkpoints, each a torch.distributed.checkpoint directory:
LATEST, PREVIOUS = "latest", "previous"  # the last two saved (minitrain/checkpoint.py)
JOB_INFO = "minitrain.json"  # beside a checkpoint's shards: world_size, mode, config
TOKENIZER = "tokenizer.json"  # the run's tokenizer, which makes the run dir a tokenizer directory too
METRICS = "metrics.jsonl"  # the plan, then one record per log step (minitrain/logger.py)
TRAIN_LOG = "train.log"  # the console's lines
MEMORY = "memory.json"  # the predicted memory terms beside the measured peaks, at the run's end
SAMPLE = "sample.txt"  # a short text sample from the trained model
ERROR = "error.txt"  # why a sweep cell did not run or stopped, for the sweep's report
RECORD = ".hydra"  # the run's record: the resolved config and the command line's overrides
CONFIG_RECORD, OVERRIDES_RECORD = "config.yaml", "overrides.yaml"


class RunDirError(RuntimeError):
    """A problem with the run directory or its checkpoints that the user can fix; the message names the
    file and what to do (scripts/train.py prints it as one line, without a traceback)."""


class RunDirBusyError(RunDirError):
    """Another live process holds the run directory."""


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINTS


def make_run_dir(out_dir: Path) -> Path:
    """`out_dir`, created if absent; a path through a file or a directory this user cannot write is named with
    what to change, not left to fail as an OSError traceback at the first file the run writes."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(unusable_run_dir("trainer.out_dir", out_dir, e)) from None
    return out_dir


def remove_if_empty(run_dir: Path, below: Path) -> None:
    """`run_dir` if a run refused at start left it empty, and its parents strictly below `below` that then hold
    nothing (the runs/<date>/ of Hydra's default run dir, made before any of our checks run): a refused run
    leaves no trace. Only empty directories go (rmdir): never `below`, the working directory or one above them
    (hydra.run.dir=. names the working directory)."""
    d, stop, cwd = run_dir.resolve(), below.resolve(), Path.cwd().resolve()
    kept = {stop, *stop.parents, cwd, *cwd.parents}
    while d not in kept:
        try:
            d.rmdir()
        except OSError:  # not empty, or not there
            return
        d = d.parent
        if stop not in d.parents:
            return


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """The temporaries of interrupted saves and record writes (a checkpoint's is as large as a checkpoint).
    Only for the holder of the run dir's lock: another live writer's temporary would go too."""
    return files.remove_temporaries(out_dir) + files.remove_temporaries(checkpoint_dir(out_dir))


class RunDirLock:
    """An exclusive lock on `out_dir/.lock`, with the holder's pid and host beside it (`.lock.holder`).

    The kernel drops the lock when its holder's process ends, so a run killed by any means leaves no stale
    lock; a pid it leaves in `.lock.holder` is read only while another process holds the lock, which wrote its
    own first."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.path, self.holder = self.out_dir / LOCK, self.out_dir / HOLDER
        self._lock, self._made = None, []

    def acquire(self) -> None:
        make_run_dir(self.out_dir)
        made = [p for p in (self.path, self.holder) if not p.exists()]
        try:
            self._lock = files.lock(self.path, wait=False)
            if self._lock is None:
                raise RunDirBusyError(self._busy_message())
            self._made = made
            self.holder.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        except OSError as e:  # a read-only run dir, a lock file that cannot be opened
            self.release(remove_file=True)
            raise RunDirError(unusable_run_dir("trainer.out_dir", self.out_dir, e)) from None
        remove_stale_temporaries(self.out_dir)

    def release(self, remove_file: bool = False) -> None:
        """remove_file: also delete the files acquire() made, while still holding the lock (a run refused at start
        leaves its dir as it found it, so an empty one can go). A finished run's lock file stays: deleting it
        would let a process that opened it just before lock the deleted file beside one that makes a new one."""
        if self._lock is None:
            return
        try:
            self.holder.write_text("")  # a reader never sees a finished holder's pid
            for path in self._made if remove_file else []:
                path.unlink(missing_ok=True)
        finally:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _busy_message(self) -> str:
        try:
            holder = json.loads(self.holder.read_text())
            pid, host = holder["pid"], holder["host"]
        except (OSError, ValueError, KeyError):  # the holder has the lock but has not written its pid yet
            pid, host = None, None
        here = host is None or host == socket.gethostname()
        who = f"pid {pid}" if pid is not None else "a process that has not yet recorded its pid"
        where = "" if here else f" on host {host}"
        stop = f"stop pid {pid}{where}" if pid is not None else "stop the other run"
        return (f"run dir {self.out_dir} is in use by another run ({who}{where}); two runs in one directory "
                f"would corrupt each other's checkpoints and metrics. Give this run its own directory "
                f"(hydra.run.dir=...), or {stop} first")


@dataclass
class RunInfo:
    """Where this run sits in a Hydra sweep (for wandb grouping), and the command line's overrides (kept in
    the run dir's .hydra/ once the run owns the dir); empty for a run built in code."""

    group: Optional[str] = None
    name: Optional[str] = None
    overrides: Optional[list[str]] = None
    recorded: bool = field(default=False, init=False)  # this run's record is in its dir (write)

    @staticmethod
    def from_hydra() -> "RunInfo":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return RunInfo()
        hc = HydraConfig.get()
        overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)  # as typed: an `${...}` in one is text
        if hc.mode != RunMode.MULTIRUN:
            return RunInfo(name=Path(hc.runtime.output_dir).name, overrides=overrides)
        sweep = Path(hc.sweep.dir)
        return RunInfo(group=f"{sweep.parent.name}_{sweep.name}",
                       name=hc.job.override_dirname or f"job{hc.job.num}", overrides=overrides)

    def write_failure(self, out_dir: Path, message: str) -> None:
        """A sweep cell that could not run, or stopped (diverged): error.txt and its overrides beside it, for the
        sweep's report; in a dir that holds no run, or this run's own record (a cell refused at start must not
        touch another run's)."""
        if self.overrides is None or ((out_dir / METRICS).exists() and not self.recorded):
            return
        self._write_overrides(out_dir)
        files.atomic_write(out_dir / ERROR, message + "\n")

    def write(self, out_dir: Path, config: dict[str, Any]) -> None:
        """.hydra/config.yaml (the resolved config) and overrides.yaml, written by the run that holds the
        dir's lock (Hydra's own copy, written before any lock, would let a refused second run overwrite
        the first run's record)."""
        if self.overrides is None:
            return
        files.atomic_write(self._write_overrides(out_dir) / CONFIG_RECORD, OmegaConf.to_yaml(config))
        (out_dir / ERROR).unlink(missing_ok=True)  # of an earlier start that failed: this one may finish
        self.recorded = True

    def _write_overrides(self, out_dir: Path) -> Path:
        folder = out_dir / RECORD
        folder.mkdir(parents=True, exist_ok=True)
        files.atomic_write(folder / OVERRIDES_RECORD, OmegaConf.to_yaml(self.overrides))
        return folder

    def continue_command(self, out_dir: Path, torchrun: bool = False) -> str:
        """The command line that resumes this run in `out_dir`: its own overrides with trainer.resume=auto (a
        resume without them would be refused as another config). A run built in code has no command line."""
        where = f"hydra.run.dir={shlex.quote(str(out_dir))}"
        if self.overrides is None:
            return f"trainer.resume=auto {where} and this run's other settings"
        kept = [shlex.quote(o) for o in self.overrides if not o.startswith("trainer.resume=")]
        launcher = "torchrun <its arguments> scripts/train.py" if torchrun else "python scripts/train.py"
        return " ".join([launcher, *kept, "trainer.resume=auto", where])


class RunDir:
    """The run directory as one run holds it, a context manager: entered, the dir exists and the job's main process
    holds its lock (the other ranks write there only their checkpoint shards, which the main process publishes);
    left, the lock is free for the next run. A run that leaves before `record` — refused at start: a checkpoint
    that does not fit it, a plan that does not fit the device — removes the lock files it made too, so that an
    empty dir can go (scripts/train.py)."""

    def __init__(self, path: Path, info: RunInfo = RunInfo(), owner: bool = True):
        self.path, self.info = Path(path), info
        self.lock = RunDirLock(self.path) if owner else None
        self.recorded = False

    @property
    def owner(self) -> bool:
        return self.lock is not None

    def __enter__(self) -> "RunDir":
        make_run_dir(self.path)
        if self.lock is not None:
            self.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release(remove_file=not self.recorded)

    def record(self, config: dict[str, Any], tokenizer: str) -> None:
        """The run's record, by its owner: its config and overrides (.hydra/), and the tokenizer (for sample.py,
        export_hf.py and eval.py)."""
        if self.owner:
            self.info.write(self.path, config)
            files.atomic_write(self.path / TOKENIZER, tokenizer)
        self.recorded = True

    def write(self, name: str, text: str) -> None:
        """A file of the run's results (memory.json, sample.txt), written whole by the owner."""
        if self.owner:
            files.atomic_write(self.path / name, text)

    def continue_command(self, torchrun: bool = False) -> str:
        return self.info.continue_command(self.path, torchrun)
