"""ddp and fsdp on the CPU (gloo), against the single-process run of the same global batch.

One 2-process job (torch.multiprocessing, the environment torchrun would set) runs every distributed
trainer these tests need, one after another in the same process group; each test then checks its
part against a reference computed in this process. The data cache is built here first, so the ranks
never race to build it.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from minitrain import distributed
from minitrain.cli import compose_config
from minitrain.trainer import Trainer

from conftest import REPO

WORLD = 2
TIMEOUT_S = 300  # bounds the whole 2-process job; a hang fails the test instead of the suite
COMMON = ("trainer.batch_size=8", "model.block_size=32", "trainer.max_steps=10", "trainer.log_every=1",
          "trainer.eval_every=10", "trainer.save_every=5", "trainer.sample_tokens=4", "distributed.timeout_s=60")
# optimizer=muon's runs: a narrower model (Newton-Schulz's bf16 GEMMs are slow on a CPU), whose matrices split into
# two row blocks of equal size under fsdp (uneven blocks: test_muon.py's Exchange test)
MUON = ("optimizer=muon", "model.n_layer=2", "model.n_embd=64")


def overrides(data_cache, out_dir, *extra):
    return [f"data.cache_dir={data_cache}", f"trainer.out_dir={out_dir}", "logger.mode=disabled",
            "trainer.warmup_steps=2", "trainer.eval_batches=2", *COMMON, *extra]


class Crash(Exception):
    pass


def full_params(trainer):
    """The whole model, gathered from the shards under fsdp (a collective: every rank calls it)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in trainer.model.state_dict().items()}


def run_job(trainer, job):
    """Run one trainer as the job asks; returns what this rank reports."""
    if job.get("crash_at") is not None:
        real_step = trainer.train_step

        def step_then_crash(step):
            if step == job["crash_at"]:
                raise Crash
            return real_step(step)

        trainer.parts.train_step = step_then_crash
    if job.get("overflow_at") is not None:  # an inf in one gradient of rank 1's shard only
        real_opt_step = trainer.optimizer.step

        def poisoned_step():
            if trainer.step == job["overflow_at"] and trainer.dist.rank == 1:
                grad = next(g for g in (p.grad for p in trainer.optimizer.buckets[0].owners)
                            if g is not None and (g.to_local() if hasattr(g, "to_local") else g).numel())
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
            real_opt_step()

        trainer.optimizer.step = poisoned_step
    try:
        trainer.fit()
    except Crash:
        return {"crashed_at": trainer.step}
    stats = trainer.optimizer.stats()
    state_bytes = sum(t.numel() * t.element_size() for b in trainer.optimizer.buckets
                      for t in vars(b.state).values() if isinstance(t, torch.Tensor))  # the flat buffers
    exchange = getattr(trainer.optimizer, "exchange", None)
    return {"skipped": int(stats["skipped_steps"]), "loss_scale": float(stats.get("loss_scale", "nan")),
            "optimizer_state_bytes": state_bytes, "params": full_params(trainer),
            "exchange": exchange.mode if exchange is not None else None}


