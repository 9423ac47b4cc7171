"""Training checkpoints: nothing lost on a crash, and a resumed run identical to an unbroken one.

A checkpoint holds everything the next step depends on — model, optimizer (masters, moments, step),
loss scaler, RNG states, the data sampler's position, the wandb run id and the config. The run dir
keeps the last two: `checkpoints/latest.pt` and `checkpoints/previous.pt`. A save writes a temporary
file whose name is unique to the process, fsyncs it, renames `latest.pt` to `previous.pt`, then the
temporary to `latest.pt`, and fsyncs the directory: a crash at any point leaves `latest.pt`, or else
`previous.pt`, complete, and `resume=auto` tries them in that order, falling back past an unreadable
one with a note. The unreadable one is then kept aside as `latest.pt.unusable-<time>` (never deleted,
never taken for a checkpoint): the next save must not rotate it into `previous.pt` over the checkpoint
the run resumed from.

Under torchrun (ddp, fsdp) a checkpoint is a directory written by torch.distributed.checkpoint: every
rank writes its own shards (fsdp: its 1/N of the weights and Adam moments; ddp: replicated tensors are
written once) into a temporary directory that rank 0 publishes as `latest/`, the one before kept as
`previous/`, the same way. Beside the shards, `minitrain.json` records the job's world size, mode and
config, so a resume checks the kind of job and the config before any rank reads a shard. A
multi-node job needs `trainer.out_dir` on a filesystem every node sees. The parts that differ by rank
(RNG states, running loss sums) are stored per rank.

One run at a time owns a run dir (`RunDirLock`): two runs in one directory would interleave their
metrics and overwrite each other's checkpoints.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from . import files
from .config import error_reason
from .rundir import RunDirError, checkpoint_dir

LATEST, PREVIOUS = "latest.pt", "previous.pt"
LATEST_SHARDED, PREVIOUS_SHARDED = "latest", "previous"  # torch.distributed.checkpoint directories
JOB_INFO = "minitrain.json"  # in a sharded checkpoint: world_size, mode, config
UNUSABLE_MARK = ".unusable-"  # a checkpoint resume=auto fell back past, kept aside for the user to look at
_PER_RANK = ("rng", "progress")  # differ by rank: each rank's generators, its running loss sums


class CheckpointError(RunDirError):
    """No usable checkpoint where one was asked for, or one that does not fit this run."""


# -- saving -------------------------------------------------------------------------------------------
def save_checkpoint(state: dict[str, Any], out_dir: Path) -> Path:
    """Single process: publish `state` as checkpoints/latest.pt, keeping the one before as previous.pt."""
    ckpts = checkpoint_dir(out_dir)
    ckpts.mkdir(parents=True, exist_ok=True)
    latest = ckpts / LATEST
    tmp = files.temp_path(latest)
    try:
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as e:  # a full disk, a quota: torch.save's writer says RuntimeError
            tmp.unlink(missing_ok=True)  # first: the free space the message gives is what the next try will have
            raise _unwritable(ckpts, e, state_bytes(state)) from None
        files.publish(tmp, latest, ckpts / PREVIOUS)
    finally:
        tmp.unlink(missing_ok=True)  # still there only when the save failed
    return latest


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) checkpoint state: what its file or shards take on disk, near
    enough. A DTensor counts whole (its numel is the global one): every rank's shards are written."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT in `e` or what it was raised from (torch.save reports the write's OSError as the context
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


def _by_rank(state: dict[str, Any], rank: int) -> dict[str, Any]:
    return {(f"{k}_rank{rank}" if k in _PER_RANK else k): v for k, v in state.items()}


def save_sharded(state: dict[str, Any], out_dir: Path, rank: int, mode: str) -> Path:
    """Collective: every rank calls it with its own state (DTensors for sharded tensors). Publishes
    checkpoints/latest/, keeping the one before as previous/; `mode` (ddp | fsdp), the world size and
    the state's `config` go into its minitrain.json, read by load_checkpoint before any shard."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    ckpts = checkpoint_dir(out_dir)
    latest = ckpts / LATEST_SHARDED
    name = [files.temp_path(latest).name if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)  # every rank writes into the directory rank 0 named
    tmp = ckpts / name[0]
    try:
        shards = {k: v for k, v in state.items() if k != "config"}  # the config lives in minitrain.json
        try:  # returns once every rank's shards and .metadata exist; a rank's failure is raised on every rank
            dcp.save(_by_rank(shards, rank), checkpoint_id=tmp)
        except (CheckpointException, OSError) as e:  # not RuntimeError: a collective's (a peer gone) stays raw
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # first: the free space the message gives
            raise _unwritable(ckpts, e, state_bytes(shards)) from None
        if rank == 0:
            info = {"world_size": dist.get_world_size(), "mode": mode, "config": state["config"]}
            with open(tmp / JOB_INFO, "w") as f:
                json.dump(info, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            files.fsync(tmp)
            files.publish(tmp, latest, ckpts / PREVIOUS_SHARDED)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # still there only when the save failed
    dist.barrier()
    return latest


# -- loading ------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    """A checkpoint read for resuming: its state, where it came from, and lines for the console (a
    fallback past an unreadable checkpoint, the config changes that were allowed)."""

    state: dict[str, Any]
    path: Path
    notes: list[str] = field(default_factory=list)


class _Unusable(Exception):
    """Why one candidate checkpoint cannot be resumed from (the next one may be)."""


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """A single-process checkpoint file; raises CheckpointError naming the file if it cannot be read."""
    try:
        # weights_only=False: the checkpoint holds RNG states and the config, written by us.
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # whatever the reader trips on (zip, pickle, EOF), the file is unusable
        raise CheckpointError(f"{path} is unreadable ({error_reason(e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a minitrain checkpoint (it holds a {type(state).__name__})")
    return state


def _shown(path: Path, out_dir: Path) -> str:
    try:
        return str(path.relative_to(out_dir))
    except ValueError:
        return str(path)


def _candidates(ckpts: Path, sharded: bool) -> list[Path]:
    names = (LATEST_SHARDED, PREVIOUS_SHARDED) if sharded else (LATEST, PREVIOUS)
    return [ckpts / name for name in names]


def holds_checkpoint(out_dir: Path) -> bool:
    """Whether a run dir has a published checkpoint of either kind (a fresh run there would overwrite it)."""
    ckpts = checkpoint_dir(out_dir)
    return any(p.exists() for kind in (False, True) for p in _candidates(ckpts, kind))


def _kind_error(path: Path, shown: str, resume_value: str) -> CheckpointError:
    """A checkpoint of the other kind: a torchrun job's directory under one process, or the converse."""
    if path.is_dir():
        try:
            info = json.loads((path / JOB_INFO).read_text())
            world, mode = info["world_size"], info["mode"]
        except (OSError, ValueError, KeyError):
            world, mode = "N", "ddp|fsdp"
        return CheckpointError(
            f"{shown} was written by a torchrun job ({world} processes, distributed={mode}); this run is a "
            f"single process. Resume it with `torchrun --standalone --nproc_per_node={world} scripts/train.py "
            f"distributed={mode} trainer.resume={resume_value} ...` and the run's other overrides, or give "
            f"this run its own directory (hydra.run.dir=...)")
    return CheckpointError(
        f"{shown} was written by a single-process run; this job runs under torchrun. Resume it with "
        f"`python scripts/train.py trainer.resume={resume_value} ...` and the run's other overrides, or give "
        f"this job its own directory (hydra.run.dir=...)")


