"""Preparation: the shards against a plain reference tokenization, the document split, a preparation stopped at
any moment and continued (bit-identical shards), no worker left behind, hub datasets streamed, pretrained
tokenizers, and what each failure says."""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from minitrain.config import DataConfig
from minitrain.cli import resolve_data
from minitrain.data import DataError, prepare_data
from minitrain.data import corpus as corpus_mod
from minitrain.data import prepare as prepare_mod
from minitrain.data.corpus import cut, is_validation
from minitrain.data.prepare import EOT
from minitrain.data.shards import ShardWriter, token_dtype
from minitrain.errors import ConfigError

from conftest import REPO, ctrl_c_as_in_a_terminal

# Small enough that a few kB of text make several documents per file, many chunks per document, and many batches.
SMALL = {"DOC_CHARS": 3000, "CHUNK_CHARS": 200, "BATCH_CHARS": 2500}
MODULES = ("textwrap", "string", "fnmatch", "glob", "shlex", "bisect", "colorsys", "keyword")


@pytest.fixture
def small_pieces(monkeypatch):
    for name, value in SMALL.items():
        monkeypatch.setattr(corpus_mod, name, value)


def code_corpus(tmp_path: Path, **settings) -> DataConfig:
    """Standard-library modules (indented code: whitespace the chunk cuts must not change) and a file without a
    final newline, one per file; several are longer than SMALL's DOC_CHARS."""
    folder = tmp_path / "text"
    folder.mkdir(exist_ok=True)
    for name in MODULES:
        (folder / f"{name}.py").write_text((Path(os.__file__).parent / f"{name}.py").read_text())
    (folder / "zz_no_newline.txt").write_text("the end, without a newline:    ")
    return DataConfig(**{"name": "files", "source": "files", "paths": str(folder / "*"), "vocab_size": 400,
                         "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.25, "shard_tokens": 1024,
                         **settings})


def reference_streams(texts: list[str], tokenizer, val_fraction: float) -> dict[str, list[int]]:
    """Each split's tokens the plain way: each text cut into documents at line ends (`cut`), each document encoded
    whole, an EOT after it, in order, to the split its hash gives."""
    eot, streams = tokenizer.token_to_id(EOT), {"train": [], "val": []}
    for text in texts:
        for doc in cut(iter_reader(text), corpus_mod.DOC_CHARS):
            split = "val" if is_validation(doc.encode(), val_fraction) else "train"
            streams[split] += tokenizer.encode(doc, add_special_tokens=False).ids + [eot]
    return streams


