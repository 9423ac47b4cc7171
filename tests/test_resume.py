import errno
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint, distributed
from minitrain import rundir
from minitrain.checkpoint import CheckpointError
from minitrain.parts import RandomState
from minitrain.progress import Progress
from minitrain.rundir import RunDirBusyError, RunDirError

CPU = torch.device("cpu")
CONFIG = {"trainer": {"lr": 0.001, "max_steps": 20}, "model": {"n_layer": 2}}
PER_RANK = {"rng": RandomState.combine_ranks, "progress": Progress.combine_ranks}


def state_at(step: int, config: dict = CONFIG) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "step": step, "config": config}


def template(config: dict = CONFIG) -> dict:
    return {"model": {"w": torch.zeros(4)}, "step": 0, "config": config}


def saved_step(path, like: dict = None) -> int:
    """The step of the checkpoint `path`, loaded into `like` (a state of its shape; template() by default)."""
    return checkpoint.load_checkpoint(str(path), path.parent.parent, template=like or template()).state["step"]


def contents(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_random_state_restores_every_generator(tmp_path):
    import random

    import numpy as np

    saved = RandomState().state_dict()
    draws = (random.random(), np.random.rand(), torch.rand(()).item())
    checkpoint.save_checkpoint({**state_at(1), "rng": saved}, tmp_path, per_rank=PER_RANK)
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template={**template(), "rng": RandomState().state_dict()},
                                        per_rank=PER_RANK)
    RandomState().load_state_dict(loaded.state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == draws


# -- the run-directory lock ---------------------------------------------------------------------------
HOLDER = ("import sys\nfrom minitrain.rundir import RunDirLock\nlock = RunDirLock(sys.argv[1])\nlock.acquire()\n"
          "print('locked', flush=True)\nsys.stdin.read()\n")


def test_a_second_process_is_refused_naming_the_holder_until_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusyError) as busy:
            rundir.RunDirLock(tmp_path).acquire()
        message = str(busy.value)
        assert f"pid {holder.pid}" in message and str(tmp_path) in message and "hydra.run.dir=" in message
        assert isinstance(busy.value, RunDirError)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs in the holder; the kernel drops its lock
        holder.wait()
    with rundir.RunDirLock(tmp_path) as lock:
        assert json.loads(lock.holder.read_text())["pid"] == os.getpid()


def test_the_lock_is_released_on_exit_and_excludes_a_second_holder_meanwhile(tmp_path):
    with pytest.raises(KeyError):
        with rundir.RunDirLock(tmp_path):
            with pytest.raises(RunDirBusyError, match=f"pid {os.getpid()}"):
                rundir.RunDirLock(tmp_path).acquire()
            raise KeyError("the run failed")
    lock = rundir.RunDirLock(tmp_path)
    lock.acquire()
    lock.release()
    assert (tmp_path / rundir.HOLDER).read_text() == ""  # no pid of a finished holder left to mislead


def test_a_refused_run_removes_only_the_lock_file_it_made(tmp_path):
    """So that the empty dir of a run refused at start can go; a file that was there, and a finished run's, stay."""
    lock = rundir.RunDirLock(tmp_path / "new")
    lock.acquire()
    lock.release(remove_file=True)
    assert list((tmp_path / "new").iterdir()) == []
    lock = rundir.RunDirLock(tmp_path / "new")
    lock.acquire()
    lock.release()
    again = rundir.RunDirLock(tmp_path / "new")
    again.acquire()
    again.release(remove_file=True)
    assert (tmp_path / "new" / rundir.LOCK).exists()


def test_a_run_dir_held_by_a_run_is_left_as_it_was_found_unless_the_run_recorded_itself(tmp_path):
    """RunDir: its owner holds the lock while inside; one that leaves before `record` (refused at start) leaves no
    file of its own; one that recorded itself keeps its lock file, and its record. Another rank of the job (not the
    owner) takes no lock and writes no record nor result there."""
    with rundir.RunDir(tmp_path / "refused") as held:
        with pytest.raises(RunDirBusyError):
            rundir.RunDirLock(held.path).acquire()
    assert list((tmp_path / "refused").iterdir()) == []
    with rundir.RunDir(tmp_path / "ran", rundir.RunInfo(name="ran", overrides=["model.n_layer=2"])) as held:
        held.record({"model": {"n_layer": 2}}, '{"tokenizer": 1}')
        held.write("sample.txt", "def ")
    assert {p.name for p in (tmp_path / "ran").iterdir()} == \
        {rundir.LOCK, rundir.HOLDER, ".hydra", "tokenizer.json", "sample.txt"}
    rundir.RunDirLock(tmp_path / "ran").acquire()  # free again
    with rundir.RunDir(tmp_path / "rank1", owner=False) as other:
        rundir.RunDirLock(other.path).acquire()  # the owner's to take
        other.record({}, "{}")
        other.write("sample.txt", "def ")
    assert {p.name for p in (tmp_path / "rank1").iterdir()} == {rundir.LOCK, rundir.HOLDER}


