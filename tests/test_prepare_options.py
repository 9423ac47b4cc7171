"""scripts/prepare_data.py as a user runs it (its `main` with a command line): each option's effect on the cache it
prepares; each ingredient of the cache's key changed alone (a new preparation, said so) and nothing changed (the
cache reused, said so); the limits of a split and of a shard; the tokenizer's progress; what it says when it stops."""

import json
import os
import re
import runpy
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from minitrain.config import DataConfig
from minitrain.data import TokenData
from minitrain.data import corpus as corpus_mod
from minitrain.data import prepare as prepare_mod
from minitrain.data.shards import open_cache

from conftest import REPO
from test_prepare import documents_of, hashed_into_validation

SCRIPT = REPO / "scripts" / "prepare_data.py"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = ("textwrap", "string", "fnmatch", "glob", "shlex", "bisect", "colorsys", "keyword")
# Its one line of output: the cache and its figures, and whether this run prepared it or found it prepared.
LINE = re.compile(r"(?P<path>\S+): (?P<train>[\d,]+) training and (?P<val>[\d,]+) validation tokens in (?P<shards>\d+) "
                  r"shards \((?P<dtype>\w+), vocabulary (?P<vocab>[\d,]+)\), "
                  r"(?:(?P<prepared>prepared in \d+ s)|already prepared: reused)")


@dataclass
class Run:
    data: TokenData  # the cache its line names, opened
    prepared: bool  # it tokenized the corpus (False: it said the cache was reused)
    err: str  # its stderr: notes and progress bars

    @property
    def documents(self) -> dict[str, list[str]]:
        return {split: documents_of(self.data, split) for split in ("train", "val")}