def iter_reader(text: str):
    import io

    return io.StringIO(text).read


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_shards_hold_the_reference_tokens(tmp_path, small_pieces):
    cfg = code_corpus(tmp_path)
    data = prepare_data(cfg, block_size=16, progress=False)
    texts = [Path(f).read_text() for f in sorted(Path(cfg.paths).parent.iterdir())]
    expected = reference_streams(texts, data.tokenizer, cfg.val_fraction)
    assert len(expected["val"]) > 0 and len(expected["train"]) > 4 * cfg.shard_tokens  # both splits, many shards
    np.testing.assert_array_equal(data.train[:], expected["train"])
    np.testing.assert_array_equal(data.val[:], expected["val"])
    index = json.loads((data.path / "index.json").read_text())
    for split, stream in (("train", data.train), ("val", data.val)):
        records = index["splits"][split]["shards"]
        assert len(records) == -(-len(stream) // cfg.shard_tokens)
        assert [r["tokens"] for r in records[:-1]] == [cfg.shard_tokens] * (len(records) - 1)
        assert [r["max_token"] for r in records] == [int(s.max()) for s in stream.shards]
    assert index["dtype"] == "uint16" and data.train.dtype == np.uint16
    assert sorted(p.name for p in data.path.iterdir()) == sorted(
        ["index.json", "tokenizer.json"] + [r["file"] for s in ("train", "val") for r in index["splits"][s]["shards"]])


def test_a_documents_chunks_tokenize_as_the_whole_document(data_cache, monkeypatch):
    """With the stdlib's 4096-token BPE, whose merges span newlines and indentation: a cut anywhere else than
    before whitespace that follows a non-space character changes the tokens around it."""
    tokenizer = prepare_data(resolve_data([f"data.cache_dir={data_cache}"]), progress=False).tokenizer
    monkeypatch.setattr(corpus_mod, "CHUNK_CHARS", 300)
    for name in MODULES:
        text = (Path(os.__file__).parent / f"{name}.py").read_text()
        pieces = list(corpus_mod.chunks(text))
        assert len(pieces) > 2 and "".join(pieces) == text
        assert [i for piece in pieces for i in tokenizer.encode(piece).ids] == tokenizer.encode(text).ids, name


def test_cut_pieces_join_into_the_text_and_end_where_tokens_split():
    text = "def f():\n    return 1\n\n\n    x = 2\nend\n" * 20 + "tail without newline"
    pieces = list(cut(iter_reader(text), 50))
    assert "".join(pieces) == text and all(len(p) <= 50 for p in pieces) and len(pieces) > 10
    for piece, following in zip(pieces, pieces[1:]):
        assert not piece[-1].isspace() and following[0] == "\n"  # before a newline that follows a non-space
    words = "word " * 30  # no line end: before a space that follows a non-space
    pieces = list(cut(iter_reader(words), 50))
    assert "".join(pieces) == words and len(pieces) == 4
    assert all(not piece[-1].isspace() and following[0] == " " for piece, following in zip(pieces, pieces[1:]))
    assert list(cut(iter_reader("x" * 120), 50)) == ["x" * 50, "x" * 50, "x" * 20]  # neither: at the limit
    assert list(cut(iter_reader(""), 50)) == []


def test_the_tokenizer_learns_from_a_bounded_sample_spread_over_the_corpus(tmp_path, monkeypatch):
    """One file far larger than the sample: the trainer sees windows of whole lines from its start to its end,
    in chunks, never more than the sample's budget."""
    monkeypatch.setattr(corpus_mod, "DOC_CHARS", 1000)
    monkeypatch.setattr(corpus_mod, "CHUNK_CHARS", 300)
    lines = [f"line {i:06d} of the one big file\n" for i in range(40_000)]  # 1.3 MB
    (tmp_path / "big.txt").write_text("".join(lines))
    files = corpus_mod.LocalFiles(DataConfig(name="files", source="files", paths=str(tmp_path / "big.txt")), print)
    sample = list(files.sample(20_000))
    assert sum(map(len, sample)) <= 20_000 and all(len(chunk) <= 300 for chunk in sample)
    text = "".join(sample)
    assert text.startswith(lines[0]) and all(line + "\n" in "".join(lines) for line in text.splitlines())
    seen = [int(line.split()[1]) for line in text.splitlines()]
    assert max(seen) > 38_000 and len(set(seen)) == len(seen)  # reaches the end, no line twice


def test_a_sample_of_many_small_files_fills_its_budget_with_whole_files(tmp_path, monkeypatch):
    """Files smaller than a window: each window goes on into the files after the one it starts in, so the sample
    still reaches its budget, and every file it takes from a file's start is taken whole."""
    monkeypatch.setattr(corpus_mod, "DOC_CHARS", 1000)
    texts = [f"file {i:04d} " + "word " * 60 + "\n" for i in range(400)]  # 316 bytes each, 126 kB in all
    for i, text in enumerate(texts):
        (tmp_path / f"{i:04d}.txt").write_text(text)
    files = corpus_mod.LocalFiles(DataConfig(name="files", source="files", paths=str(tmp_path / "*.txt")), print)
    sample = "".join(files.sample(20_000))
    assert 0.9 * 20_000 <= len(sample) <= 20_000
    taken = [line + "\n" for line in sample.splitlines()]
    assert all(line in texts for line in taken) and len(set(taken)) == len(taken)
    assert int(taken[-1].split()[1]) > 360  # spread to the corpus's end


# -- the document split (the same on every start, stable as the corpus grows, never cutting a document) ----------

def prose_corpus(folder: Path, names, **settings) -> DataConfig:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.txt").write_text(f"document {name}: " + " ".join(f"w{(int(name) * 7 + j) % 97}"
                                                                            for j in range(40)) + "\n")
    return DataConfig(**{"name": "files", "source": "files", "paths": str(folder / "*.txt"), "vocab_size": 300,
                         "cache_dir": str(folder.parent / "cache"), "val_fraction": 0.3, **settings})


