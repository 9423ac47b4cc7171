import json
import runpy
import shutil
import subprocess
import sys

import pytest

from minitrain.tools import report
from minitrain.tools.report import PLOTS_SKIPPED, RSS_NOTE, load_sweep, write_report

from conftest import REPO

CELLS = {"0_precision=fp32,checkpointing=none": (["precision=fp32", "checkpointing=none", "trainer.max_steps=3"],
                                                 [900.0, 1000.0, 1100.0], 6.0, 5.5),
         "1_precision=bf16,checkpointing=full": (["precision=bf16", "checkpointing=full", "trainer.max_steps=3"],
                                                 [1500.0, 2500.0, 2700.0], 2.0, 2.2)}


PLAN = {"plan": {"precision": "bf16", "micro_batch": 8, "grad_accum": 2}}


TOKENS_PER_STEP = 64


def fabricate_sweep(root):
    """Job dirs as the trainer writes them: .hydra/overrides.yaml, metrics.jsonl (the run's plan first,
    then one record per log step), memory.json."""
    for job, (overrides, tokens_per_s, predicted, measured) in CELLS.items():
        d = root / job
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        records = [{"step": i + 1, "tokens": (i + 1) * TOKENS_PER_STEP, "train/loss": 5.0 - i,
                    "amp/skipped_steps": 0.0, "perf/tokens_per_s": t, "perf/mfu": t / 1e4, "perf/hfu": t / 8e3}
                   for i, t in enumerate(tokens_per_s)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [PLAN, *records]))
        terms = {"weights": 0.1, "grads": 0.1, "masters": 0.2, "adam_m": 0.2, "adam_v": 0.2}
        (d / "memory.json").write_text(json.dumps({
            **{f"mem_pred/{k}_gb": v for k, v in terms.items()}, "mem_pred/activations_total_gb": predicted - 1.0,
            "mem_pred/transient_gb": 0.2, "mem_pred/peak_gb": predicted, "mem/peak_allocated_gb": measured}))


def test_a_cell_that_did_not_run_is_listed_under_the_table(tmp_path):
    fabricate_sweep(tmp_path)
    failed = tmp_path / "2_precision=fp16,checkpointing=none"
    (failed / ".hydra").mkdir(parents=True)
    (failed / ".hydra" / "overrides.yaml").write_text("- precision=fp16\n- checkpointing=none\n- trainer.max_steps=3\n")
    (failed / "error.txt").write_text("the step does not fit\n")
    cells, not_run = load_sweep(tmp_path)
    assert len(cells) == 2 and not_run == [("precision=fp16,checkpointing=none", "the step does not fit")]
    md = write_report(tmp_path, out_dir=tmp_path / "out", wandb_mode=None)["report"].read_text()
    assert "Did not finish:\n- precision=fp16,checkpointing=none: the step does not fit\n" in md


def test_report_from_fabricated_sweep(tmp_path):
    fabricate_sweep(tmp_path)
    cells, failed = load_sweep(tmp_path)
    assert failed == []
    assert [c.name for c in cells] == ["precision=fp32,checkpointing=none", "precision=bf16,checkpointing=full"]
    assert [r["step"] for r in cells[0].records] == [1, 2, 3]  # the plan record is not a step
    assert cells[0].tokens_per_s == 1000.0  # median over every interval (the trainer leaves warm-up out)
    assert cells[1].final_loss == 3.0 and cells[1].measured_gb == 2.2
    files = write_report(tmp_path, out_dir=tmp_path / "out", wandb_mode=None)
    md = files["report"].read_text()
    assert "| precision=bf16,checkpointing=full | 2,500 | 25.0% | 31.2% | 2.000 | 2.200 | 0.909 | 3.0000 |" in md
    for name in ("throughput_vs_memory", "memory_breakdown", "loss_curves"):
        assert files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss_scale" not in files  # no cell scales its loss