def worker(rank, port, jobs, results_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    for name, job in jobs.items():
        report = run_job(Trainer(compose_config(job["overrides"]), progress=False), job)
        torch.save(report, f"{results_dir}/{name}.rank{rank}.pt")
    distributed.teardown(finished=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_losses(out_dir):
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r], [r["val/loss"] for r in records if "val/loss" in r]


@pytest.fixture(scope="module")
def runs(data_cache, tmp_path_factory):
    """The single-process reference and every 2-process job, run once for the module."""
    root = tmp_path_factory.mktemp("dist")
    reference = Trainer(compose_config(overrides(data_cache, root / "single")), progress=False)  # builds the cache
    reference.fit()
    crashing = Trainer(compose_config(overrides(data_cache, root / "from_single")), progress=False)
    assert run_job(crashing, {"crash_at": 7}) == {"crashed_at": 7}  # its checkpoint of step 5, for ddp to resume
    fsdp = overrides(data_cache, root / "fsdp", "distributed=fsdp")
    jobs = {
        "ddp": {"overrides": overrides(data_cache, root / "ddp", "distributed=ddp", "trainer.micro_batch=2",
                                       "checkpointing=full")},
        "fsdp": {"overrides": fsdp},
        # the fused AdamW (Triton's interpreter here) reading each rank's gradient shards in place; a unit per block
        "fsdp_fused": {"overrides": overrides(data_cache, root / "fsdp_fused", "distributed=fsdp",
                                              "optimizer.impl=fused", "distributed.fsdp_unit_blocks=1")},
        # blocks grouped 3 + 1 into FSDP units, kept gathered from forward to backward; selective's own block forward
        "fsdp_units": {"overrides": overrides(data_cache, root / "fsdp_units", "distributed=fsdp",
                                              "distributed.fsdp_unit_blocks=3", "distributed.reshard_after_forward=false",
                                              "checkpointing=selective")},
        # units of 3 + 1 blocks, resharded after forward, re-gathered for full checkpointing's recompute
        "fsdp_recompute": {"overrides": overrides(data_cache, root / "fsdp_recompute", "distributed=fsdp",
                                                  "distributed.fsdp_unit_blocks=3", "checkpointing=full")},
        "fsdp_crash": {"overrides": overrides(data_cache, root / "resumed", "distributed=fsdp"), "crash_at": 7},
        "fsdp_resumed": {"overrides": overrides(data_cache, root / "resumed", "distributed=fsdp",
                                                "trainer.resume=auto")},
        "fsdp_fp16": {"overrides": overrides(data_cache, root / "fp16", "distributed=fsdp", "precision=fp16",
                                             "trainer.max_steps=4"), "overflow_at": 2},
        # one checkpoint format for every world size: one process's resumed by two, two's by one (below)
        "ddp_from_single": {"overrides": overrides(data_cache, root / "from_single", "distributed=ddp",
                                                   "trainer.resume=auto")},
        "fsdp_to_single": {"overrides": overrides(data_cache, root / "to_single", "distributed=fsdp"), "crash_at": 7},
    }
    reports = run_jobs(root, jobs)
    resumed = Trainer(compose_config(overrides(data_cache, root / "to_single", "trainer.resume=auto")), progress=False)
    resumed.fit()
    reports["fsdp_to_single.resumed"] = {"params": full_params(resumed)}
    return root, reference, reports


def run_jobs(root, jobs: dict) -> dict:
    """Every job in one 2-process group, one after another; each rank's report by `job.rank`."""
    ctx = mp.start_processes(worker, args=(free_port(), jobs, str(root)), nprocs=WORLD, join=False,
                             start_method="spawn")
    for _ in range(TIMEOUT_S):
        if ctx.join(timeout=1):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail(f"the 2-process job did not finish in {TIMEOUT_S} s")
    return {f"{name}.{r}": torch.load(root / f"{name}.rank{r}.pt") for name in jobs for r in range(WORLD)}


@pytest.fixture(scope="module")
def muon_runs(data_cache, tmp_path_factory):
    """optimizer=muon: one process's run, and a 2-process job of its own: a share of the Newton-Schulz work per rank
    under ddp and under fsdp, on the fused kernels too; fsdp's checkpoint of step 5 resumed by two processes and by
    one."""
    root = tmp_path_factory.mktemp("dist-muon")
    single = Trainer(compose_config(overrides(data_cache, root / "muon", *MUON)), progress=False)
    single.fit()
    reports = run_jobs(root, {
        "ddp_muon": {"overrides": overrides(data_cache, root / "ddp_muon", "distributed=ddp", *MUON)},
        "fsdp_muon": {"overrides": overrides(data_cache, root / "fsdp_muon", "distributed=fsdp", *MUON)},
        "fsdp_muon_fused": {"overrides": overrides(data_cache, root / "fsdp_muon_fused", "distributed=fsdp",
                                                   "optimizer.impl=fused", *MUON)},
        "fsdp_muon_to_single": {"overrides": overrides(data_cache, root / "muon_to_single", "distributed=fsdp", *MUON),
                                "crash_at": 7},
        "fsdp_muon_crash": {"overrides": overrides(data_cache, root / "muon_resumed", "distributed=fsdp", *MUON),
                            "crash_at": 7},
        "fsdp_muon_resumed": {"overrides": overrides(data_cache, root / "muon_resumed", "distributed=fsdp",
                                                     "trainer.resume=auto", *MUON)}})
    resumed = Trainer(compose_config(overrides(data_cache, root / "muon_to_single", "trainer.resume=auto", *MUON)),
                      progress=False)
    resumed.fit()
    reports["fsdp_muon_to_single.resumed"] = {"params": full_params(resumed)}
    reports["muon"] = {"params": full_params(single)}
    return root, reports


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp_fused", "fsdp_units", "fsdp_recompute"])
def test_losses_match_the_single_process_run(runs, mode):
    root, reference, reports = runs
    train_ref, val_ref = read_losses(root / "single")
    train_dist, val_dist = read_losses(root / mode)
    assert len(train_dist) == len(train_ref) == 10
    torch.testing.assert_close(train_dist, train_ref, rtol=1e-5, atol=1e-5)
    if mode != "ddp":  # (eval batches are global micro-batches: ddp's micro-batch of 2 halves them)
        torch.testing.assert_close(val_dist, val_ref, rtol=1e-5, atol=1e-5)
    ref = full_params(reference)
    for rank in range(WORLD):
        params = reports[f"{mode}.{rank}"]["params"]
        for k in ref:
            torch.testing.assert_close(params[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {k}")


# How far apart two runs of one process and one global batch end when only the order of their gradient sums
# differs (micro-batches of 2 against 8): 1-2.3% relative distance in the attention matrices after 10 steps, since
# Newton-Schulz in bf16 amplifies a flipped rounding of its input (AdamW's runs end 1e-4 apart). A wrong update
# (another matrix's, a rank's rows misplaced) moves them by their whole 10 steps' movement, tens of percent.
MUON_RUNS_APART = 0.05


def assert_muon_params_close(params, ref, msg=""):
    for k in ref:
        distance = (torch.linalg.vector_norm(params[k] - ref[k]) / torch.linalg.vector_norm(ref[k])).item()
        assert distance <= MUON_RUNS_APART, f"{msg}{k}: {distance:.3g} apart (relative Frobenius distance)"


@pytest.mark.parametrize("mode, exchange", [("ddp_muon", "replicated"), ("fsdp_muon", "sharded"),
                                            ("fsdp_muon_fused", "sharded")])
def test_muon_matches_the_single_process_run(muon_runs, mode, exchange):
    """Muon's Newton-Schulz work shared by the ranks (ddp) or gathered from the shards (fsdp): the losses of one
    process's run, within the rounding of gradient sums added in another order, and its params as near as the same
    process's with another summation order (MUON_RUNS_APART); the ranks' params the same bits."""
    root, reports = muon_runs
    train_ref, val_ref = read_losses(root / "muon")
    train, val = read_losses(root / mode)
    assert len(train) == 10
    torch.testing.assert_close(train, train_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(val, val_ref, rtol=1e-5, atol=1e-5)
    for rank in range(WORLD):
        assert reports[f"{mode}.{rank}"]["exchange"] == exchange
        assert_muon_params_close(reports[f"{mode}.{rank}"]["params"], reports["muon"]["params"], f"rank {rank}: ")
    a, b = (reports[f"{mode}.{r}"]["params"] for r in range(WORLD))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_muon_fsdp_resume_reproduces_the_uninterrupted_run(muon_runs):
    """Killed at step 7, resumed from step 5's sharded momentum and moments: the same bits as the run never stopped."""
    root, reports = muon_runs
    straight, resumed = read_losses(root / "fsdp_muon"), read_losses(root / "muon_resumed")
    assert resumed[0][-3:] == straight[0][-3:] and resumed[1] == straight[1]
    for rank in range(WORLD):
        a, b = reports[f"fsdp_muon.{rank}"]["params"], reports[f"fsdp_muon_resumed.{rank}"]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_muon_fsdp_checkpoint_resumes_in_one_process(muon_runs):
    """fsdp's sharded momentum buffers and moments, resharded into one process's at step 5: steps 6-10 end within
    rounding of the unbroken run."""
    root, reports = muon_runs
    said = (root / "muon_to_single" / "train.log").read_text()
    assert "checkpoints/latest was saved by 2 processes, this run has 1" in said
    torch.testing.assert_close(read_losses(root / "muon_to_single")[0], read_losses(root / "muon")[0], rtol=1e-5,
                               atol=1e-5)
    assert_muon_params_close(reports["fsdp_muon_to_single.resumed"]["params"], reports["muon"]["params"])


def test_fsdp_ranks_each_hold_half_the_optimizer_state(runs):
    _, reference, reports = runs
    single = sum(t.numel() * 4 for b in reference.optimizer.buckets for t in (b.state.exp_avg, b.state.exp_avg_sq))
    for rank in range(WORLD):
        assert reports[f"ddp.{rank}"]["optimizer_state_bytes"] == single  # replicated
        held = reports[f"fsdp.{rank}"]["optimizer_state_bytes"]
        assert 0.49 < held / single < 0.52, held / single  # half, plus each shard's ALIGN padding


def test_fsdp_resume_reproduces_the_uninterrupted_run(runs):
    root, _, reports = runs
    assert reports["fsdp_crash.0"] == reports["fsdp_crash.1"] == {"crashed_at": 7}
    straight, resumed = read_losses(root / "fsdp"), read_losses(root / "resumed")
    assert resumed[0][-3:] == straight[0][-3:] and resumed[1] == straight[1]  # steps 8-10 and the eval
    for rank in range(WORLD):
        a, b = reports[f"fsdp.{rank}"]["params"], reports[f"fsdp_resumed.{rank}"]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("run, saved_by", [("from_single", "1 process, this run has 2"),
                                            ("to_single", "2 processes, this run has 1")])
def test_a_checkpoint_resumes_under_another_world_size_within_rounding_of_the_unbroken_run(runs, run, saved_by):
    """One process's checkpoint of step 5 resumed by ddp on two, and fsdp's on two resumed by one process: steps
    6-10 sum the same global batch's gradients in another order, so they end within rounding of the unbroken run."""
    root, reference, reports = runs
    said = (root / run / "train.log").read_text()
    assert "resumed from " in said and f"checkpoints/latest was saved by {saved_by}: the same global batch" in said
    train_ref, val_ref = read_losses(root / "single")
    train, val = read_losses(root / run)
    assert len(train) == 10  # steps 1-5 logged by the start that saved, 6-10 by the one that resumed
    torch.testing.assert_close(train, train_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(val, val_ref, rtol=1e-5, atol=1e-5)
    ref = full_params(reference)
    resumed = [reports[f"ddp_from_single.{r}"] for r in range(WORLD)] if run == "from_single" else \
        [reports["fsdp_to_single.resumed"]]
    for report in resumed:
        for k in ref:
            torch.testing.assert_close(report["params"][k], ref[k], rtol=1e-4, atol=1e-5, msg=k)


def test_fp16_overflow_on_one_rank_skips_the_step_on_both(runs):
    _, _, reports = runs
    for rank in range(WORLD):
        report = reports[f"fsdp_fp16.{rank}"]
        assert report["skipped"] == 1
        assert report["loss_scale"] == 65536.0 / 2  # backed off once, together
    a, b = (reports[f"fsdp_fp16.{r}"]["params"] for r in range(WORLD))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_launch(data_cache, tmp_path):
    """The command users run: torchrun + scripts/train.py, the run dir written by rank 0 only."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(REPO / "scripts" / "train.py"), "distributed=ddp", f"data.cache_dir={data_cache}",
           "logger.mode=disabled", "trainer.batch_size=4", "model.block_size=32", "trainer.max_steps=2",
           "trainer.warmup_steps=1", "trainer.log_every=1", "trainer.eval_batches=1", "trainer.sample_tokens=0",
           f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("plan: tiny on 2 x cpu (ddp)") == 1  # resolved on every rank, printed once
    assert "Callback" not in out.stderr  # the sweep's callback has nothing to say about a single run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    assert {"mem/rank0/peak_rss_gb", "mem/rank1/peak_rss_gb"} <= records[-1].keys()
    assert (run_dir / "checkpoints" / "latest" / ".metadata").exists()


def test_a_failing_rank_ends_the_job_with_a_clear_message(data_cache, tmp_path):
    """Rank 1 raises mid-run while rank 0 waits in the gradient all-reduce: the job must end, non-zero,
    saying which rank failed, instead of hanging."""
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(
        "import runpy, sys\n"
        "from minitrain.step import TrainStep\n"
        "real_step = TrainStep.__call__\n"
        "def train_step(self, step):\n"
        "    if step == 2 and self.dist.rank == 1:\n"
        "        raise RuntimeError('simulated failure')\n"
        "    return real_step(self, step)\n"
        "TrainStep.__call__ = train_step\n"
        f"sys.argv[0] = {str(REPO / 'scripts' / 'train.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", str(script),
           "distributed=ddp", f"data.cache_dir={data_cache}", "logger.mode=disabled", "trainer.batch_size=4",
           "model.block_size=32", "trainer.max_steps=5", "trainer.warmup_steps=1", "trainer.eval_batches=1",
           "trainer.sample_tokens=0", "distributed.timeout_s=30", f"hydra.run.dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    assert "rank 1 failed: RuntimeError: simulated failure" in out.stdout + out.stderr


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_under_torchrun_saves_at_the_next_log_step_reports_once_and_resumes(data_cache, tmp_path, how):
    """ctrl-c: the terminal's SIGINT reaches every worker, and torchrun forwards another within milliseconds:
    one interrupt, not the abort a second Ctrl-C asks for. sigterm: a scheduler stops torchrun alone, which
    forwards it. Either way the ranks stop together at the next log step with a sharded checkpoint, one of
    them says so, and the run continues from it."""
    run_dir = tmp_path / "run"

    def command(max_steps, *extra):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                str(REPO / "scripts" / "train.py"), "distributed=ddp", f"data.cache_dir={data_cache}",
                "logger.mode=disabled", "trainer.batch_size=4", "model.block_size=32", f"trainer.max_steps={max_steps}",
                "trainer.warmup_steps=1", "trainer.log_every=4", "trainer.save_every=100000",
                "trainer.eval_every=100000", "trainer.eval_batches=1", "trainer.sample_tokens=0",
                f"hydra.run.dir={run_dir}", *extra]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(command(100000), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # a process group of its own, as a terminal's job
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and '"step": 4' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if how == "ctrl-c":
        os.killpg(job.pid, signal.SIGINT)  # the whole foreground group
    else:
        job.send_signal(signal.SIGTERM)  # torchrun only
    out, _ = job.communicate(timeout=TIMEOUT_S)
    stopped = re.findall(r"stopped at step (\d+) of 100000", out)
    assert len(stopped) == 1, out[-3000:]  # every rank stopped; one said so
    step = int(stopped[0])
    assert step % 4 == 0 and step >= 4  # a log step (the signal may land just before step 4's agreement)
    assert "KeyboardInterrupt" not in out, out[-3000:]  # the forwarded copy did not abort the save
    assert json.loads((run_dir / "checkpoints" / "latest" / "minitrain.json").read_text())["world_size"] == WORLD
    resumed = subprocess.run(command(step + 1, "trainer.resume=auto"), cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout + resumed.stderr


def test_ddp_wraps_the_model_without_a_warning(tmp_path):
    """torch 2.13 deprecates DDP's broadcast_buffers (each rank printed a FutureWarning for it); the model holds no
    buffer, so DDP's default has nothing to broadcast either."""
    import warnings

    import torch.distributed as dist

    from minitrain.config import DistributedConfig, DistributedMode
    from minitrain.model import GPT
    from minitrain.model_config import ModelConfig
    from minitrain.ops import linear_cross_entropy_reference
    from minitrain.precision import preset, resolve_precision

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
        assert list(model.buffers()) == []
        ddp, fp32 = distributed.Dist(mode=DistributedMode.ddp), resolve_precision(preset("fp32"), torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            distributed.wrap(model, linear_cross_entropy_reference, fp32, DistributedConfig(mode=DistributedMode.ddp),
                             ddp)
    finally:
        distributed.teardown()
