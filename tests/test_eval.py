"""Evaluation: HellaSwag scored on a hand-made fixture, validation loss against a direct computation, a checkpoint
evaluated twice, another corpus tokenized as the run was, and the trainer's eval records."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from minitrain.data import DataError, TokenStream, cache_path
from minitrain.evaluate import (HellaSwagExample, ending_losses, evaluate_checkpoint, hellaswag, load_hellaswag,
                                perplexity, validation_loss)
from minitrain.trainer import train

from conftest import REPO

CPU = torch.device("cpu")
LN2 = math.log(2)
# A unigram model: whatever came before, the next word is `yes` with probability 1/2, `no` 1/4, `maybe` 1/8,
# `so` 1/16, and the context's words and the unknown word 1/32 each. A word costs 1, 2, 3, 4 or 5 bits.
WORDS = {"[UNK]": 1 / 32, "yes": 1 / 2, "no": 1 / 4, "maybe": 1 / 8, "so": 1 / 16, "ctx": 1 / 32}


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def unigram_logits(ids: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.tensor(list(WORDS.values()))).expand(*ids.shape, len(WORDS))


# Bits of each ending (sum / mean) and which one each rule picks, by hand:
FIXTURE = [
    # yes 1/1, no no 4/2, maybe 3/3, so 4/4: both pick 0, right
    {"ctx": "ctx", "endings": ["yes", "no no", "maybe", "so"], "label": 0},
    # no 2/2, yes yes yes 3/1, maybe maybe 6/3, so 4/4: the sum picks 0 (wrong), the mean 1 (right)
    {"ctx": "ctx ctx", "endings": ["no", "yes yes yes", "maybe maybe", "so"], "label": "1"},
    # maybe 3/3, no yes 3/1.5, so so 8/4, yes maybe maybe maybe 10/2.5: the sum picks 0 (the first of a tie),
    # the mean 1; both wrong
    {"ctx": "ctx ctx ctx", "endings": ["maybe", "no yes", "so so", "yes maybe maybe maybe"], "label": 3},
    # yes 1/1, so so 8/4, maybe 3/3, no 2/2: both pick 0, right
    {"ctx": "ctx", "endings": ["yes", "so so", "maybe", "no"], "label": 0},
]
ACC, ACC_NORM = 2 / 4, 3 / 4


@pytest.fixture
def hellaswag_file(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in FIXTURE) + "\n\n")
    return path


def test_hellaswag_accuracy_of_a_hand_made_fixture(hellaswag_file):
    examples = load_hellaswag(str(hellaswag_file))
    for batch in (1, 3, 8):  # padding rows of different lengths together changes nothing
        scores = hellaswag(unigram_logits, word_tokenizer(), examples, block_size=16, device=CPU, batch_examples=batch)
        assert scores == {"hellaswag/acc_norm": ACC_NORM, "hellaswag/acc": ACC, "hellaswag/examples": 4}


def test_an_endings_loss_counts_its_own_tokens_only(hellaswag_file):
    """The second example's endings cost 2, 3, 6 and 4 bits over 1, 3, 2 and 1 tokens: the context's two words
    (10 bits) count nowhere, also when the context must be cut to fit the block."""
    example = load_hellaswag(str(hellaswag_file))[1]
    for block_size in (16, 3):  # 3: "yes yes yes" fills the block, the context is cut to its last word
        summed, mean = ending_losses(unigram_logits, word_tokenizer(), [example], block_size, CPU)
        torch.testing.assert_close(summed, torch.tensor([2.0, 3.0, 6.0, 4.0]) * LN2)
        torch.testing.assert_close(mean, torch.tensor([2.0, 1.0, 3.0, 4.0]) * LN2)


def test_hellaswag_examples_are_read_and_refused_with_their_line(tmp_path, hellaswag_file):
    assert load_hellaswag(str(hellaswag_file), limit=2) == [
        HellaSwagExample("ctx", ("yes", "no no", "maybe", "so"), 0),
        HellaSwagExample("ctx ctx", ("no", "yes yes yes", "maybe maybe", "so"), 1)]
    bad = tmp_path / "bad.jsonl"
    for line, message in [('{"ctx": "a", "endings": ["b"], "label": 1}', r"bad.jsonl:2: label 1 names none"),
                          ('{"ctx": "a", "label": 0}', r"bad.jsonl:2: not a HellaSwag example \(KeyError"),
                          ("not json", r"bad.jsonl:2: not a JSON line")]:
        bad.write_text(json.dumps(FIXTURE[0]) + "\n" + line + "\n")
        with pytest.raises(DataError, match=message):
            load_hellaswag(str(bad))
    with pytest.raises(DataError, match="cannot read it"):
        load_hellaswag(str(tmp_path / "missing.jsonl"))


def test_hellaswag_from_an_unreachable_hub_points_at_a_local_copy(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(DataError, match="needs network once. Offline, point at a local copy"):
        load_hellaswag("hub")


def test_hellaswag_from_the_hub_is_read_from_the_cache_first_and_announced_before_a_download(tmp_path, monkeypatch,
                                                                                              capsys):
    import huggingface_hub

    calls = []
    cached = tmp_path / "validation.parquet"
    pq_rows = [{"ctx": "a b", "endings": ["c", "d", "a", "b"], "label": 2}]

    def download(repo_id, filename, repo_type, revision, local_files_only=False):
        calls.append(local_files_only)
        if local_files_only and not cached.exists():
            raise FileNotFoundError("not in the cache")
        if not local_files_only:  # the download writes the cache
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.Table.from_pylist(pq_rows), cached)
        return str(cached)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert load_hellaswag("hub")[0].label == 2
    assert calls == [True, False] and "downloading Rowan/hellaswag" in capsys.readouterr().err
    assert load_hellaswag("hub")[0].label == 2  # cached now: no network, nothing announced
    assert calls == [True, False, True] and capsys.readouterr().err == ""


def test_validation_loss_is_the_mean_over_consecutive_windows():
    tokens = np.random.default_rng(0).integers(0, len(WORDS), size=103).astype(np.uint16)
    stream = TokenStream([tokens[:40], tokens[40:80], tokens[80:]])
    nats = -torch.log(torch.tensor(list(WORDS.values())))

    def loss_fn(x, y):
        return torch.nn.functional.cross_entropy(unigram_logits(x).flatten(0, 1), y.flatten())

    for max_tokens, predicted in [(None, 100), (50, 50), (57, 50)]:  # windows of 10 predictions each
        for batch_size in (1, 4, 100):
            result = validation_loss(loss_fn, stream, 10, batch_size, CPU, max_tokens)
            expected = float(nats[tokens[1:predicted + 1].astype(np.int64)].mean())
            assert result["val/tokens"] == predicted
            assert result["val/loss"] == pytest.approx(expected, rel=1e-6)
            assert result["val/ppl"] == pytest.approx(math.exp(expected), rel=1e-6)
    with pytest.raises(DataError, match="fewer than one window"):
        validation_loss(loss_fn, TokenStream([tokens[:10]]), 10, 1, CPU)


def test_perplexity_of_a_diverged_loss_is_infinite():
    assert perplexity(1.0) == pytest.approx(math.e) and perplexity(1e6) == math.inf
    assert math.isnan(perplexity(float("nan")))


def test_the_trainer_logs_perplexity_and_hellaswag_at_eval_steps(make_cfg, tmp_path, hellaswag_file):
    train(make_cfg("trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=2",
                   f"trainer.eval_hellaswag={hellaswag_file}", "trainer.eval_hellaswag_examples=3"), progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["val/ppl"] == pytest.approx(math.exp(r["val/loss"]))
        assert r["hellaswag/examples"] == 3 and 0 <= r["hellaswag/acc_norm"] <= 1
    assert "| ppl " in (tmp_path / "run" / "train.log").read_text()


def test_a_checkpoint_evaluated_twice_gives_identical_numbers(make_cfg, tmp_path, hellaswag_file, data_cache):
    train(make_cfg("trainer.max_steps=4", "trainer.eval_every=4"), progress=False)
    run = tmp_path / "run"
    results = [evaluate_checkpoint(str(run), CPU, val_tokens=4000, hellaswag_source=str(hellaswag_file),
                                   progress=False) for _ in range(2)]
    assert results[0] == results[1]
    assert results[0]["step"] == 4 and results[0]["val/tokens"] == 4000 - 4000 % 64
    assert results[0]["hellaswag/examples"] == 4
    same = evaluate_checkpoint(str(run / "checkpoints" / "latest"), CPU, val_tokens=4000, progress=False)
    assert same["val/loss"] == results[0]["val/loss"]


def test_a_torchrun_jobs_checkpoint_is_evaluated_as_the_single_process_run(data_cache, tmp_path):
    """A step sees the same windows whatever the world size, so two fsdp ranks train the one-process run's model
    (up to the collectives' rounding); their sharded checkpoint is read whole in one process."""
    mode = "fsdp"
    common = ["logger.mode=disabled", f"data.cache_dir={data_cache}", "trainer.batch_size=4", "model.block_size=32",
              "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.eval_batches=1", "trainer.sample_tokens=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for launcher, run in (([sys.executable], "single"), ([sys.executable, "-m", "torch.distributed.run",
                                                        "--standalone", "--nproc_per_node=2"], mode)):
        extra = [f"distributed={mode}"] if run == mode else []
        subprocess.run([*launcher, str(REPO / "scripts" / "train.py"), *common, *extra,
                        f"hydra.run.dir={tmp_path / run}"], cwd=tmp_path, env=env, check=True, capture_output=True,
                       timeout=300)
    single, sharded = (evaluate_checkpoint(str(tmp_path / run), CPU, val_tokens=2000, progress=False)
                       for run in ("single", mode))
    assert (tmp_path / mode / "checkpoints" / "latest" / ".metadata").exists()
    assert sharded["step"] == single["step"] == 2
    assert sharded["val/loss"] == pytest.approx(single["val/loss"], rel=1e-4)


def test_another_corpus_is_evaluated_with_the_runs_tokenizer(make_cfg, tmp_path, data_cache):
    from minitrain.config import DataConfig

    train(make_cfg("trainer.max_steps=2", "trainer.eval_every=2"), progress=False)
    run = tmp_path / "run"
    (tmp_path / "other").mkdir()
    for i in range(30):
        (tmp_path / "other" / f"{i}.txt").write_text(f"def other_{i}(x):\n    return x * {i}\n" * 40)
    other = DataConfig(name="files", source="files", paths=str(tmp_path / "other" / "*.txt"),
                       cache_dir=str(data_cache), val_fraction=0.2)
    result = evaluate_checkpoint(str(run), CPU, data_cfg=other, progress=False)
    assert result["val/tokens"] > 0 and math.isfinite(result["val/loss"])
    prepared = cache_path(DataConfig(**{**other.__dict__, "tokenizer": str(run)}))
    assert (prepared / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    assert not cache_path(other).exists()  # no tokenizer of its own was trained


def test_eval_script_prints_the_numbers_and_refuses_a_missing_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "eval.py"), str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error: " in out.stderr and "no such run dir or checkpoint" in out.stderr