def test_a_run_dir_that_cannot_be_made_or_written_names_trainer_out_dir(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(RunDirError, match=r"trainer\.out_dir: cannot use .*a-file/run as the run dir"):
        rundir.RunDirLock(tmp_path / "a-file" / "run").acquire()
    (tmp_path / "run" / rundir.LOCK).mkdir(parents=True)  # the lock file cannot be opened for writing
    with pytest.raises(RunDirError, match=r"trainer\.out_dir: cannot use .*run as the run dir"):
        rundir.RunDirLock(tmp_path / "run").acquire()


def test_taking_the_lock_removes_the_temporaries_of_dead_runs(tmp_path):
    checkpoint.save_checkpoint(state_at(1), tmp_path)
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    (ckpts / "latest.pt.tmp.999.beef").write_bytes(b"half a checkpoint")
    (ckpts / "latest.tmp.999.beef").mkdir()
    (ckpts / "latest.tmp.999.beef" / "__0_0.distcp").write_bytes(b"a shard")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "metrics.jsonl.tmp.999").write_text('{"step": 1}\n')  # a log rewrite killed mid-way
    with rundir.RunDirLock(tmp_path):
        assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST]
        assert not list(tmp_path.glob("metrics.jsonl.tmp*")) and (tmp_path / "metrics.jsonl").exists()


# -- saving: the last two kept, a crash anywhere recoverable ------------------------------------------
def test_each_save_keeps_the_one_before_as_previous(tmp_path):
    for step in (1, 2, 3):
        path = checkpoint.save_checkpoint(state_at(step), tmp_path)
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    assert path == ckpts / checkpoint.LATEST
    assert (saved_step(ckpts / checkpoint.LATEST), saved_step(ckpts / checkpoint.PREVIOUS)) == (3, 2)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]  # no temporary left


def failing_writes(monkeypatch, error):
    """Every shard write of torch.distributed.checkpoint raises `error` (made fresh for each)."""
    from torch.distributed.checkpoint import FileSystemWriter

    def fail(self, *args, **kwargs):
        raise error()

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)


@pytest.mark.parametrize("group", [False, True], ids=["one-process", "process-group"])
def test_a_failed_write_leaves_both_checkpoints_and_no_temporary(tmp_path, monkeypatch, group, request):
    if group:
        request.getfixturevalue("process_group")
    checkpoint.save_checkpoint(state_at(1), tmp_path)
    checkpoint.save_checkpoint(state_at(2), tmp_path)
    failing_writes(monkeypatch, lambda: OSError(errno.EIO, "Input/output error"))
    with pytest.raises(CheckpointError, match=r"could not write a checkpoint into .*\(OSError: \[Errno 5\] "
                                              r"Input/output error\); the checkpoints published before are "
                                              r"untouched.*trainer.resume=auto"):
        checkpoint.save_checkpoint(state_at(3), tmp_path)
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    assert (saved_step(ckpts / checkpoint.LATEST), saved_step(ckpts / checkpoint.PREVIOUS)) == (2, 1)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]


def big_state(step: int) -> dict:
    """A checkpoint of 2 MB of tensors: their bytes are nearly all of its files."""
    return {"model": {"w": torch.full((400_000,), float(step)), "b": torch.zeros(100_000, dtype=torch.float16)},
            "step": step, "config": CONFIG}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="the kernel's full-disk device (Linux)")
