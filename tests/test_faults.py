"""Fault injection for the whole run: `scripts/train.py` SIGKILLed at seeded random moments and at the
moments a resume must get right, restarted with trainer.resume=auto each time until it finishes, must end
exactly where an unbroken run ends — weights, optimizer state (masters, moments, step, skipped steps, loss
scaler), the generator dropout draws from, and every deterministic metric in metrics.jsonl, each step
logged once.

The kills are aimed at what a checkpoint has to carry or a restart has to repair: a save in progress (its
temporary left behind, or `latest` already renamed away), a checkpoint taken between two log steps (a
loss sum in flight), records logged after the last checkpoint (to be dropped and logged again), and under
fp16 a loss scaler part-way to its next growth. The test checks that these happened, and that every
restart resumed from the checkpoint the kill left: a run that silently started over would also end equal.
"""

import json
import os
import random
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from minitrain import checkpoint

from conftest import REPO, saved_state
from test_trainer import assert_identical, deterministic, strict_records

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="kills through pidfds (Linux)")

LOG_EVERY, SAVE_EVERY, EVAL_EVERY = 2, 3, 6  # saves at odd steps fall between two log steps
POLL_S = 0.001  # a save's temporary lasts as long as a small file's write and fsync
SAVE_WATCH_S = 0.2  # the longest a poll watches one save for the moment between its renames
START_TIMEOUT_S = 300
EXTRA_KILLS = 6  # retries for a kill that timing made miss its aim
RUNS_FOR_AIMS = 3  # killed runs, each in a fresh dir, until every aim has landed in one of them


def train_args(corpus: Path, data_cache: Path, max_steps: int, *extra: str) -> list[str]:
    """A model whose steps cost little next to a start; dropout, so the RNG state matters.
    One plan candidate (micro-batch and checkpointing pinned) and a small corpus: each start predicts the
    memory of every candidate and checks every corpus file against the token cache."""
    return ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.dropout=0.1",
            "trainer.batch_size=4", "trainer.micro_batch=4", "checkpointing=none", f"trainer.max_steps={max_steps}",
            f"trainer.log_every={LOG_EVERY}", f"trainer.save_every={SAVE_EVERY}", f"trainer.eval_every={EVAL_EVERY}",
            "trainer.eval_batches=1", "trainer.sample_tokens=0", "trainer.resume=auto", "logger.mode=disabled",
            "data=files", f"data.paths='{corpus}/*.py'", "data.vocab_size=512", f"data.cache_dir={data_cache}",
            *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few standard-library modules, copied once so that their mtimes (part of the cache key) stay put."""
    corpus = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap", "string", "fnmatch", "glob", "shlex", "bisect"):
        shutil.copy(Path(os.__file__).parent / f"{name}.py", corpus)
    return corpus


def checkout_env(**extra: str) -> dict[str, str]:
    """The environment of a process that runs this checkout's code."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **extra}


@dataclass
class Run:
    """One start of scripts/train.py. Its pidfd names this process only: a kill cannot reach another
    process that reused the pid."""

    pidfd: int
    started: float

    def exited(self) -> bool:
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:  # it finished first
            pass


