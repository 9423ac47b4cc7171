"""Training checkpoints: nothing lost on a crash, and a resumed run identical to an unbroken one.

A checkpoint holds everything the next step depends on — model, optimizer (masters, moments, step),
loss scaler, RNG states, the data sampler's position, the wandb run id and the config — and is
written to a temporary file, fsynced, then renamed over `latest.pt`: a crash mid-save leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

LATEST = "latest.pt"


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


def find_checkpoint(resume: str, out_dir: Path) -> Optional[Path]:
    """`none` -> None; `auto` -> the run dir's latest checkpoint if any; else a path that must exist."""
    if resume == "none":
        return None
    if resume == "auto":
        path = checkpoint_dir(out_dir) / LATEST
        return path if path.exists() else None
    path = Path(resume).expanduser()
    if path.is_dir():
        path = checkpoint_dir(path) / LATEST if (checkpoint_dir(path) / LATEST).exists() else path / LATEST
    if not path.exists():
        raise FileNotFoundError(f"trainer.resume={resume!r}: no checkpoint at {path}")
    return path


def load(path: Path, device: torch.device) -> dict[str, Any]:
    # weights_only=False: the checkpoint holds RNG states and the config, written by us.
    return torch.load(path, map_location=device, weights_only=False)