def test_a_full_disk_is_named_with_the_room_a_checkpoint_needs(tmp_path, monkeypatch):
    """The shards written into the kernel's /dev/full, which fails every write with ENOSPC as a full disk does."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    checkpoint.save_checkpoint(big_state(1), tmp_path)
    checkpoint.save_checkpoint(big_state(2), tmp_path)
    ckpts, real_stream = checkpoint.checkpoint_dir(tmp_path), FileSystem.create_stream
    size = sum(p.stat().st_size for p in (ckpts / checkpoint.LATEST).iterdir())
    assert checkpoint.state_bytes(big_state(3)) == 1_800_000 == pytest.approx(size, rel=0.01)

    @contextmanager
    def on_a_full_disk(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            with open("/dev/full", mode) as f:
                yield f
        else:
            with real_stream(self, path, mode) as f:
                yield f

    monkeypatch.setattr(FileSystem, "create_stream", on_a_full_disk)
    with pytest.raises(CheckpointError) as error:
        checkpoint.save_checkpoint(big_state(3), tmp_path)
    message = re.sub(r"\(\d[\d.]* [GMk]B free", "(N free", str(error.value))  # others write on this disk meanwhile
    assert message == (f"could not write a checkpoint into {ckpts}: the disk is full (N free there; a checkpoint of "
                       "this run needs about 1.8 MB); the checkpoints published before are untouched. Free space "
                       "there (or move the run dir to a disk with room), then continue with trainer.resume=auto")
    assert (saved_step(ckpts / checkpoint.LATEST, big_state(0)), saved_step(ckpts / checkpoint.PREVIOUS, big_state(0))) \
        == (2, 1)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]


def test_a_full_disk_that_a_writer_reports_as_its_own_error_is_named_too(tmp_path, monkeypatch):
    """On a disk that fills, the kernel takes part of a write and refuses the rest: a writer may raise a
    RuntimeError of its own, the OSError only its context (what torch.save's first report of this fault showed)."""
    def filling():
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            try:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            except RuntimeError as e:
                return e

    failing_writes(monkeypatch, filling)
    with pytest.raises(CheckpointError, match=r": the disk is full \(\d[\d.]* [kMG]B free there; a checkpoint of this "
                                              r"run needs about 1\.8 MB\)"):
        checkpoint.save_checkpoint(big_state(1), tmp_path)


def test_a_write_error_that_names_no_cause_on_a_disk_without_room_is_a_full_disk(tmp_path, monkeypatch):
    """A writer may report ENOSPC as `basic_ios::clear: iostream error`: the room left tells."""
    failing_writes(monkeypatch, lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 500_000, 500_000))
    with pytest.raises(CheckpointError, match=r": the disk is full \(500 kB free there; a checkpoint of this run needs "
                                              r"about 1\.8 MB\)"):
        checkpoint.save_checkpoint(big_state(1), tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(CheckpointError, match=r"could not write a checkpoint into .* \(RuntimeError: \[enforce fail"):
        checkpoint.save_checkpoint(big_state(1), tmp_path)


class Crash(BaseException):
    """The process dies: this filesystem operation and every later one never happen."""


MUTATIONS = [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "remove"), (shutil, "rmtree")]


def save_with_crash(monkeypatch, save, crash_at: int) -> bool:
    """Run `save` with the process dying before its `crash_at`-th filesystem mutation (the write of
    the checkpoint's shards is mutation 0); True if it finished first."""
    from torch.distributed.checkpoint import FileSystemWriter

    done = [0]

    def dying(real):
        def op(*args, **kwargs):
            if done[0] >= crash_at:
                raise Crash()
            done[0] += 1
            return real(*args, **kwargs)
        return op

    real_write = FileSystemWriter.write_data

    def torn_write(self, plan, planner):
        if crash_at == 0:
            path = getattr(self, "path", None) or self.fs.path  # the checkpoint's directory
            (Path(str(path)) / "__0_0.distcp").write_bytes(b"torn")
            raise Crash()
        done[0] += 1
        return real_write(self, plan, planner)

    with monkeypatch.context() as m:
        for module, name in MUTATIONS:
            m.setattr(module, name, dying(getattr(module, name)))
        m.setattr(FileSystemWriter, "write_data", torn_write)
        try:
            save()
            return True
        except (Crash, CheckpointError):  # torch.distributed.checkpoint reports what its writer raised
            return False