def load_checkpoint(resume: str, out_dir: Path, device: torch.device, *, template: dict[str, Any],
                    sharded: bool = False, rank: int = 0) -> Optional[Loaded]:
    """The checkpoint `trainer.resume` names, checked against this run; None for a fresh start.

    resume: `none`; `auto` (out_dir's latest checkpoint, else the previous one, else a fresh start); a
    run dir or its checkpoints/ dir (the same, in that dir); or a checkpoint file / sharded directory
    (that one only). template: this run's live state: its keys are required in the checkpoint, and its
    `config` is compared with the saved one (config_changes: a breaking change raises). sharded: a
    torchrun job's checkpoint, loaded collectively into `template` (load_sharded); which one is decided
    from the files, identically on every rank, before any shard is read.

    Raises CheckpointError naming each file tried and why, or the config keys that changed.
    """
    if resume == "none":
        return None
    out_dir = Path(out_dir)
    path = Path(resume).expanduser() if resume != "auto" else checkpoint_dir(out_dir)
    if not path.exists():
        if resume == "auto":
            return None
        raise CheckpointError(f"trainer.resume={resume!r}: no checkpoint at {path}")
    if path.is_dir() and not (path / ".metadata").exists():  # a run dir or a checkpoints dir: search it
        ckpts = checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path
        candidates = _candidates(ckpts, sharded)
        if not any(p.exists() for p in candidates):
            other = next((p for p in _candidates(ckpts, not sharded) if p.exists()), None)
            if other is not None:
                raise _kind_error(other, _shown(other, out_dir), resume)
            if resume == "auto":
                return None
            raise CheckpointError(f"trainer.resume={resume!r}: no checkpoint in {ckpts}")
    else:
        if path.is_dir() != sharded:
            raise _kind_error(path, _shown(path, out_dir), resume)
        candidates = [path]

    problems, unusable = [], []
    for candidate in candidates:
        shown = _shown(candidate, out_dir)
        if not candidate.exists():
            problems.append(f"{shown} is absent ({_why_absent(candidate)})")
            continue
        try:
            state, config_notes = (_load_sharded_checked(candidate, shown, template, rank) if sharded
                                   else _load_file_checked(candidate, shown, template, device))
        except _Unusable as e:
            problems.append(f"{shown} {e}")
            unusable.append(candidate)
            continue
        if unusable and rank == 0 and candidate.parent.resolve() == checkpoint_dir(out_dir).resolve():
            problems += [f"kept aside as {_shown(_set_aside(bad), out_dir)}" for bad in unusable]
        fallback = [f"{'; '.join(problems)}; resumed from {shown}"] if problems else []
        return Loaded(state=state, path=candidate, notes=fallback + config_notes)
    raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems)
                          + ". Point trainer.resume at a good checkpoint, or start a new run dir "
                            "(hydra.run.dir=...) with trainer.resume=none")