def documents_of(data, split: str) -> list[str]:
    """The documents a split holds, read back from its tokens (each ends with EOT)."""
    eot = data.tokenizer.token_to_id(EOT)
    tokens, docs, start = getattr(data, split)[:], [], 0
    for end in np.flatnonzero(tokens == eot):
        docs.append(data.decode(tokens[start:end]))
        start = end + 1
    assert start == len(tokens)  # the split ends with a whole document
    return docs


def hashed_into_validation(text: str, fraction: float) -> bool:
    """The documented rule, written out: blake2b-64 of the document's UTF-8, as a fraction of 2**64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64 < fraction


def test_each_document_is_whole_in_one_split_chosen_by_its_hash(tmp_path):
    names = [f"{i:03d}" for i in range(60)]
    data = prepare_data(prose_corpus(tmp_path / "text", names), block_size=8, progress=False)
    texts = {(tmp_path / "text" / f"{n}.txt").read_text() for n in names}
    train, val = documents_of(data, "train"), documents_of(data, "val")
    assert sorted(train + val) == sorted(texts)  # every document whole, once
    assert not set(train) & set(val)
    assert set(val) == {t for t in texts if hashed_into_validation(t, 0.3)}
    assert 8 <= len(val) <= 30  # 0.3 of 60, give or take the binomial's spread
    index = json.loads((data.path / "index.json").read_text())
    assert index["documents"] == {"train": len(train), "val": len(val)}


def test_the_split_is_the_same_on_every_start_and_as_the_corpus_grows(tmp_path):
    """Two starts in processes with different string-hash seeds split alike; documents added before, between and
    after the others leave every earlier document on its side."""
    names = [f"{i:03d}" for i in range(10, 70, 2)]
    cfg = prose_corpus(tmp_path / "text", names)
    build = ("import sys; from minitrain.config import DataConfig; from minitrain.data import prepare_data; "
             "d = prepare_data(DataConfig(name='files', source='files', paths=sys.argv[1], vocab_size=300, "
             "val_fraction=0.3, cache_dir=sys.argv[2]), block_size=8, progress=False); print(d.path)")
    paths = [Path(subprocess.run([sys.executable, "-c", build, cfg.paths, str(tmp_path / f"cache{seed}")],
                                 env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}, check=True,
                                 capture_output=True, text=True, timeout=120).stdout.strip()) for seed in ("1", "2")]
    assert folder_bytes(paths[0]) == folder_bytes(paths[1])
    before = prepare_data(cfg, block_size=8, progress=False)
    prose_corpus(tmp_path / "text", [f"{i:03d}" for i in (0, 1, 11, 13, 95, 99)])
    after = prepare_data(cfg, block_size=8, progress=False)
    assert after.path != before.path  # another corpus, another cache
    for split in ("train", "val"):
        assert set(documents_of(before, split)) <= set(documents_of(after, split))


def test_a_corpus_too_small_for_the_split_gives_its_last_document_to_validation(tmp_path, small_pieces):
    """No document hashes into validation at this fraction: the last one moves there, whole, and leaves training;
    in several shards, so the move cuts the training stream back across a shard boundary."""
    cfg = code_corpus(tmp_path, val_fraction=1e-6)
    data = prepare_data(cfg, block_size=16, progress=False)
    texts = [Path(f).read_text() for f in sorted(Path(cfg.paths).parent.iterdir())]
    expected = reference_streams(texts, data.tokenizer, cfg.val_fraction)
    assert expected["val"] == []
    last = len(data.tokenizer.encode("the end, without a newline:    ").ids) + 1
    np.testing.assert_array_equal(data.val[:], expected["train"][-last:])
    np.testing.assert_array_equal(data.train[:], expected["train"][:-last])
    assert documents_of(data, "val") == ["the end, without a newline:    "]


def test_a_one_document_corpus_prepares_with_an_empty_training_split(tmp_path):
    """Its one document goes to validation: the training stream is empty, and still says its dtype and reads
    (prepare_data.py prints both splits)."""
    (tmp_path / "one.txt").write_text("a single short document\n" * 20)
    data = prepare_data(DataConfig(name="files", source="files", paths=str(tmp_path / "one.txt"), vocab_size=300,
                                   cache_dir=str(tmp_path / "cache")), progress=False)
    assert len(data.train) == 0 and len(data.val) > 0
    assert data.train.dtype == data.val.dtype == np.uint16 and data.train[:].dtype == np.uint16
    assert len(data.train[:]) == 0


def test_the_trainers_windows_come_from_their_own_splits(make_cfg):
    from minitrain.trainer import Trainer

    t = Trainer(make_cfg(), progress=False)
    try:
        for batches, stream in ((t.train_batches, t.data.train), (t.val_batches, t.data.val)):
            for step in range(3):
                x, y = batches.get(step)
                for row, start in zip(x, batches.starts(step)):
                    assert row.tolist() == stream[start:start + len(row)].tolist()
        assert len(t.data.val) < len(t.data.train) // 10  # two different streams, told apart by their sizes
    finally:
        t.close()


# -- stopped and continued ---------------------------------------------------------------------------------------

def build_uninterrupted(cfg: DataConfig, tmp_path: Path) -> dict[str, bytes]:
    reference = DataConfig(**{**cfg.__dict__, "cache_dir": str(tmp_path / "uninterrupted")})
    return folder_bytes(prepare_data(reference, block_size=16, progress=False).path)


class Stop(Exception):
    pass


def stop_at_call(monkeypatch, owner, name: str, n: int, stop: BaseException, partial: bool = False):
    """`owner.name` raises `stop` on its n-th call (after writing half its tokens with `partial`)."""
    real, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            if partial:
                self, ids = args
                real(self, ids[:len(ids) // 2])
            raise stop
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("where, stop, partial", [
    ("token_ids", KeyboardInterrupt(), False),  # Ctrl-C while a batch is encoded
    ("append", KeyboardInterrupt(), True),  # mid-write: tokens on disk beyond the last record
    ("append", OSError(28, "No space left on device"), True),  # a full disk, mid-write
    ("_record", KeyboardInterrupt(), False),  # tokens on disk, their record not written
])
@pytest.mark.parametrize("nth", [2, 7])
def test_a_stopped_preparation_continues_to_the_same_shards(tmp_path, small_pieces, monkeypatch, where, stop,
                                                            partial, nth):
    cfg = code_corpus(tmp_path)
    expected = build_uninterrupted(cfg, tmp_path)
    owner = {"token_ids": prepare_mod, "append": ShardWriter, "_record": prepare_mod._Preparation}[where]
    with monkeypatch.context() as m:
        stop_at_call(m, owner, where, nth, stop, partial)
        notes = []
        with pytest.raises(DataError if isinstance(stop, OSError) else KeyboardInterrupt) as raised:
            prepare_data(cfg, block_size=16, progress=False, notify=notes.append)
    if isinstance(stop, OSError):
        assert "is full" in str(raised.value) and "kept there" in str(raised.value)
        assert "run the same command again" in str(raised.value)
    else:
        assert "the next run with these data settings continues them" in notes[-1]
    tmp = next(Path(cfg.cache_dir).glob("*.tmp"))
    assert (tmp / "progress.json").exists()
    notes = []
    data = prepare_data(cfg, block_size=16, progress=False, notify=notes.append)
    assert folder_bytes(data.path) == expected
    assert any("continuing the preparation stopped in" in n for n in notes)
    assert not any("training a" in n for n in notes)  # the tokenizer was kept, not trained again
    assert sorted(p.name for p in Path(cfg.cache_dir).iterdir()) == sorted([data.path.name, data.path.name + ".lock"])


@pytest.mark.parametrize("method", ["append", "truncate"])
def test_a_stop_while_the_last_document_moves_to_validation_continues_exactly(tmp_path, small_pieces, monkeypatch,
                                                                             method):
    """The move appends the document to validation, records, then cuts training: stopped in either write."""
    cfg = code_corpus(tmp_path, val_fraction=1e-6)
    expected = build_uninterrupted(cfg, tmp_path)
    real = getattr(ShardWriter, method)

    def stopped(self, arg):
        if method == "append" and self.split == "val":
            real(self, arg[:len(arg) // 2])
            raise KeyboardInterrupt
        if method == "truncate" and self.split == "train" and self.tokens > 0:
            raise KeyboardInterrupt
        return real(self, arg)

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, method, stopped)
        with pytest.raises(KeyboardInterrupt):
            prepare_data(cfg, block_size=16, progress=False)
    data = prepare_data(cfg, block_size=16, progress=False)
    assert folder_bytes(data.path) == expected


def test_a_stop_after_the_index_is_written_continues_exactly(tmp_path, small_pieces, monkeypatch):
    """Stopped between the index and the folder's publication: the next run finishes from the progress record."""
    cfg = code_corpus(tmp_path)
    expected = build_uninterrupted(cfg, tmp_path)
    real = prepare_mod._Preparation._write_index

    def then_stop(self, *args):
        real(self, *args)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prepare_mod._Preparation, "_write_index", then_stop)
        with pytest.raises(KeyboardInterrupt):
            prepare_data(cfg, block_size=16, progress=False)
    notes = []
    data = prepare_data(cfg, block_size=16, progress=False, notify=notes.append)
    assert folder_bytes(data.path) == expected
    assert any("continuing the preparation" in n for n in notes) and not any("training a" in n for n in notes)