@pytest.fixture
def process_group(tmp_path_factory):
    """A one-rank gloo group: torch.distributed.checkpoint's collectives run as under torchrun (for one test: the
    others run as one process without a group)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    yield
    distributed.teardown()


def resumed_step(out_dir) -> int:
    loaded = checkpoint.load_checkpoint("auto", out_dir, template=template())
    assert torch.equal(loaded.state["model"]["w"], torch.full((4,), float(loaded.state["step"])))
    return loaded.state["step"]


@pytest.mark.parametrize("group", [False, True], ids=["one-process", "process-group"])
def test_a_crash_between_any_two_filesystem_operations_leaves_a_checkpoint_to_resume(tmp_path, monkeypatch,
                                                                                      group, request):
    """Steps 1 and 2 saved, the save of step 3 killed at every point in turn: resume=auto must find step 2
    or 3, complete; before the publish begins both earlier checkpoints are untouched; then saving goes on."""
    if group:
        request.getfixturevalue("process_group")
    crash_at, finished = 0, False
    while not finished:
        out_dir = tmp_path / f"crash{crash_at}"
        checkpoint.save_checkpoint(state_at(1), out_dir)
        checkpoint.save_checkpoint(state_at(2), out_dir)
        finished = save_with_crash(monkeypatch, lambda: checkpoint.save_checkpoint(state_at(3), out_dir), crash_at)
        assert resumed_step(out_dir) in ((3,) if finished else (2, 3)), crash_at
        if crash_at == 0:
            both = [checkpoint.load_checkpoint(str(checkpoint.checkpoint_dir(out_dir) / n), out_dir,
                                               template=template()) for n in (checkpoint.LATEST, checkpoint.PREVIOUS)]
            assert [b.state["step"] for b in both] == [2, 1]
        with rundir.RunDirLock(out_dir):  # a restart: the dead save's temporaries go, the next save works
            checkpoint.save_checkpoint(state_at(4), out_dir)
            assert resumed_step(out_dir) == 4
            assert not list(checkpoint.checkpoint_dir(out_dir).glob("*.tmp*"))
        crash_at += 1
    assert crash_at >= 3  # the write and the two renames were each interrupted once


def rank_state(value: float, rank: int) -> dict:
    """A state whose parts differ by rank as a run's do: the RNG states and the running loss sums."""
    progress = Progress(CPU)
    progress.step, progress.steps_since_log = 3, 2
    progress.loss_sum.fill_(value + 10 * rank)
    progress.last_loss.fill_(value + 20 * rank)
    return {"model": {"w": torch.full((4,), value)}, "rng": {"torch": torch.full((2,), value + rank)},
            "progress": progress.state_dict(), "config": CONFIG}


def _two_rank_worker(rank, out_dir, store):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store}")
    try:
        save = dict(per_rank=PER_RANK, rank=rank, world_size=2, mode="ddp")
        checkpoint.save_checkpoint(rank_state(1.0, rank), out_dir / "two", **save)
        checkpoint.save_checkpoint(rank_state(2.0, rank), out_dir / "two", **save)
        load = dict(per_rank=PER_RANK, rank=rank, world_size=2)
        loaded = checkpoint.load_checkpoint("auto", out_dir / "two", template=rank_state(0.0, rank), **load)
        torch.save(loaded.state, out_dir / f"loaded.rank{rank}.pt")
        from_one = checkpoint.load_checkpoint("auto", out_dir / "one", template=rank_state(0.0, rank), **load)
        torch.save((from_one.state, from_one.notes), out_dir / f"from_one.rank{rank}.pt")
        distributed.teardown(finished=True)
    finally:
        distributed.teardown()


def test_a_checkpoint_of_two_ranks_resumes_in_two_or_in_one_and_one_of_one_in_two(tmp_path):
    """What differs by rank (RNG states, running loss sums) comes back to the rank that saved it; the
    replicated weights to both; every rank writes into the one temporary directory rank 0 named. Another world
    size merges the ranks' parts: the mean loss sums, rank 0's generators."""
    import torch.multiprocessing as mp

    checkpoint.save_checkpoint(rank_state(5.0, 0), tmp_path / "one", per_rank=PER_RANK)
    mp.start_processes(_two_rank_worker, args=(tmp_path, tmp_path / "store"), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        state = torch.load(tmp_path / f"loaded.rank{rank}.pt", weights_only=False)
        assert torch.equal(state["model"]["w"], torch.full((4,), 2.0))
        assert torch.equal(state["rng"]["torch"], torch.full((2,), 2.0 + rank))
        assert state["progress"]["loss_sum"].item() == 2.0 + 10 * rank and state["progress"]["step"] == 3
        state, notes = torch.load(tmp_path / f"from_one.rank{rank}.pt", weights_only=False)
        assert torch.equal(state["model"]["w"], torch.full((4,), 5.0))
        assert torch.equal(state["rng"]["torch"], torch.full((2,), 5.0))
        assert state["progress"]["loss_sum"].item() == 5.0 and state["progress"]["steps_since_log"] == 2
        assert notes == ["checkpoints/latest was saved by 1 process, this run has 2: the same global batch, its "
                         "gradients summed in another order (the losses differ by rounding)"]
    ckpts = checkpoint.checkpoint_dir(tmp_path / "two")
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]
    assert json.loads((ckpts / checkpoint.LATEST / checkpoint.JOB_INFO).read_text())["world_size"] == 2
    one = checkpoint.load_checkpoint("auto", tmp_path / "two", template=rank_state(0.0, 0), per_rank=PER_RANK)
    progress = one.state["progress"]
    assert (progress["loss_sum"].item(), progress["last_loss"].item()) == (7.0, 12.0)  # the ranks' means
    assert (progress["step"], progress["steps_since_log"]) == (3, 2)
    assert torch.equal(one.state["rng"]["torch"], torch.full((2,), 2.0))  # rank 0's


