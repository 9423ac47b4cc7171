import gc
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint, rundir
from minitrain.divergence import NonFiniteLossError
from minitrain.errors import ConfigError
from minitrain.progress import Progress
from minitrain.trainer import Trainer, set_expandable_segments, train

from conftest import REPO, round_trip, saved_state

CPU = torch.device("cpu")
SMALL_MODEL = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "trainer.eval_batches=1",
               "trainer.sample_tokens=0")


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_identical(a, b, where="state"):
    """Bitwise equality of nested dicts / lists / tensors (an optimizer's state_dict)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loss_drops_on_default_corpus(make_cfg, tmp_path):
    record = train(make_cfg("trainer.max_steps=100", "trainer.log_every=20", "trainer.eval_every=100",
                            "trainer.save_every=100", "trainer.batch_size=16", "trainer.lr=3e-3"), progress=False)
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    first, last = records[0]["train/loss"], records[-1]["train/loss"]
    assert last < first - 0.5, (first, last)
    assert record["val/loss"] < math.log(4096) - 1.5  # from chance (ln vocab) to well below it
    assert (tmp_path / "run" / "sample.txt").read_text().startswith("def ")


def test_grad_accum_does_not_change_the_math(make_cfg, tmp_path):
    runs = []
    norms = []
    for micro in (8, 2):  # the global batch of 8 in one micro-batch, then in 4
        t = Trainer(make_cfg("trainer.max_steps=3", f"trainer.micro_batch={micro}",
                             f"trainer.out_dir={tmp_path / str(micro)}"), progress=False)
        assert t.plan.grad_accum == 8 // micro
        t.train_step(0)  # the norm the first step clipped with: sensitive to how micro-batch losses are scaled
        norms.append(float(t.optimizer.stats()["grad_norm"]))
        t.fit()
        runs.append(params(t))
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    for k in runs[0]:
        torch.testing.assert_close(runs[0][k], runs[1][k], rtol=1e-4, atol=1e-5)


def test_step_loss_is_the_mean_over_micro_batches(make_cfg, tmp_path):
    """The loss a step returns (and the run logs) is the global batch's mean, however it is split."""
    losses = []
    for micro in (8, 2):
        t = Trainer(make_cfg(*SMALL_MODEL, f"trainer.micro_batch={micro}", f"trainer.out_dir={tmp_path / str(micro)}"),
                    progress=False)
        losses.append(t.train_step(0).item())
        t.close()
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_logged_lr_is_the_lr_each_step_ran_at(make_cfg, tmp_path, monkeypatch):
    """Warmup over 3 steps: step 1 runs at lr/3, and each step's logged opt/lr is the lr it ran at."""
    t = Trainer(make_cfg(*SMALL_MODEL, "trainer.max_steps=5", "trainer.warmup_steps=3", "trainer.log_every=1",
                         "trainer.eval_every=100", "trainer.save_every=100"), progress=False)
    ran_at, set_lr = [], t.optimizer.set_lr

    def recording(lr):
        ran_at.append(lr)
        set_lr(lr)

    monkeypatch.setattr(t.optimizer, "set_lr", recording)
    t.fit()
    logged = [r["opt/lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert ran_at[0] == pytest.approx(t.cfg.trainer.lr / 3)
    assert logged == ran_at



def test_an_eval_step_between_log_steps_logs_its_evaluation_alone(make_cfg, tmp_path):
    """log_every=2, eval_every=3 over 4 steps: step 3 evaluates without logging, so its record holds the evaluation
    only, not step 2's training numbers again under step 3; the last step logs and evaluates."""
    train(make_cfg(*SMALL_MODEL, "trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=3",
                   "trainer.save_every=100"), progress=False)
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert [r["step"] for r in records] == [2, 3, 4]
    assert set(records[1]) == {"step", "val/loss", "val/ppl"}
    assert "val/loss" not in records[0] and {"train/loss", "val/loss"} <= set(records[2])

@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16_no_master", "amp_bf16"])
def test_precision_modes_train(make_cfg, precision, tmp_path):
    t = Trainer(make_cfg(f"precision={precision}", "trainer.max_steps=5", "trainer.log_every=5", "trainer.lr=3e-3"),
                progress=False)
    dtype = {"amp_bf16": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)
    assert t.model.wte.weight.dtype == dtype
    record = t.fit()
    # Untrained, the model scores chance on the validation tokens, ln 4096 = 8.32 (8.35 at init); these five steps
    # reach about 7.5 in every precision. The bound lies halfway: a step whose update never reaches the weights
    # (masters not copied back, updates swamped, every step skipped) cannot meet it.
    assert record["val/loss"] < math.log(t.plan.model.vocab_size) - 0.4
    assert record["amp/skipped_steps"] < 5  # the steps ran (fp16 may skip an overflow or two, not all)


def test_muon_trains_the_hidden_matrices_and_the_plan_says_so(make_cfg):
    """optimizer=muon with bf16 masters: the blocks' 16 matrices take Muon at its own lr, scaled by the schedule as
    trainer.lr is, the rest AdamW at trainer.lr; the plan names both lrs; five steps reach the bound every AdamW
    precision meets."""
    from minitrain.optim import Muon

    t = Trainer(make_cfg("optimizer=muon", "precision=bf16", "trainer.max_steps=5", "trainer.log_every=5",
                         "trainer.lr=3e-3", "trainer.min_lr=3e-4", "optimizer.muon.lr=0.03"), progress=False)
    said = t.plan.describe()
    assert "optimizer=foreach muon" in said and "lr 0.003 -> 0.0003 (Muon's 0.03 -> 0.003)" in said
    opt = t.optimizer
    assert isinstance(opt, Muon)
    assert [p for b in opt.muon_buckets for p in b.owners] and \
        {id(p) for b in opt.muon_buckets for p in b.owners} == {id(p) for p in t.model.hidden_matrices()}
    assert len(t.model.hidden_matrices()) == 4 * t.model.cfg.n_layer
    assert {id(p) for b in opt.adamw_buckets for p in b.owners} == \
        {id(p) for p in t.model.parameters()} - {id(p) for p in t.model.hidden_matrices()}
    record = t.fit()
    assert record["val/loss"] < math.log(t.plan.model.vocab_size) - 0.4
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([record["opt/lr"] * 10] + [record["opt/lr"]])


@pytest.mark.parametrize("overrides, scaled", [
    (["precision=fp32"], False), (["precision=bf16"], False), (["precision=fp32", "optimizer.impl=torch"], False),
    (["precision=fp16"], True),
    (["precision=fp32", "precision.autocast_dtype=fp16", "precision.loss_scaling=true", "optimizer.impl=torch"], True),
])
def test_the_loss_scale_is_logged_only_with_loss_scaling(make_cfg, overrides, scaled):
    """Without dynamic loss scaling there is no scale: no `scale 1` on every console line, nor in the records.
    The skipped steps are counted in every precision."""
    t = Trainer(make_cfg(*overrides, "trainer.max_steps=2", "trainer.log_every=1", "trainer.sample_tokens=0"),
                progress=False)
    last = t.fit()
    records = [r for r in strict_records(t.out_dir / "metrics.jsonl") if "step" in r] + [last]
    assert [("amp/loss_scale" in r, "amp/skipped_steps" in r) for r in records] == [(scaled, True)] * 3
    lines = [line for line in (t.out_dir / "train.log").read_text().splitlines() if line.startswith("step")]
    assert [(" scale " in line, " skipped " in line) for line in lines] == [(scaled, True)] * 2


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(make_cfg, tmp_path, monkeypatch):
    t = Trainer(make_cfg("trainer.max_steps=20", "trainer.save_every=5", "trainer.log_every=5"), progress=False)
    real = t.train_step.forward_loss

    def poisoned(x, y):
        loss = real(x, y)
        return loss * float("nan") if t.step >= 7 else loss

    monkeypatch.setattr(t.train_step, "forward_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match="inf/NaN"):
        t.fit()
    state = saved_state(checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.LATEST)
    assert state["progress"]["step"] == 5
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_single_nan_loss_stops_an_fp32_run(make_cfg, monkeypatch):
    """Without loss scaling an inf/NaN loss is divergence, not an overflow to back off from: one such step stops
    the run at the next log step, though it skipped fewer than max_skipped_steps steps."""
    t = Trainer(make_cfg(*SMALL_MODEL, "precision=fp32", "trainer.max_steps=10", "trainer.log_every=5"),
                progress=False)
    real = t.train_step.forward_loss

    def one_nan(x, y):
        loss = real(x, y)
        return loss * float("nan") if t.step == 2 else loss

    monkeypatch.setattr(t.train_step, "forward_loss", one_nan)
    with pytest.raises(NonFiniteLossError, match="loss became inf/NaN by step 5"):
        t.fit()


def test_wandb_offline_run_holds_the_metrics(make_cfg, tmp_path):
    train(make_cfg("logger.mode=offline", "trainer.max_steps=4", "trainer.log_every=2"), progress=False)
    run_dir = tmp_path / "run"
    records = read_jsonl(run_dir / "metrics.jsonl")
    for key in ("train/loss", "opt/lr", "opt/grad_norm", "perf/tokens_per_s", "perf/step_ms", "mem/peak_rss_gb"):
        assert key in records[-1], key
    assert records[-1]["perf/tokens_per_s"] > 0 and records[-1]["mem/peak_rss_gb"] > 0
    # Offline runs keep their history in the run's binary .wandb log (protobuf records), where the
    # metric keys are stored verbatim. wandb's service may still be writing it after run.finish() (under
    # load the file once held only its header); its shutdown, which atexit runs in train.py, flushes it.
    import wandb

    wandb.teardown()
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    history = logs[0].read_bytes()
    for key in ("train/loss", "perf/tokens_per_s", "mem/peak_rss_gb"):
        assert key.encode() in history, key


def test_a_run_refused_by_the_lock_leaves_the_holders_record_alone(data_cache, tmp_path):
    """.hydra/ holds the config of the run that owns the dir: a second run, refused at the lock, must not
    overwrite it (Hydra writes its copy before any code of ours runs)."""
    from minitrain.rundir import RunDirLock

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- the holder's\n")
    with RunDirLock(run_dir):
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "trainer.max_steps=2",
                              f"data.cache_dir={data_cache}", "logger.mode=disabled", f"hydra.run.dir={run_dir}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pid" in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["overrides.yaml"]
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- the holder's\n"


def test_a_sweep_cell_refused_by_anothers_lock_leaves_that_runs_record_alone(data_cache, tmp_path):
    from minitrain.rundir import RunDirLock

    cell = tmp_path / "sweep" / "0"
    (cell / ".hydra").mkdir(parents=True)
    (cell / ".hydra" / "overrides.yaml").write_text("- the holder's\n")
    with RunDirLock(cell):
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "-m", "trainer.max_steps=2,3",
                              f"data.cache_dir={data_cache}", "logger.mode=disabled",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
    assert out.returncode != 0 and "pid" in out.stderr, out.stderr[-2000:]
    assert (cell / ".hydra" / "overrides.yaml").read_text() == "- the holder's\n"
    assert not (cell / "error.txt").exists()


def test_a_run_dir_through_a_file_fails_at_start_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), f"trainer.out_dir={tmp_path}/a-file/run",
                          "logger.mode=disabled", f"hydra.run.dir={tmp_path / 'hydra'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"error: trainer.out_dir: cannot use {tmp_path}/a-file/run as the run dir" in out.stderr


@pytest.mark.parametrize("argv, error", [
    (["trainer.max_step=10"], "trainer.max_step is not a setting of trainer; did you mean trainer.max_steps?"),
    (["-m", "trainer.max_steps=10,lots"],  # a sweep stops before its first cell
     "trainer.max_steps: Value 'lots' of type 'str' could not be converted to Integer"),
])
def test_an_unknown_key_or_a_mistyped_value_fails_before_hydra_in_one_line(tmp_path, argv, error):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), *argv],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (2, f"error: {error}\n")
    assert list(tmp_path.iterdir()) == []  # before Hydra made a run dir


