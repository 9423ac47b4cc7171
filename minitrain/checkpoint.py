"""Training checkpoints: nothing lost on a crash, and a resumed run identical to an unbroken one.

A checkpoint holds everything the next step depends on — model, optimizer (masters, moments, step), loss
scaler, RNG states, the loop's progress — and the config. It has one format for every world size:
torch.distributed.checkpoint (DCP) writes it as a directory of shards (fsdp: each rank its 1/N of the weights
and Adam moments; ddp and one process: each tensor once) beside `minitrain.json`, which records the job's world
size, mode and config so that a resume checks the config before anything reads a shard. DCP reshards on load:
a checkpoint of one process resumes under ddp or fsdp and the other way round, as long as the global batch is
unchanged (the config check refuses another one). The parts that differ by rank (RNG states, running loss sums)
are stored per rank; a job of another size merges them (each part's `combine_ranks`).

The run dir keeps the last two: `checkpoints/latest/` and `checkpoints/previous/`. A save writes a temporary
directory named by rank 0, fsyncs it, renames `latest` to `previous`, then the temporary to `latest`, and
fsyncs the folder: a crash at any point leaves `latest`, or else `previous`, complete, and `resume=auto` tries
them in that order, falling back past an unreadable one with a note. The unreadable one is then kept aside as
`latest.unusable-<time>` (never taken for a checkpoint): the next save must not rotate it into `previous` over the
checkpoint the run resumed from. The last KEPT_UNUSABLE kept aside stay, the older are removed: each is as large as
a checkpoint, and a run that keeps failing its saves would fill the disk with them. A multi-node job needs
`trainer.out_dir` on a filesystem every node sees.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import shutil
import time
import warnings
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import files
from .errors import error_reason
from .rundir import JOB_INFO, LATEST, PREVIOUS, RunDirError, checkpoint_dir

UNUSABLE_MARK = ".unusable-"  # a checkpoint resume=auto fell back past, kept aside for the user to look at
# Kept aside at most: the one a resume just fell back past and the one before it, enough to tell a one-off failure
# from a repeating one; older ones are removed (the note of the fallback names them).
KEPT_UNUSABLE = 2
_ASIDE_STAMP = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")  # _set_aside's <time>[-n]

# The parts that differ by rank, each with how a rank of a job of another size makes its state from the saved
# ranks' states (a list, by rank).
PerRank = dict[str, Callable[[list[dict[str, Any]]], dict[str, Any]]]


class CheckpointError(RunDirError):
    """No usable checkpoint where one was asked for, or one that does not fit this run."""


def _collective() -> bool:
    """Under torchrun every rank takes part in a save and a load; a single process runs DCP without a group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _dcp(save: bool, state: dict[str, Any], path: Path, alone: bool = False) -> None:
    """torch.distributed.checkpoint's save or load of `state` at `path`, collective under torchrun; `alone`: in
    this process only, whatever the group (a warning says so each time: here it is what is meant)."""
    import torch.distributed.checkpoint as dcp

    no_dist = alone or not _collective()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        (dcp.save if save else dcp.load)(state, checkpoint_id=path, no_dist=no_dist)


# -- saving -------------------------------------------------------------------------------------------
def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) checkpoint state: what its shards take on disk, near enough. A
    DTensor counts whole (its numel is the global one): every rank's shards are written."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT in `e` or what it was raised from (a writer may report the write's OSError as the context
    of a RuntimeError of its own)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _size(n: float) -> str:
    return next(f"{n / scale:.3g} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes"))
                if n >= scale or unit == "bytes")


def _unwritable(ckpts: Path, e: BaseException, needed: int) -> "CheckpointError":
    """A save that could not be written: what happened (a full disk: how much room a checkpoint needs), that
    nothing published is lost, and what to do. `needed`: the state's tensor bytes (state_bytes)."""
    if failures := getattr(e, "failures", None):  # torch.distributed.checkpoint's, wrapping each rank's error
        e, _ = next(iter(failures.values()))
    try:
        free = shutil.disk_usage(ckpts).free
    except OSError:  # the directory itself could not be made
        free = None
    if _disk_full(e) or (free is not None and free < needed):
        room = f"{_size(free)} free" if free is not None else "no room"
        what = f": the disk is full ({room} there; a checkpoint of this run needs about {_size(needed)})"
    else:
        what = f" ({error_reason(e)})"
    return CheckpointError(f"could not write a checkpoint into {ckpts}{what}; the checkpoints published before are "
                           "untouched. Free space there (or move the run dir to a disk with room), then continue "
                           "with trainer.resume=auto")


