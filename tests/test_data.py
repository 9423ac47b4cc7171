"""The token cache (built once, checked at every start, rebuilt saying why), the corpus checks and the batches."""

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from minitrain import files
from minitrain.config import DataConfig
from minitrain.cli import resolve_data
from minitrain.data import Batches, DataError, TokenStream, prepare_data, shards, stdlib_files
from minitrain.data import prepare as prepare_mod


@pytest.fixture(scope="session")
def stdlib_data(data_cache):
    return prepare_data(resolve_data([f"data.cache_dir={data_cache}"]), block_size=64, progress=False)


def test_stdlib_corpus_is_real_text(stdlib_data):
    assert len(stdlib_files()) > 500
    assert stdlib_data.vocab_size == 4096
    assert stdlib_data.train.dtype == np.uint16  # the vocab fits in 16 bits
    train, val = len(stdlib_data.train), len(stdlib_data.val)
    assert train > 1_000_000 and train // 200 < val < train // 20  # configs/data/stdlib.yaml holds out 2%
    assert max(int(s.max()) for s in stdlib_data.train.shards + stdlib_data.val.shards) < stdlib_data.vocab_size


def test_tokenizer_round_trip(stdlib_data):
    text = open(torch.__file__.replace("__init__.py", "functional.py")).read()[:5000] + "\n  ünïcødé ✓\t"
    ids = stdlib_data.tokenizer.encode(text).ids
    assert len(ids) < len(text) / 2  # BPE merges learned from Python code compress Python code
    assert stdlib_data.decode(ids) == text


