"""Data-parallel scaling on one host: 1 GPU vs N GPUs under ddp and fsdp, through the trainer's own code
(`scripts/bench_distributed.py` is its command line and each rank's entry point).

For each model, three runs of `minitrain.trainer.Trainer` (precision=bf16, fused loss and AdamW), each
launched by torchrun: 1 GPU (distributed=none), N GPUs with ddp, N GPUs with fsdp. The micro-batch per GPU is fixed
(weak scaling: the global batch is N x the micro-batch), so N x the single-GPU tokens/s is perfect scaling. Each rank
reports its peak allocated memory and the bytes its optimizer state occupies (fp32 masters + Adam m, v as allocated),
beside the memory model's prediction of the same terms. Checkpoints are not written (a 1.5b one is ~20 GB):
trainer.save_every=0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from minitrain.tools import bench

REPO = Path(__file__).resolve().parents[3]

GB = 1e9
STEPS = {"gpt2-124m": 30, "gpt2-1.5b": 16}
MODES = [("none", 1), ("ddp", None), ("fsdp", None)]  # None: --gpus


def overrides(model: str, mode: str, world: int, micro_batch: int, steps: int, out_dir: str,
              extra: list[str]) -> list[str]:
    log_every = steps // 3
    return [f"model={model}", "precision=bf16", "loss=fused", "optimizer.impl=fused", f"distributed={mode}",
            f"trainer.batch_size={micro_batch * world}", f"trainer.max_steps={steps}",
            f"trainer.log_every={log_every}", f"trainer.eval_every={steps}", "trainer.eval_batches=1",
            "trainer.save_every=0", "trainer.sample_tokens=0", "trainer.warmup_steps=2", "trainer.lr=3e-4",
            "trainer.min_lr=3e-5", "logger.mode=disabled", f"trainer.out_dir={out_dir}", *extra]


def worker(part: str, run_overrides: list[str]) -> None:
    """One rank of one run: train, then write what this rank measured to `part`.rank<N>.json."""
    import torch
    from minitrain import distributed
    from minitrain.cli import compose_config
    from minitrain.trainer import Trainer

    trainer = Trainer(compose_config(run_overrides), progress=False)
    record = trainer.fit()
    # fp32 masters + Adam m, v as allocated; under fsdp the fp32 param shards are the masters.
    state = sum(b.state.exp_avg.nbytes + b.state.exp_avg_sq.nbytes
                + (b.state.master.nbytes if b.state.master is not None else
                   sum(p.nbytes for p in b.params) if trainer.dist.sharded else 0) for b in trainer.optimizer.buckets)
    est = trainer.plan.memory
    peak = torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else 0.0
    measured = {"rank": trainer.dist.rank, "tokens_per_s": record["perf/tokens_per_s"], "mfu": record.get("perf/mfu"),
                "peak_allocated_gb": peak, "optimizer_state_gb": state / GB,
                "optimizer_state_pred_gb": (est.masters + est.adam_m + est.adam_v) / GB,
                "peak_pred_gb": est.peak / GB, "loss": record["train/loss"]}
    Path(f"{part}.rank{trainer.dist.rank}.json").write_text(json.dumps(measured))
    distributed.teardown(finished=True)


def launch(script: Path, model: str, mode: str, world: int, args, part: Path, extra: str = "") -> dict:
    """One torchrun job of `script --worker` (scripts/bench_distributed.py), its run dir and rank reports at `part`;
    `extra`: space-separated config overrides, shown beside the mode."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(script), "--worker", "--part", str(part), "--overrides",
           *overrides(model, mode, world, args.micro_batch, args.steps or STEPS[model], str(part), extra.split())]
    mode = f"{mode} {extra.replace('distributed.', '')}".strip()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "4"})
    if out.returncode != 0:
        print(out.stderr[-4000:], file=sys.stderr)
        return {"model": model, "mode": mode, "gpus": world, "error": f"exit {out.returncode}"}
    ranks = [json.loads(Path(f"{part}.rank{r}.json").read_text()) for r in range(world)]
    r0 = ranks[0]
    return {"model": model, "mode": mode, "gpus": world, "tokens_per_s": r0["tokens_per_s"], "mfu": r0["mfu"],
            "loss": r0["loss"], "peak_allocated_gb": [r["peak_allocated_gb"] for r in ranks],
            "peak_pred_gb": r0["peak_pred_gb"], "optimizer_state_gb": [r["optimizer_state_gb"] for r in ranks],
            "optimizer_state_pred_gb": r0["optimizer_state_pred_gb"]}


def _speedup(row: dict, rows: list[dict]) -> float | None:
    """tokens/s over the same model's one-GPU row: N x 1.00 is perfect scaling."""
    single = next((r.get("tokens_per_s") for r in rows if r["model"] == row["model"] and r["gpus"] == 1), None)
    return row["tokens_per_s"] / single if single and "tokens_per_s" in row else None


def table(rows: list[dict]) -> list[str]:
    def worst(key: str, predicted: str) -> Callable[[dict], str | None]:
        return lambda r: f"{max(r[key]):.2f} ({r[predicted]:.2f})" if key in r else None

    columns = (bench.Column("model", "model"), bench.Column("mode", "mode"), bench.Column("gpus", "gpus", "d"),
               bench.Column("tok/s", "tokens_per_s", ",.0f"),
               bench.Column("x 1 GPU", lambda r: _speedup(r, rows), ".2f"), bench.Column("MFU", "mfu", ".1%"),
               bench.Column("peak GB/GPU (pred)", worst("peak_allocated_gb", "peak_pred_gb"), "s"),
               bench.Column("opt state GB/GPU (pred)", worst("optimizer_state_gb", "optimizer_state_pred_gb"), "s"))
    return bench.table(rows, columns, note=lambda r: r.get("error", ""))


def run(script: Path, args) -> list[dict]:
    """Every model's runs (one GPU, then each mode on --gpus, then the fsdp ablations), a row each, the results
    written to args.out after each run (kept if a later one overruns the call)."""
    from minitrain.cli import resolve_data
    from minitrain.data import prepare_data

    prepare_data(resolve_data([]), 1024, progress=False)  # build the data cache once, before any rank needs it
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            runs = [(mode, world, "") for mode, world in MODES if mode in args.modes]
            runs += [("fsdp", None, extra) for extra in args.fsdp_ablate]
            for mode, world, extra in runs:
                rows.append(launch(script, model, mode, world or args.gpus, args, Path(scratch) / f"run{len(rows)}",
                                   extra))
                print(table(rows)[-1], flush=True)
                bench.write_results(args.out, {"rows": rows})
    return rows
