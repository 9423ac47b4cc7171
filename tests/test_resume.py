import errno
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from minitrain import checkpoint, distributed
from minitrain import rundir
from minitrain.checkpoint import CheckpointError
from minitrain.parts import RandomState
from minitrain.rundir import RunDirBusyError, RunDirError

CPU = torch.device("cpu")
CONFIG = {"trainer": {"lr": 0.001, "max_steps": 20}, "model": {"n_layer": 2}}


def state_at(step: int, config: dict = CONFIG) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "step": step, "config": config}


def template(config: dict = CONFIG) -> dict:
    return {"model": {"w": torch.zeros(4)}, "step": 0, "config": config}


def saved_step(path) -> int:
    return torch.load(path, weights_only=False)["step"]


def test_random_state_restores_every_generator(tmp_path):
    import random

    import numpy as np

    saved = RandomState().state_dict()
    draws = (random.random(), np.random.rand(), torch.rand(()).item())
    checkpoint.save_checkpoint({**state_at(1), "rng": saved}, tmp_path)
    RandomState().load_state_dict(torch.load(checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST,
                                                    weights_only=False)["rng"])
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


def test_a_failed_write_leaves_both_checkpoints_and_no_temporary(tmp_path, monkeypatch):
    checkpoint.save_checkpoint(state_at(1), tmp_path)
    checkpoint.save_checkpoint(state_at(2), tmp_path)

    def io_error(obj, f):
        f.write(b"PK\x03\x04 partial")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(torch, "save", io_error)
    with pytest.raises(CheckpointError, match=r"could not write a checkpoint into .*\(OSError: \[Errno 5\] "
                                              r"Input/output error\); the checkpoints published before are "
                                              r"untouched.*trainer.resume=auto"):
        checkpoint.save_checkpoint(state_at(3), tmp_path)
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    assert (saved_step(ckpts / checkpoint.LATEST), saved_step(ckpts / checkpoint.PREVIOUS)) == (2, 1)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]


def big_state(step: int) -> dict:
    """A checkpoint of 2 MB of tensors: their bytes are nearly all of its file."""
    return {"model": {"w": torch.full((400_000,), float(step)), "b": torch.zeros(100_000, dtype=torch.float16)},
            "step": step, "config": CONFIG}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="the kernel's full-disk device (Linux)")
def test_a_full_disk_is_named_with_the_room_a_checkpoint_needs(tmp_path, monkeypatch):
    """torch.save writing into the kernel's /dev/full, which fails every write with ENOSPC as a full disk does
    (torch reports it as a RuntimeError of its own, the OSError only as its context)."""
    checkpoint.save_checkpoint(big_state(1), tmp_path)
    checkpoint.save_checkpoint(big_state(2), tmp_path)
    ckpts, real_save = checkpoint.checkpoint_dir(tmp_path), torch.save
    size = (ckpts / checkpoint.LATEST).stat().st_size
    assert checkpoint.state_bytes(big_state(3)) == 1_800_000 == pytest.approx(size, rel=0.01)

    def on_a_full_disk(obj, f):
        os.dup2(os.open("/dev/full", os.O_WRONLY), f.fileno())
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", on_a_full_disk)
    with pytest.raises(CheckpointError) as error:
        checkpoint.save_checkpoint(big_state(3), tmp_path)
    message = re.sub(r"\(\d[\d.]* [GMk]B free", "(N free", str(error.value))  # others write on this disk meanwhile
    assert message == (f"could not write a checkpoint into {ckpts}: the disk is full (N free there; a checkpoint of "
                       "this run needs about 1.8 MB); the checkpoints published before are untouched. Free space "
                       "there (or move the run dir to a disk with room), then continue with trainer.resume=auto")
    assert (saved_step(ckpts / checkpoint.LATEST), saved_step(ckpts / checkpoint.PREVIOUS)) == (2, 1)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST, checkpoint.PREVIOUS]


def test_a_full_disk_that_torch_reports_as_its_own_error_is_named_too(tmp_path, monkeypatch):
    """On a disk that fills, the kernel takes part of a write and refuses the rest: torch.save raises a RuntimeError
    of its own, the OSError only its context (what this fault's first report showed), and the file's close has
    nothing left to fail on."""
    def filling(obj, f):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", filling)
    with pytest.raises(CheckpointError, match=r": the disk is full \(\d[\d.]* [kMG]B free there; a checkpoint of this "
                                              r"run needs about 1\.8 MB\)"):
        checkpoint.save_checkpoint(big_state(1), tmp_path)