def test_a_cpu_runs_rss_is_shown_as_such_and_not_divided_into_the_prediction(tmp_path):
    fabricate_sweep(tmp_path)
    cpu = tmp_path / "1_precision=bf16,checkpointing=full" / "memory.json"
    memory = json.loads(cpu.read_text())
    memory["mem/peak_rss_gb"] = memory.pop("mem/peak_allocated_gb")
    cpu.write_text(json.dumps(memory))
    cells, _ = load_sweep(tmp_path)
    assert [c.measured_is_rss for c in cells] == [False, True] and cells[1].measured_gb == 2.2
    md = write_report(tmp_path, out_dir=tmp_path / "out", wandb_mode=None)["report"].read_text()
    assert "| precision=fp32,checkpointing=none | 1,000 | 10.0% | 12.5% | 6.000 | 5.500 | 1.091 | 3.0000 |" in md
    assert "| precision=bf16,checkpointing=full | 2,500 | 25.0% | 31.2% | 2.000 | 2.200 (peak RSS) | — | 3.0000 |" in md
    assert RSS_NOTE in md


def test_a_cuda_graphed_cell_is_measured_by_its_peak_reserved(tmp_path):
    """Under CUDA graphs the graphs' tensors sit in a pool the allocated counter misses (the trainer's memory line
    compares reserved then); the report must set the prediction beside the same counter."""
    fabricate_sweep(tmp_path)
    graphed = tmp_path / "1_precision=bf16,checkpointing=full"
    lines = (graphed / "metrics.jsonl").read_text().splitlines()
    (graphed / "metrics.jsonl").write_text("\n".join([json.dumps({"plan": {**PLAN["plan"], "cuda_graphs": True}}),
                                                      *lines[1:]]) + "\n")
    memory = json.loads((graphed / "memory.json").read_text())
    (graphed / "memory.json").write_text(json.dumps({**memory, "mem/peak_reserved_gb": 2.5}))
    cells, _ = load_sweep(tmp_path)
    assert [c.measured_is_reserved for c in cells] == [False, True] and cells[1].measured_gb == 2.5
    md = write_report(tmp_path, out_dir=tmp_path / "out", wandb_mode=None)["report"].read_text()
    assert "| precision=bf16,checkpointing=full | 2,500 | 25.0% | 31.2% | 2.000 | 2.500 (reserved) | 0.800 |" in md
    assert "| precision=fp32,checkpointing=none | 1,000 | 10.0% | 12.5% | 6.000 | 5.500 | 1.091 |" in md
    assert report.RESERVED_NOTE in md


def test_report_without_matplotlib_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    fabricate_sweep(tmp_path)
    files = write_report(tmp_path, wandb_mode=None)
    assert list(files) == ["report"] and not list(tmp_path.glob("*.png"))
    assert "| precision=bf16,checkpointing=full | 2,500 |" in files["report"].read_text()


def test_training_and_the_report_table_import_no_matplotlib():
    code = ("import sys, minitrain.trainer, minitrain.tools.report; "
            "sys.exit('matplotlib' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_report_script_names_a_dir_without_a_sweep(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "report.py"), str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"error: no <job>/metrics.jsonl under {tmp_path}" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_run_dir_is_reported_as_one_cell(tmp_path):
    fabricate_sweep(tmp_path)
    run = tmp_path / "1_precision=bf16,checkpointing=full"
    cells, failed = load_sweep(run)
    assert [c.name for c in cells] == [run.name] and failed == []
    md = write_report(run, out_dir=tmp_path / "out", wandb_mode=None)["report"].read_text()
    assert md.startswith(f"# Run report: {run}\n")
    assert f"| {run.name} | 2,500 |" in md


def test_report_script_refuses_a_missing_dir_without_creating_it(tmp_path):
    missing = tmp_path / "runs" / "multirun" / "typo"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "report.py"), str(missing)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"error: {missing} is not a directory" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_report_logs_plots_to_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    fabricate_sweep(tmp_path)
    write_report(tmp_path, wandb_mode="offline")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert sorted(p.name.split("_0_")[0] for p in runs[0].rglob("*.png")) == \
        ["loss_curves", "memory_breakdown", "throughput_vs_memory"]
    table = json.loads(next(runs[0].rglob("sweep_*.table.json")).read_text())  # the table, as numbers
    assert table["data"][1][:2] == ["precision=bf16,checkpointing=full", 2500.0]
    assert table["data"][1][table["columns"].index("predicted_over_measured")] == pytest.approx(2.0 / 2.2)


