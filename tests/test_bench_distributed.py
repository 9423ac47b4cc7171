"""minitrain/tools/benchmarks/distributed.py's logic on the CPU: the runs' command lines compose into the configs
they mean (weak scaling: the global batch is the world's micro-batches), and the table's scaling column is each
row's tokens/s over its model's one-GPU row."""

import pytest

from minitrain.cli import compose_config
from minitrain.config import DistributedMode, resolve
from minitrain.tools.benchmarks import distributed as bench_distributed


@pytest.mark.parametrize("mode, world", [("none", 1), ("ddp", 4), ("fsdp", 2)])
def test_a_runs_overrides_compose_into_its_mode_world_batch_and_steps(mode, world, tmp_path):
    cfg = resolve(compose_config(bench_distributed.overrides("tiny", mode, world, 3, 9, str(tmp_path),
                                                             ["distributed.fsdp_unit_blocks=1"])))
    assert cfg.distributed.mode == DistributedMode(mode) and cfg.distributed.fsdp_unit_blocks == 1
    assert (cfg.trainer.batch_size, cfg.trainer.max_steps, cfg.trainer.log_every) == (3 * world, 9, 3)
    assert cfg.trainer.out_dir == str(tmp_path) and cfg.logger.mode.value == "disabled"
    assert cfg.trainer.save_every == 0  # timing the step, not the disk (a gpt2-1.5b checkpoint is ~20 GB)


def row(model, mode, gpus, tokens_per_s, peaks=(1.0,)):
    return {"model": model, "mode": mode, "gpus": gpus, "tokens_per_s": tokens_per_s, "mfu": 0.25, "loss": 3.0,
            "peak_allocated_gb": list(peaks), "peak_pred_gb": 1.5, "optimizer_state_gb": [0.5] * len(peaks),
            "optimizer_state_pred_gb": 0.5}


def test_the_table_scales_each_row_by_its_own_models_one_gpu_row_and_shows_the_worst_ranks_peak():
    rows = [row("a", "none", 1, 100.0), row("b", "none", 1, 40.0), row("a", "ddp", 2, 190.0, peaks=(1.25, 2.75)),
            row("b", "fsdp", 2, 70.0), {"model": "a", "mode": "fsdp", "gpus": 2, "error": "exit 1"}]
    lines = bench_distributed.table(rows)
    cells = {(r["model"], r["mode"]): line.split() for r, line in zip(rows, lines[-len(rows):])}
    assert cells["a", "ddp"][4] == "1.90" and cells["b", "fsdp"][4] == "1.75" and cells["a", "none"][4] == "1.00"
    assert cells["a", "ddp"][6:8] == ["2.75", "(1.50)"]  # the rank with the largest peak, beside the prediction
    assert cells["a", "fsdp"][-2:] == ["exit", "1"]