def main(capsys, *argv: str) -> tuple[int, str, str]:
    code = runpy.run_path(str(SCRIPT))["main"](list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def prepare(capsys, *argv: str) -> Run:
    """A preparation that succeeds; its line's figures checked against the cache it names."""
    code, out, err = main(capsys, *argv)
    assert code == 0, err
    line = LINE.fullmatch(out.strip())
    assert line, out
    data = open_cache(Path(line["path"]))
    figures = [int(line[k].replace(",", "")) for k in ("train", "val", "shards", "vocab")]
    assert figures == [len(data.train), len(data.val), len(data.train.shards) + len(data.val.shards), data.vocab_size]
    assert line["dtype"] == data.train.dtype.name
    return Run(data, line["prepared"] is not None, err)


def args(**settings) -> list[str]:
    """A command line: `data_x=...` for data.x, `model_x=...` for model.x, `data=...` for the group."""
    return [f"{key.replace('_', '.', 1) if key != 'data' else key}={value}" for key, value in settings.items()]


def text_corpus(folder: Path, docs: int = 40) -> list[str]:
    """`docs` documents of real text (consecutive lines of a few standard-library modules), one file each."""
    lines = [line for name in MODULES for line in (STDLIB / f"{name}.py").read_text().splitlines(keepends=True)]
    folder.mkdir(parents=True, exist_ok=True)
    texts = ["".join(lines[i * len(lines) // docs:(i + 1) * len(lines) // docs]) for i in range(docs)]
    for i, text in enumerate(texts):
        (folder / f"doc{i:03d}.txt").write_text(text)
    return texts


@pytest.fixture
def corpus(tmp_path) -> tuple[list[str], dict[str, object]]:
    """The texts of a corpus of 40 files, and the settings that prepare it in tmp_path/cache."""
    texts = text_corpus(tmp_path / "text")
    return texts, dict(data="files", data_paths=f"{tmp_path / 'text'}/*.txt", data_cache_dir=str(tmp_path / "cache"),
                       data_vocab_size=400, data_val_fraction=0.2, data_shard_tokens=1024, model_block_size=16)


# -- the options, and the cache's key ----------------------------------------------------------------------------

def test_help_prints_the_usage_and_prepares_nothing(capsys, tmp_path):
    code, out, err = main(capsys, "--help", f"data.cache_dir={tmp_path / 'cache'}")
    assert code == 0 and out.startswith("Prepare a corpus's token shards ahead of training") and err == ""
    assert not (tmp_path / "cache").exists()


def test_data_paths_and_cache_dir_are_the_corpus_and_where_its_cache_goes(capsys, tmp_path, corpus):
    texts, settings = corpus
    (tmp_path / "text" / "notes.md").write_text("a file the glob leaves out\n" * 50)
    first = prepare(capsys, *args(**settings))
    assert first.prepared and first.data.path.parent == tmp_path / "cache" and first.data.path.name.startswith("files-")
    assert sorted(first.documents["train"] + first.documents["val"]) == sorted(texts)  # the *.txt files, whole
    name = first.data.path.name
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [name, name + ".lock"]  # and nothing else
    again = prepare(capsys, *args(**settings))  # nothing changed
    assert not again.prepared and again.data.path == first.data.path
    for f in (tmp_path / "text").glob("*.txt"):  # times changed, contents not: the tokens would be the same
        os.utime(f, ns=(f.stat().st_atime_ns + 10**9, f.stat().st_mtime_ns + 10**9))
    touched = prepare(capsys, *args(**settings))
    assert not touched.prepared and touched.data.path == first.data.path


def fake_site(tmp_path, monkeypatch) -> list[str]:
    """A site directory holding a package's .py sources, a third each one, two and three directories down
    (pkg/, pkg/sub/, pkg/sub/deeper/), beside a file that is no source and a symlink to a source; the interpreter's
    site directories (site.getsitepackages, purelib, platlib) pointed at it, twice, once with a slash, once at the
    package inside it, and at a directory that is gone; PYTHONPATH at other .py files. The sources' texts."""
    texts = text_corpus(tmp_path / "site" / "pkg", docs=30)
    deeper = tmp_path / "site" / "pkg" / "sub" / "deeper"
    deeper.mkdir(parents=True)
    for i, f in enumerate(sorted((tmp_path / "site" / "pkg").glob("*.txt"))):
        f.rename([f.parent, f.parent / "sub", deeper][i % 3] / f.with_suffix(".py").name)
    (tmp_path / "site" / "pkg" / "README.txt").write_text("not a source\n" * 40)
    (tmp_path / "site" / "pkg" / "alias.py").symlink_to(deeper / "doc029.py")  # the same file twice
    text_corpus(tmp_path / "pythonpath", docs=3)  # on sys.path only: not the packages'
    for f in (tmp_path / "pythonpath").glob("*.txt"):
        f.rename(f.with_suffix(".py"))
    monkeypatch.syspath_prepend(str(tmp_path / "pythonpath"))
    site_dir = str(tmp_path / "site")
    monkeypatch.setattr(corpus_mod.site, "getsitepackages",
                        lambda: [site_dir, site_dir + "/", f"{site_dir}/pkg", str(tmp_path / "gone")])
    paths = dict(corpus_mod.sysconfig.get_paths(), purelib=site_dir, platlib=site_dir)
    monkeypatch.setattr(corpus_mod.sysconfig, "get_paths", lambda: paths)
    return texts


PACKAGES = ("data=packages", "data.vocab_size=400", "data.val_fraction=0.2", "data.shard_tokens=1024",
            "model.block_size=16")


def test_data_packages_is_every_py_file_of_the_interpreters_site_directories_once(capsys, tmp_path, monkeypatch):
    """data=packages reads the .py files under each site directory, however deep, each once however many of the
    directories name its directory or one above it and however many links lead to it, and nothing else: not other
    files there, not PYTHONPATH's, not the standard library."""
    texts = fake_site(tmp_path, monkeypatch)
    run = prepare(capsys, *PACKAGES, f"data.cache_dir={tmp_path / 'cache'}")
    assert run.prepared and run.data.path.name.startswith("packages-")
    assert sorted(run.documents["train"] + run.documents["val"]) == sorted(texts)


def test_data_packages_is_keyed_by_the_sources_contents(capsys, tmp_path, monkeypatch):
    """The packages' cache is reused while their sources are unchanged; a source rewritten in place to the same size
    and times (a package upgraded by a patch) is prepared again, with its new text."""
    texts = fake_site(tmp_path, monkeypatch)
    settings = (*PACKAGES, f"data.cache_dir={tmp_path / 'cache'}")
    first = prepare(capsys, *settings)
    again = prepare(capsys, *settings)
    assert first.prepared and not again.prepared and again.data.path == first.data.path
    source = tmp_path / "site" / "pkg" / "sub" / "deeper" / "doc008.py"
    times, size = (source.stat().st_atime_ns, source.stat().st_mtime_ns), source.stat().st_size
    edited = texts[8].swapcase()
    assert source.read_text() == texts[8] and edited != texts[8] and len(edited.encode()) == size
    with open(source, "r+") as f:  # in place: the same inode, size and times
        f.write(edited)
    os.utime(source, ns=times)
    upgraded = prepare(capsys, *settings)
    assert upgraded.prepared and upgraded.data.path != first.data.path
    documents = upgraded.documents["train"] + upgraded.documents["val"]
    assert edited in documents and texts[8] not in documents


def test_a_file_rewritten_in_place_to_the_same_size_and_times_or_renamed_is_prepared_again(capsys, tmp_path, corpus):
    texts, settings = corpus
    first = prepare(capsys, *args(**settings))
    doc = tmp_path / "text" / "doc007.txt"
    times, size = (doc.stat().st_atime_ns, doc.stat().st_mtime_ns), doc.stat().st_size
    edited = texts[7].swapcase()
    assert edited != texts[7] and len(edited.encode()) == size
    with open(doc, "r+") as f:  # in place: the same inode, size and times
        f.write(edited)
    os.utime(doc, ns=times)
    assert (doc.stat().st_size, doc.stat().st_mtime_ns) == (size, times[1])
    again = prepare(capsys, *args(**settings))
    assert again.prepared and again.data.path != first.data.path
    documents = again.documents["train"] + again.documents["val"]
    assert edited in documents and texts[7] not in documents
    (tmp_path / "text" / "doc000.txt").rename(tmp_path / "text" / "doc999.txt")  # the same text, last in order
    renamed = prepare(capsys, *args(**settings))
    assert renamed.prepared and renamed.data.path != again.data.path
    assert renamed.documents["train"] + renamed.documents["val"] != documents
    assert sorted(renamed.documents["train"] + renamed.documents["val"]) == sorted(documents)


def test_val_fraction_chooses_each_documents_split_and_keys_the_cache(capsys, corpus):
    texts, settings = corpus
    runs = {fraction: prepare(capsys, *args(**{**settings, "data_val_fraction": fraction})) for fraction in (0.2, 0.4)}
    for fraction, run in runs.items():
        assert run.prepared
        assert sorted(run.documents["val"]) == sorted(t for t in texts if hashed_into_validation(t, fraction))
    assert len(runs[0.2].documents["val"]) < len(runs[0.4].documents["val"])
    assert runs[0.2].data.path != runs[0.4].data.path


def test_vocab_size_is_the_trained_tokenizers_and_keys_the_cache(capsys, corpus):
    _, settings = corpus
    runs = {vocab: prepare(capsys, *args(**{**settings, "data_vocab_size": vocab})) for vocab in (300, 400)}
    for vocab, run in runs.items():
        assert run.prepared and run.data.vocab_size == run.data.tokenizer.get_vocab_size() == vocab
    assert runs[300].data.path != runs[400].data.path


def test_tokenizer_sample_mb_bounds_what_the_tokenizer_learns_from_and_keys_the_cache(capsys, tmp_path):
    """A corpus of 1.1 MB whose last file's words appear nowhere else: a 1 MB sample (one window from the start)
    never reaches them, a 2 MB one takes the whole corpus. Each tokenizer is the one learned from that sample."""
    (tmp_path / "text").mkdir()
    text = "".join((STDLIB / f"{name}.py").read_text() for name in sorted(MODULES + ("argparse", "typing", "inspect",
                                                                                      "dataclasses", "pathlib")))
    (tmp_path / "text" / "a.txt").write_text((text * (1 + (1 << 20) // len(text)))[:(1 << 20) + 50_000])
    (tmp_path / "text" / "b.txt").write_text("zyzzyva quokka axolotl\n" * 2000)
    settings = dict(data="files", data_paths=f"{tmp_path / 'text'}/*.txt", data_cache_dir=str(tmp_path / "cache"),
                    data_vocab_size=400, model_block_size=16)
    files = corpus_mod.LocalFiles(DataConfig(name="files", source="files", paths=settings["data_paths"]), print)
    runs = {}
    for mb in (1, 2):
        runs[mb] = prepare(capsys, *args(**settings, data_tokenizer_sample_mb=mb))
        learned = prepare_mod.train_tokenizer(files.sample(mb << 20), 400)
        assert runs[mb].prepared and runs[mb].data.tokenizer.get_vocab() == learned.get_vocab()
    words = [len(runs[mb].data.tokenizer.encode(" zyzzyva quokka axolotl").ids) for mb in (1, 2)]
    assert words[0] > words[1]  # learned from the 2 MB sample only
    assert runs[1].data.path != runs[2].data.path


def test_shard_tokens_cuts_the_shards_exactly_and_keys_the_cache(capsys, corpus):
    """Shards of data.shard_tokens tokens, the last holding the rest; a split of exactly one shard's tokens makes one
    full shard (and no empty one after it), one token more or less makes two shards or one short one."""
    _, settings = corpus
    first = prepare(capsys, *args(**settings))
    n = len(first.data.train)
    assert n > 2048
    for shard_tokens in (n, n - 1, n + 1):
        expected = [shard_tokens] * (n // shard_tokens) + ([n % shard_tokens] if n % shard_tokens else [])
        run = prepare(capsys, *args(**{**settings, "data_shard_tokens": shard_tokens}))
        assert run.prepared and run.data.path != first.data.path
        index = json.loads((run.data.path / "index.json").read_text())
        assert index["shard_tokens"] == shard_tokens
        assert [r["tokens"] for r in index["splits"]["train"]["shards"]] == expected
        assert sorted(p.name for p in run.data.path.glob("train-*.bin")) == [
            f"train-{i:05d}.bin" for i in range(len(expected))]
        assert [len(s) for s in run.data.train.shards] == expected
        np.testing.assert_array_equal(run.data.train[:], first.data.train[:])  # the same stream, cut elsewhere
        np.testing.assert_array_equal(run.data.val[:], first.data.val[:])


def trained_tokenizer(texts: list[str], vocab_size: int):
    return prepare_mod.train_tokenizer(iter(texts), vocab_size)


def test_a_pretrained_tokenizer_directory_keys_the_cache_by_its_files(capsys, tmp_path, corpus):
    """data.tokenizer=DIR tokenizes with DIR's tokenizer as it is (data.vocab_size plays no part, and is no part
    of the key); another tokenizer saved over it in the same directory is another cache; the same BPE as
    vocab.json + merges.txt (older checkpoints' files) gives the same tokens as its tokenizer.json."""
    texts, settings = corpus
    trained = prepare(capsys, *args(**settings))
    first, second = trained_tokenizer(texts[:20], 320), trained_tokenizer(texts[20:], 350)
    (tmp_path / "tok").mkdir()
    first.save(str(tmp_path / "tok" / "tokenizer.json"))
    pretrained = {**settings, "data_tokenizer": str(tmp_path / "tok")}
    run = prepare(capsys, *args(**pretrained))
    assert run.prepared and run.data.path != trained.data.path
    assert run.data.tokenizer.to_str() == first.to_str() and run.data.vocab_size == 320
    eot = first.token_to_id("<|endoftext|>")
    expected = [i for text in run.documents["val"] for i in first.encode(text).ids + [eot]]
    np.testing.assert_array_equal(run.data.val[:], expected)
    other_vocab = prepare(capsys, *args(**{**pretrained, "data_vocab_size": 999}))
    assert not other_vocab.prepared and other_vocab.data.path == run.data.path
    second.save(str(tmp_path / "tok" / "tokenizer.json"))  # another tokenizer, same place
    replaced = prepare(capsys, *args(**pretrained))
    assert replaced.prepared and replaced.data.path != run.data.path
    assert replaced.data.tokenizer.to_str() == second.to_str() and replaced.data.vocab_size == 350
    (tmp_path / "pair").mkdir()
    second.model.save(str(tmp_path / "pair"))  # vocab.json + merges.txt
    pair = prepare(capsys, *args(**{**pretrained, "data_tokenizer": str(tmp_path / "pair")}))
    assert pair.prepared and pair.data.path != replaced.data.path
    np.testing.assert_array_equal(pair.data.train[:], replaced.data.train[:])
    np.testing.assert_array_equal(pair.data.val[:], replaced.data.val[:])


def hub_cache_with(folder: Path, tokenizers: dict) -> None:
    """A Hugging Face cache holding `tokenizers` ({name: Tokenizer}) as the hub's download would leave them."""
    revision = "0" * 40
    for name, tokenizer in tokenizers.items():
        repo = folder / f"models--{name.replace('/', '--')}"
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        tokenizer.save(str(repo / "snapshots" / revision / "tokenizer.json"))


def test_a_pretrained_tokenizers_hub_name_keys_the_cache(capsys, tmp_path, corpus, monkeypatch):
    """Two Hugging Face names (read from the hub's cache, offline) are two caches, each tokenized by its own."""
    from huggingface_hub import constants

    texts, settings = corpus
    tokenizers = {"someone/tok-a": trained_tokenizer(texts[:20], 320), "someone/tok-b": trained_tokenizer(texts, 320)}
    hub_cache_with(tmp_path / "hub", tokenizers)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    runs = {name: prepare(capsys, *args(**settings, data_tokenizer=name)) for name in tokenizers}
    for name, run in runs.items():
        assert run.prepared and run.data.tokenizer.to_str() == tokenizers[name].to_str()
    assert runs["someone/tok-a"].data.path != runs["someone/tok-b"].data.path
    again = prepare(capsys, *args(**settings, data_tokenizer="someone/tok-a"))
    assert not again.prepared and again.data.path == runs["someone/tok-a"].data.path


def hub_copy(folder: Path) -> None:
    """A local copy of a hub dataset with two configs (`a`, `b`), each with a train and a test split of jsonl rows
    with a `story` and a `title` column, described by its README's YAML as on the hub."""
    configs = []
    for config in ("a", "b"):
        (folder / config).mkdir(parents=True)
        for split in ("train", "test"):
            rows = [{"story": f"story {i} of {config}/{split}: " + " ".join(f"w{(i * 7 + j) % 41}" for j in range(60)),
                     "title": f"title {i} of {config}/{split}"} for i in range(12)]
            (folder / config / f"{split}-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        configs.append(f"- config_name: {config}\n  data_files:\n" + "".join(
            f"  - split: {split}\n    path: {config}/{split}-*.jsonl\n" for split in ("train", "test")))
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(configs) + "---\n")


def test_a_hub_datasets_name_config_split_and_column_choose_its_text_and_key_the_cache(capsys, tmp_path):
    hub_copy(tmp_path / "stories")
    settings = dict(data="hub", data_hub_name=str(tmp_path / "stories"), data_hub_config="a", data_hub_split="train",
                    data_text_column="story", data_cache_dir=str(tmp_path / "cache"), data_vocab_size=300,
                    data_val_fraction=0.3, model_block_size=8)
    runs = []
    for change in ({}, {"data_hub_config": "b"}, {"data_hub_split": "test"}, {"data_text_column": "title"}):
        run = prepare(capsys, *args(**{**settings, **change}))
        config, split = change.get("data_hub_config", "a"), change.get("data_hub_split", "train")
        path = tmp_path / "stories" / config / f"{split}-0.jsonl"
        texts = [json.loads(row)[change.get("data_text_column", "story")] for row in path.read_text().splitlines()]
        assert run.prepared and sorted(run.documents["train"] + run.documents["val"]) == sorted(texts)
        runs.append(run)
    assert len({run.data.path for run in runs}) == 4
    (tmp_path / "stories" / ".git").mkdir()  # a clone's own files, which the datasets library does not read
    (tmp_path / "stories" / ".git" / "FETCH_HEAD").write_text("0" * 40)
    again = prepare(capsys, *args(**settings))
    assert not again.prepared and again.data.path == runs[0].data.path
    copy = tmp_path / "stories" / "a" / "train-0.jsonl"  # the local copy rewritten: same size, same times
    times = (copy.stat().st_atime_ns, copy.stat().st_mtime_ns)
    story = json.loads(copy.read_text().splitlines()[0])["story"]
    copy.write_text(copy.read_text().replace("story 0 of", "story 9 of", 1))
    os.utime(copy, ns=times)
    rewritten = prepare(capsys, *args(**settings))
    assert rewritten.prepared and rewritten.data.path != runs[0].data.path
    documents = rewritten.documents["train"] + rewritten.documents["val"]
    assert story.replace("story 0 of", "story 9 of") in documents and story not in documents


# -- the limits: a split of exactly one block -----------------------------------------------------------------------

def test_a_split_of_exactly_one_block_is_accepted_one_token_less_is_refused_naming_the_block_size(capsys, corpus):
    """model.block_size (train.py's command line) is checked as train.py checks it: each split must hold one window
    of block_size + 1 tokens. It changes no token, so every block size reuses the one cache."""
    _, settings = corpus
    first = prepare(capsys, *args(**settings))
    shortest = min(len(first.data.train), len(first.data.val))  # the validation split
    for block_size in (shortest - 1, shortest - 2):  # exactly one window, and one token to spare
        run = prepare(capsys, *args(**{**settings, "model_block_size": block_size}))
        assert not run.prepared and run.data.path == first.data.path
    code, out, err = main(capsys, *args(**{**settings, "model_block_size": shortest}))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"its val split has {shortest} tokens, fewer than one block of model.block_size={shortest} + 1" in err


def test_bad_settings_stop_with_one_line_naming_them_and_exit_2(capsys, tmp_path, corpus):
    _, settings = corpus
    for key, value, says in (("data_val_fraction", 0.5, "data.val_fraction"),
                             ("data_vocab_size", 259, "data.vocab_size"),
                             ("data_shard_tokens", 1023, "data.shard_tokens"),
                             ("data_tokenizer_sample_mb", 0, "data.tokenizer_sample_mb"),
                             ("data_vocab", 300, "did you mean data.vocab_size")):
        code, out, err = main(capsys, *args(**{**settings, key: value}))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, (key, err)
    assert not (tmp_path / "cache").exists()


def test_ctrl_c_stops_with_130_saying_how_to_continue_and_the_same_command_continues(capsys, corpus, monkeypatch):
    _, settings = corpus
    def interrupted(*a):  # Ctrl-C while the first batch is encoded
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prepare_mod, "token_ids", interrupted)
        try:
            code, out, err = main(capsys, *args(**settings))
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C left prepare_data.py's main as a traceback")
    assert code == 130 and out == ""
    assert err.strip().splitlines()[-1] == "minitrain: preparation stopped; run the same command again to continue it"
    run = prepare(capsys, *args(**settings))
    assert run.prepared and "data: continuing the preparation stopped in" in run.err


# -- progress ---------------------------------------------------------------------------------------------------------

def renders(err: str, desc: str) -> list[str]:
    """Each drawing of the progress bar `desc` in a stderr that is not a terminal (tqdm redraws after a \\r)."""
    return [part.strip() for part in re.split(r"[\r\n]", err) if part.strip().startswith(f"{desc}:")]


def test_training_the_tokenizer_shows_its_progress_as_the_tokenizing_does(capsys, tmp_path):
    """A bar over the sample's bytes as the library reads them, ending at the sample's size (here the whole corpus,
    small enough for the bar to print exact numbers), then the merges being computed; a pretrained tokenizer has no
    such phase."""
    (tmp_path / "text").mkdir()
    texts = ["déjà vu, ünïcødé ✓\n" * 5, "the quick brown fox\n" * 8, "jumps over the lazy dog\n" * 6]
    for i, text in enumerate(texts):
        (tmp_path / "text" / f"{i}.txt").write_text(text)
    settings = dict(data="files", data_paths=f"{tmp_path / 'text'}/*.txt", data_cache_dir=str(tmp_path / "cache"),
                    data_vocab_size=300, model_block_size=4)
    run = prepare(capsys, *args(**settings))
    sample = sum(len(t.encode()) for t in texts)
    assert sample < 1000 and sample > sum(map(len, texts))
    bar = renders(run.err, "tokenizer")
    assert bar and re.fullmatch(rf"tokenizer: 100%\|.*\| {sample}/{sample} \[.*, computing the merges of 300 tokens\]",
                                bar[-1]), bar[-3:]
    assert renders(run.err, "tokenizing")  # the next phase's bar
    (tmp_path / "tok").mkdir()
    run.data.tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    pretrained = prepare(capsys, *args(**settings, data_tokenizer=tmp_path / "tok"))
    assert pretrained.prepared and not renders(pretrained.err, "tokenizer") and renders(pretrained.err, "tokenizing")


def test_the_tokenizer_bars_clock_runs_while_the_merges_are_computed(tmp_path, capsys, monkeypatch):
    """The library updates nothing while it computes the merges (seconds to tens of seconds): the bar is redrawn
    meanwhile, so that its elapsed time runs on."""
    train_tokenizer = prepare_mod.train_tokenizer

    def slow_merges(chunks, vocab_size):
        tokenizer = train_tokenizer(chunks, vocab_size)
        time.sleep(1.6)
        return tokenizer

    monkeypatch.setattr(prepare_mod, "train_tokenizer", slow_merges)
    text_corpus(tmp_path / "text", docs=4)
    prepare_mod.prepare_data(DataConfig(name="files", source="files", paths=str(tmp_path / "text" / "*.txt"),
                                        vocab_size=300, cache_dir=str(tmp_path / "cache")), progress=True)
    merging = [r for r in renders(capsys.readouterr().err, "tokenizer") if "computing the merges" in r]
    assert len(merging) >= 4, merging  # redrawn every 0.5 s, beside the drawings of the postfix and of the close
