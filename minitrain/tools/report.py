"""A Hydra sweep as one table and its pictures: what each cell bought in memory, paid in speed, and learned.

Reads each job dir of `<sweep>/<job_num>/` (or one run's dir, as a table of one row): `.hydra/overrides.yaml`
(the cell's name), `metrics.jsonl` (one record per log step) and `memory.json` (predicted terms + measured
peaks).
Throughput is the median over the log intervals (the trainer leaves its warm-up steps out of them).
The pictures: throughput against memory, memory by term, the loss curves (train and validation loss against
tokens), and for cells with dynamic loss scaling (fp16) the loss scale and the skipped steps against step.
matplotlib is an optional install that only the plots import: without it the report is the table alone.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from minitrain.rundir import ERROR, MEMORY, METRICS, OVERRIDES_RECORD, RECORD

# The stacked bar's segments: `mem_pred/<key>_gb` keys of memory.MemoryEstimate.as_dict().
BREAKDOWN = ("weights", "grads", "masters", "adam_m", "adam_v", "activations_total", "transient")
PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install -e '.[plots]')"
RSS_NOTE = ("peak RSS: a CPU run's largest resident memory over the process's life, the interpreter, torch and the "
            "data included; it is no measure of the tensors the memory model predicts, so no ratio is given.")
RESERVED_NOTE = ("reserved: a run replaying CUDA graphs keeps their tensors in a pool that only the allocator's "
                 "reserved counter sees, so its peak reserved is the measure (as in the run's own memory line).")


class ReportError(ValueError):
    """A directory that holds no sweep: the message names it."""


@dataclass
class Cell:
    name: str
    records: list[dict]
    memory: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)  # metrics.jsonl's first record

    def _median(self, key: str) -> Optional[float]:
        values = [r[key] for r in self.records if key in r]
        return statistics.median(values) if values else None

    def _last(self, key: str) -> Optional[float]:
        return next((r[key] for r in reversed(self.records) if key in r), None)

    def series(self, key: str, against: str = "step") -> tuple[list[float], list[float]]:
        """(x, y) of the records that logged `key`, x the step or the tokens trained on by then (a record of an
        evaluation between log steps holds its step only); a non-finite value is logged as null and left out."""
        per_step = next((r["tokens"] / r["step"] for r in self.records if "tokens" in r), 0.0)
        scale = per_step if against == "tokens" else 1
        points = [(r["step"] * scale, r[key]) for r in self.records if r.get(key) is not None]
        return [x for x, _ in points], [y for _, y in points]

    @property
    def loss_scaled(self) -> bool:
        """Dynamic loss scaling (fp16): only then does a record hold amp/loss_scale."""
        return any("amp/loss_scale" in r for r in self.records)

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self._median("perf/tokens_per_s")

    @property
    def mfu(self) -> Optional[float]:
        return self._median("perf/mfu")

    @property
    def hfu(self) -> Optional[float]:
        return self._median("perf/hfu")

    @property
    def predicted_gb(self) -> Optional[float]:
        return self.memory.get("mem_pred/peak_gb")

    def _measured(self) -> tuple[Optional[str], Optional[float]]:
        keys = ("mem/peak_reserved_gb",) if self.plan.get("cuda_graphs") else \
            ("mem/peak_allocated_gb", "mem/peak_rss_gb")
        for key in keys:
            value = self.memory.get(key, max((r[key] for r in self.records if key in r), default=None))
            if value is not None:
                return key, value
        return None, None

    @property
    def measured_gb(self) -> Optional[float]:
        """The allocator's peak (CUDA: reserved under CUDA graphs, else allocated), else the process's peak
        RSS (CPU)."""
        return self._measured()[1]

    @property
    def measured_is_reserved(self) -> bool:
        return self._measured()[0] == "mem/peak_reserved_gb"

    @property
    def measured_is_rss(self) -> bool:
        """The measured figure is a CPU run's process peak RSS, not the allocator's peak of its tensors."""
        return self._measured()[0] == "mem/peak_rss_gb"

    @property
    def predicted_over_measured(self) -> Optional[float]:
        """None where they cannot be compared: one is missing, or the measured figure is a process's RSS."""
        comparable = self.predicted_gb and self.measured_gb and not self.measured_is_rss
        return self.predicted_gb / self.measured_gb if comparable else None

    @property
    def final_loss(self) -> Optional[float]:
        return self._last("train/loss")


def is_run_dir(path: Path) -> bool:
    """A single run's dir (its own metrics.jsonl), not a sweep of job dirs."""
    return (Path(path) / METRICS).is_file()