class TrainServer:
    """tests/train_server.py: every start a forked child of one process that imported torch and minitrain.
    One intra-op thread: the run shares the CPU with the polling that decides when to kill it."""

    def __init__(self, cwd: Path):
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "train_server.py")], cwd=cwd,
                                     env=checkout_env(OMP_NUM_THREADS="1"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def start(self, args: list[str], run_dir: Path) -> Run:
        request = {"args": [*args, f"hydra.run.dir={run_dir}"], "log": str(console_path(run_dir))}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return Run(os.pidfd_open(int(self._answer("pid"))), time.monotonic())

    def wait(self, run: Run, kill_when: Callable[[], bool] = lambda: False) -> tuple[int, bool]:
        """Poll until the run exits, SIGKILLing it once `kill_when()` holds; (exit code, whether it was killed)."""
        killed = timed_out = False
        while not run.exited():
            if not killed and kill_when():
                run.kill()
                killed = True
            elif not timed_out and time.monotonic() - run.started > START_TIMEOUT_S:
                run.kill()
                timed_out = True
            time.sleep(POLL_S)
        code = int(self._answer("exit"))
        os.close(run.pidfd)
        assert not timed_out, f"a start of scripts/train.py ran past {START_TIMEOUT_S} s"
        return code, killed

    def _answer(self, key: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(f"{key} "):
            raise RuntimeError(f"tests/train_server.py answered {line!r} where `{key} ...` was due")
        return line.split()[1]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = TrainServer(tmp_path_factory.mktemp("train-server"))
    yield s
    s.close()


# -- what the run dir shows -------------------------------------------------------------------------
def console_path(run_dir: Path) -> Path:
    """Every start's stdout and stderr, appended (beside the run dir: train.log is the trainer's own)."""
    return run_dir.parent / f"{run_dir.name}.console"


def temporaries(run_dir: Path) -> set[str]:
    ckpts = checkpoint.checkpoint_dir(run_dir)
    return {p.name for p in ckpts.iterdir() if ".tmp" in p.name} if ckpts.is_dir() else set()


def last_logged_step(run_dir: Path) -> int:
    """Tolerant of a line torn by a kill (the next start drops it)."""
    path, last = run_dir / "metrics.jsonl", 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                last = max(last, json.loads(line).get("step", 0))
            except ValueError:
                pass
    return last


def checkpoint_to_resume(run_dir: Path) -> tuple[Optional[str], Optional[dict]]:
    """What resume=auto must load next: latest, or previous when a kill fell between a save's renames."""
    for name in (checkpoint.LATEST, checkpoint.PREVIOUS):
        path = checkpoint.checkpoint_dir(run_dir) / name
        if path.exists():
            return name, saved_state(path)
    return None, None


# -- when to kill ------------------------------------------------------------------------------------
def file_identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_ino, stat.st_mtime_ns


def published_progress(latest: Path, seen: list[tuple[int, int]]) -> Optional[dict]:
    """The progress part of a latest checkpoint published since the ones in `seen` (then appended), else None (also
    when a save renames it away while it is read)."""
    try:
        identity = file_identity(latest.stat())
        if identity in seen:
            return None
        progress = checkpoint.read_part(latest, "progress_rank0")
    except (OSError, CheckpointException):  # between a save's renames
        return None
    seen.append(identity)
    return progress


def kill_trigger(aim: Optional[str], run_dir: Path, resume_step: int, delay_s: float,
                 max_steps: int) -> Callable[[], bool]:
    """When to kill a start, by what the run dir shows.

    save: a new checkpoint temporary appeared (the save is writing it). publish: latest is gone while
    previous is there (between the save's two renames, an fsync apart). mid_window / at_log_step: a
    checkpoint was just published that holds a loss sum not yet logged / that was taken at a log step (its
    record must stay).
    delay: `delay_s` after the start first logs a step the killed start had not (its steps are under way), at
    the latest when the last log step before the end is logged, so that the kill comes before the finish.
    None: never. The records a start finds in metrics.jsonl are the killed start's; only a later step is its own.
    """
    if aim is None:
        return lambda: False
    ckpts, before = checkpoint.checkpoint_dir(run_dir), temporaries(run_dir)
    latest, previous = ckpts / checkpoint.LATEST, ckpts / checkpoint.PREVIOUS
    if aim == "save":
        return lambda: bool(temporaries(run_dir) - before)
    if aim == "publish":
        def fire() -> bool:  # while a save of this start is under way, watched without sleeping
            deadline = time.monotonic() + SAVE_WATCH_S
            while temporaries(run_dir) - before and time.monotonic() < deadline:
                if not latest.exists() and previous.exists():
                    return True
            return False

        return fire
    if aim in ("mid_window", "at_log_step"):
        seen = [file_identity(latest.stat())] if latest.exists() else []

        def fire() -> bool:
            progress = published_progress(latest, seen)
            return progress is not None and (progress["steps_since_log"] > 0) == (aim == "mid_window")

        return fire
    assert aim == "delay", aim
    found, last_log, under_way = max(last_logged_step(run_dir), resume_step), max_steps - LOG_EVERY, []

    def fire() -> bool:
        step = last_logged_step(run_dir)
        if step > found and not under_way:
            under_way.append(time.monotonic())
        return bool(under_way) and (time.monotonic() - under_way[0] >= delay_s or step >= last_log)

    return fire


@dataclass
class Kill:
    """What one kill left for the next start."""

    aim: str
    inside_save: bool  # a checkpoint temporary was left behind
    latest_gone: bool  # killed between a save's renames: the next start must fall back to previous
    resume_from: Optional[str]  # the checkpoint the next start must resume from
    resume_step: int  # its step (0: none yet)
    mid_window: bool  # it holds a loss sum of steps not yet logged
    at_log_step: bool  # it was taken at a log step, whose record must stay
    records_to_drop: bool  # metrics.jsonl holds records past it
    scaler_mid_growth: bool  # its loss scaler has counted steps towards the next growth


def observe(aim: str, run_dir: Path, temps_before: set[str]) -> Kill:
    name, state = checkpoint_to_resume(run_dir)
    step = state["progress"]["step"] if state is not None else 0
    scaler = state["optimizer"]["loss_scaler"] if state is not None else None
    return Kill(aim, inside_save=bool(temporaries(run_dir) - temps_before), latest_gone=name == checkpoint.PREVIOUS,
                resume_from=name, resume_step=step,
                mid_window=state is not None and state["progress"]["steps_since_log"] > 0,
                at_log_step=state is not None and state["progress"]["steps_since_log"] == 0,
                records_to_drop=last_logged_step(run_dir) > step,
                scaler_mid_growth=scaler is not None and int(scaler["growth_tracker"]) != 0)


AIM_GOAL = {"save": "inside_save", "publish": "latest_gone", "mid_window": "mid_window", "at_log_step": "at_log_step"}
GOAL_AIM = {goal: aim for aim, goal in AIM_GOAL.items()}  # a goal not here is a random moment's: "delay"


def missed(needed: list[str], kills: list[Kill]) -> list[str]:
    return [goal for goal in needed if not any(getattr(k, goal) for k in kills)]


def train_with_kills(server: TrainServer, args: list[str], run_dir: Path, aims: list[str], needed: list[str],
                     seed: int, step_s: float, max_steps: int) -> list[Kill]:
    """Start, kill as `aims` says, restart with resume=auto, until a start finishes. Up to EXTRA_KILLS more
    kills make up for timing: a kill that missed its aim is tried again at once, and what of `needed` (Kill
    fields) is still missing when the plan is done is aimed at. Every start must resume from the checkpoint
    the kill before it left (a killed process's lock is the kernel's to release, so every start gets it). A
    start can still finish before every aim has landed (the moment between a save's renames is short, and a
    loaded CPU polls it less often): the caller then runs again for what is missing."""
    rng, kills, planned, extra = random.Random(seed), [], list(aims), EXTRA_KILLS
    log = run_dir / "train.log"
    while True:
        if not planned and missed(needed, kills) and extra:
            planned.append(GOAL_AIM.get(missed(needed, kills)[0], "delay"))
            extra -= 1
        aim = planned.pop(0) if planned else None
        expected = kills[-1] if kills else None
        resume_step = expected.resume_step if expected else 0
        log_start, temps = log.stat().st_size if log.exists() else 0, temporaries(run_dir)
        delay_s = rng.uniform(0, 2 * SAVE_EVERY) * step_s  # a random moment of the next two save cycles
        trigger = kill_trigger(aim, run_dir, resume_step, delay_s, max_steps)
        code, killed = server.wait(server.start(args, run_dir), trigger)
        said = log.read_bytes()[log_start:].decode() if log.exists() else ""
        if "minitrain: " in said:  # the start reached its loop, past the line saying where it resumed
            resumed = re.findall(r"resumed from (\S+) at step (\d+)", said)
            path = checkpoint.checkpoint_dir(run_dir) / expected.resume_from if resume_step else None
            assert resumed == ([(str(path), str(resume_step))] if resume_step else []), (expected, said)
        if code == 0:
            break
        assert killed and code == -signal.SIGKILL, f"exit {code}:\n{console_path(run_dir).read_text()[-3000:]}"
        kills.append(observe(aim, run_dir, temps))
        if aim in AIM_GOAL and not getattr(kills[-1], AIM_GOAL[aim]) and extra:
            planned.insert(0, aim)
            extra -= 1
    assert not temporaries(run_dir), "the temporaries of killed saves outlive the next start"
    return kills


def assert_same_run(straight: Path, killed: Path, max_steps: int) -> None:
    final = [saved_state(checkpoint.checkpoint_dir(d) / checkpoint.LATEST) for d in (straight, killed)]
    assert final[0]["progress"]["step"] == max_steps
    for part in ("model", "optimizer", "progress"):
        assert_identical(final[0][part], final[1][part], part)
    assert torch.equal(final[0]["rng"]["torch"], final[1]["rng"]["torch"]), "the generator dropout draws from"
    records = [strict_records(d / "metrics.jsonl") for d in (straight, killed)]
    assert "plan" in records[1][0] and sum("plan" in r for r in records[1]) == 1
    logged = [deterministic(r) for r in records]
    steps = sorted({*range(LOG_EVERY, max_steps + 1, LOG_EVERY), *range(EVAL_EVERY, max_steps + 1, EVAL_EVERY),
                    max_steps})
    assert [r["step"] for r in logged[0]] == steps
    assert [r["step"] for r in logged[1]] == steps  # none twice, none missing
    assert logged[1] == logged[0]


@pytest.mark.parametrize("precision, max_steps, aims, needed, seed", [
    ("fp32", 24, ["at_log_step", "mid_window", "publish", "save", "delay", "save", "delay"],
     ["inside_save", "latest_gone", "mid_window", "at_log_step", "records_to_drop"], 15),
    # fp16 on a CPU is slow: fewer steps. growth_interval=2: the growth tracker is non-zero at some checkpoints.
    ("fp16", 12, ["mid_window", "at_log_step", "save", "delay"],
     ["inside_save", "mid_window", "at_log_step", "records_to_drop", "scaler_mid_growth"], 16),
])
def test_killed_and_resumed_until_done_equals_an_unbroken_run(server, corpus, data_cache, tmp_path, precision,
                                                              max_steps, aims, needed, seed):
    args = train_args(corpus, data_cache, max_steps, f"precision={precision}",
                      *(["precision.growth_interval=2"] if precision == "fp16" else []))
    code, _ = server.wait(server.start(args, tmp_path / "straight"))
    assert code == 0, console_path(tmp_path / "straight").read_text()[-3000:]
    step_s = statistics.median(r["perf/step_ms"] for r in strict_records(tmp_path / "straight" / "metrics.jsonl")
                               if "perf/step_ms" in r) / 1e3  # the scale of the random delays
    kills: list[Kill] = []
    for attempt in range(RUNS_FOR_AIMS):  # each killed run must end as the unbroken one did
        still = missed(needed, kills)
        plan = aims if attempt == 0 else [GOAL_AIM.get(goal, "delay") for goal in still]
        run_dir = tmp_path / f"killed-{attempt}"
        kills += (new := train_with_kills(server, args, run_dir, plan, still, seed + attempt, step_s, max_steps))
        print(f"{run_dir.name}:", *new, sep="\n")  # pytest shows it when an assertion below fails
        assert_same_run(tmp_path / "straight", run_dir, max_steps)
        if not missed(needed, kills):
            break
    assert not missed(needed, kills), f"no kill achieved {missed(needed, kills)}: {kills}"


# -- faults a user meets: each through the real scripts/train.py --------------------------------------
def step_of(path: Path) -> int:
    return checkpoint.read_part(path, "progress_rank0")["step"]


def test_a_fallback_past_a_torn_latest_keeps_it_aside_and_previous_stays_the_checkpoint_that_loaded(
        server, corpus, data_cache, tmp_path):
    """A save after the fallback must not rotate the torn latest into previous over the only good checkpoint:
    a kill between that save's renames would leave nothing to resume from."""
    run_dir, ckpts = tmp_path / "run", checkpoint.checkpoint_dir(tmp_path / "run")
    args = train_args(corpus, data_cache, 2 * SAVE_EVERY)
    assert server.wait(server.start(args, run_dir))[0] == 0
    for shard in (ckpts / checkpoint.LATEST).glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:1000])
    torn = {p.name: p.read_bytes() for p in (ckpts / checkpoint.LATEST).iterdir()}
    code, _ = server.wait(server.start(args, run_dir))  # from step 3 to 6: one save
    assert code == 0, console_path(run_dir).read_text()[-3000:]
    said = (run_dir / "train.log").read_text()
    [aside] = ckpts.glob(f"{checkpoint.LATEST}{checkpoint.UNUSABLE_MARK}*")
    assert f"kept aside as checkpoints/{aside.name}; resumed from checkpoints/{checkpoint.PREVIOUS}" in said
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == torn
    assert (step_of(ckpts / checkpoint.LATEST), step_of(ckpts / checkpoint.PREVIOUS)) == (2 * SAVE_EVERY, SAVE_EVERY)
    code, _ = server.wait(server.start(train_args(corpus, data_cache, 3 * SAVE_EVERY), run_dir))
    assert code == 0, console_path(run_dir).read_text()[-3000:]  # a later start neither takes it nor removes it
    assert (step_of(ckpts / checkpoint.LATEST), step_of(ckpts / checkpoint.PREVIOUS)) == (3 * SAVE_EVERY, 2 * SAVE_EVERY)
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([checkpoint.LATEST, checkpoint.PREVIOUS, aside.name])
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == torn