def test_a_save_records_the_job_beside_its_shards(tmp_path, process_group):
    checkpoint.save_checkpoint(state_at(5), tmp_path, world_size=1, mode="ddp")
    info = json.loads((checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST / checkpoint.JOB_INFO).read_text())
    assert info == {"world_size": 1, "mode": "ddp", "config": CONFIG}


# -- loading: fallback, clear errors ------------------------------------------------------------------
def two_checkpoints(out_dir, config: dict = CONFIG):
    checkpoint.save_checkpoint(state_at(1, config), out_dir)
    checkpoint.save_checkpoint(state_at(2, config), out_dir)
    return checkpoint.checkpoint_dir(out_dir) / checkpoint.LATEST


def truncate(path):
    """Every shard of the checkpoint `path` cut to half."""
    for shard in path.glob("*.distcp"):
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])


def incomplete(path):
    """A checkpoint without the model part in `path`'s place."""
    other = path.parent.parent.parent / "other-run"
    checkpoint.save_checkpoint({"step": 2, "config": CONFIG}, other)
    shutil.rmtree(path)
    os.replace(checkpoint.checkpoint_dir(other) / checkpoint.LATEST, path)


def replace_by_a_file(path):
    shutil.rmtree(path)
    path.write_bytes(b"not a checkpoint, just text\n")


@pytest.mark.parametrize("damage, reason", [
    (truncate, "could not be loaded"),
    (lambda p: (p / ".metadata").write_bytes(b"not a checkpoint, just text\n" * 10), "could not be loaded"),
    (lambda p: (p / ".metadata").unlink(), "is incomplete (no .metadata: its save did not finish)"),
    (lambda p: (p / checkpoint.JOB_INFO).write_text("{"), f"has no readable {checkpoint.JOB_INFO}"),
    (incomplete, "could not be loaded (rank 0: RuntimeError: Missing key in checkpoint state_dict: model.w"),
    (replace_by_a_file, "is not a checkpoint directory"),
])
def test_auto_falls_back_past_a_bad_latest_with_a_note(tmp_path, damage, reason):
    damage(two_checkpoints(tmp_path / "run"))
    loaded = checkpoint.load_checkpoint("auto", tmp_path / "run", template=template())
    assert loaded.state["step"] == 1
    assert loaded.path == checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.PREVIOUS
    assert len(loaded.notes) == 1
    assert "checkpoints/latest " in loaded.notes[0] and reason in loaded.notes[0], loaded.notes[0]
    assert re.search(r"; kept aside as checkpoints/latest\.unusable-\d{8}-\d{6}; resumed from "
                     r"checkpoints/previous$", loaded.notes[0]), loaded.notes[0]