def test_a_write_error_that_names_no_cause_on_a_disk_without_room_is_a_full_disk(tmp_path, monkeypatch):
    """torch.save given a path reports ENOSPC as `basic_ios::clear: iostream error`: the room left tells."""
    def unexplained(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", unexplained)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 500_000, 500_000))
    with pytest.raises(CheckpointError, match=r": the disk is full \(500 kB free there; a checkpoint of this run needs "
                                              r"about 1\.8 MB\)"):
        checkpoint.save_checkpoint(big_state(1), tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(CheckpointError, match=r"could not write a checkpoint into .* \(RuntimeError: \[enforce fail"):
        checkpoint.save_checkpoint(big_state(1), tmp_path)


def test_a_sharded_save_that_cannot_be_written_says_so_and_leaves_both_checkpoints(tmp_path, monkeypatch,
                                                                                   process_group):
    from torch.distributed.checkpoint import FileSystemWriter

    checkpoint.save_sharded(state_at(1), tmp_path, rank=0, mode="ddp")
    checkpoint.save_sharded(state_at(2), tmp_path, rank=0, mode="ddp")

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(CheckpointError, match=r"could not write a checkpoint into .*: the disk is full \(.* free "
                                              r"there; a checkpoint of this run needs about 16 bytes\)"):
        checkpoint.save_sharded(state_at(3), tmp_path, rank=0, mode="ddp")
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST_SHARDED, checkpoint.PREVIOUS_SHARDED]
    assert resumed_step(tmp_path, is_sharded=True) == 2


class Crash(BaseException):
    """The process dies: this filesystem operation and every later one never happen."""


MUTATIONS = [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "remove"), (shutil, "rmtree")]


def save_with_crash(monkeypatch, save, crash_at: int) -> bool:
    """Run `save` with the process dying before its `crash_at`-th filesystem mutation (the write of
    the checkpoint's bytes is mutation 0); True if it finished first."""
    done = [0]

    def dying(real):
        def op(*args, **kwargs):
            if done[0] >= crash_at:
                raise Crash()
            done[0] += 1
            return real(*args, **kwargs)
        return op

    real_save = torch.save

    def torn_save(obj, f, *args, **kwargs):
        if crash_at == 0:
            f.write(b"PK\x03\x04 torn")
            raise Crash()
        done[0] += 1
        return real_save(obj, f, *args, **kwargs)

    with monkeypatch.context() as m:
        for module, name in MUTATIONS:
            m.setattr(module, name, dying(getattr(module, name)))
        m.setattr(torch, "save", torn_save)
        try:
            save()
            return True
        except (Crash, CheckpointError):  # the sharded save reports what its writer raised as a CheckpointError
            return False


def single_process(out_dir, step):
    checkpoint.save_checkpoint(state_at(step), out_dir)


def sharded(out_dir, step):
    checkpoint.save_sharded(state_at(step), out_dir, rank=0, mode="fsdp")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-rank gloo group: torch.distributed.checkpoint's collectives run as under torchrun."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    yield
    distributed.teardown()


def resumed_step(out_dir, is_sharded: bool) -> int:
    loaded = checkpoint.load_checkpoint("auto", out_dir, CPU, template=template(), sharded=is_sharded)
    assert torch.equal(loaded.state["model"]["w"], torch.full((4,), float(loaded.state["step"])))
    return loaded.state["step"]


@pytest.mark.parametrize("save", [single_process, sharded])
def test_a_crash_between_any_two_filesystem_operations_leaves_a_checkpoint_to_resume(tmp_path, monkeypatch,
                                                                                      save, request):
    """Steps 1 and 2 saved, the save of step 3 killed at every point in turn: resume=auto must find step 2
    or 3, complete; before the publish begins both earlier checkpoints are untouched; then saving goes on."""
    is_sharded = save is sharded
    if is_sharded:
        request.getfixturevalue("process_group")
    crash_at, finished = 0, False
    while not finished:
        out_dir = tmp_path / f"crash{crash_at}"
        save(out_dir, 1)
        save(out_dir, 2)
        finished = save_with_crash(monkeypatch, lambda: save(out_dir, 3), crash_at)
        assert resumed_step(out_dir, is_sharded) in ((3,) if finished else (2, 3)), crash_at
        if crash_at == 0:
            names = (checkpoint.LATEST_SHARDED, checkpoint.PREVIOUS_SHARDED) if is_sharded else (checkpoint.LATEST, checkpoint.PREVIOUS)
            both = [checkpoint.load_checkpoint(str(checkpoint.checkpoint_dir(out_dir) / n), out_dir, CPU, template=template(),
                                           sharded=is_sharded) for n in names]
            assert [b.state["step"] for b in both] == [2, 1]
        with rundir.RunDirLock(out_dir):  # a restart: the dead save's temporaries go, the next save works
            save(out_dir, 4)
            assert resumed_step(out_dir, is_sharded) == 4
            assert not list(checkpoint.checkpoint_dir(out_dir).glob("*.tmp*"))
        crash_at += 1
    assert crash_at >= 3  # the write and the two renames were each interrupted once