@pytest.mark.parametrize("argv, key, what", [
    (["trainer.out_dir={file}/run"], "trainer.out_dir", "as the run dir"),
    (["hydra.run.dir={file}/run"], "hydra.run.dir", "as the run dir"),
    (["trainer.out_dir=mine", "hydra.run.dir={file}/run"], "hydra.run.dir", "as the run dir"),
    (["-m", "trainer.max_steps=1,2", "hydra.sweep.dir={file}/run"], "hydra.sweep.dir", "as the sweep's dir"),
])
def test_a_run_dir_that_cannot_be_made_is_refused_in_one_line_and_nothing_is_made(tmp_path, argv, key, what):
    """Hydra makes its run dir before any code of the run: where it cannot (here under a path that is a file), the
    refusal must come first, in one line, exit 2, not as Hydra's traceback."""
    file = tmp_path / "a-file"
    file.write_text("")
    (tmp_path / "cwd").mkdir()
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), *(a.format(file=file) for a in argv)],
                         cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=120)
    reason = f"NotADirectoryError: [Errno 20] Not a directory: '{file}'"
    advice = "give the sweep a writable directory (hydra.sweep.dir=...)" if key == "hydra.sweep.dir" else \
        "give the run a writable directory (hydra.run.dir=... or trainer.out_dir=...)"
    assert (out.returncode, out.stderr) == (2, f"error: {key}: cannot use {file}/run {what} ({reason}); {advice}\n")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a-file", "cwd"]


