"""Where the numbers go: a console line per log step, `metrics.jsonl` in the run dir, and wandb.

Every record is written to all three with the same keys, so a run or a sweep can be read back
without wandb (`metrics.jsonl`, one JSON object per line) and compared with what wandb shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from .config import LoggerConfig, LoggerMode

# Console columns: (key, label, format); a key absent from a record is left out of the line.
_CONSOLE = [
    ("train/loss", "loss", "{:.4f}"), ("val/loss", "val", "{:.4f}"), ("opt/lr", "lr", "{:.2e}"),
    ("opt/grad_norm", "gnorm", "{:.3f}"), ("amp/loss_scale", "scale", "{:.0f}"),
    ("amp/skipped_steps", "skipped", "{:.0f}"), ("perf/step_ms", "ms", "{:.1f}"),
    ("perf/tokens_per_s", "tok/s", "{:,.0f}"), ("perf/mfu", "mfu", "{:.1%}"),
    ("perf/hfu", "hfu", "{:.1%}"),
    ("mem/peak_allocated_gb", "peak", "{:.2f}GB"), ("mem/rss_gb", "rss", "{:.2f}GB"),
]


def console_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']:>6}"]
    for key, label, fmt in _CONSOLE:
        value = record.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


class RunLogger:
    """Console + metrics.jsonl + wandb for one run (one job of a sweep)."""

    def __init__(self, cfg: LoggerConfig, out_dir: Path, config: dict, run_id: Optional[str],
                 group: Optional[str], name: Optional[str], enabled: bool = True):
        self.enabled = enabled  # False on ranks other than 0
        self.jsonl = out_dir / "metrics.jsonl"
        self.wandb_run = None
        if not enabled or cfg.mode == LoggerMode.disabled:
            return
        import wandb

        self.wandb_run = wandb.init(
            project=cfg.project, group=cfg.group or group, name=cfg.name or name, tags=list(cfg.tags),
            config=config, dir=str(out_dir), mode=cfg.mode.value, id=run_id, resume="allow",
        )

    @property
    def run_id(self) -> Optional[str]:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, record: dict[str, Any], console: bool = True) -> None:
        if not self.enabled:
            return
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if console:
            self.print(console_line(record))

    def print(self, text: str) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            tqdm.write(text)

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