def test_report_on_a_real_cpu_multirun(data_cache, tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "-m", "precision=fp32", "checkpointing=none,selective",
           "trainer.max_steps=2", "trainer.log_every=1", "trainer.batch_size=4", "model.block_size=32",
           "trainer.warmup_steps=1", "trainer.eval_batches=1", "trainer.sample_tokens=0",
           f"data.cache_dir={data_cache}", "logger.mode=disabled", f"hydra.sweep.dir={sweep}"]
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, timeout=600)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "report.py"), str(sweep)],
                         check=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "report.md" in out.stdout and "| checkpointing=selective |" in out.stdout
    assert PLOTS_SKIPPED not in out.stdout
    md = (sweep / "report.md").read_text()
    assert "| checkpointing=none |" in md and "| checkpointing=selective |" in md
    assert (sweep / "throughput_vs_memory.png").exists() and (sweep / "memory_breakdown.png").exists()


def fp16_cell(root, name="2_precision=fp16,checkpointing=none"):
    """A loss-scaled cell: amp/loss_scale in its log records, a step skipped (the scale halved), a validation
    record of its own between log steps (step only), and a loss that went non-finite (logged as null)."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("- precision=fp16\n- checkpointing=none\n- trainer.max_steps=3\n")
    records = [{"step": 2, "tokens": 2 * TOKENS_PER_STEP, "train/loss": 6.0, "amp/loss_scale": 65536.0,
                "amp/skipped_steps": 0.0},
               {"step": 3, "val/loss": 5.5},
               {"step": 4, "tokens": 4 * TOKENS_PER_STEP, "train/loss": None, "amp/loss_scale": 32768.0,
                "amp/skipped_steps": 1.0, "val/loss": 5.25}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [PLAN, *records]))


def test_loss_curves_are_against_tokens_one_line_per_cell(tmp_path, monkeypatch):
    fabricate_sweep(tmp_path)
    fp16_cell(tmp_path)
    cells, _ = load_sweep(tmp_path)
    fp16 = cells[2]
    # the evaluation between log steps is placed at its tokens too; the null loss is left out
    assert fp16.series("val/loss", "tokens") == ([3 * TOKENS_PER_STEP, 4 * TOKENS_PER_STEP], [5.5, 5.25])
    assert fp16.series("train/loss", "tokens") == ([2 * TOKENS_PER_STEP], [6.0])
    assert [c.loss_scaled for c in cells] == [False, False, True]
    monkeypatch.setattr(report, "_save", lambda plt, fig, path: fig)  # the figure itself, to read its lines
    train, val = report.plot_loss_curves(cells, tmp_path / "loss_curves.png").axes
    assert [list(line.get_xdata()) for line in train.lines] == [[64, 128, 192], [64, 128, 192], [128]]
    assert [list(line.get_ydata()) for line in train.lines] == [[5.0, 4.0, 3.0], [5.0, 4.0, 3.0], [6.0]]
    assert [len(line.get_xdata()) for line in val.lines] == [0, 0, 2]
    assert [line.get_color() for line in train.lines] == [line.get_color() for line in val.lines]


def test_loss_scale_and_skipped_steps_of_the_loss_scaled_cells_only(tmp_path, monkeypatch):
    fabricate_sweep(tmp_path)
    fp16_cell(tmp_path)
    cells, _ = load_sweep(tmp_path)
    monkeypatch.setattr(report, "_save", lambda plt, fig, path: fig)
    scale, skipped = report.plot_loss_scale(cells, tmp_path / "loss_scale.png").axes
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in scale.lines] == \
        [([2, 4], [65536.0, 32768.0])]
    assert [list(line.get_ydata()) for line in skipped.lines] == [[0.0, 1.0]]
    curves = report.plot_loss_curves(cells, tmp_path / "loss_curves.png").axes[0]
    assert scale.lines[0].get_color() == curves.lines[2].get_color()  # the cell's colour in the loss curves
    monkeypatch.undo()
    files = write_report(tmp_path, out_dir=tmp_path / "out", wandb_mode=None)
    assert files["loss_scale"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![loss_scale](loss_scale.png)" in files["report"].read_text()


def test_cells_of_one_setting_run_twice_are_told_apart_by_job(tmp_path):
    fabricate_sweep(tmp_path)
    again = tmp_path / "2_again"
    shutil.copytree(tmp_path / "1_precision=bf16,checkpointing=full", again)
    cells, _ = load_sweep(tmp_path)
    assert [c.name for c in cells] == ["precision=fp32,checkpointing=none",
                                       "precision=bf16,checkpointing=full #1_precision=bf16,checkpointing=full",
                                       "precision=bf16,checkpointing=full #2_again"]


def report_main(capsys, *argv) -> tuple[int, str, str]:
    """scripts/report.py's main(argv) in this process: (exit code, stdout, stderr)."""
    code = runpy.run_path(str(REPO / "scripts" / "report.py"))["main"]([str(arg) for arg in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_report_script_prints_the_report_and_writes_it_where_out_says(tmp_path, capsys):
    sweep, elsewhere = tmp_path / "sweep", tmp_path / "elsewhere"
    fabricate_sweep(sweep)
    code, out, _ = report_main(capsys, sweep, "--out", elsewhere)
    written = {"report": "report.md", "throughput_vs_memory": "throughput_vs_memory.png",
               "memory_breakdown": "memory_breakdown.png", "loss_curves": "loss_curves.png"}
    md = (elsewhere / "report.md").read_text()
    assert code == 0 and md.startswith(f"# Sweep report: {sweep}\n")
    assert out == md + "\n" + "".join(f"{name}: {elsewhere / file}\n" for name, file in written.items())
    assert sorted(p.name for p in sweep.iterdir() if p.is_file()) == []  # nothing written into the sweep
    code, out, _ = report_main(capsys, sweep)  # by default, into the sweep dir
    assert code == 0 and (sweep / "report.md").read_text() == md and f"report: {sweep / 'report.md'}\n" in out
    assert not (sweep / "wandb").exists()  # no --wandb and no job logged to wandb: nothing logged


def test_report_script_logs_to_wandb_in_the_project_given(tmp_path, capsys, monkeypatch):
    """--wandb offline logs a sweep whose jobs did not, into --project; without --wandb, a sweep whose jobs logged
    to wandb is logged offline, into the minitrain project."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    runs, init = [], wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append((kw["mode"], kw["project"])) or init(**kw))
    sweep = tmp_path / "sweep"
    fabricate_sweep(sweep)
    assert report_main(capsys, sweep, "--wandb", "offline", "--project", "my-sweeps")[0] == 0
    assert runs == [("offline", "my-sweeps")] and len(list((sweep / "wandb").glob("offline-run-*"))) == 1
    shutil.rmtree(sweep / "wandb")
    (sweep / "0_precision=fp32,checkpointing=none" / "wandb").mkdir()  # a job that logged to wandb
    assert report_main(capsys, sweep)[0] == 0
    assert runs[1:] == [("offline", "minitrain")] and len(list((sweep / "wandb").glob("offline-run-*"))) == 1
    with pytest.raises(SystemExit) as exit:
        report_main(capsys, sweep, "--wandb", "sometimes")
    assert exit.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