def test_cache_is_reused(data_cache, stdlib_data, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("prepared the corpus again instead of using the cache")

    monkeypatch.setattr(prepare_mod._Preparation, "run", fail)
    again = prepare_data(resolve_data([f"data.cache_dir={data_cache}"]), block_size=64, progress=False)
    assert again.path == stdlib_data.path
    np.testing.assert_array_equal(again.train[:1000], stdlib_data.train[:1000])


def test_local_files(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog %d. " % i) * 200)
    cfg = DataConfig(name="files", source="files", paths=str(tmp_path / "*.txt"), vocab_size=300,
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    data = prepare_data(cfg, block_size=16, progress=False)
    assert data.vocab_size <= 300
    assert "quick brown" in data.decode(data.train[:64])


@pytest.mark.parametrize("setup, message", [
    ("missing", "matched no files"),
    ("a directory", r"matched no files; it names a directory: give a glob of its files, e\.g\. data\.paths='.*/\*\*/\*\.txt'"),
    ("empty", "the corpus holds no text: all 2 files are empty"),
    ("short", "too short"),
    ("cache under a file", "data.cache_dir=.*: cannot keep the token cache there"),
])
def test_bad_corpus_errors_name_the_problem(tmp_path, setup, message):
    paths, cache_dir = tmp_path / "*.txt", tmp_path / "cache"
    if setup == "a directory":
        paths = tmp_path
    if setup == "empty":
        (tmp_path / "a.txt").write_text("")
        (tmp_path / "b.txt").write_text("")
    if setup in ("short", "cache under a file"):
        (tmp_path / "a.txt").write_text("just a few words of text")
    if setup == "cache under a file":
        cache_dir.write_text("")
        cache_dir = cache_dir / "minitrain"
    cfg = DataConfig(name="files", source="files", paths=str(paths), vocab_size=300, cache_dir=str(cache_dir))
    with pytest.raises(DataError, match=message):
        prepare_data(cfg, block_size=64, progress=False)


def test_batches_depend_only_on_seed_and_step(stdlib_data):
    b = Batches(stdlib_data.train, 32, 8, seed=3, device=torch.device("cpu"))
    x1, y1 = b.get(5)
    x2, _ = Batches(stdlib_data.train, 32, 8, seed=3, device=torch.device("cpu")).get(5)
    assert torch.equal(x1, x2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(b.get(6)[0], x1)
    # Splitting the global batch into parts (micro-batches, ranks) keeps the same windows.
    parts = [b.get(5, p, 4)[0] for p in range(4)]
    assert torch.equal(torch.cat(parts), x1)


def test_batches_are_the_token_windows_at_their_starts(stdlib_data):
    b = Batches(stdlib_data.train, 32, 8, seed=3, device=torch.device("cpu"))
    x, y = b.get(7, 1, 2)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 32)
    for row, start in zip(range(4), b.starts(7)[4:]):
        window = torch.from_numpy(stdlib_data.train[start:start + 33].astype(np.int64))
        assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])


@pytest.mark.parametrize("shard_tokens", [7, 10, 33, 1000])
def test_windows_cross_shard_boundaries_as_in_one_array(shard_tokens):
    """Shards are a storage detail: every window, wherever it starts, is the one of the unsharded stream, so the
    batches are the same whatever the shard size (a step's windows never depend on how the cache was cut)."""
    tokens = np.random.default_rng(0).integers(0, 60000, size=100).astype(np.uint16)
    stream = TokenStream([tokens[i:i + shard_tokens] for i in range(0, len(tokens), shard_tokens)])
    assert len(stream) == 100
    for start in range(0, 100 - 33 + 1):
        out = np.empty(33, dtype=np.int64)
        stream.read(start, out)
        np.testing.assert_array_equal(out, tokens[start:start + 33])
    whole = Batches(tokens, 32, 16, seed=1, device=torch.device("cpu"))
    sharded = Batches(stream, 32, 16, seed=1, device=torch.device("cpu"))
    for step in range(3):
        assert torch.equal(whole.get(step)[0], sharded.get(step)[0])


def test_a_stream_of_exactly_one_window_gives_that_window():
    """T + 1 tokens, the shortest split prepare_data accepts: every window of every step is the whole stream."""
    T = 8
    x, y = Batches(np.arange(T + 1, dtype=np.uint16), T, batch_size=4, seed=0, device=torch.device("cpu")).get(3)
    assert torch.equal(x, torch.arange(T).expand(4, T)) and torch.equal(y, x + 1)


def test_windows_reach_the_last_token_and_stay_inside():
    """T + 2 tokens hold two windows of T + 1: both are drawn, and none reads past the end."""
    T = 8
    batches = Batches(np.arange(T + 2, dtype=np.uint16), T, batch_size=16, seed=0, device=torch.device("cpu"))
    firsts = set()
    for step in range(4):
        x, y = batches.get(step)
        firsts |= set(x[:, 0].tolist())
        assert torch.equal(y, x + 1)
    assert firsts == {0, 1}


def test_windows_are_gathered_on_the_host_whatever_torchs_default_device():
    """Under torch.set_default_device (here "meta", which every machine has; a user's is "cuda") the windows are
    still read into host memory, pinned there for a GPU: made on the default device, they could be neither pinned
    ("Only dense CPU tensors can be pinned") nor filled through numpy."""
    T = 8
    with torch.device("meta"):
        x, y = Batches(np.arange(T + 1, dtype=np.uint16), T, batch_size=4, seed=0, device=torch.device("cpu")).get(3)
    assert x.device.type == "cpu" and torch.equal(x, torch.arange(T).expand(4, T)) and torch.equal(y, x + 1)


# -- the token cache checks itself at every start ---------------------------------------------------------------

def small_corpus(tmp_path, docs=40, **settings):
    """`docs` small documents of varied words (so several land in validation), as one file each."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    (tmp_path / "text").mkdir(exist_ok=True)
    for i in range(docs):
        (tmp_path / "text" / f"doc{i:03d}.txt").write_text(
            " ".join(words[(i * 7 + j * j) % len(words)] for j in range(60 + i)) + f" {i}\n")
    return DataConfig(**{"name": "files", "source": "files", "paths": str(tmp_path / "text" / "*.txt"),
                         "vocab_size": 300, "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.2,
                         "shard_tokens": 1024, **settings})


def _truncate(path):
    shard = path / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])


def _large_ids(path):
    with open(path / "train-00001.bin", "r+b") as f:  # ids far beyond the vocabulary, same size
        f.seek(f.seek(0, 2) // 2)
        f.write(b"\xff" * 64)


def _index(path, edit):
    index = json.loads((path / "index.json").read_text())
    edit(index)
    (path / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("corrupt, reason", [
    (_truncate, "train-00000.bin holds"),
    (lambda p: (p / "val-00000.bin").unlink(), "val-00000.bin is unreadable"),
    (_large_ids, "train-00001.bin does not match its checksum"),
    (lambda p: (p / "index.json").write_text('{"format": 2'), "index.json is unreadable"),
    (lambda p: _index(p, lambda i: i.update(shard_tokens="many")), "index.json is unreadable"),
    (lambda p: _index(p, lambda i: i.pop("tokenizer_checksum")), "index.json is unreadable"),
    (lambda p: _index(p, lambda i: i.update(format=1)), "written by another minitrain"),
    (lambda p: _index(p, lambda i: i["splits"]["val"]["shards"][0].update(max_token=300)), "largest token id 300"),
    (lambda p: _index(p, lambda i: i["splits"]["train"].update(tokens=5)), "the train shards hold"),
    (lambda p: (p / "tokenizer.json").write_text("{}"), "tokenizer.json is unreadable"),
    (lambda p: (p / "tokenizer.json").write_text(  # still a valid tokenizer, another one
        (p / "tokenizer.json").read_text().replace('"add_prefix_space": false', '"add_prefix_space": true', 1)),
     "tokenizer.json does not match"),
])
def test_an_unusable_cache_is_rebuilt_saying_why(tmp_path, corrupt, reason):
    cfg = small_corpus(tmp_path)
    said = []
    fresh = prepare_data(cfg, block_size=16, progress=False, notify=said.append)
    assert said == ["data: training a 300-token BPE on up to 64 MB of the files corpus"]  # a first build's one note
    assert len(fresh.train.shards) >= 2  # the corruptions above have more than one shard to choose from
    fresh_train, fresh_val, fresh_vocab = fresh.train[:], fresh.val[:], fresh.tokenizer.get_vocab()
    corrupt(fresh.path)
    files.temp_path(fresh.path).mkdir()  # the cache set aside by a publication that crashed
    said.clear()
    again = prepare_data(cfg, block_size=16, progress=False, notify=said.append)
    assert str(fresh.path) in said[0] and reason in said[0], said
    assert again.path == fresh.path
    np.testing.assert_array_equal(again.train[:], fresh_train)
    np.testing.assert_array_equal(again.val[:], fresh_val)
    assert again.tokenizer.get_vocab() == fresh_vocab
    assert sorted(p.name for p in fresh.path.parent.iterdir()) == sorted(
        [fresh.path.name, fresh.path.name + ".lock"])  # nothing left aside, nothing of the build
    quiet = []
    prepare_data(cfg, block_size=16, progress=False, notify=quiet.append)
    assert quiet == []  # the rebuilt cache passes its own check


def test_a_cache_rebuilt_by_another_process_while_waiting_is_used(tmp_path, monkeypatch):
    """Ranks and sweep jobs that find the cache unusable queue on its lock; once the first has rebuilt it,
    the others read that one."""
    cfg = small_corpus(tmp_path)
    fresh = prepare_data(cfg, block_size=16, progress=False)
    good = tmp_path / "good"
    shutil.copytree(fresh.path, good)
    _truncate(fresh.path)
    real_lock = prepare_mod.files.lock

    def lock_after_another_rebuild(path, wait=True):
        shutil.rmtree(fresh.path)  # what the lock's holder does before it lets go
        shutil.copytree(good, fresh.path)
        return real_lock(path, wait)

    def fail(*a, **k):
        raise AssertionError("rebuilt a cache that another process had just rebuilt")

    monkeypatch.setattr(prepare_mod.files, "lock", lock_after_another_rebuild)
    monkeypatch.setattr(prepare_mod._Preparation, "run", fail)
    said = []
    again = prepare_data(cfg, block_size=16, progress=False, notify=said.append)
    assert said == []
    np.testing.assert_array_equal(again.train[:1024], np.fromfile(good / "train-00000.bin", dtype=np.uint16))


def test_checksum_covers_a_small_shard_whole_and_samples_a_large_one(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_CHECK_CHUNK_BYTES", 16)
    monkeypatch.setattr(shards, "_CHECK_CHUNKS", 4)
    path = tmp_path / "train-00000.bin"

    def checksum_after_flipping(data: bytes, offset: int) -> str:
        flipped = bytearray(data)
        flipped[offset] ^= 1
        path.write_bytes(bytes(flipped))
        return shards.shard_checksum(path)

    small = bytes(range(60))  # four chunks cover it whole
    path.write_bytes(small)
    original = shards.shard_checksum(path)
    assert all(checksum_after_flipping(small, i) != original for i in range(len(small)))
    large = bytes(range(256)) * 4  # four chunks at 0, 336, 672, 1008
    path.write_bytes(large)
    original = shards.shard_checksum(path)
    assert checksum_after_flipping(large, 0) != original and checksum_after_flipping(large, 1023) != original
    assert checksum_after_flipping(large, 340) != original and checksum_after_flipping(large, 100) == original


def test_an_id_out_of_range_where_the_checksum_does_not_look_fails_at_its_batch(tmp_path, monkeypatch):
    """A large shard is checksummed in samples: ids corrupted between them pass the start, and must stop the run
    at the first batch that holds one, naming the cache, before the embedding sees them."""
    monkeypatch.setattr(shards, "_CHECK_CHUNK_BYTES", 16)
    monkeypatch.setattr(shards, "_CHECK_CHUNKS", 2)  # the first and the last 16 bytes of each shard
    cfg = small_corpus(tmp_path)
    data = prepare_data(cfg, block_size=16, progress=False)
    for shard in sorted(data.path.glob("train-*.bin")):
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.seek(64)
            f.write(b"\xff" * (size - 128))  # every token between the two sampled chunks
    said = []
    data = prepare_data(cfg, block_size=16, progress=False, notify=said.append)
    assert said == []  # passes its check at start
    unchecked = Batches(data.train, 16, 4, seed=0, device=torch.device("cpu"))
    assert int(unchecked.get(0)[0].max()) == 0xFFFF >= data.vocab_size
    batches = Batches(data.train, 16, 4, seed=0, device=torch.device("cpu"), vocab_size=data.vocab_size,
                      cache_path=data.path)
    with pytest.raises(DataError, match=f"step 0 holds token id 65535, outside the tokenizer's {data.vocab_size}"):
        batches.get(0)
    edge = np.full(17, data.vocab_size - 1, dtype=np.uint16)  # one window: the largest id in range passes
    Batches(edge, 16, 1, seed=0, device=torch.device("cpu"), vocab_size=data.vocab_size).get(0)
    edge[-1] = data.vocab_size
    with pytest.raises(DataError, match=f"token id {data.vocab_size},"):
        Batches(edge, 16, 1, seed=0, device=torch.device("cpu"), vocab_size=data.vocab_size).get(0)


# -- non-text input ------------------------------------------------------------------------------------------------

def _write_corpus(tmp_path, **files):
    (tmp_path / "text").mkdir()
    for name, content in files.items():
        (tmp_path / "text" / name.replace("_", ".")).write_bytes(content)
    return DataConfig(name="files", source="files", paths=str(tmp_path / "text" / "*"), vocab_size=300,
                      cache_dir=str(tmp_path / "cache"), val_fraction=0.3)


PROSE = "the quick brown fox jumps over the lazy dog, and then it rests a while. " * 60


@pytest.mark.parametrize("binary", [
    random.Random(0).randbytes(5000),  # compressed or random data
    PROSE.encode("utf-16-le"),  # NUL bytes, otherwise valid UTF-8
    ("съешь же ещё этих мягких французских булок, да выпей чаю. " * 40).encode("cp1251"),  # no NUL, not UTF-8
])
def test_non_text_files_are_refused_naming_them(tmp_path, binary):
    bad = {f"blob{i}_bin": binary for i in range(6)}
    cfg = _write_corpus(tmp_path, a_txt=PROSE.encode(), b_txt=PROSE.encode(), **bad)
    with pytest.raises(DataError, match=r"data.paths=.*6 of 8 files are not UTF-8 text: .*blob0.bin.*and 1 more"):
        prepare_data(cfg, block_size=16, progress=False)


def test_text_with_a_few_stray_bytes_is_text(tmp_path):
    latin1 = PROSE.encode() + "café, naïve, déjà vu ".encode("latin-1") + PROSE.encode()
    cfg = _write_corpus(tmp_path, a_txt=latin1, b_txt=PROSE.encode(), c_py=open(prepare_mod.__file__, "rb").read())
    notes = []
    data = prepare_data(cfg, block_size=16, progress=False, notify=notes.append)
    text = data.decode(data.train[:]) + data.decode(data.val[:])
    assert "caf\ufffd" in text
    # ... and said so, naming the file and what to do (a file in another encoding reads like this)
    stray = [n for n in notes if "hold bytes that are not UTF-8" in n]
    assert len(stray) == 1 and "1 of 3 files" in stray[0]
    assert "a.txt" in stray[0] and "b.txt" not in stray[0] and "iconv" in stray[0]


# -- nothing outside data.cache_dir --------------------------------------------------------------------------------

def test_a_build_writes_nothing_under_the_home_directory(tmp_path):
    """Libraries default to caches under the home directory; data.cache_dir must hold everything."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "XDG_CACHE_HOME"}
    cfg = small_corpus(tmp_path)
    build = ("import sys; from minitrain.config import DataConfig; from minitrain.data import prepare_data; "
             "prepare_data(DataConfig(name='files', source='files', paths=sys.argv[1], vocab_size=300, "
             "cache_dir=sys.argv[2], val_fraction=0.2), block_size=16, progress=False)")
    subprocess.run([sys.executable, "-c", build, cfg.paths, cfg.cache_dir], env=env | {"HOME": str(home)},
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    assert list(home.rglob("*")) == []
    assert len(list((tmp_path / "cache").iterdir())) == 2  # the cache and its lock file