def _two_rank_worker(rank, out_dir, store):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store}")
    try:
        def rank_state(value):
            return {"model": {"w": torch.full((4,), value)}, "rng": {"torch": torch.full((2,), value + rank)},
                    "progress": {"step": 3, "loss_sum": torch.tensor(value + 10 * rank)}, "config": CONFIG}

        checkpoint.save_sharded(rank_state(1.0), out_dir, rank, mode="ddp")
        checkpoint.save_sharded(rank_state(2.0), out_dir, rank, mode="ddp")
        loaded = checkpoint.load_checkpoint("auto", out_dir, CPU, template=rank_state(0.0), sharded=True, rank=rank)
        torch.save(loaded.state, out_dir / f"loaded.rank{rank}.pt")
        distributed.teardown(finished=True)
    finally:
        distributed.teardown()


def test_two_ranks_save_into_one_directory_and_each_gets_its_own_state_back(tmp_path):
    """What differs by rank (RNG states, running loss sums) comes back to the rank that saved it; the
    replicated weights to both; every rank writes into the one temporary directory rank 0 named."""
    import torch.multiprocessing as mp

    mp.start_processes(_two_rank_worker, args=(tmp_path, tmp_path / "store"), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        state = torch.load(tmp_path / f"loaded.rank{rank}.pt", weights_only=False)
        assert torch.equal(state["model"]["w"], torch.full((4,), 2.0))
        assert torch.equal(state["rng"]["torch"], torch.full((2,), 2.0 + rank))
        assert state["progress"]["loss_sum"].item() == 2.0 + 10 * rank and state["progress"]["step"] == 3
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint.LATEST_SHARDED, checkpoint.PREVIOUS_SHARDED]
    assert json.loads((ckpts / checkpoint.LATEST_SHARDED / checkpoint.JOB_INFO).read_text())["world_size"] == 2


def test_a_sharded_save_records_the_job_beside_its_shards(tmp_path, process_group):
    checkpoint.save_sharded(state_at(5), tmp_path, rank=0, mode="ddp")
    info = json.loads((checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED / checkpoint.JOB_INFO).read_text())
    assert info == {"world_size": 1, "mode": "ddp", "config": CONFIG}


# -- loading: fallback, clear errors ------------------------------------------------------------------
def two_checkpoints(out_dir, config: dict = CONFIG):
    checkpoint.save_checkpoint(state_at(1, config), out_dir)
    checkpoint.save_checkpoint(state_at(2, config), out_dir)
    return checkpoint.checkpoint_dir(out_dir) / checkpoint.LATEST


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, reason", [
    (truncate, "PytorchStreamReader failed reading zip archive"),
    (lambda p: p.write_bytes(b"not a checkpoint, just text\n" * 10), "UnpicklingError"),
    (lambda p: p.write_bytes(b""), "EOFError"),
    (lambda p: torch.save({"step": 2}, p), "incomplete (no config, model)"),
    (lambda p: torch.save([1, 2], p), "not a minitrain checkpoint"),
])
def test_auto_falls_back_past_a_bad_latest_with_a_note(tmp_path, damage, reason):
    damage(two_checkpoints(tmp_path))
    loaded = checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template())
    assert loaded.state["step"] == 1 and loaded.path == checkpoint.checkpoint_dir(tmp_path) / checkpoint.PREVIOUS
    assert len(loaded.notes) == 1
    assert "checkpoints/latest.pt" in loaded.notes[0] and reason in loaded.notes[0]
    assert re.search(r"; kept aside as checkpoints/latest\.pt\.unusable-\d{8}-\d{6}; resumed from "
                     r"checkpoints/previous\.pt$", loaded.notes[0]), loaded.notes[0]