def _by_rank(state: dict[str, Any], rank: int, per_rank) -> dict[str, Any]:
    return {(f"{k}_rank{rank}" if k in per_rank else k): v for k, v in state.items()}


def save_checkpoint(state: dict[str, Any], out_dir: Path, *, per_rank=(), rank: int = 0, world_size: int = 1,
                    mode: str = "none") -> Path:
    """Every rank calls it with its own state (DTensors for sharded tensors; `per_rank`: the names of the parts
    that differ by rank). Publishes checkpoints/latest/, keeping the one before as previous/; `mode`, the world
    size and the state's `config` go into its minitrain.json, read by load_checkpoint before any shard."""
    from torch.distributed.checkpoint.api import CheckpointException

    ckpts, collective = checkpoint_dir(out_dir), _collective()
    latest = ckpts / LATEST
    name = [files.temp_path(latest).name if rank == 0 else None]
    if collective:
        torch.distributed.broadcast_object_list(name, src=0)  # every rank writes into the directory rank 0 named
    tmp = ckpts / name[0]
    try:
        shards = {k: v for k, v in state.items() if k != "config"}  # the config lives in minitrain.json
        try:  # returns once every rank's shards and .metadata exist; a rank's failure is raised on every rank
            _dcp(True, _by_rank(shards, rank, per_rank), tmp)
        except (CheckpointException, OSError) as e:  # not RuntimeError: a collective's (a peer gone) stays raw
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # first: the free space the message gives
            raise _unwritable(ckpts, e, state_bytes(shards)) from None
        if rank == 0:
            info = {"world_size": world_size, "mode": mode, "config": state["config"]}
            with open(tmp / JOB_INFO, "w") as f:
                json.dump(info, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            files.fsync(tmp)
            files.publish(tmp, latest, ckpts / PREVIOUS)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # still there only when the save failed
    if collective:
        torch.distributed.barrier()
    return latest


def locate(path: Path) -> Path:
    """The checkpoint a path names (exports, samples, evaluation): itself, or the latest one of a run dir or of its
    checkpoints/ folder."""
    if (path / JOB_INFO).is_file() or (path / ".metadata").is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"{path}: no such run dir or checkpoint")
    ckpts = checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path
    if (ckpts / LATEST).exists():
        return ckpts / LATEST
    raise CheckpointError(f"{path}: no checkpoint there (checkpoints/{LATEST}/)")


