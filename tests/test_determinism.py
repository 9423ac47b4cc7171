"""trainer.deterministic: the process-wide switches it sets, minitrain's own kernels without unordered sums, and
the end-to-end claim: two runs of one config, and a run SIGKILLed and resumed, end with the same bits.

The end-to-end test runs on the CPU here (the tiny model, eager) and on a GPU from `scripts/gpu_suite.sh OUT
determinism` (gpt2-124m, compiled with CUDA graphs, 30 steps), where it is the claim itself: a GPU's default step is
not reproducible bit for bit, and each switch of minitrain/determinism.py closes one way that it differs.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint, determinism
from minitrain.ops.cross_entropy_triton import cross_entropy_rows

from conftest import REPO, saved_state
from test_trainer import assert_identical, deterministic, strict_records

MAX_STEPS, LOG_EVERY, SAVE_EVERY = 30, 5, 10
KILL_AFTER_LOGGED = 15  # the step-10 checkpoint is saved by then; steps 11-15 are lost and must be redone


@pytest.fixture
def switches_restored(monkeypatch):
    """The switches are process-wide: each test leaves them as it found them."""
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, torch.backends.cuda.cudnn_sdp_enabled(), inductor_config.deterministic)
    yield inductor_config
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    torch.backends.cuda.enable_cudnn_sdp(before[3])
    inductor_config.deterministic = before[4]


def test_the_switches_are_set_and_cleared(switches_restored):
    inductor_config = switches_restored
    torch.backends.cudnn.benchmark = True
    determinism.apply(True)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert inductor_config.deterministic  # the same call switches Inductor's mode (torch >= 2.10)
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # its backward sums dQ in no fixed order
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
    determinism.apply(False)  # the next trainer of this process is a default one
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert torch.backends.cuda.cudnn_sdp_enabled() and not inductor_config.deterministic


def test_an_explicit_cublas_workspace_is_kept(switches_restored, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    determinism.apply(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_trainer_sets_them_as_its_config_says_and_its_plan_tells(make_cfg, tmp_path, switches_restored):
    from minitrain.trainer import Trainer

    for on in (True, False):  # one process, two trainers: the second one's default takes the switches back
        trainer = Trainer(make_cfg(f"trainer.deterministic={str(on).lower()}", f"trainer.out_dir={tmp_path / str(on)}"),
                          progress=False)
        trainer.close()
        assert torch.are_deterministic_algorithms_enabled() == on
        assert ("deterministic  yes" in trainer.plan.describe()) == on
        assert trainer.plan.as_dict()["deterministic"] == on


def test_no_triton_kernel_of_minitrain_sums_values_with_atomics():
    """An atomic add of values sums in the order the hardware finishes: such a kernel would need an ordered variant
    under trainer.deterministic (minitrain/determinism.py says none does). Counters and maxima are allowed: an
    arrival count (add 1), its re-arming (set 0) and a maximum (the float8 casts' amax) come out the same whatever
    the order."""
    kernels = [p for p in (REPO / "minitrain").rglob("*.py") if "@triton.jit" in p.read_text()]
    assert len(kernels) >= 3  # the loss, the optimizer, the GELU
    counter = re.compile(r"tl\.atomic_add\(\w+, 1[,)]|tl\.atomic_xchg\(\w+, 0\)|tl\.atomic_max\(")
    atomics = [(p.name, m.group(0)) for p in kernels
               for m in re.finditer(r"\btl\.atomic_\w+\([^)]*\)?", p.read_text())]
    assert [(name, call) for name, call in atomics if not counter.match(call)] == []


@pytest.mark.parametrize("programs", [1, 3])
def test_the_loss_rows_do_not_depend_on_how_many_programs_stream_them(programs):
    """On a GPU the row kernel's grid is a multiple of the SM count (another per GPU model): each row's loss,
    log-sum-exp and gradient must come out the same bits whatever the grid."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 300, generator=gen, device="cpu") * 4).to(torch.get_default_device())
    targets = torch.randint(0, 300, (7,), generator=gen, device="cpu").to(logits.device)
    targets[2] = -100

    def rows(programs):
        work, losses, lse = logits.clone(), logits.new_empty(7), logits.new_empty(7)
        cross_entropy_rows(work, targets, losses, lse, logits.new_tensor(1 / 6), ignore_index=-100,
                           label_smoothing=0.1, z_loss=1e-4, write_grad=True, programs=programs, block=128)
        return work, losses, lse

    for a, b in zip(rows(7), rows(programs)):  # one program per row against fewer, each looping over rows
        assert torch.equal(a, b)


# -- the end-to-end claim ----------------------------------------------------------------------------------------
def run_args(device: str, data_cache: Path) -> list[str]:
    short = [f"trainer.max_steps={MAX_STEPS}", f"trainer.log_every={LOG_EVERY}", f"trainer.save_every={SAVE_EVERY}",
             f"trainer.eval_every={SAVE_EVERY}", "trainer.eval_batches=2", "trainer.sample_tokens=0",
             "trainer.deterministic=true", "trainer.resume=auto", "logger.mode=disabled",
             f"data.cache_dir={data_cache}"]
    if device == "cuda":  # the default path: bf16, compiled, CUDA graphs, the fused kernels
        return ["model=gpt2-124m", "trainer.device=cuda", *short]
    return ["trainer.device=cpu", "trainer.batch_size=8", "model.block_size=64", *short]


def start(args: list[str], run_dir: Path) -> subprocess.Popen:
    """scripts/train.py in a process of its own. On the CPU with one intra-op thread: a loaded machine's spinning
    threads slow a step many times over."""
    cuda = "trainer.device=cuda" in args
    env = {**os.environ, "TRITON_INTERPRET": "0" if cuda else "1", **({} if cuda else {"OMP_NUM_THREADS": "1"}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # the run sets it itself
    log = open(run_dir.parent / f"{run_dir.name}.console", "a")
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), *args, f"hydra.run.dir={run_dir}"],
                            stdout=log, stderr=log, env=env)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line).get("step", 0) for line in lines if line.endswith("}")]  # a torn last line: not yet