def load_sweep(sweep_dir: Path) -> tuple[list[Cell], list[tuple[str, str]]]:
    """Every job dir with a metrics.jsonl, in job order, named by the overrides that vary across the sweep;
    and (name, error) of each cell that did not run or stopped early (its error.txt, written by scripts/train.py;
    one that stopped, diverged, is also a cell, with what it logged before). A run dir
    is its own one cell, named by the dir (all of a run's overrides would make a name too long to plot)."""
    if is_run_dir(sweep_dir):
        jobs = [Path(sweep_dir)]
        names = [jobs[0].name]
    else:
        jobs = sorted({p.parent for pattern in (f"*/{METRICS}", f"*/{ERROR}")
                       for p in Path(sweep_dir).glob(pattern)}, key=_job_order)
        overrides = [_overrides(job) for job in jobs]
        shared = set.intersection(*map(set, overrides)) if len(jobs) > 1 else set()
        names = [",".join(o for o in ov if o not in shared) or job.name for job, ov in zip(jobs, overrides)]
        names = [f"{name} #{job.name}" if names.count(name) > 1 else name for job, name in zip(jobs, names)]
    cells = [Cell(name=name, records=read_step_records(job / METRICS),
                  memory=json.loads((job / MEMORY).read_text()) if (job / MEMORY).exists() else {},
                  plan=read_plan(job / METRICS))
             for job, name in zip(jobs, names) if (job / METRICS).exists()]
    failed = [(name, (job / ERROR).read_text().strip()) for job, name in zip(jobs, names) if (job / ERROR).exists()]
    return cells, failed


def read_step_records(path: Path) -> list[dict]:
    """The log steps of one metrics.jsonl, in order: a record without "step" (the run's plan, written
    first) describes the run, not a log step."""
    records = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return [r for r in records if "step" in r]


def read_plan(path: Path) -> dict:
    """The run's plan: metrics.jsonl's first record (empty for a file without one)."""
    lines = Path(path).read_text().splitlines()
    return json.loads(lines[0]).get("plan", {}) if lines else {}


def _overrides(job: Path) -> list[str]:
    path = job / RECORD / OVERRIDES_RECORD
    return (yaml.safe_load(path.read_text()) or []) if path.exists() else []


def _job_order(job: Path) -> tuple[int, str]:
    """Hydra numbers a sweep's job dirs 0, 1, ...: sort 10 after 9, not after 1."""
    return (int(job.name), "") if job.name.isdigit() else (1 << 30, job.name)