SLOW_PREPARE = """
import sys, time
from minitrain.config import DataConfig
from minitrain.data import corpus, prepare, prepare_data
for name, value in {small}.items():
    setattr(corpus, name, value)
token_ids, calls = prepare.token_ids, []
def slow(*args):  # a few batches, then a wait the test's signal ends: the preparation cannot finish first
    calls.append(1)
    time.sleep(0.05 if len(calls) <= 8 else 600)
    return token_ids(*args)
prepare.token_ids = slow
prepare_data(DataConfig(name="files", source="files", paths=sys.argv[1], vocab_size=400, cache_dir=sys.argv[2],
                        val_fraction=0.25, shard_tokens=1024), block_size=16, progress=False)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_preparation_leaves_no_process_and_continues_to_the_same_shards(tmp_path, small_pieces, signum):
    cfg = code_corpus(tmp_path)
    expected = build_uninterrupted(cfg, tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE.format(small=SMALL), cfg.paths, cfg.cache_dir],
                            env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "true"},
                            stderr=subprocess.PIPE, preexec_fn=ctrl_c_as_in_a_terminal)
    descendants, deadline = set(), time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # until it has recorded some batches
            descendants |= set(psutil.Process(proc.pid).children(recursive=True))
            progress = list(Path(cfg.cache_dir).glob("*.tmp/progress.json"))
            if progress and json.loads(progress[0].read_text() or "{}").get("bytes", 0) > 3 * SMALL["BATCH_CHARS"]:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the preparation recorded no progress")
        proc.send_signal(signum)
        try:  # its stderr read while it stops: a full pipe must not be what holds it
            stderr = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the preparation outlived {signum!r} by 60 s; it wrote {proc.communicate()[1][-2000:]!r}")
    finally:
        proc.kill()
    assert proc.returncode != 0
    if signum == signal.SIGINT:
        assert b"continues them" in stderr
    assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    notes = []
    data = prepare_data(cfg, block_size=16, progress=False, notify=notes.append)
    assert folder_bytes(data.path) == expected
    assert any("continuing the preparation" in n for n in notes)


# -- a hub dataset, streamed ----------------------------------------------------------------------------------------

def hub_copy(tmp_path: Path) -> tuple[Path, list[str]]:
    """A local copy of a hub dataset: two jsonl files of rows with a `story` column, one row longer than a
    document, one empty."""
    folder, stories = tmp_path / "someone--stories", []
    folder.mkdir()
    for part in range(2):
        rows = []
        for i in range(30):
            story = f"story {part}-{i}: " + " ".join(f"w{(i * 13 + j) % 53}" for j in range(20 + i)) + "\n"
            story = story * 40 if i == 3 else "" if i == 5 else story
            rows.append(json.dumps({"story": story, "id": i}))
            stories.append(story)
        (folder / f"train-{part}.jsonl").write_text("\n".join(rows) + "\n")
    return folder, stories


def test_a_hub_dataset_is_streamed_into_the_reference_shards_and_continued_exactly(tmp_path, small_pieces,
                                                                                   monkeypatch):
    folder, stories = hub_copy(tmp_path)
    cfg = DataConfig(name="hub", source="hub", hub_name=str(folder), text_column="story", vocab_size=300,
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.25, shard_tokens=1024)
    expected = build_uninterrupted(cfg, tmp_path)
    with monkeypatch.context() as m:
        stop_at_call(m, prepare_mod, "token_ids", 4, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            prepare_data(cfg, block_size=16, progress=False)
    state = json.loads(next(Path(cfg.cache_dir).glob("*.tmp/progress.json")).read_text())
    assert state["cursor"]["state"] is not None  # continued from the stream's own position, not from its start
    data = prepare_data(cfg, block_size=16, progress=False)
    assert folder_bytes(data.path) == expected
    reference = reference_streams(stories, data.tokenizer, cfg.val_fraction)
    np.testing.assert_array_equal(data.train[:], reference["train"])
    np.testing.assert_array_equal(data.val[:], reference["val"])
    assert sorted(p.name for p in Path(cfg.cache_dir).iterdir()) == sorted([data.path.name, data.path.name + ".lock"])


def test_a_hub_dataset_without_the_text_column_is_named(tmp_path):
    folder, _ = hub_copy(tmp_path)
    cfg = DataConfig(name="hub", source="hub", hub_name=str(folder), vocab_size=300, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"text_column='text' is not a column of .*; its columns: \['id', 'story'\]"):
        prepare_data(cfg, block_size=16, progress=False)


def test_an_unreachable_hub_dataset_says_it_needs_network_and_how_to_go_local(tmp_path):
    code = ("from minitrain.config import DataConfig; from minitrain.data import prepare_data; import sys; "
            "prepare_data(DataConfig(name='hub', source='hub', hub_name='someone/stories', cache_dir=sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    assert "data.hub_name='someone/stories'" in out.stderr and "needs network" in out.stderr
    assert "point data.hub_name at a local copy of its files" in out.stderr


def test_a_home_path_hydra_cannot_parse_is_one_line_and_its_quoted_form_works():
    """Hydra's grammar refuses an unquoted ~ in a value: prepare_data.py and eval.py say how to quote it, and the
    quoted value reaches the corpus as the user wrote it (the corpus expands ~)."""
    with pytest.raises(ConfigError, match=r"^data.paths=~/corpus/\*\*/\*.txt: Hydra cannot parse this override; "
                                          r"quote the value"):
        resolve_data(["data=files", "data.paths=~/corpus/**/*.txt"])
    assert resolve_data(["data=files", "data.paths='~/corpus/**/*.txt'"]).paths == "~/corpus/**/*.txt"


def test_an_unreachable_hub_datasets_retries_are_not_logged_before_the_one_line(tmp_path, monkeypatch, caplog):
    import datasets

    def offline(*args, **kwargs):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise ConnectionError("Couldn't reach 'someone/stories' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="needs network"):
        prepare_data(DataConfig(name="hub", source="hub", hub_name="someone/stories", cache_dir=str(tmp_path)),
                     progress=False)
    assert not [r.getMessage() for r in caplog.records if "Retrying" in r.getMessage()]
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying later")  # only during the hub call
    assert [r.getMessage() for r in caplog.records] == ["Retrying later"]


# -- tokenizers --------------------------------------------------------------------------------------------------

def test_a_pretrained_tokenizer_from_a_directory_is_used_as_it_is(tmp_path, small_pieces, monkeypatch):
    cfg = code_corpus(tmp_path)
    trained = prepare_data(cfg, block_size=16, progress=False)
    (tmp_path / "tok").mkdir()
    trained.tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))

    def fail(*a, **k):
        raise AssertionError("trained a tokenizer where a pretrained one was named")

    monkeypatch.setattr(prepare_mod, "train_tokenizer", fail)
    pretrained = prepare_data(DataConfig(**{**cfg.__dict__, "tokenizer": str(tmp_path / "tok"), "vocab_size": 9999}),
                              block_size=16, progress=False)
    assert pretrained.path != trained.path
    np.testing.assert_array_equal(pretrained.train[:], trained.train[:])


def test_a_pretrained_tokenizer_that_cannot_be_used_stops_the_preparation_in_one_line(tmp_path):
    """minitrain/data/tokenizer.py's refusals (tests/test_hf.py) reach the user as a DataError, which train.py and
    prepare_data.py print as one line."""
    cfg = code_corpus(tmp_path)
    (tmp_path / "tok").mkdir()
    with pytest.raises(DataError, match=r"^data.tokenizer=.*tok: holds neither tokenizer.json nor vocab.json"):
        prepare_data(DataConfig(**{**cfg.__dict__, "tokenizer": str(tmp_path / "tok")}), block_size=16, progress=False)


def test_the_token_dtype_is_the_narrowest_that_holds_every_id():
    assert token_dtype(50257) == np.uint16  # GPT-2's vocabulary
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    assert token_dtype(2**32) == np.uint32
    with pytest.raises(DataError, match="more than uint32 shards hold"):
        token_dtype(2**32 + 1)
