"""minitrain/weights.py, the one reader of a trained model, as scripts/sample.py, scripts/export_hf.py and
scripts/eval.py use it: a run dir, one of its checkpoints and Hugging Face weights each read once per script,
into the same tensors and tokenizer, which each script's output then shows (the greedy text, the exported model's
logits in transformers and its tokenizer's ids, the validation loss computed directly); every way a source can be
unusable refused by all three in the same one line; and eval.py's loss named apart from the trainer's."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minitrain import weights as reader
from minitrain.config import DataConfig
from minitrain.cli import compose_config
from minitrain.data import prepare_data
from minitrain.generate import Sampling, sample_texts
from minitrain.trainer import train
from minitrain.weights import open_weights

from conftest import GPT2_VOCAB, run_script

PROMPT = "def wrap(text"
VOCAB = 300  # the run's trained BPE


def data_config(gpt2_corpus, data_cache, **changes) -> DataConfig:
    return DataConfig(name="files", source="files", paths=f"{gpt2_corpus}/*.txt", val_fraction=0.05,
                      vocab_size=VOCAB, cache_dir=str(data_cache), **changes)


@pytest.fixture(scope="module")
def trained(data_cache, gpt2_corpus, tmp_path_factory):
    """Two steps of a 2-layer GPT on the corpus with a BPE of 300 tokens trained on it, saved at each:
    checkpoints/latest/ is step 2, previous/ step 1."""
    out = tmp_path_factory.mktemp("weights") / "run"
    train(compose_config(["data=files", f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05",
                          f"data.vocab_size={VOCAB}", f"data.cache_dir={data_cache}", f"trainer.out_dir={out}",
                          "logger.mode=disabled", "trainer.batch_size=8", "model.block_size=64", "model.n_layer=2",
                          "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.log_every=1",
                          "trainer.eval_every=2", "trainer.save_every=1", "trainer.eval_batches=1",
                          "trainer.sample_tokens=0"]), progress=False)
    return out


def window_losses(model, tokens: np.ndarray, block_size: int) -> list[float]:
    """The model's mean loss on each consecutive window of `tokens` (window i predicts tokens
    [i block_size + 1, (i + 1) block_size]), all windows in one forward."""
    ids, n = torch.from_numpy(tokens.astype(np.int64)), (len(tokens) - 1) // block_size
    with torch.no_grad():
        logits = model(ids[:n * block_size].view(n, block_size)).float()
    return F.cross_entropy(logits.transpose(1, 2), ids[1:n * block_size + 1].view(n, block_size),
                           reduction="none").mean(1).tolist()


def val_tokens(data) -> np.ndarray:
    tokens = np.empty(len(data.val), dtype=np.int64)
    data.val.read(0, tokens)
    return tokens


@pytest.mark.parametrize("kind", ["run dir", "checkpoint", "hugging face"])
def test_the_three_scripts_read_a_source_through_the_one_reader_alike(kind, trained, hf_gpt2, gpt2_corpus,
                                                                     data_cache, tmp_path, monkeypatch, capsys):
    """Each script reads the source once, through minitrain/weights.py, into the tensors and the tokenizer the
    reader gives; their outputs are that model's and that tokenizer's. The checkpoint is previous/, not the
    latest: a checkpoint is read as itself."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    source = {"run dir": trained, "checkpoint": trained / "checkpoints" / "previous", "hugging face": hf_gpt2}[kind]
    expected = open_weights(str(source))
    reads = []
    for name in ("read_checkpoint", "read_hf"):
        read = getattr(reader, name)
        monkeypatch.setattr(reader, name, lambda *a, read=read, **k: reads.append(read(*a, **k)) or reads[-1])

    code, out, err = run_script("sample", [source, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", 12],
                                monkeypatch, capsys)
    assert code == 0, err
    model = expected.build("cpu")
    [text] = sample_texts(model, expected.tokenizer, PROMPT, 1, 12, Sampling(temperature=0))[0]
    assert out == text + "\n---------------\n"

    code, _, err = run_script("export_hf", [source, tmp_path / "out"], monkeypatch, capsys)
    assert code == 0, err
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()(idx).logits, model(idx),
                                   rtol=0, atol=1e-5)
    text = "def f(x):\n    return x <|endoftext|> café"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == expected.tokenizer.encode(text).ids

    # eval.py on the run's own data, or the corpus named for Hugging Face weights (tokenized with their tokenizer)
    hf = kind == "hugging face"
    data = prepare_data(data_config(gpt2_corpus, data_cache, **({"tokenizer": str(hf_gpt2)} if hf else {})),
                        model.cfg.block_size, progress=False)
    overrides = ["data=files", f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05",
                 f"data.cache_dir={data_cache}"] if hf else []
    json_path = tmp_path / "eval.json"
    code, _, err = run_script("eval", [source, *overrides, "--val-tokens", 128, "--json", json_path], monkeypatch,
                              capsys)
    assert code == 0, err
    record = json.loads(json_path.read_text())
    windows = 128 // model.cfg.block_size
    assert record["eval/val_tokens"] == 128
    assert record["eval/val_loss"] == pytest.approx(
        np.mean(window_losses(model, val_tokens(data), model.cfg.block_size)[:windows]), rel=1e-5)
    assert record.get("step") == (None if hf else expected.run.step)
    assert (model.cfg.vocab_size, expected.run and expected.run.step) == \
        ((GPT2_VOCAB, None) if hf else (320, {"run dir": 2, "checkpoint": 1}[kind]))

    assert len(reads) == 3  # one read per script, each the reader's
    for weights in reads:
        assert weights.source == expected.source and weights.cfg == expected.cfg
        assert weights.state.keys() == expected.state.keys()
        assert all(torch.equal(weights.state[k], expected.state[k]) for k in expected.state)
        assert weights.tokenizer.to_str() == expected.tokenizer.to_str()