def read_part(path: Path, name: str) -> dict[str, Any]:
    """One part of a checkpoint, whole, read in this one process without a live template (exports, samples,
    tests): its tensors as they were saved, its other values as they were. A flat part (the model's state_dict,
    a rank's progress): nested values come back under dotted keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
             for k, m in meta.items() if k.startswith(f"{name}.")}
    _dcp(False, state, path, alone=True)
    return {k.removeprefix(f"{name}."): v for k, v in state.items()}


# -- loading ------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    """A checkpoint read for resuming: its state, where it came from, and lines for the console (a
    fallback past an unreadable checkpoint, the config changes that were allowed, a change of world size)."""

    state: dict[str, Any]
    path: Path
    notes: list[str] = field(default_factory=list)


class _Unusable(Exception):
    """Why one candidate checkpoint cannot be resumed from (the next one may be)."""


def _shown(path: Path, out_dir: Path) -> str:
    try:
        return str(path.relative_to(out_dir))
    except ValueError:
        return str(path)


def _candidates(ckpts: Path) -> list[Path]:
    return [ckpts / LATEST, ckpts / PREVIOUS]


def holds_checkpoint(out_dir: Path) -> bool:
    """Whether a run dir has a published checkpoint (a fresh run there would overwrite it)."""
    return any(p.exists() for p in _candidates(checkpoint_dir(out_dir)))


def load_checkpoint(resume: str, out_dir: Path, *, template: dict[str, Any], per_rank: PerRank = {},
                    rank: int = 0, world_size: int = 1, defaults: Optional[dict] = None) -> Optional[Loaded]:
    """The checkpoint `trainer.resume` names, checked against this run; None for a fresh start.

    resume: `none`; `auto` (out_dir's latest checkpoint, else the previous one, else a fresh start); a run dir or
    its checkpoints/ dir (the same, in that dir); or a checkpoint directory (that one only). template: this
    run's live state, its tensors loaded in place (under torchrun collectively: each rank reads the shards it
    holds); its keys are required in the checkpoint, and its `config` is compared with the saved one
    (config_changes over `defaults`, the schema's: a breaking change raises). per_rank: the parts stored per rank. Which checkpoint is decided
    from the files, identically on every rank, before any shard is read.

    Raises CheckpointError naming each checkpoint tried and why, or the config keys that changed.
    """
    if resume == "none":
        return None
    out_dir = Path(out_dir)
    path = Path(resume).expanduser() if resume != "auto" else checkpoint_dir(out_dir)
    if not path.exists():
        if resume == "auto":
            return None
        raise CheckpointError(f"trainer.resume={resume!r}: no checkpoint at {path}")
    if path.is_dir() and not (path / JOB_INFO).exists() and not (path / ".metadata").exists():  # a run dir
        ckpts = checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path
        candidates = _candidates(ckpts)
        if not any(p.exists() for p in candidates):
            if resume == "auto":
                return None
            raise CheckpointError(f"trainer.resume={resume!r}: no checkpoint in {ckpts}")
    else:
        candidates = [path]

    problems, unusable = [], []
    for candidate in candidates:
        shown = _shown(candidate, out_dir)
        if not candidate.exists():
            problems.append(f"{shown} is absent ({_why_absent(candidate)})")
            continue
        try:
            state, notes = _load_checked(candidate, shown, template, per_rank, rank, world_size, defaults or {})
        except _Unusable as e:
            problems.append(f"{shown} {e}")
            unusable.append(candidate)
            continue
        if unusable and rank == 0 and candidate.parent.resolve() == checkpoint_dir(out_dir).resolve():
            problems += [_set_aside(bad, out_dir) for bad in unusable]
        fallback = [f"{'; '.join(problems)}; resumed from {shown}"] if problems else []
        return Loaded(state=state, path=candidate, notes=fallback + notes)
    raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems)
                          + ". Point trainer.resume at a good checkpoint, or start a new run dir "
                            "(hydra.run.dir=...) with trainer.resume=none")


def _set_aside(path: Path, out_dir: Path) -> str:
    """Rename a checkpoint resume=auto fell back past to a name that says so, beside the good ones: in the run's
    own dir the next save would rotate it into `previous`, over the checkpoint the run resumed from (then the
    only good one). Kept, not deleted: it may be worth a look; but only the last KEPT_UNUSABLE of them (older ones
    set aside the same way are removed). Called after every rank has read its candidates (the load of the good one
    is collective), on rank 0 only. Returns the note that says what was kept and what removed."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}{UNUSABLE_MARK}{stamp}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{UNUSABLE_MARK}{stamp}-{n}")
    os.replace(path, aside)
    removed = _kept_aside(path.parent)[:-KEPT_UNUSABLE]
    for old in removed:
        if old.is_dir():
            shutil.rmtree(old)
        else:  # a file where a checkpoint directory was expected
            old.unlink()
    files.fsync(path.parent)
    note = f"kept aside as {_shown(aside, out_dir)}"
    if removed:
        note += (f" (the last {KEPT_UNUSABLE} kept aside stay, each as large as a checkpoint; removed the older "
                 f"{', '.join(p.name for p in removed)})")
    return note


def _kept_aside(ckpts: Path) -> list[Path]:
    """The checkpoints _set_aside renamed in `ckpts`, oldest first, by the time in their names (a name it did not
    make is left alone)."""
    stamped = [(m[1], int(m[2] or 1), p) for p in ckpts.glob(f"*{UNUSABLE_MARK}*")
               if (m := _ASIDE_STAMP.fullmatch(p.name.partition(UNUSABLE_MARK)[2]))]
    return [p for *_, p in sorted(stamped)]


