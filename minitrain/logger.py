"""Where the numbers go: a console line per log step, `metrics.jsonl` in the run dir, and wandb.

Every record is written to all three with the same keys, so a run or a sweep can be read back
without wandb (`metrics.jsonl`, one JSON object per line) and compared with what wandb shows.
`metrics.jsonl` is strict JSON: a non-finite float (NaN, ±inf, also inside a nested value) is written
as `null`, since a bare `NaN` makes a strict reader reject the line. Its first line may be the run's
plan, `{"plan": {...}}`, the one record without a `step`. Every console line is also appended to
`train.log` in the run dir, so the run dir tells the console's story after the terminal is gone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from . import files
from .config import LoggerConfig, LoggerMode
from .errors import ConfigError, error_reason
from .progress import Progress
from .rundir import METRICS, TRAIN_LOG, RunDir

# Console columns: (key, label, format); a key absent from a record is left out of the line.
_CONSOLE = [
    ("train/loss", "loss", "{:.4f}"), ("val/loss", "val", "{:.4f}"), ("val/ppl", "ppl", "{:.2f}"),
    ("hellaswag/acc_norm", "hellaswag", "{:.1%}"), ("opt/lr", "lr", "{:.2e}"),
    ("opt/grad_norm", "gnorm", "{:.3f}"), ("amp/loss_scale", "scale", "{:.0f}"),
    ("amp/skipped_steps", "skipped", "{:.0f}"), ("perf/step_ms", "ms", "{:.1f}"),
    ("perf/tokens_per_s", "tok/s", "{:,.0f}"), ("perf/mfu", "mfu", "{:.1%}"),
    ("perf/hfu", "hfu", "{:.1%}"),
    ("mem/peak_allocated_gb", "peak", "{:.2f}GB"), ("mem/peak_rss_gb", "peak rss", "{:.2f}GB"),
]


def console_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']:>6}"]
    for key, label, fmt in _CONSOLE:
        value = record.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON null), at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(json_safe(record), allow_nan=False) + "\n"


class RunLogger:
    """Console + metrics.jsonl + train.log + wandb for one run (one job of a sweep).

    resume_step: the step this run continues from (0: a fresh start). The records past it were logged by
    the run that crashed after its last checkpoint (at a fresh start: by one that died before its first)
    and will be logged again, so they are dropped (a line torn by the crash too): the file then continues
    exactly. `dropped_records` counts them.
    """

    def __init__(self, cfg: LoggerConfig, out_dir: Path, config: dict, run_id: Optional[str],
                 group: Optional[str], name: Optional[str], enabled: bool = True,
                 resume_step: int = 0):
        self.enabled = enabled  # False on ranks other than 0
        self.jsonl = out_dir / METRICS
        self.log_file = out_dir / TRAIN_LOG
        self.wandb_run = None
        self.dropped_records = 0
        if not enabled:
            return
        records = self._records()
        kept = [r for r in records if r.get("step", 0) <= resume_step]
        self.dropped_records = sum("step" in r for r in records) - sum("step" in r for r in kept)
        self._rewrite(kept)
        if cfg.mode == LoggerMode.disabled:
            return
        import wandb

        try:
            self.wandb_run = wandb.init(
                project=cfg.project, group=cfg.group or group, name=cfg.name or name, tags=list(cfg.tags),
                config=config, dir=str(out_dir), mode=cfg.mode.value, id=run_id, resume="allow",
            )
        except wandb.errors.Error as e:  # no API key, no network, a refused project
            raise ConfigError(f"logger.mode={cfg.mode.value}: wandb could not start the run ({error_reason(e)}). "
                              "Run `wandb login` (or set WANDB_API_KEY), or log offline (logger.mode=offline, "
                              "the default) and upload later with `wandb sync`") from None

    @classmethod
    def from_config(cls, cfg: LoggerConfig, plan, run_dir: RunDir, config: dict, progress: Progress,
                    enabled: bool = True) -> "RunLogger":
        """The run's logger in its run dir, continuing the wandb run and the metrics of `progress` (a resumed run's),
        named by the run's place in a sweep, with the plan (minitrain.plan.Plan) as its first record."""
        logger = cls(cfg, run_dir.path, config, run_id=progress.wandb_id, group=run_dir.info.group,
                     name=run_dir.info.name, enabled=enabled, resume_step=progress.step)
        logger.log_plan(plan.as_dict())
        return logger

    @property
    def run_id(self) -> Optional[str]:
        return self.wandb_run.id if self.wandb_run is not None else None

    def _records(self) -> list[dict[str, Any]]:
        if not self.jsonl.exists():
            return []
        records = []
        for line in self.jsonl.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # the torn last line of a killed run
                continue
        return records

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace metrics.jsonl at once: a crash mid-rewrite leaves the old file, never half of one."""
        files.atomic_write(self.jsonl, "".join(map(_json_line, records)))

    def log_plan(self, plan: dict[str, Any]) -> None:
        """The run's resolved plan as metrics.jsonl's first line (replacing the plan of the run it resumes)
        and in wandb's config."""
        if not self.enabled:
            return
        self._rewrite([{"plan": plan}] + [r for r in self._records() if "plan" not in r])
        if self.wandb_run is not None:
            self.wandb_run.config.update({"plan": plan}, allow_val_change=True)

    def log(self, record: dict[str, Any], console: bool = True) -> None:
        if not self.enabled:
            return
        with open(self.jsonl, "a") as f:
            f.write(_json_line(record))
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if console:
            self.print(console_line(record))

    def print(self, text: str) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            tqdm.write(text)
            with open(self.log_file, "a") as f:
                f.write(text + "\n")

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
