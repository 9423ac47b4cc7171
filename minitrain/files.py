"""Files other processes, or the run after a crash, may read: published whole by rename, and locks.

A file or directory is written under a temporary name of its writer's own (`<name>.tmp.<pid>.<hex>`), made
durable (fsync), then renamed over its published name, and the rename made durable (fsync of the folder): a
reader sees the version before or the new one, never half of either. A temporary left by a writer that died is
recognised by its name (`is_temporary`) and removed by the process that holds the lock on its folder (no other
live writer can be using it then).

Locks are `filelock`'s, an flock on Unix: the kernel drops it when its holder's process ends, however it ends, so
a SIGKILL leaves no stale lock behind.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Optional, Union

TEMP_MARK = ".tmp."
_TEMPORARY = re.compile(r".+\.tmp\.\d+(\.[0-9a-f]+)?")


def temp_path(path: Path) -> Path:
    """A name beside `path` that no other process or earlier write uses (two writers of one name could publish
    a mix of both)."""
    return path.with_name(f"{path.name}{TEMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")


def is_temporary(path: Path) -> bool:
    return _TEMPORARY.fullmatch(Path(path).name) is not None


def remove_temporaries(folder: Path) -> list[Path]:
    """Delete the temporaries in `folder` (not below it): only safe for the holder of the folder's lock."""
    stale = sorted(p for p in Path(folder).glob(f"*{TEMP_MARK}*") if is_temporary(p)) if Path(folder).is_dir() else []
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def fsync(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (the renames in it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, content: Union[str, bytes]) -> Path:
    """Publish `content` as the file `path`: written and synced under a temporary name, then renamed over it."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)  # still there only when the write failed
    return path


def publish(tmp: Path, path: Path, previous: Optional[Path] = None) -> None:
    """`tmp` (complete and synced) becomes `path`; the `path` it replaces becomes `previous`, or is deleted without
    one. Each step is one rename, so a crash between any two leaves `path`, or else `previous`, complete."""
    aside = None
    if path.exists():
        keep = previous if previous is not None else temp_path(path)
        if previous is not None and previous.is_dir():  # a rename cannot replace a non-empty directory
            aside = temp_path(previous)
            os.replace(previous, aside)
        os.replace(path, keep)
        fsync(path.parent)
        aside = keep if previous is None else aside
    os.replace(tmp, path)
    fsync(path.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True) if aside.is_dir() else aside.unlink(missing_ok=True)


def lock(path: Path, wait: bool = True):
    """An exclusive lock on the file `path` (made if absent), held until its `release()` or its holder's end; None
    when `wait` is false and another process (or another lock object of this one) holds it. An OSError when
    `path` cannot be opened for writing."""
    import filelock

    held = filelock.FileLock(str(path))
    try:
        held.acquire(timeout=-1 if wait else 0)
    except filelock.Timeout:
        return None
    return held