def test_after_a_fallback_previous_stays_the_checkpoint_that_loaded_and_the_bad_one_is_kept_aside(tmp_path):
    """The next saves must not rotate the unreadable latest into previous, over the only good checkpoint:
    a crash before the second save would leave nothing to resume from."""
    latest = two_checkpoints(tmp_path)
    truncate(latest)
    torn = contents(latest)
    assert resumed_step(tmp_path) == 1
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    [aside] = ckpts.glob("latest.unusable-*")
    assert contents(aside) == torn and sorted(p.name for p in ckpts.iterdir()) == [aside.name, checkpoint.PREVIOUS]
    assert checkpoint.holds_checkpoint(tmp_path)
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template=template())  # a crash before the next save
    assert loaded.state["step"] == 1 and loaded.notes[0].startswith(
        f"checkpoints/latest is absent (a save was interrupted, or it was kept aside as {aside.name}); resumed")
    checkpoint.save_checkpoint(state_at(2), tmp_path)
    assert (saved_step(ckpts / checkpoint.LATEST), saved_step(ckpts / checkpoint.PREVIOUS)) == (2, 1)
    with rundir.RunDirLock(tmp_path):  # a restart: what it removes as a dead save's temporary, it must not be
        assert contents(aside) == torn
    truncate(ckpts / checkpoint.LATEST)  # and a second fallback finds the one that loaded
    assert resumed_step(tmp_path) == 1
    assert len(list(ckpts.glob("latest.unusable-*"))) == 2


def test_only_the_last_checkpoints_kept_aside_stay_and_the_note_names_those_removed(tmp_path):
    """A run whose saves keep failing falls back on every start, and each checkpoint kept aside is as large as a
    checkpoint: the older ones go, by the time in their names (the tenth of one second after its ninth), and a
    name the fallback did not make stays."""
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    latest = two_checkpoints(tmp_path)
    older = [f"latest.unusable-20000101-000000-{n}" for n in (9, 10)]
    for name in [*older, "latest.unusable-mine"]:
        shutil.copytree(latest, ckpts / name)
    truncate(latest)
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template=template())
    assert loaded.state["step"] == 1 and checkpoint.KEPT_UNUSABLE == 2
    [new] = set(ckpts.glob("latest.unusable-*")) - {ckpts / name for name in [*older, "latest.unusable-mine"]}
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([new.name, older[1], "latest.unusable-mine", "previous"])
    assert loaded.notes[0].endswith(
        f"; kept aside as checkpoints/{new.name} (the last 2 kept aside stay, each as large as a checkpoint; removed "
        f"the older {older[0]}); resumed from checkpoints/previous"), loaded.notes[0]


def test_a_fallback_in_another_runs_dir_leaves_that_dir_as_it_is(tmp_path):
    """This run saves into its own dir: the other run's files are not this run's to rename."""
    truncate(two_checkpoints(tmp_path / "old-run"))
    before = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path / "old-run").iterdir())
    loaded = checkpoint.load_checkpoint(str(tmp_path / "old-run"), tmp_path / "new-run", template=template())
    assert loaded.state["step"] == 1 and "kept aside" not in loaded.notes[0]
    assert sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path / "old-run").iterdir()) == before


def test_auto_takes_previous_when_a_save_stopped_between_its_renames(tmp_path):
    os.replace(two_checkpoints(tmp_path), checkpoint.checkpoint_dir(tmp_path) / "latest.tmp.1.ab")
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template=template())
    assert loaded.state["step"] == 1 and "checkpoints/latest is absent" in loaded.notes[0]


def test_auto_names_every_bad_checkpoint_when_none_is_usable(tmp_path):
    latest = two_checkpoints(tmp_path)
    truncate(latest)
    (latest.parent / checkpoint.PREVIOUS / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        checkpoint.load_checkpoint("auto", tmp_path, template=template())
    message = str(error.value)
    assert message.startswith("no usable checkpoint to resume from: checkpoints/latest could not be loaded (")
    assert "; checkpoints/previous could not be loaded (" in message


def test_a_good_latest_is_taken_without_notes_and_a_fresh_dir_starts_fresh(tmp_path):
    assert checkpoint.load_checkpoint("auto", tmp_path, template=template()) is None
    assert checkpoint.load_checkpoint("none", tmp_path, template=template()) is None
    two_checkpoints(tmp_path)
    assert checkpoint.load_checkpoint("none", tmp_path, template=template()) is None
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template=template())
    assert loaded.state["step"] == 2 and loaded.notes == []


def test_an_explicit_checkpoint_never_falls_back(tmp_path):
    latest = two_checkpoints(tmp_path)
    truncate(latest)
    with pytest.raises(CheckpointError, match=r"latest could not be loaded") as error:
        checkpoint.load_checkpoint(str(latest), tmp_path / "new-run", template=template())
    assert "previous" not in str(error.value)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load_checkpoint(str(tmp_path / "nothing"), tmp_path, template=template())