def test_a_run_dir_on_a_read_only_filesystem_is_refused_naming_it(tmp_path, monkeypatch):
    """A read-only mount, faked: making one needs root. Hydra's default run dir, runs/<date>/<time>/, is checked
    by its fixed part (runs/ in the working directory)."""
    from minitrain.cli import command_line
    from minitrain.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(os, "statvfs", lambda path: type("Stat", (), {"f_flag": os.ST_RDONLY})())
    with pytest.raises(ConfigError) as refused:
        command_line(["trainer.max_steps=1"])
    assert str(refused.value) == (f"hydra.run.dir: cannot use runs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}} as the run dir "
                                  f"(OSError: [Errno 30] Read-only file system: '{tmp_path}'); give the run a writable "
                                  "directory (hydra.run.dir=... or trainer.out_dir=...)")


# The disk fills at the `fail_at`-th save: from then on every write of a checkpoint goes to /dev/full, which fails
# it with the kernel's ENOSPC, as a full disk does.
ON_A_FULL_DISK = """
import contextlib, runpy, sys
from torch.distributed.checkpoint.filesystem import FileSystem
real_stream, saves = FileSystem.create_stream, []
@contextlib.contextmanager
def on_a_full_disk(self, path, mode):
    full = str(path).endswith(".distcp") and "w" in mode and (saves.append(1) or len(saves) >= {fail_at})
    with (open("/dev/full", mode) if full else real_stream(self, path, mode)) as f:
        yield f
FileSystem.create_stream = on_a_full_disk
sys.argv = ["train.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="the kernel's full-disk device (Linux)")
def test_a_full_disk_stops_the_run_saying_so_and_how_much_room_a_save_needs(server, corpus, data_cache, tmp_path):
    """The third save (step 9) meets a full disk: one line that says so, exit 2, the checkpoints of steps 6 and 3
    intact and no temporary; once there is room, resume=auto goes on from step 6 as if nothing happened."""
    run_dir, ckpts = tmp_path / "run", checkpoint.checkpoint_dir(tmp_path / "run")
    args = [*train_args(corpus, data_cache, 4 * SAVE_EVERY), f"hydra.run.dir={run_dir}"]
    script = ON_A_FULL_DISK.format(fail_at=3, args=args, script=str(REPO / "scripts" / "train.py"))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=checkout_env())
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    size = sum(p.stat().st_size for p in (ckpts / checkpoint.LATEST).iterdir())
    needed = re.search(r"^error: could not write a checkpoint into (\S+): the disk is full \(\d[\d.]* [kMG]B free "
                       r"there; a checkpoint of this run needs about ([\d.]+) kB\); the checkpoints published before "
                       r"are untouched\. Free space there .*, then continue with trainer\.resume=auto$",
                       out.stderr.splitlines()[-1])
    assert needed and needed.group(1) == str(ckpts), out.stderr[-3000:]
    # the tensors, and each one's record in the shard file (about 2 kB: a third of this tiny model's checkpoint)
    assert 0.6 * size < float(needed.group(2)) * 1e3 <= size
    assert (step_of(ckpts / checkpoint.LATEST), step_of(ckpts / checkpoint.PREVIOUS)) == (2 * SAVE_EVERY, SAVE_EVERY)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]
    code, _ = server.wait(server.start(train_args(corpus, data_cache, 4 * SAVE_EVERY), run_dir))
    assert code == 0, console_path(run_dir).read_text()[-3000:]
    assert f"resumed from {ckpts / checkpoint.LATEST} at step {2 * SAVE_EVERY}" in (run_dir / "train.log").read_text()


def process_group_alive(pgid: int, grace_s: float) -> bool:
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stdlib_modules(tmp_path_factory) -> Path:
    """The standard library's top-level modules (5 MB): a second or more of tokenizing."""
    corpus = tmp_path_factory.mktemp("stdlib-modules")
    for module in Path(os.__file__).parent.glob("*.py"):
        shutil.copy(module, corpus)
    return corpus