@pytest.mark.parametrize("out_dir, run_dir, made", [
    ("myrun", "myrun", ["myrun"]),
    # an interpolation Hydra's run dir cannot follow: runs/<date>/<time>/ is made, and goes again at the end
    ("myrun/${trainer.seed}", "myrun/1337", ["myrun", "runs"]),
])
def test_trainer_out_dir_is_the_only_dir_a_run_makes(data_cache, tmp_path, out_dir, run_dir, made):
    """Hydra makes its run dir (runs/<date>/<time>/ by default) before the trainer reads trainer.out_dir."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), f"trainer.out_dir={out_dir}",
                          "trainer.max_steps=1", "trainer.batch_size=2", "model.n_layer=1", "model.block_size=32",
                          "trainer.eval_batches=1", "trainer.sample_tokens=0", f"data.cache_dir={data_cache}",
                          "logger.mode=disabled"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == made and not list((tmp_path / "runs").glob("*"))
    assert (tmp_path / run_dir / "metrics.jsonl").exists() and (tmp_path / run_dir / "checkpoints").is_dir()



def test_a_trainer_out_dir_under_the_home_directory_is_expanded(make_cfg, tmp_path, monkeypatch):
    """trainer.out_dir=~/runs/a is $HOME/runs/a (where Hydra's run dir follows it), not ./~/runs/a: a resume looks
    where the run wrote."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    Trainer(make_cfg(*SMALL_MODEL, "trainer.out_dir='~/runs/a'"), progress=False).close()
    assert (tmp_path / "home" / "runs" / "a" / rundir.TOKENIZER).exists() and not (tmp_path / "~").exists()

@pytest.mark.parametrize("override, error", [
    ("trainer.batch_size=0", "trainer.batch_size: must be >= 1, got 0"),
    # the override itself holds the interpolation: reading the command line back must not resolve it
    ("trainer.out_dir=${oc.env:MINITRAIN_UNSET_VARIABLE}", "trainer.out_dir: KeyError raised while resolving "
     "interpolation: \"Environment variable 'MINITRAIN_UNSET_VARIABLE' not found\""),
])
def test_a_run_refused_at_start_leaves_no_run_dir(tmp_path, override, error):
    """Hydra makes runs/<date>/<time>/ before the config's checks: a run they refuse removes it again."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), override],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (2, f"error: {error}\n")
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("runs")]


def test_a_run_refused_after_it_took_its_run_dir_leaves_no_run_dir(data_cache, tmp_path):
    """A resume refused once the run dir is locked (data loaded, model built) removes the lock file it made too."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "trainer.resume=nope",
                          f"data.cache_dir={data_cache}", "logger.mode=disabled"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines()[-1] == "error: trainer.resume='nope': no checkpoint at nope", \
        out.stderr[-2000:]  # after the data's progress bars
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("runs")]


