"""One-line refusals: the error that names the setting at fault, and an exception put in a few words.

A module of its own so that both halves of the schema (minitrain/config.py, minitrain/model_config.py) and every
module that refuses a setting share one rule without an import cycle.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def error_reason(e: BaseException) -> str:
    """An exception as a few words for a one-line message: its type and its first sentence."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first.split('. ')[0]}" if first else type(e).__name__


def unusable_run_dir(key: str, path, e: OSError) -> str:
    """The one-line refusal of a run dir (or a sweep's dir) that cannot be made or written, naming the setting
    that chose it."""
    if key == "hydra.sweep.dir":
        return (f"{key}: cannot use {path} as the sweep's dir ({error_reason(e)}); give the sweep a writable "
                "directory (hydra.sweep.dir=...)")
    return (f"{key}: cannot use {path} as the run dir ({error_reason(e)}); give the run a writable directory "
            "(hydra.run.dir=... or trainer.out_dir=...)")


def require(ok: bool, key: str, message: str) -> None:
    """Refuse a setting: a ConfigError naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