def _fmt(value: Optional[float], spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(cells: list[Cell]) -> str:
    head = ("| cell | tokens/s | MFU | HFU | peak predicted (GB) | peak measured (GB) | predicted/measured "
            "| final loss |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for c in cells:
        counter = " (peak RSS)" if c.measured_is_rss else " (reserved)" if c.measured_is_reserved else ""
        measured = _fmt(c.measured_gb, '.3f') + counter
        rows.append(f"| {c.name} | {_fmt(c.tokens_per_s, ',.0f')} | {_fmt(c.mfu, '.1%')} | {_fmt(c.hfu, '.1%')} "
                    f"| {_fmt(c.predicted_gb, '.3f')} | {measured} | {_fmt(c.predicted_over_measured, '.3f')} "
                    f"| {_fmt(c.final_loss, '.4f')} |")
    notes = [f"\n{note}" for note, shown in ((RSS_NOTE, any(c.measured_is_rss for c in cells)),
                                             (RESERVED_NOTE, any(c.measured_is_reserved for c in cells))) if shown]
    return "\n".join([head, *rows, *notes])


def plotting_available() -> bool:
    """matplotlib is an optional install (the `plots` extra); the table needs none of it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    """matplotlib.pyplot drawing to files, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_beside(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: hides no point


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_throughput_vs_memory(cells: list[Cell], path: Path) -> Path:
    """One labelled point per cell: what a cell costs in memory against what it delivers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for c in cells:
        memory = c.measured_gb if c.measured_gb is not None else c.predicted_gb
        if memory is None or c.tokens_per_s is None:
            continue
        ax.scatter(memory, c.tokens_per_s, s=40)
        ax.annotate(c.name, (memory, c.tokens_per_s), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.set(xlabel="peak memory (GB, measured; predicted where not measured)", ylabel="tokens/s",
           title="Throughput against peak memory, one point per sweep cell")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_memory_breakdown(cells: list[Cell], path: Path) -> Path:
    """The predicted peak of each cell, stacked by term, with the measured peak as a marker."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(cells) + 2), 5.5))
    x = range(len(cells))
    bottom = [0.0] * len(cells)
    for term in BREAKDOWN:
        heights = [c.memory.get(f"mem_pred/{term}_gb", 0.0) for c in cells]
        ax.bar(x, heights, bottom=bottom, label=term.replace("_total", "").replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    measured = [(i, c.measured_gb) for i, c in enumerate(cells) if c.measured_gb is not None]
    if measured:
        rss = any(c.measured_is_rss for c in cells)
        ax.scatter(*zip(*measured), marker="_", s=600, color="black", zorder=3,
                   label="measured: process peak RSS (CPU)" if rss else "measured peak")
    ax.set_xticks(list(x), [c.name for c in cells], rotation=35, ha="right", fontsize=7)
    ax.set(ylabel="GB", title="Peak memory by term (predicted) and measured")
    _legend_beside(ax)
    return _save(plt, fig, path)


def plot_loss_curves(cells: list[Cell], path: Path) -> Path:
    """Train loss (the mean over each log interval) and validation loss against tokens, one line per cell, in the
    same colour in both panels: what a precision or checkpointing choice does to learning."""
    plt = _pyplot()
    fig, (train, val) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for i, c in enumerate(cells):
        train.plot(*c.series("train/loss", "tokens"), color=f"C{i % 10}", label=c.name)
        val.plot(*c.series("val/loss", "tokens"), color=f"C{i % 10}", marker="o", label=c.name)
    train.set(xlabel="tokens", ylabel="loss", title="train loss")
    val.set(xlabel="tokens", title="validation loss")
    for ax in (train, val):
        ax.grid(alpha=0.3)
    _legend_beside(val)
    return _save(plt, fig, path)


def plot_loss_scale(cells: list[Cell], path: Path) -> Path:
    """For the cells with dynamic loss scaling: the loss scale, and the optimizer steps skipped so far (inf/NaN
    gradients), against step; each cell in the colour it has in the loss curves."""
    plt = _pyplot()
    fig, (scale, skipped) = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    for i, c in enumerate(cells):
        if c.loss_scaled:
            scale.plot(*c.series("amp/loss_scale"), color=f"C{i % 10}", label=c.name)
            skipped.step(*c.series("amp/skipped_steps"), where="post", color=f"C{i % 10}", label=c.name)
    scale.set(xlabel="step", ylabel="loss scale", yscale="log", title="loss scale")
    skipped.set(xlabel="step", ylabel="steps", title="skipped steps, in all so far")
    for ax in (scale, skipped):
        ax.grid(alpha=0.3)
    _legend_beside(skipped)
    return _save(plt, fig, path)


TABLE_COLUMNS = ("cell", "tokens_per_s", "mfu", "hfu", "predicted_gb", "measured_gb", "measured_is_rss",
                 "measured_is_reserved", "predicted_over_measured", "final_loss")


def log_to_wandb(sweep_dir: Path, files: dict[str, Path], cells: list[Cell], table_md: str, mode: str,
                 project: str) -> None:
    """The table (one row per cell, as numbers) and the plots into a `report` run in the sweep's wandb group
    (trainer.RunInfo's group name)."""
    import wandb

    sweep_dir = Path(sweep_dir).resolve()
    run = wandb.init(project=project, group=f"{sweep_dir.parent.name}_{sweep_dir.name}", job_type="report",
                     name="report", mode=mode, dir=str(sweep_dir))
    rows = [[c.name if column == "cell" else getattr(c, column) for column in TABLE_COLUMNS] for c in cells]
    run.log({"sweep": wandb.Table(columns=list(TABLE_COLUMNS), data=rows),
             **{name: wandb.Image(str(path)) for name, path in files.items()}})
    run.summary["report_markdown"] = table_md
    run.finish()


def write_report(sweep_dir: Path, out_dir: Optional[Path] = None, wandb_mode: Optional[str] = None,
                 project: str = "minitrain") -> dict[str, Path]:
    """report.md, throughput_vs_memory.png, memory_breakdown.png, loss_curves.png and (with a loss-scaled cell)
    loss_scale.png in `out_dir` (default: the sweep dir); the PNGs only where matplotlib is installed.
    wandb_mode (offline | online): also log the table and plots to wandb; None: only if the jobs of a sweep
    logged to wandb."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ReportError(f"{sweep_dir} is not a directory: give the directory of a sweep "
                          "(runs/multirun/<date>/<time>) or of a run (runs/<date>/<time>)")
    out_dir = Path(out_dir or sweep_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells, failed = load_sweep(sweep_dir)
    if not cells:
        raise ReportError(f"no <job>/metrics.jsonl under {sweep_dir}: give the directory of a sweep "
                          "(`train.py -m ...` writes runs/multirun/<date>/<time>/<job>/) or of a run")
    table = markdown_table(cells)
    if failed:
        table += "\n\nDid not finish:\n" + "".join(f"- {name}: {error}\n" for name, error in failed)
    plots = {}
    if plotting_available():
        plots = {"throughput_vs_memory": plot_throughput_vs_memory(cells, out_dir / "throughput_vs_memory.png"),
                 "memory_breakdown": plot_memory_breakdown(cells, out_dir / "memory_breakdown.png"),
                 "loss_curves": plot_loss_curves(cells, out_dir / "loss_curves.png")}
        if any(c.loss_scaled for c in cells):
            plots["loss_scale"] = plot_loss_scale(cells, out_dir / "loss_scale.png")
    report = out_dir / "report.md"
    kind = "Run" if is_run_dir(sweep_dir) else "Sweep"
    report.write_text(f"# {kind} report: {sweep_dir}\n\n{table}\n\n"
                      + "".join(f"![{name}]({path.name})\n" for name, path in plots.items()))
    if wandb_mode is None and kind == "Sweep" and any(sweep_dir.rglob("wandb")):
        wandb_mode = "offline"
    if wandb_mode:
        log_to_wandb(sweep_dir, plots, cells, table, wandb_mode, project)
    return {"report": report, **plots}