def _set_aside(path: Path) -> Path:
    """Rename a checkpoint resume=auto fell back past to a name that says so, beside the good ones: in the run's
    own dir the next save would rotate it into `previous`, over the checkpoint the run resumed from (then the
    only good one). Kept, not deleted: it may be worth a look. Called after every rank has read its candidates
    (the load of the good one is collective), on rank 0 only."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}{UNUSABLE_MARK}{stamp}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{UNUSABLE_MARK}{stamp}-{n}")
    os.replace(path, aside)
    files.fsync(path.parent)
    return aside


def _why_absent(path: Path) -> str:
    kept = sorted(path.parent.glob(f"{path.name}{UNUSABLE_MARK}*"))
    return "a save was interrupted" + (f", or it was kept aside as {kept[-1].name}" if kept else "")


def _check_config(saved: dict, template: dict[str, Any], shown: str) -> list[str]:
    changes = config_changes(saved, template["config"])
    if changes.breaking:
        raise CheckpointError(changes.refusal(shown))
    return [changes.accepted()] if changes.allowed else []


def _load_file_checked(path: Path, shown: str, template: dict[str, Any],
                       device: torch.device) -> tuple[dict[str, Any], list[str]]:
    try:
        state = load(path, device)
    except CheckpointError as e:
        raise _Unusable(str(e).removeprefix(f"{path} ")) from None
    missing = sorted(template.keys() - state.keys())
    if missing:
        raise _Unusable(f"is incomplete (no {', '.join(missing)})")
    return state, _check_config(state["config"], template, shown)


def _load_sharded_checked(path: Path, shown: str, template: dict[str, Any],
                          rank: int) -> tuple[dict[str, Any], list[str]]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    if not (path / ".metadata").is_file():
        raise _Unusable("is incomplete (no .metadata: its save did not finish)")
    try:
        info = json.loads((path / JOB_INFO).read_text())
        world, config = info["world_size"], info["config"]
    except (OSError, ValueError, KeyError) as e:
        raise _Unusable(f"has no readable {JOB_INFO} ({error_reason(e)})") from None
    if world != dist.get_world_size():
        raise CheckpointError(
            f"{shown} was written by {world} processes; this job has {dist.get_world_size()} (each rank's RNG "
            f"state and data position are its own). Resume with torchrun --nproc_per_node={world}, or start a new "
            "run dir (hydra.run.dir=...)")
    notes = _check_config(config, template, shown)
    try:
        state = load_sharded(path, {k: v for k, v in template.items() if k != "config"}, rank)
    except (CheckpointException, RuntimeError, OSError, ValueError) as e:  # a shard torn after its save
        if isinstance(e, CheckpointException):  # it wraps what each rank's reader raised
            rank_failed, (e, _) = next(iter(e.failures.items()))
            shown = f"{shown} (rank {rank_failed})"
        raise CheckpointError(f"{shown} could not be loaded ({error_reason(e)}); point trainer.resume at "
                              "another checkpoint or start a new run dir (hydra.run.dir=...)") from None
    return {**state, "config": config}, notes


def load_sharded(path: Path, template: dict[str, Any], rank: int) -> dict[str, Any]:
    """Collective: `template` is the live state, its tensors loaded in place (each rank reads the
    shards it holds); returns the template with the saved values."""
    import torch.distributed.checkpoint as dcp

    state = _by_rank(template, rank)
    dcp.load(state, checkpoint_id=path)
    return {k: state[f"{k}_rank{rank}" if k in _PER_RANK else k] for k in template}


# -- the config a run resumes with ---------------------------------------------------------------------
# Keys that may change between a checkpoint and its resume, each with why the resumed run is still the
# same run: they steer how long it goes, what is reported, where files go, or how the same arithmetic is
# scheduled on the device. Any other difference (shapes, data, precision, lr, batch, seed, optimizer,
# world size...) changes what the steps compute and is refused. fnmatch patterns.
ALLOWED_CHANGES: dict[str, str] = {
    "trainer.max_steps": "extending or shortening the run is what resuming is for (the cosine schedule "
                         "is laid over the new length from here on)",
    "trainer.log_every": "how often metrics are reported, not what a step computes",
    "trainer.eval_every": "evaluation reads the model without changing it",
    "trainer.eval_batches": "evaluation reads the model without changing it",
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
    "trainer.micro_batch": "how the global batch is split into micro-batches; the sum is the same",
    "trainer.max_skipped_steps": "when a diverging run is stopped, not what a step computes",
    "checkpointing.*": "which activations are recomputed in backward instead of kept; the same values",
    "logger.*": "where and under which names metrics are reported",
    "data.num_proc": "how many processes tokenize; the tokens are the same",
    "data.cache_dir": "where the token cache lives; its contents are the same",
    "distributed.timeout_s": "how long a rank waits for a stalled peer",
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
    """Dotted keys whose value differs between a checkpoint's config and this run's: key -> (saved, now)."""

    allowed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    breaking: dict[str, tuple[Any, Any]] = field(default_factory=dict)

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


def config_changes(saved: dict, current: dict) -> ConfigChanges:
    """Compare nested config dicts by dotted key; a key on one side only is a change (an older checkpoint
    lacks newer keys). Allowed: the keys ALLOWED_CHANGES matches; breaking: every other difference."""
    saved_flat, current_flat = _flatten(saved), _flatten(current)
    changes = ConfigChanges()
    for key in sorted((saved_flat.keys() | current_flat.keys()) - set(UNCOMPARED)):
        before, now = saved_flat.get(key, _ABSENT), current_flat.get(key, _ABSENT)
        if before is _ABSENT or now is _ABSENT or before != now:
            allowed = any(fnmatch.fnmatchcase(key, pattern) for pattern in ALLOWED_CHANGES)
            (changes.allowed if allowed else changes.breaking)[key] = (before, now)
    return changes