def test_a_named_tokenizer_serves_a_run_that_kept_none_and_replaces_one_it_kept(trained, hf_gpt2, tmp_path):
    """--tokenizer wins over the run's own tokenizer.json; a run without one gives None to a reader that does not
    need one (eval.py, which then takes its data cache's) and is refused to the others."""
    named = open_weights(str(trained), str(hf_gpt2))
    assert named.tokenizer.to_str() == open_weights(str(hf_gpt2)).tokenizer.to_str() != \
        open_weights(str(trained)).tokenizer.to_str()
    assert named.tokenizer_source == str(hf_gpt2)
    bare = tmp_path / "run"
    shutil.copytree(trained, bare)
    (bare / "tokenizer.json").unlink()
    without = open_weights(str(bare), need_tokenizer=False)
    assert without.tokenizer is None and without.tokenizer_source is None and without.run.run_dir == bare
    with pytest.raises(reader.SourceError, match=r"its run keeps no tokenizer.json .*\(--tokenizer gpt2, or "):
        open_weights(str(bare))


def torn_shard(ckpt):
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])


def job_info(ckpt, edit):
    path = ckpt / "minitrain.json"
    path.write_text(edit(json.loads(path.read_text())))


@pytest.mark.parametrize("make, message", [
    (lambda run: run / "nowhere", "{run}/nowhere: no such run dir or checkpoint, nor Hugging Face weights "
                                  "(model.init_from='{run}/nowhere': no such directory, and not a Hugging Face model "
                                  "name)"),
    (lambda run: shutil.rmtree(run / "checkpoints") or run, "{run}: no checkpoint there (checkpoints/latest/)"),
    (lambda run: shutil.rmtree(run / "checkpoints" / "latest") or run / "checkpoints",
     "{run}/checkpoints: no checkpoint there (checkpoints/latest/)"),
    (lambda run: (run / "notes").mkdir() or run / "notes",
     "{run}/notes: neither a run dir (checkpoints/), a checkpoint (minitrain.json) nor Hugging Face weights "
     "(config.json)"),
    (lambda run: torn_shard(run / "checkpoints" / "latest") or run, "{run}/checkpoints/latest could not be read ("),
    (lambda run: job_info(run / "checkpoints" / "latest", lambda info: "{") or run,
     "{run}/checkpoints/latest/minitrain.json is unreadable (JSONDecodeError"),
    (lambda run: job_info(run / "checkpoints" / "latest",
                          lambda info: json.dumps({**info, "config": {**info["config"], "model": {"n_layer": "two"}}}))
     or run, "{run}/checkpoints/latest: its config is not one this minitrain reads ("),
], ids=["missing", "no checkpoint yet", "checkpoints without latest", "neither", "torn shard", "unreadable job info",
        "another config"])