def test_after_a_fallback_previous_stays_the_checkpoint_that_loaded_and_the_bad_one_is_kept_aside(tmp_path):
    """The next saves must not rotate the unreadable latest.pt into previous.pt, over the only good checkpoint:
    a crash before the second save would leave nothing to resume from."""
    latest = two_checkpoints(tmp_path)
    truncate(latest)
    torn = latest.read_bytes()
    assert resumed_step(tmp_path, is_sharded=False) == 1
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    [aside] = ckpts.glob("latest.pt.unusable-*")
    assert aside.read_bytes() == torn and sorted(p.name for p in ckpts.iterdir()) == [aside.name, checkpoint.PREVIOUS]
    assert checkpoint.holds_checkpoint(tmp_path)
    loaded = checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template())  # a crash before the next save
    assert loaded.state["step"] == 1 and loaded.notes[0].startswith(
        f"checkpoints/latest.pt is absent (a save was interrupted, or it was kept aside as {aside.name}); resumed")
    checkpoint.save_checkpoint(state_at(2), tmp_path)
    assert (saved_step(ckpts / checkpoint.LATEST), saved_step(ckpts / checkpoint.PREVIOUS)) == (2, 1)
    with rundir.RunDirLock(tmp_path):  # a restart: what it removes as a dead save's temporary, it must not be
        assert aside.read_bytes() == torn
    truncate(ckpts / checkpoint.LATEST)  # and a second fallback finds the one that loaded
    assert resumed_step(tmp_path, is_sharded=False) == 1
    assert len(list(ckpts.glob("latest.pt.unusable-*"))) == 2


def test_a_fallback_in_another_runs_dir_leaves_that_dir_as_it_is(tmp_path):
    """This run saves into its own dir: the other run's files are not this run's to rename."""
    truncate(two_checkpoints(tmp_path / "old-run"))
    before = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path / "old-run").iterdir())
    loaded = checkpoint.load_checkpoint(str(tmp_path / "old-run"), tmp_path / "new-run", CPU, template=template())
    assert loaded.state["step"] == 1 and "kept aside" not in loaded.notes[0]
    assert sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path / "old-run").iterdir()) == before


def test_auto_takes_previous_when_a_save_stopped_between_its_renames(tmp_path):
    os.replace(two_checkpoints(tmp_path), checkpoint.checkpoint_dir(tmp_path) / "latest.pt.tmp.1.ab")
    loaded = checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template())
    assert loaded.state["step"] == 1 and "checkpoints/latest.pt is absent" in loaded.notes[0]


def test_auto_names_every_bad_checkpoint_when_none_is_usable(tmp_path):
    latest = two_checkpoints(tmp_path)
    truncate(latest)
    (latest.parent / checkpoint.PREVIOUS).write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template())
    message = str(error.value)
    assert "checkpoints/latest.pt is unreadable (RuntimeError: PytorchStreamReader" in message
    assert "checkpoints/previous.pt is unreadable (EOFError" in message


def test_a_good_latest_is_taken_without_notes_and_a_fresh_dir_starts_fresh(tmp_path):
    assert checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template()) is None
    assert checkpoint.load_checkpoint("none", tmp_path, CPU, template=template()) is None
    two_checkpoints(tmp_path)
    assert checkpoint.load_checkpoint("none", tmp_path, CPU, template=template()) is None
    loaded = checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template())
    assert loaded.state["step"] == 2 and loaded.notes == []


def test_an_explicit_checkpoint_file_never_falls_back(tmp_path):
    latest = two_checkpoints(tmp_path)
    truncate(latest)
    with pytest.raises(CheckpointError, match=r"latest\.pt is unreadable") as error:
        checkpoint.load_checkpoint(str(latest), tmp_path / "new-run", CPU, template=template())
    assert "previous" not in str(error.value)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load_checkpoint(str(tmp_path / "nothing.pt"), tmp_path, CPU, template=template())


def test_an_explicit_run_dir_is_searched_like_auto(tmp_path):
    truncate(two_checkpoints(tmp_path / "old-run"))
    loaded = checkpoint.load_checkpoint(str(tmp_path / "old-run"), tmp_path / "new-run", CPU, template=template())
    assert loaded.state["step"] == 1 and "unreadable" in loaded.notes[0]