def test_bad_config_fails_at_start_with_the_key(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "model.n_head=5",
                          f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "model.n_embd" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are only observable on CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_step_never_syncs_with_the_host(make_cfg, precision):
    """The whole step — data, forward, fused loss, backward, fused AdamW, loss scaling — queues work
    without waiting on the GPU: device values reach the host at log steps only."""
    t = Trainer(make_cfg(f"precision={precision}", "trainer.device=cuda", "loss=fused", "optimizer.impl=fused"),
                progress=False)
    t.train_step(0)  # first-call work (kernel compilation, workspace allocation) happens once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            t.train_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("on", [True, False])
def test_expandable_segments_setting_reaches_the_allocator(monkeypatch, on):
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    set_expandable_segments(on)
    assert settings == [f"expandable_segments:{on}"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator")
def test_cuda_trainer_params_live_in_segments_of_its_setting(make_cfg, tmp_path):
    """trainer.expandable_segments is applied before the model's first tensor: its weights sit in segments of
    that kind, whatever the setting of the run before it in this process."""
    for on in (False, True, False):
        t = Trainer(make_cfg(*SMALL_MODEL, "model.n_embd=256", "trainer.device=cuda",
                             f"trainer.expandable_segments={on}", f"trainer.out_dir={tmp_path / str(on)}"),
                    progress=False)
        segments = torch.cuda.memory_snapshot()
        weight = max(t.model.parameters(), key=lambda p: p.untyped_storage().nbytes())  # > 1 MiB: the large pool
        segment, = [s for s in segments if s["address"] <= weight.data_ptr() < s["address"] + s["total_size"]]
        assert segment["is_expandable"] == on
        t.close()
        del t, weight, segment
        gc.collect()  # the trainer's reference cycles, then its segments
        torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_steps_match_the_plain_compiled_ones(make_cfg, tmp_path):
    """compile_mode=reduce-overhead replays forward and backward as CUDA graphs whose outputs live in a pool
    reused by the next replay. With two micro-batches the first one's gradients (graph outputs, kept as
    p.grad) must survive the second's replay; the step must stay free of host syncs. Selective checkpointing:
    the policy with the most moving parts under compile."""
    common = ("precision=bf16", "trainer.device=cuda", "trainer.compile=true", "trainer.micro_batch=4",
              "loss=fused", "optimizer.impl=fused", "checkpointing=selective")
    runs = {}
    for mode in ("default", "reduce-overhead"):
        t = Trainer(make_cfg(*common, f"trainer.compile_mode={mode}", f"trainer.out_dir={tmp_path / mode}"),
                    progress=False)
        losses = [t.train_step(step) for step in range(3)]  # graphs are recorded in the first calls
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses += [t.train_step(step) for step in range(3, 6)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs[mode] = torch.stack(losses), [p.detach().float().clone() for p in t.model.parameters()]
    (plain_losses, plain_params), (graph_losses, graph_params) = runs["default"], runs["reduce-overhead"]
    torch.testing.assert_close(graph_losses, plain_losses, rtol=1e-3, atol=1e-3)
    for graph, plain in zip(graph_params, plain_params):
        torch.testing.assert_close(graph, plain, rtol=0, atol=2e-2)


def test_evaluate_reads_each_loss_before_the_next_call(make_cfg):
    """As under CUDA graphs, where each replay writes its output into the same memory: evaluate must not
    keep a call's output past the next call."""
    t = Trainer(make_cfg("trainer.eval_batches=3"), progress=False)
    graph_output, calls = torch.zeros(()), iter([1.0, 2.0, 6.0])

    def replay(x, y):
        return graph_output.fill_(next(calls))

    t.parts.forward_loss = replay
    assert t.evaluate() == pytest.approx(3.0)


def test_vocab_larger_than_the_model_fails_naming_both(make_cfg):
    with pytest.raises(ConfigError, match=r"model\.vocab_size=512 is smaller than the tokenizer's vocabulary \(4096"):
        Trainer(make_cfg("model.vocab_size=512"), progress=False)


def test_train_py_says_in_its_plan_what_a_vocabulary_beyond_the_tokenizer_costs(data_cache, tmp_path):
    """As a user runs it: the plan (console and train.log) names the rows no token has, their share of the step
    and the setting that sizes them away (tests/test_plan.py checks the share itself)."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "model.vocab_size=4160",
                          "trainer.max_steps=1", "trainer.batch_size=2", "model.block_size=32", "trainer.eval_batches=1",
                          "trainer.sample_tokens=0", f"data.cache_dir={data_cache}", "logger.mode=disabled",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    note = re.compile(r"  note: model\.vocab_size=4160 scores 64 rows more than the tokenizer's 4,096 ids need \(padded "
                      r"to 4,096\): logits of tokens that never occur, \d+\.\d% of the step's FLOPs; "
                      r"model\.vocab_size=null sizes the vocabulary to the tokenizer")
    for said in (out.stdout, (tmp_path / "run" / "train.log").read_text()):
        assert len([line for line in said.splitlines() if note.fullmatch(line)]) == 1, said[:3000]


def strict_records(path):
    """metrics.jsonl as strict JSON: a bare NaN or Infinity fails here."""
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def deterministic(records):
    keep = ("step", "tokens", "train/loss", "val/loss", "opt/lr", "opt/grad_norm", "amp/loss_scale", "amp/skipped_steps")
    return [{k: r[k] for k in keep if k in r} for r in records if "step" in r]


def crash_at(trainer, crash_step, monkeypatch):
    """Fit `trainer` until its step `crash_step` raises, as a crash after the last checkpoint would."""
    real_step = trainer.train_step

    def step_then_crash(step):
        if step == crash_step:
            raise RuntimeError("simulated crash")
        return real_step(step)

    monkeypatch.setattr(trainer.parts, "train_step", step_then_crash)
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.fit()


@pytest.mark.parametrize("precision, extra", [
    ("fp32", ["model.dropout=0.1"]),  # dropout: the RNG state must come back
    ("fp16", ["model.dropout=0.1", "precision.growth_interval=2"]),  # the scaler's growth tracker is non-zero
    # Muon's momentum beside AdamW's moments (a narrower model: Newton-Schulz's bf16 GEMMs are slow on a CPU)
    ("fp16", ["optimizer=muon", "model.n_layer=2", "model.n_embd=64", "precision.growth_interval=2"]),
])
def test_resume_restores_every_part_and_the_logged_metrics(make_cfg, tmp_path, monkeypatch, precision, extra):
    """log_every=4, save_every=6: the crash at step 9 loses steps 7-9 and the running loss of steps 5-6, which the
    resumed run must log exactly as the unbroken one did (no record twice)."""
    overrides = (f"precision={precision}", *extra, "trainer.max_steps=12", "trainer.save_every=6",
                 "trainer.log_every=4", "trainer.eval_every=12")
    straight = Trainer(make_cfg(*overrides, f"trainer.out_dir={tmp_path / 'straight'}"), progress=False)
    straight.fit()

    crash_dir = tmp_path / "crashed"
    crash_at(Trainer(make_cfg(*overrides, f"trainer.out_dir={crash_dir}"), progress=False), 9, monkeypatch)
    resumed = Trainer(make_cfg(*overrides, f"trainer.out_dir={crash_dir}", "trainer.resume=auto"), progress=False)
    assert resumed.step == 6
    resumed.fit()
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_identical(straight.optimizer.state_dict(), resumed.optimizer.state_dict())
    logged = [deterministic(strict_records(d / "metrics.jsonl")) for d in (tmp_path / "straight", crash_dir)]
    assert logged[0] == logged[1] and [r["step"] for r in logged[1]] == [4, 8, 12]


def record_steps(progress, steps, losses, skipped_totals):
    for s in steps:
        progress.record(torch.tensor(losses[s]), torch.tensor(skipped_totals[s], dtype=torch.int32))


def test_progress_resumed_mid_log_window_logs_what_an_unbroken_one_does():
    """Logging every 4 steps, a checkpoint after step 6, two steps into a log window and into a run of skipped
    steps: the resumed loop's next mean loss and its skip bookkeeping must equal the unbroken loop's."""
    losses = [5.0, 4.0, 3.5, 3.0, 2.75, 2.5, 2.25, 2.0]
    skipped = [0, 0, 0, 0, 1, 2, 3, 3]  # the optimizer's count after each step: steps 5, 6 and 7 skipped in a row
    straight = Progress(CPU)
    record_steps(straight, range(4), losses, skipped)
    straight.take_mean_loss()
    record_steps(straight, range(4, 8), losses, skipped)

    crashed = Progress(CPU)
    record_steps(crashed, range(4), losses, skipped)
    crashed.take_mean_loss()
    record_steps(crashed, range(4, 6), losses, skipped)
    resumed = Progress(CPU)
    resumed.load_state_dict(round_trip(crashed.state_dict()))
    assert resumed.last_loss.item() == losses[5]  # the loss a diverged run names for this checkpoint
    record_steps(resumed, range(6, 8), losses, skipped)

    assert resumed.step == straight.step == 8
    assert resumed.take_mean_loss().item() == straight.take_mean_loss().item() == pytest.approx(2.375)
    assert resumed.longest_skip_run.item() == straight.longest_skip_run.item() == 3
    for key in ("skip_run", "skipped_seen"):
        assert getattr(resumed, key).item() == getattr(straight, key).item(), key


def test_skip_run_counts_skips_in_a_row_only():
    """Sporadic skips (an fp16 scaler backing off now and then) are not a diverged run; skips in a row are."""
    progress = Progress(CPU)
    skipped = [1, 1, 2, 2, 3, 3, 4, 5, 6]  # skipped: steps 1, 3, 5, then 7, 8, 9 in a row
    record_steps(progress, range(6), [1.0] * 9, skipped)
    assert progress.longest_skip_run.item() == 1
    record_steps(progress, range(6, 9), [1.0] * 9, skipped)
    assert progress.longest_skip_run.item() == 3 and progress.skip_run.item() == 3


def test_a_second_run_in_the_same_dir_is_refused_naming_the_holder(make_cfg):
    import os

    first = Trainer(make_cfg(), progress=False)
    with pytest.raises(rundir.RunDirBusyError, match=f"pid {os.getpid()}"):
        Trainer(make_cfg(), progress=False)
    first.close()
    Trainer(make_cfg(), progress=False).close()  # free again once the holder is done


def test_resume_refuses_a_different_run_and_accepts_a_longer_one(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=4", "trainer.save_every=4"), progress=False)
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer\.lr: saved 0\.001, now 0\.002"):
        Trainer(make_cfg("trainer.max_steps=4", "trainer.lr=2e-3", "trainer.resume=auto"), progress=False)
    with pytest.raises(checkpoint.CheckpointError, match="trainer.resume=auto"):  # a fresh start would overwrite it
        Trainer(make_cfg("trainer.max_steps=4"), progress=False)
    longer = Trainer(make_cfg("trainer.max_steps=6", "trainer.resume=auto"), progress=False)
    assert longer.step == 4
    longer.fit()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "trainer.max_steps" in log and "resumed from" in log


def test_a_run_ends_with_where_its_results_are_and_a_finished_run_started_again_trains_nothing(make_cfg, tmp_path):
    run = tmp_path / "run"
    record = train(make_cfg("trainer.max_steps=4", "trainer.save_every=4"), progress=False)
    last = (run / "train.log").read_text().splitlines()[-1]
    assert last == (f"finished: step 4 of 4, loss {record['train/loss']:.4f}, val {record['val/loss']:.4f} | "
                    f"checkpoint {run / 'checkpoints' / 'latest'} | metrics {run / 'metrics.jsonl'}")
    memory_json, sample = (run / "memory.json").read_text(), (run / "sample.txt").read_text()
    assert "mem/peak_rss_gb" in memory_json
    again = train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"), progress=False)
    assert again == {"step": 4}
    assert "nothing to train: the checkpoint is at step 4 and trainer.max_steps=4" in (run / "train.log").read_text()
    assert (run / "memory.json").read_text() == memory_json and (run / "sample.txt").read_text() == sample


def test_a_fresh_run_in_a_dir_whose_run_saved_no_checkpoint_starts_the_metrics_again(make_cfg, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"plan": {}}\n{"step": 5, "train/loss": 9.0}\n{"step": 10, "train/lo')
    train(make_cfg("trainer.max_steps=4", "trainer.save_every=4"), progress=False)
    assert [r.get("step") for r in read_jsonl(run / "metrics.jsonl")] == [None, 4]
    assert "metrics.jsonl: dropped 1 log record(s) of an earlier run here that saved no checkpoint" in \
        (run / "train.log").read_text()


def test_the_continue_command_repeats_the_runs_overrides():
    from minitrain.rundir import RunInfo

    run = RunInfo(name="r", overrides=["model.n_layer=2", "data.paths=my corpus/*.txt", "trainer.resume=none"])
    assert run.continue_command(Path("/runs/r")) == (
        "python scripts/train.py model.n_layer=2 'data.paths=my corpus/*.txt' trainer.resume=auto hydra.run.dir=/runs/r")
    assert run.continue_command(Path("/runs/r"), torchrun=True).startswith("torchrun <its arguments> scripts/train.py ")
    assert RunInfo().continue_command(Path("/runs/r")) == \
        "trainer.resume=auto hydra.run.dir=/runs/r and this run's other settings"


def test_a_diverged_run_stops_with_a_clear_message_and_valid_json(data_cache, tmp_path):
    """lr=1e4: the gradients are inf/NaN from the second step and every step after is skipped."""
    run = tmp_path / "diverged"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "trainer.lr=1e4", "trainer.min_lr=0",
                          "trainer.max_steps=30", "trainer.log_every=5", "trainer.save_every=100",
                          "trainer.batch_size=4", "model.block_size=32", "trainer.sample_tokens=0",
                          f"data.cache_dir={data_cache}", "logger.mode=disabled", f"hydra.run.dir={run}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "skipped" in out.stderr and "Traceback" not in out.stderr
    records = strict_records(run / "metrics.jsonl")  # the NaN grad norm is written as null
    assert not (run / "checkpoints").exists() and not (run / "sample.txt").exists()
    assert all("step" not in r or r["step"] <= 5 for r in records)


def test_ctrl_c_saves_a_checkpoint_after_the_step_and_the_run_continues_from_it(make_cfg, monkeypatch):
    import os
    import signal

    from minitrain.interrupts import TrainingInterrupted

    from minitrain.rundir import RunInfo

    t = Trainer(make_cfg("trainer.max_steps=10"), RunInfo(name="run", overrides=["trainer.max_steps=10"]),
                progress=False)
    real_step = t.train_step

    def interrupted_at_3(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the step runs
        return real_step(step)

    monkeypatch.setattr(t.parts, "train_step", interrupted_at_3)
    with pytest.raises(TrainingInterrupted, match=re.escape(
            f"continue with: python scripts/train.py trainer.max_steps=10 trainer.resume=auto hydra.run.dir={t.out_dir}")):
        t.fit()
    resumed = Trainer(make_cfg("trainer.max_steps=10", "trainer.resume=auto"), progress=False)
    assert resumed.step == 4
    resumed.close()


def test_save_every_0_writes_no_checkpoint_at_the_cadence_the_end_or_a_ctrl_c(make_cfg, monkeypatch):
    """trainer.save_every=0 (a benchmark's run): no checkpoint at the last step, nor at a stop request, whose
    message then names the setting instead of a continue command."""
    import os
    import signal

    from minitrain.interrupts import TrainingInterrupted

    t = Trainer(make_cfg("trainer.max_steps=4", "trainer.save_every=0", "trainer.sample_tokens=0"), progress=False)
    assert t.fit()["step"] == 4 and not checkpoint.checkpoint_dir(t.out_dir).exists()
    t = Trainer(make_cfg("trainer.max_steps=10", "trainer.save_every=0", "trainer.resume=auto"), progress=False)
    real_step = t.train_step

    def interrupted_at_3(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(step)

    monkeypatch.setattr(t.parts, "train_step", interrupted_at_3)
    with pytest.raises(TrainingInterrupted, match=r"stopped at step 4 of 10; no checkpoint saved "
                                                  r"\(trainer\.save_every=0\)$"):
        t.fit()
    assert not checkpoint.checkpoint_dir(t.out_dir).exists()


def test_the_trainers_batches_check_token_ids_against_the_tokenizer(make_cfg, monkeypatch):
    t = Trainer(make_cfg(), progress=False)
    try:
        for batches in (t.train_batches, t.val_batches):
            assert (batches.vocab_size, batches.cache_path) == (t.data.vocab_size, t.data.path)
    finally:
        t.close()


def test_tokens_per_s_leaves_out_the_processes_first_steps(make_cfg, monkeypatch):
    """The first step of an eager process (and the first three compiled ones) is warm-up: a log interval of
    nothing else reports no rate, the next one only its own steps."""
    from minitrain import metrics

    t = Trainer(make_cfg("trainer.max_steps=3", "trainer.log_every=1", "trainer.sample_tokens=0"), progress=False)
    real_step, now = t.train_step, [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])

    def timed_step(step):
        now[0] += 100.0 if step == 0 else 1.0  # the warm-up step takes long
        return real_step(step)

    monkeypatch.setattr(t.parts, "train_step", timed_step)
    t.fit()
    records = [r for r in read_jsonl(t.out_dir / "metrics.jsonl") if "step" in r]
    assert "perf/step_ms" not in records[0]
    assert records[1]["perf/step_ms"] == pytest.approx(1000.0)


def test_a_compiled_run_says_its_first_steps_compile(make_cfg, tmp_path, monkeypatch):
    """Said before the first step, where the compile's minutes go (the step itself is not run here)."""

    class FirstStep(Exception):
        pass

    def first_step(step):
        raise FirstStep

    import dataclasses

    t = Trainer(make_cfg(), progress=False)
    t.plan = dataclasses.replace(t.plan, compile_mode="default")  # as planned with trainer.compile=true
    monkeypatch.setattr(t.parts, "train_step", first_step)
    with pytest.raises(FirstStep):
        t.fit()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "compiling: the first 3 steps build the compiled step; tokens/s leaves them out" in log


def test_a_copy_of_the_interrupt_within_a_moment_is_the_same_interrupt_a_later_one_aborts(monkeypatch):
    """Under torchrun the terminal's SIGINT and torchrun's forwarded copy arrive together: one request."""
    from minitrain import interrupts as interrupts_module
    from minitrain.distributed import Dist

    said, now = [], [100.0]
    monkeypatch.setattr(interrupts_module.time, "monotonic", lambda: now[0])
    interrupts = interrupts_module.Interrupts(said.append, Dist(), CPU)
    interrupts._handle(signal.SIGINT, None)
    now[0] += 0.9 * interrupts.SAME_INTERRUPT_S
    try:
        interrupts._handle(signal.SIGINT, None)  # the forwarded copy
    except KeyboardInterrupt:
        pytest.fail("torchrun's forwarded copy of the interrupt aborted the run")
    assert interrupts.requested and len(said) == 1 and "after this step" in said[0]
    now[0] += 0.2 * interrupts.SAME_INTERRUPT_S
    with pytest.raises(KeyboardInterrupt):
        interrupts._handle(signal.SIGINT, None)  # the user's second Ctrl-C


@pytest.mark.parametrize("saved_before", [False, True])
def test_ctrl_c_before_training_or_a_second_one_ends_in_one_line(tmp_path, saved_before):
    """Ctrl-C while the data, tokenizer or compiled step are being made (before fit's own handler is on), or a
    second Ctrl-C that aborts the checkpoint: one line and exit 130, not KeyboardInterrupt's traceback. It says
    that checkpoints saved before are kept only where the run dir holds some: before a first run's first step there
    are none, nor any run dir."""
    run_dir = tmp_path / "run" / "1337"  # the run's dir, not the one Hydra made before it resolved
    if saved_before:
        (checkpoint.checkpoint_dir(run_dir) / checkpoint.LATEST).mkdir(parents=True)
    stopped = ("import runpy, sys\nimport minitrain.trainer\n"
               "def interrupted(cfg, run):\n    raise KeyboardInterrupt\n"
               "minitrain.trainer.train = interrupted\n"
               f"sys.argv = ['train.py', 'trainer.out_dir={tmp_path}/run/${{trainer.seed}}']\n"
               f"runpy.run_path({str(REPO / 'scripts' / 'train.py')!r}, run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", stopped], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr[-2000:]
    kept = f"; the checkpoints saved before in {run_dir} are kept" if saved_before else ""
    assert out.stderr.strip().splitlines() == [f"minitrain: aborted (Ctrl-C) without saving a checkpoint{kept}"]


def test_sigterm_saves_a_checkpoint_after_the_step_and_exits_143(data_cache, tmp_path):
    """A scheduler's stop (SIGTERM, then SIGKILL after a grace period) loses no step."""
    import signal
    import time

    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), "trainer.max_steps=100000",
                            "trainer.log_every=2", "trainer.save_every=100000", "trainer.eval_every=100000",
                            "trainer.batch_size=4", "model.block_size=32", "trainer.warmup_steps=1",
                            f"data.cache_dir={data_cache}", "logger.mode=disabled", f"hydra.run.dir={run_dir}"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and '"step": 4' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM: saving a checkpoint after this step" in out and "Traceback" not in err
    step = int(re.search(r"stopped at step (\d+) of 100000", err).group(1))
    state = saved_state(checkpoint.checkpoint_dir(run_dir) / checkpoint.LATEST)
    assert state["progress"]["step"] == step >= 4


def test_fused_kernels_inside_a_trainer_match_the_torch_parts(make_cfg, tmp_path):
    """The Triton loss, optimizer and GELU (through the interpreter) wired into a whole run."""
    losses = {}
    for name, parts in {"torch": ("loss=torch", "optimizer.impl=foreach", "model.gelu=torch"),
                        "fused": ("loss=fused", "optimizer.impl=fused", "model.gelu=fused")}.items():
        t = Trainer(make_cfg(*parts, "trainer.max_steps=3", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                             "trainer.batch_size=4", "model.block_size=32", f"trainer.out_dir={tmp_path / name}"),
                    progress=False)
        assert (t.plan.loss_impl, t.plan.optimizer_impl) == (parts[0][5:], parts[1][15:])
        losses[name] = torch.stack([t.train_step(s) for s in range(3)])
        losses[name + "_norm"] = t.optimizer.stats()["grad_norm"].clone()
        t.close()
    torch.testing.assert_close(losses["fused"], losses["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(losses["fused_norm"], losses["torch_norm"], rtol=1e-3, atol=1e-5)