def test_an_explicit_run_dir_is_searched_like_auto(tmp_path):
    truncate(two_checkpoints(tmp_path / "old-run"))
    loaded = checkpoint.load_checkpoint(str(tmp_path / "old-run"), tmp_path / "new-run", template=template())
    assert loaded.state["step"] == 1 and "could not be loaded" in loaded.notes[0]


def test_auto_under_a_process_group_falls_back_past_an_unfinished_latest(tmp_path, process_group):
    two_checkpoints(tmp_path)
    latest = checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST
    (latest / checkpoint.JOB_INFO).unlink()
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template=template())
    assert loaded.state["step"] == 1 and loaded.state["config"] == CONFIG
    assert torch.equal(loaded.state["model"]["w"], torch.full((4,), 1.0))
    assert f"checkpoints/latest has no readable {checkpoint.JOB_INFO}" in loaded.notes[0]
    [aside] = checkpoint.checkpoint_dir(tmp_path).glob("latest.unusable-*")  # never rotated into previous/
    assert (aside / ".metadata").is_file() and not latest.exists()
    checkpoint.save_checkpoint(state_at(3), tmp_path)
    assert resumed_step(tmp_path) == 3
    assert checkpoint.load_checkpoint(str(checkpoint.checkpoint_dir(tmp_path) / checkpoint.PREVIOUS), tmp_path,
                                      template=template()).state["step"] == 1
    (checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST / ".metadata").unlink()
    assert "no .metadata" in checkpoint.load_checkpoint("auto", tmp_path, template=template()).notes[0]


def test_a_checkpoint_with_a_torn_shard_and_nothing_before_it_fails_naming_it(tmp_path, process_group):
    checkpoint.save_checkpoint(state_at(1), tmp_path)
    truncate(checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST)
    with pytest.raises(CheckpointError, match=r"checkpoints/latest could not be loaded \(rank 0: \w+"):
        checkpoint.load_checkpoint("auto", tmp_path, template=template())


@pytest.mark.parametrize("group", [False, True], ids=["one-process", "process-group"])
def test_a_changed_config_is_refused_or_noted(tmp_path, group, request):
    if group:
        request.getfixturevalue("process_group")
    checkpoint.save_checkpoint(state_at(1), tmp_path)
    changed_lr = {"trainer": {"lr": 0.01, "max_steps": 20}, "model": {"n_layer": 2}}
    with pytest.raises(CheckpointError, match=r"trainer\.lr: saved 0\.001, now 0\.01"):
        checkpoint.load_checkpoint("auto", tmp_path, template=template(changed_lr))
    longer = {"trainer": {"lr": 0.001, "max_steps": 40}, "model": {"n_layer": 2}}
    loaded = checkpoint.load_checkpoint("auto", tmp_path, template=template(longer))
    assert loaded.notes == ["config changed since the checkpoint (allowed): trainer.max_steps 20 -> 40"]


def test_a_refused_run_s_empty_dirs_go_and_nothing_else(tmp_path, monkeypatch):
    """Hydra makes runs/<date>/<time>/ before any check of ours: a run refused at start removes what is still
    empty of it, and never a directory holding anything, `below` itself, or the working directory."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    (runs / "d1" / "t1").mkdir(parents=True)
    rundir.remove_if_empty(runs / "d1" / "t1", below=runs)
    assert [p.name for p in tmp_path.rglob("*")] == ["runs"]
    (runs / "d2" / "t1").mkdir(parents=True)
    (runs / "d2" / "t2").mkdir()
    rundir.remove_if_empty(runs / "d2" / "t2", below=runs)  # its date dir holds another run's
    assert sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) == ["d2", "d2/t1"]
    rundir.remove_if_empty(runs / "d2" / "t1" / "missing", below=runs)
    (runs / "d2" / "t1" / "metrics.jsonl").write_text("{}")
    rundir.remove_if_empty(runs / "d2" / "t1", below=runs)
    assert (runs / "d2" / "t1" / "metrics.jsonl").exists()
    (tmp_path / "mine" / "a" / "b").mkdir(parents=True)
    rundir.remove_if_empty(tmp_path / "mine" / "a" / "b", below=runs)  # outside runs/: the run dir alone
    assert (tmp_path / "mine" / "a").is_dir() and not (tmp_path / "mine" / "a" / "b").exists()
    rundir.remove_if_empty(runs, below=runs)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    rundir.remove_if_empty(tmp_path / "cwd", below=runs)  # hydra.run.dir=. in an empty directory
    assert runs.is_dir() and (tmp_path / "cwd").is_dir()