def write_sharded_dir(path, world_size=4, mode="fsdp"):
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / checkpoint.JOB_INFO).write_text(json.dumps({"world_size": world_size, "mode": mode, "config": CONFIG}))


def test_a_torchrun_checkpoint_resumed_by_one_process_is_refused_with_the_command(tmp_path):
    write_sharded_dir(checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED)
    for value in ("auto", str(checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED)):
        with pytest.raises(CheckpointError) as error:
            checkpoint.load_checkpoint(value, tmp_path, CPU, template=template(), sharded=False)
        message = str(error.value)
        assert "torchrun job (4 processes, distributed=fsdp)" in message
        assert "torchrun --standalone --nproc_per_node=4 scripts/train.py distributed=fsdp" in message


def test_a_single_process_checkpoint_resumed_under_torchrun_is_refused(tmp_path):
    latest = two_checkpoints(tmp_path)
    for value in ("auto", str(latest)):
        with pytest.raises(CheckpointError, match="written by a single-process run.*python scripts/train.py"):
            checkpoint.load_checkpoint(value, tmp_path, CPU, template=template(), sharded=True)


def test_sharded_auto_falls_back_past_an_unfinished_latest(tmp_path, process_group):
    checkpoint.save_sharded(state_at(1), tmp_path, rank=0, mode="fsdp")
    checkpoint.save_sharded(state_at(2), tmp_path, rank=0, mode="fsdp")
    latest = checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED
    (latest / checkpoint.JOB_INFO).unlink()
    loaded = checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template(), sharded=True)
    assert loaded.state["step"] == 1 and loaded.state["config"] == CONFIG
    assert torch.equal(loaded.state["model"]["w"], torch.full((4,), 1.0))
    assert f"checkpoints/latest has no readable {checkpoint.JOB_INFO}" in loaded.notes[0]
    [aside] = checkpoint.checkpoint_dir(tmp_path).glob("latest.unusable-*")  # never rotated into previous/
    assert (aside / ".metadata").is_file() and not latest.exists()
    checkpoint.save_sharded(state_at(3), tmp_path, rank=0, mode="fsdp")
    assert resumed_step(tmp_path, is_sharded=True) == 3
    assert checkpoint.load_checkpoint(str(checkpoint.checkpoint_dir(tmp_path) / checkpoint.PREVIOUS_SHARDED), tmp_path, CPU,
                                  template=template(), sharded=True).state["step"] == 1
    (checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED / ".metadata").unlink()
    assert "no .metadata" in checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template(), sharded=True).notes[0]


def test_a_sharded_checkpoint_of_another_world_size_is_refused(tmp_path, process_group):
    write_sharded_dir(checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED, world_size=2)
    with pytest.raises(CheckpointError, match="written by 2 processes; this job has 1.*--nproc_per_node=2"):
        checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template(), sharded=True)


def test_a_sharded_checkpoint_with_a_torn_shard_fails_naming_it(tmp_path, process_group):
    checkpoint.save_sharded(state_at(1), tmp_path, rank=0, mode="fsdp")
    latest = checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST_SHARDED
    for shard in latest.glob("*.distcp"):
        shard.write_bytes(b"xx")
    with pytest.raises(CheckpointError, match=r"checkpoints/latest \(rank 0\) could not be loaded \(\w+Error"):
        checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template(), sharded=True)


@pytest.mark.parametrize("is_sharded", [False, True])
def test_a_changed_config_is_refused_or_noted_by_either_kind(tmp_path, is_sharded, request):
    if is_sharded:
        request.getfixturevalue("process_group")
        checkpoint.save_sharded(state_at(1), tmp_path, rank=0, mode="fsdp")
    else:
        checkpoint.save_checkpoint(state_at(1), tmp_path)
    changed_lr = {"trainer": {"lr": 0.01, "max_steps": 20}, "model": {"n_layer": 2}}
    with pytest.raises(CheckpointError, match=r"trainer\.lr: saved 0\.001, now 0\.01"):
        checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template(changed_lr), sharded=is_sharded)
    longer = {"trainer": {"lr": 0.001, "max_steps": 40}, "model": {"n_layer": 2}}
    loaded = checkpoint.load_checkpoint("auto", tmp_path, CPU, template=template(longer), sharded=is_sharded)
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
