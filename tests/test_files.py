"""The helpers every file published by rename goes through, and the lock every shared folder is taken with."""

import errno
import os

import pytest

from minitrain import files


def test_temporary_names_differ_between_writes_and_only_they_count_as_temporaries(tmp_path):
    path = tmp_path / "metrics.jsonl"
    a, b = files.temp_path(path), files.temp_path(path)
    assert a != b and str(os.getpid()) in a.name and files.is_temporary(a) and files.is_temporary(b)
    for kept in ("metrics.jsonl", "latest", "latest.unusable-20261203-101010", "notes.tmp", "tmp.1"):
        assert not files.is_temporary(tmp_path / kept), kept


def test_removing_temporaries_leaves_every_published_name(tmp_path):
    for name in ("latest", "latest.tmp.12.beef", "memory.json", "memory.json.tmp.3", "latest.unusable-1"):
        (tmp_path / name).mkdir() if "latest" in name else (tmp_path / name).write_text("")
    (tmp_path / "latest.tmp.12.beef" / "shard").write_text("")
    removed = files.remove_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == ["latest.tmp.12.beef", "memory.json.tmp.3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "latest.unusable-1", "memory.json"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = files.atomic_write(tmp_path / "memory.json", '{"old": 1}')
    assert path.read_text() == '{"old": 1}'

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        files.atomic_write(path, '{"new": 2}')
    assert path.read_text() == '{"old": 1}' and [p.name for p in tmp_path.iterdir()] == ["memory.json"]


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_publish_keeps_the_one_before_or_deletes_it(tmp_path, kind):
    def make(name, content):
        path = tmp_path / name
        if kind == "dir":
            path.mkdir()
            (path / "x").write_text(content)
        else:
            path.write_text(content)
        return path

    def read(name):
        path = tmp_path / name
        return (path / "x" if kind == "dir" else path).read_text()

    latest, previous = tmp_path / "latest", tmp_path / "previous"
    for step in ("1", "2", "3"):
        files.publish(make(f"new{step}", step), latest, previous)
    assert (read("latest"), read("previous")) == ("3", "2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "previous"]
    files.publish(make("new4", "4"), latest)  # no previous to keep: the one replaced goes
    assert read("latest") == "4" and sorted(p.name for p in tmp_path.iterdir()) == ["latest", "previous"]


def test_a_lock_excludes_a_second_holder_until_released(tmp_path):
    first = files.lock(tmp_path / ".lock", wait=False)
    assert first is not None
    assert files.lock(tmp_path / ".lock", wait=False) is None
    first.release()
    again = files.lock(tmp_path / ".lock", wait=False)
    assert again is not None
    again.release()
