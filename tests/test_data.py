import numpy as np
import pytest
import torch

from minitrain import data as data_mod
from minitrain.config import DataConfig
from minitrain.data import Batches, DataError, prepare_data, stdlib_files


@pytest.fixture(scope="session")
def stdlib_data(data_cache):
    return prepare_data(DataConfig(cache_dir=str(data_cache)), block_size=64, progress=False)


def test_stdlib_corpus_is_real_text(stdlib_data):
    assert len(stdlib_files()) > 500
    assert stdlib_data.vocab_size == 4096
    assert stdlib_data.tokens.dtype == np.uint16  # the vocab fits in 16 bits
    assert len(stdlib_data.tokens) > 1_000_000 and 0 < stdlib_data.n_val < len(stdlib_data.tokens) // 50
    assert int(stdlib_data.tokens.max()) < stdlib_data.vocab_size


def test_tokenizer_round_trip(stdlib_data):
    text = open(torch.__file__.replace("__init__.py", "functional.py")).read()[:5000] + "\n  ünïcødé ✓\t"
    ids = stdlib_data.tokenizer.encode(text).ids
    assert len(ids) < len(text) / 2  # BPE merges learned from Python code compress Python code
    assert stdlib_data.decode(ids) == text


def test_cache_is_reused(data_cache, stdlib_data, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("read the corpus again instead of using the cache")

    monkeypatch.setattr(data_mod, "load_corpus", fail)
    monkeypatch.setattr(data_mod, "_train_tokenizer", fail)
    again = prepare_data(DataConfig(cache_dir=str(data_cache)), block_size=64, progress=False)
    assert again.path == stdlib_data.path
    np.testing.assert_array_equal(again.tokens[:1000], stdlib_data.tokens[:1000])


def test_local_files_and_uint32_not_needed(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog %d. " % i) * 200)
    cfg = DataConfig(name="files", source="files", paths=str(tmp_path / "*.txt"), vocab_size=300,
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.1, num_proc=1)
    data = prepare_data(cfg, block_size=16, progress=False)
    assert data.vocab_size <= 300
    assert "quick brown" in data.decode(data.train[:64])


@pytest.mark.parametrize("setup, message", [
    ("missing", "matched no files"),
    ("empty", "files are empty"),
    ("short", "too short"),
])
def test_bad_corpus_errors_name_the_problem(tmp_path, setup, message):
    if setup == "empty":
        (tmp_path / "a.txt").write_text("")
    if setup == "short":
        (tmp_path / "a.txt").write_text("just a few words of text")
    cfg = DataConfig(name="files", source="files", paths=str(tmp_path / "*.txt"), vocab_size=300,
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
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
