"""Training checkpoints: nothing lost on a crash, and a resumed run identical to an unbroken one.

A checkpoint holds everything the next step depends on — model, optimizer (masters, moments, step),
loss scaler, RNG states, the data sampler's position, the wandb run id and the config — and is
written to a temporary file, fsynced, then renamed over `latest.pt`: a crash mid-save leaves the
previous checkpoint intact.

Under torchrun (ddp, fsdp) the checkpoint is a directory written by torch.distributed.checkpoint:
every rank writes its own shards (fsdp: its 1/N of the weights and Adam moments; ddp: replicated
tensors are written once), to `latest.tmp/`, which rank 0 then swaps in for `latest/`. A multi-node
job needs `trainer.out_dir` on a filesystem every node sees. RNG states and the wandb run id differ
by rank and are stored per rank.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

LATEST = "latest.pt"
LATEST_SHARDED = "latest"  # a torch.distributed.checkpoint directory
_PER_RANK = ("rng", "wandb_id")


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def find_checkpoint(resume: str, out_dir: Path, sharded: bool = False) -> Optional[Path]:
    """`none` -> None; `auto` -> the run dir's latest checkpoint if any; else a path that must exist.
    sharded: the torch.distributed.checkpoint directory of a torchrun job instead of `latest.pt`."""
    name = LATEST_SHARDED if sharded else LATEST
    if resume == "none":
        return None
    if resume == "auto":
        # A sharded save swaps directories in two renames (latest -> latest.old, latest.tmp -> latest);
        # a crash between them leaves the previous checkpoint, complete, as latest.old.
        candidates = [checkpoint_dir(out_dir) / n for n in ((name, name + ".old") if sharded else (name,))]
        return next((path for path in candidates if path.exists()), None)
    path = Path(resume).expanduser()
    if path.is_dir() and not (path / ".metadata").exists():
        path = checkpoint_dir(path) / name if (checkpoint_dir(path) / name).exists() else path / name
    if not path.exists():
        raise FileNotFoundError(f"trainer.resume={resume!r}: no checkpoint at {path}")
    return path


def load(path: Path, device: torch.device) -> dict[str, Any]:
    # weights_only=False: the checkpoint holds RNG states and the config, written by us.
    return torch.load(path, map_location=device, weights_only=False)


def _by_rank(state: dict[str, Any], rank: int) -> dict[str, Any]:
    return {(f"{k}_rank{rank}" if k in _PER_RANK else k): v for k, v in state.items()}


def save_sharded(state: dict[str, Any], path: Path, rank: int) -> None:
    """Collective: every rank calls it with its own state (DTensors for sharded tensors)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(_by_rank(state, rank), checkpoint_id=tmp)  # returns once every rank's shards and the metadata are written
    if rank == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_sharded(path: Path, template: dict[str, Any], rank: int) -> dict[str, Any]:
    """Collective: `template` is the live state, its tensors loaded in place (each rank reads the
    shards it holds); returns the template with the saved values."""
    import torch.distributed.checkpoint as dcp

    state = _by_rank(template, rank)
    dcp.load(state, checkpoint_id=path)
    return {k: state[f"{k}_rank{rank}" if k in _PER_RANK else k] for k in template}