def _why_absent(path: Path) -> str:
    kept = sorted(path.parent.glob(f"{path.name}{UNUSABLE_MARK}*"))
    return "a save was interrupted" + (f", or it was kept aside as {kept[-1].name}" if kept else "")


def _check_config(saved: dict, template: dict[str, Any], shown: str, defaults: dict) -> list[str]:
    changes = config_changes(saved, template["config"], defaults)
    if changes.breaking:
        raise CheckpointError(changes.refusal(shown))
    return ([changes.accepted()] if changes.allowed else []) + ([changes.newer()] if changes.added else [])


def _load_checked(path: Path, shown: str, template: dict[str, Any], per_rank: PerRank, rank: int,
                  world_size: int, defaults: dict) -> tuple[dict[str, Any], list[str]]:
    from torch.distributed.checkpoint.api import CheckpointException

    if not path.is_dir():
        raise _Unusable("is not a checkpoint directory (a file: written by an older minitrain?)")
    if not (path / ".metadata").is_file():
        raise _Unusable("is incomplete (no .metadata: its save did not finish)")
    try:
        info = json.loads((path / JOB_INFO).read_text())
        saved_world, config = info["world_size"], info["config"]
    except (OSError, ValueError, KeyError) as e:
        raise _Unusable(f"has no readable {JOB_INFO} ({error_reason(e)})") from None
    notes = _check_config(config, template, shown, defaults)
    if saved_world != world_size:
        saved_by = f"{saved_world} process" + ("es" if saved_world > 1 else "")
        notes.append(f"{shown} was saved by {saved_by}, this run has {world_size}: the same global batch, its "
                     "gradients summed in another order (the losses differ by rounding)")
    try:
        state = _load_into(path, {k: v for k, v in template.items() if k != "config"}, per_rank, rank,
                           saved_world, world_size)
    except (Exception, CheckpointException) as e:  # whatever the reader trips on (a torn shard, a missing part)
        failed = rank
        if isinstance(e, CheckpointException):  # it wraps what each rank's reader raised
            failed, (e, _) = next(iter(e.failures.items()))
        raise _Unusable(f"could not be loaded (rank {failed}: {error_reason(e)})") from None
    return {**state, "config": config}, notes


def _load_into(path: Path, template: dict[str, Any], per_rank: PerRank, rank: int, saved_world: int,
               world_size: int) -> dict[str, Any]:
    """`template`'s tensors loaded in place (each rank reads the shards it holds); returns the template with the
    saved values. The parts stored per rank: this rank's own, or under another world size, every saved rank's
    merged by the part's `combine_ranks`."""
    if saved_world == world_size:
        state = _by_rank(template, rank, per_rank)
        _dcp(False, state, path)
        return {k: state[f"{k}_rank{rank}" if k in per_rank else k] for k in template}
    state = {k: v for k, v in template.items() if k not in per_rank}
    state.update({f"{k}_rank{r}": deepcopy(template[k]) for k in per_rank if k in template for r in range(saved_world)})
    _dcp(False, state, path)
    merged = {k: per_rank[k]([state[f"{k}_rank{r}"] for r in range(saved_world)]) for k in per_rank if k in template}
    return {k: merged[k] if k in merged else state[k] for k in template}