def test_an_unusable_source_is_refused_by_each_script_in_the_same_line(trained, tmp_path, monkeypatch, capsys,
                                                                       make, message):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    source = make(run)
    expected = "error: " + message.format(run=run)
    for name, argv in [("sample", [source]), ("export_hf", [source, tmp_path / "out"]), ("eval", [source])]:
        code, out, err = run_script(name, argv, monkeypatch, capsys)
        assert (code, out, err.count("\n")) == (2, "", 1), (name, err)
        assert err.startswith(expected), (name, err)
    assert not (tmp_path / "out").exists()


def test_a_run_without_its_tokenizer_is_evaluated_but_not_sampled_or_exported(trained, tmp_path, monkeypatch,
                                                                              capsys):
    """eval.py scores the run on its own data, tokenized by its data cache; sample.py and export_hf.py need the
    tokenizer itself and ask for --tokenizer."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    kept = (run / "tokenizer.json").read_text()
    code, _, err = run_script("eval", [run, "--val-tokens", 64, "--json", tmp_path / "kept.json"], monkeypatch, capsys)
    assert code == 0, err
    (run / "tokenizer.json").unlink()
    code, _, err = run_script("eval", [run, "--val-tokens", 64, "--json", tmp_path / "none.json"], monkeypatch, capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "none.json").read_text()) == json.loads((tmp_path / "kept.json").read_text())
    refusal = f"error: {run}/checkpoints/latest: its run keeps no tokenizer.json (written by runs since 2026-12-03); " \
              "name the one it was trained with (--tokenizer gpt2, or the data cache's directory)\n"
    assert run_script("sample", [run], monkeypatch, capsys) == (2, "", refusal)
    assert run_script("export_hf", [run, tmp_path / "out"], monkeypatch, capsys) == (2, "", refusal)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text(kept)
    code, out, err = run_script("sample", [run, "--tokenizer", tmp_path / "tokenizer", "--prompt", PROMPT,
                                           "--temperature", 0, "--max-new-tokens", 5], monkeypatch, capsys)
    assert code == 0 and out.startswith(PROMPT), err


def test_hugging_face_weights_are_evaluated_on_the_data_named_and_refused_without(hf_gpt2, tmp_path, monkeypatch,
                                                                                  capsys, hellaswag_rows):
    """Weights name no corpus: the validation loss needs the data overrides (one line otherwise); HellaSwag alone
    needs none, and the line printed names no step."""
    code, out, err = run_script("eval", [hf_gpt2], monkeypatch, capsys)
    assert (code, out) == (2, "") and err == (
        f"error: {hf_gpt2} is Hugging Face weights, which name no corpus: give the data to evaluate on (data=NAME "
        "data.KEY=VALUE), or leave the validation loss out (--val-tokens 0)\n")
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in hellaswag_rows))
    code, out, err = run_script("eval", [hf_gpt2, "--val-tokens", 0, "--hellaswag", path, "--json",
                                         tmp_path / "r.json"], monkeypatch, capsys)
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and set(r) == {"hellaswag/acc_norm", "hellaswag/acc", "hellaswag/examples"}, err
    assert out == (f"{hf_gpt2}: hellaswag/acc_norm {r['hellaswag/acc_norm']:.4f}, hellaswag/acc "
                   f"{r['hellaswag/acc']:.4f}, hellaswag/examples {len(hellaswag_rows)}\n")


@pytest.fixture
def hellaswag_rows():
    return [{"activity_label": "Coding", "ctx_a": "A programmer opens an editor.", "ctx_b": "she",
             "endings": ["types a function.", "eats the keyboard.", "sings to the screen.", "walks away."],
             "label": i % 4} for i in range(3)]


def test_eval_names_its_loss_apart_from_the_trainers(trained, monkeypatch, capsys, tmp_path):
    """The trainer's val/loss (random windows) and eval.py's loss over the split's consecutive windows are two
    estimators: no key of the one is a key of the other (the step and HellaSwag's, the same estimator in both,
    aside)."""
    logged = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    trainer_keys = set().union(*(r for r in logged if "val/loss" in r))
    code, _, err = run_script("eval", [trained, "--val-tokens", 64, "--json", tmp_path / "r.json"], monkeypatch,
                              capsys)
    eval_keys = set(json.loads((tmp_path / "r.json").read_text()))
    assert code == 0 and {"val/loss", "val/ppl"} <= trainer_keys and "eval/val_loss" in eval_keys, err
    assert trainer_keys & eval_keys == {"step"}