def moment_reached(moment: str) -> Callable[[int, bytes], bool]:
    """importing: the script's imports have reached torch (its libraries are mapped; loading them and the rest of
    torch takes a second or more). tokenizing: the preparation's progress bar is up (the corpus is one batch,
    encoded for a second or more)."""

    def reached(pid: int, stderr: bytes) -> bool:
        if moment == "importing":
            return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        return b"tokenizing" in stderr

    return reached


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads a process's mapped libraries from /proc")
@pytest.mark.parametrize("moment, said", [
    ("importing", "minitrain: aborted (Ctrl-C) while starting, before the run began"),
    # before the first step the run dir holds no checkpoint: none is said to be kept
    ("tokenizing", "minitrain: aborted (Ctrl-C) without saving a checkpoint"),
])
def test_ctrl_c_before_training_ends_in_one_line_and_exit_130(stdlib_modules, tmp_path, moment, said):
    """Ctrl-C as a terminal sends it (to the whole process group) while torch and minitrain are imported, or
    while a fresh corpus is tokenized: one line, exit 130, no traceback from the script or any worker."""
    run = tmp_path / "run"
    args = [*train_args(stdlib_modules, tmp_path / "cache", 2), f"hydra.run.dir={run}"]
    job = subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), *args], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                           env=checkout_env())
    err = bytearray()

    def read():
        while chunk := job.stderr.read1():
            err.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    deadline, reached = time.monotonic() + START_TIMEOUT_S, moment_reached(moment)
    while not reached(job.pid, bytes(err)):
        assert job.poll() is None and time.monotonic() < deadline, f"never {moment}:\n{err.decode()[-3000:]}"
        time.sleep(POLL_S)
    os.killpg(job.pid, signal.SIGINT)
    try:
        job.wait(timeout=120)
        reader.join()
        assert not process_group_alive(job.pid, grace_s=5), "workers outlived the run"
    finally:  # a run that hangs, or its workers, must not outlive the test
        if process_group_alive(job.pid, grace_s=0):
            os.killpg(job.pid, signal.SIGKILL)
    text = err.decode()
    assert "tokenizing: 100%" not in text, "the Ctrl-C came after the tokenizing"
    assert job.returncode == 130 and "Traceback" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1] == said, repr(text[-600:])