# -- the config a run resumes with ---------------------------------------------------------------------
# Keys that may change between a checkpoint and its resume, each with why the resumed run is still the
# same run: they steer how long it goes, what is reported, where files go, or how the same arithmetic is
# scheduled on the device or over processes. Any other difference (shapes, data, precision, the params' stored
# dtype, lr, global batch, seed, optimizer...) changes what the steps compute and is refused. fnmatch patterns.
ALLOWED_CHANGES: dict[str, str] = {
    "trainer.max_steps": "extending or shortening the run is what resuming is for (the cosine schedule "
                         "is laid over the new length from here on)",
    "trainer.log_every": "how often metrics are reported, not what a step computes",
    "trainer.eval_every": "evaluation reads the model without changing it",
    "trainer.eval_batches": "evaluation reads the model without changing it",
    "trainer.eval_hellaswag*": "evaluation reads the model without changing it",
    "trainer.save_every": "how often checkpoints are written",
    "trainer.sample_tokens": "the end-of-run sample only",
    "trainer.out_dir": "a run dir moved or copied elsewhere",
    "trainer.device": "where the same arithmetic runs (kernel rounding aside)",
    "trainer.compile": "the same graph, compiled or not",
    "trainer.compile_mode": "the same graph, compiled differently",
    "trainer.compile_check": "a check at the first step, not what a step computes",
    "trainer.deterministic": "the order in which the same sums are added (kernel rounding aside)",
    "trainer.peak_flops": "the MFU denominator only",
    "trainer.memory_budget": "a check of the plan before allocating",
    "trainer.expandable_segments": "how the allocator lays out the same tensors",
    "trainer.micro_batch": "how the global batch is split into micro-batches; the sum is the same",
    "trainer.max_skipped_steps": "when a diverging run is stopped, not what a step computes",
    "trainer.target_loss": "when the run stops at its validation loss, not what a step computes",
    "checkpointing.*": "which activations are recomputed in backward instead of kept; the same values",
    "logger.*": "where and under which names metrics are reported",
    "data.cache_dir": "where the token cache lives; its contents are the same",
    "data.shard_tokens": "how the token streams are cut into files; windows cross shards, so the batches are the same",
    "distributed.timeout_s": "how long a rank waits for a stalled peer",
    "distributed.mode": "the same global batch over one process, replicas (ddp) or shards (fsdp); the gradient "
                        "sums add in another order",
    "distributed.fsdp_unit_blocks": "how many blocks FSDP gathers at once; the same sums",
    "distributed.reshard_after_forward": "whether FSDP keeps the gathered params until backward; the same values",
    "plan.world_size": "the same global batch over more or fewer processes; the gradient sums add in another order",
    "plan.distributed": "as distributed.mode",
    "loss.chunk_bytes": "the fused loss's workspace tile; the same loss",
}

UNCOMPARED = ("trainer.resume",)  # how a start finds its checkpoint: every resume changes it, none is news

_ABSENT = object()


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(not set)"
    return "null" if value is None else str(value)


@dataclass
class ConfigChanges:
    """Dotted keys whose value differs between a checkpoint's config and this run's: key -> (saved, now); and the
    settings newer than the checkpoint that this run leaves at their defaults: key -> value."""

    allowed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    breaking: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    added: dict[str, Any] = field(default_factory=dict)

    def refusal(self, checkpoint: str) -> str:
        lines = [f"{checkpoint} was saved by a run with a different config; resuming would silently make it "
                 "another run:"]
        lines += [f"  {key}: saved {_show(a)}, now {_show(b)}" for key, (a, b) in self.breaking.items()]
        lines.append("Put the saved values back to resume it, or start a new run dir (hydra.run.dir=...) "
                     "for the new config")
        return "\n".join(lines)

    def accepted(self) -> str:
        return "config changed since the checkpoint (allowed): " + ", ".join(
            f"{key} {_show(a)} -> {_show(b)}" for key, (a, b) in self.allowed.items())

    def newer(self) -> str:
        return "settings newer than the checkpoint, at their defaults (what it was trained with): " + ", ".join(
            f"{key}={_show(value)}" for key, value in self.added.items())


def config_changes(saved: dict, current: dict, defaults: Optional[dict] = None) -> ConfigChanges:
    """Compare nested config dicts by dotted key. A setting enters the schema with a default that computes what
    minitrain computed before it, so a key an older checkpoint lacks is no change where this run leaves it at its
    default in `defaults` (the schema's, nested as the configs); any other key on one side only is a change.
    Allowed: the keys ALLOWED_CHANGES matches; breaking: every other difference."""
    saved_flat, current_flat, default_flat = _flatten(saved), _flatten(current), _flatten(defaults or {})
    changes = ConfigChanges()
    for key in sorted((saved_flat.keys() | current_flat.keys()) - set(UNCOMPARED)):
        before, now = saved_flat.get(key, _ABSENT), current_flat.get(key, _ABSENT)
        if before is _ABSENT and key in default_flat and now == default_flat[key]:
            changes.added[key] = now
        elif before is _ABSENT or now is _ABSENT or before != now:
            allowed = any(fnmatch.fnmatchcase(key, pattern) for pattern in ALLOWED_CHANGES)
            (changes.allowed if allowed else changes.breaking)[key] = (before, now)
    return changes