def finish(process: subprocess.Popen, run_dir: Path) -> None:
    assert process.wait(timeout=600) == 0, (run_dir.parent / f"{run_dir.name}.console").read_text()[-3000:]


def final_state(run_dir: Path) -> dict:
    return saved_state(checkpoint.checkpoint_dir(run_dir) / checkpoint.LATEST)


def assert_same_bits(a: Path, b: Path) -> None:
    """Every logged value a step computes, and every tensor of the final checkpoint (not its config: the run dir)."""
    assert deterministic(strict_records(b / "metrics.jsonl")) == deterministic(strict_records(a / "metrics.jsonl"))
    first, second = final_state(a), final_state(b)
    assert first["progress"]["step"] == MAX_STEPS
    for part in ("model", "optimizer", "progress"):
        assert_identical(first[part], second[part], part)
    assert torch.equal(first["rng"]["torch"], second["rng"]["torch"])
    assert_identical(first["rng"]["cuda"], second["rng"]["cuda"], "cuda generators")


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_two_runs_and_a_killed_and_resumed_one_end_with_the_same_bits(data_cache, tmp_path, device):
    args = run_args(device, data_cache)
    for name in ("first", "second"):
        finish(start(args, tmp_path / name), tmp_path / name)
    assert_same_bits(tmp_path / "first", tmp_path / "second")

    killed = tmp_path / "killed"
    process, deadline = start(args, killed), time.monotonic() + 600
    while max(logged_steps(killed), default=0) < KILL_AFTER_LOGGED:
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert final_state(killed)["progress"]["step"] < MAX_STEPS  # killed before its end: it resumes from there
    finish(start(args, killed), killed)
    assert re.search(r"resumed from \S+ at step \d+", (killed / "train.log").read_text())
    assert_same_bits(tmp_path / "first", killed)
