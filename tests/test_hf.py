"""GPT-2 in and out (minitrain/hf.py, minitrain/data/tokenizer.py), checked against transformers itself: a randomly
initialised GPT2LMHeadModel saved to a directory (conftest's hf_gpt2), imported, fine-tuned, exported and loaded
back by transformers, on the CPU in fp32, without network."""

import json
import shutil

import pytest
import torch

from minitrain import hf
from minitrain.data import EOT
from minitrain.errors import ConfigError
from minitrain.ops import fused_linear_cross_entropy, linear_cross_entropy_reference
from minitrain.data.tokenizer import TokenizerError, pretrained_tokenizer
from minitrain.trainer import Trainer
from minitrain.weights import Weights, open_weights

from conftest import GPT2_VOCAB
from test_trainer import crash_at


def transformers_model(folder):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder).eval()


def windows(n=3, length=40, seed=0):
    return torch.randint(0, GPT2_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def finetune(make_cfg, hf_gpt2, gpt2_corpus, *extra):
    return make_cfg(f"model.init_from={hf_gpt2}", f"data.tokenizer={hf_gpt2}", "data=files",
                    f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05", *extra)


def test_imported_gpt2_computes_transformers_logits_and_loss(hf_gpt2):
    weights = open_weights(str(hf_gpt2))
    model, theirs = weights.build("cpu"), transformers_model(hf_gpt2)
    assert (model.cfg.n_layer, model.cfg.n_head, model.cfg.n_embd, model.cfg.block_size) == (2, 4, 64, 128)
    assert model.cfg.vocab_size == 320 and model.cfg.head_vocab == GPT2_VOCAB  # 320 is already a multiple of 64
    idx = windows()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), theirs(idx).logits, rtol=0, atol=1e-5)
        # transformers' loss on the same batch: the head's rows only take part in the softmax
        hidden = model.forward_hidden(idx[:, :-1]).flatten(0, 1)
        expected = theirs(idx, labels=idx).loss
        for loss in (linear_cross_entropy_reference, fused_linear_cross_entropy):
            torch.testing.assert_close(loss(hidden, model.lm_head_weight, idx[:, 1:].flatten()), expected,
                                       rtol=0, atol=1e-5)


def resized(hf_gpt2, folder, rows):
    """The fixture's GPT-2 with its vocab cut to `rows` (transformers' resize_token_embeddings), saved to `folder`."""
    shutil.copytree(hf_gpt2, folder)
    theirs = transformers_model(folder)
    theirs.resize_token_embeddings(rows)
    theirs.save_pretrained(folder)
    return folder


def test_padding_rows_are_zero_and_outside_the_head(hf_gpt2, tmp_path):
    """A vocab of 300 rows is padded to 320: the 20 rows are zero, and the head (loss, sampling) never scores them,
    though zero rows would score 0 where real tokens score less."""
    folder = resized(hf_gpt2, tmp_path / "gpt2-300", 300)
    theirs = transformers_model(folder)
    model = open_weights(str(folder)).build("cpu")
    assert model.cfg.vocab_size == 320 and model.cfg.head_vocab == 300
    assert model.wte.weight[300:].abs().sum() == 0 and model.lm_head_weight.shape == (300, 64)
    idx = windows(n=2) % 300
    with torch.no_grad():
        torch.testing.assert_close(model(idx), theirs(idx).logits, rtol=0, atol=1e-5)
        hidden = model.forward_hidden(idx[:, :-1]).flatten(0, 1)
        torch.testing.assert_close(linear_cross_entropy_reference(hidden, model.lm_head_weight, idx[:, 1:].flatten()),
                                   theirs(idx, labels=idx).loss, rtol=0, atol=1e-5)


def test_export_loads_in_transformers_with_our_logits_and_tokenizer(hf_gpt2, tmp_path):
    from transformers import AutoTokenizer

    weights = open_weights(str(hf_gpt2))
    weights.state = {k: v + 0.01 * torch.randn_like(v) for k, v in weights.state.items()}  # not the files' weights
    hf.export(weights, tmp_path / "out")
    theirs = transformers_model(tmp_path / "out")
    idx = windows()
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, weights.build("cpu")(idx), rtol=0, atol=1e-5)
    text = "def f(x):\n    return x , y . It 's done <|endoftext|> café"  # spaces transformers' clean-up would drop
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok(text)["input_ids"] == weights.tokenizer.encode(text).ids
    assert tok.eos_token == tok.bos_token == EOT and theirs.config.eos_token_id == weights.tokenizer.token_to_id(EOT)
    assert tok.decode(tok(text)["input_ids"]) == text
    # on, transformers 4 drops the spaces before punctuation in a decode; 5 skips that for a BPE, with a warning
    assert tok.clean_up_tokenization_spaces is False


def test_a_model_without_biases_is_exported_with_zero_ones(hf_gpt2, tmp_path):
    from dataclasses import replace

    from minitrain.model import GPT

    weights = open_weights(str(hf_gpt2))
    torch.manual_seed(1)
    unbiased = GPT(replace(weights.cfg, bias=False))
    assert not any(name.endswith("bias") for name in unbiased.state_dict())
    weights = Weights(unbiased.cfg, unbiased.state_dict(), weights.tokenizer, hf_gpt2)
    hf.export(weights, tmp_path / "out")
    idx = windows()
    with torch.no_grad():
        torch.testing.assert_close(transformers_model(tmp_path / "out")(idx).logits, unbiased(idx), rtol=0, atol=1e-5)


def imported(folder, block_size=None):
    """GPT-2 weights imported as a run imports them (model.init_from=folder, model.block_size=block_size)."""
    from minitrain.model import GPT
    from minitrain.model_config import ModelConfig

    cfg = hf.settle_shape(ModelConfig(init_from=str(folder), block_size=block_size))
    torch.manual_seed(1)  # random weights first: what the import leaves unwritten would show
    model = GPT(cfg)
    hf.load_weights(model)
    return model.eval()


def losses(model, theirs, idx):
    """Our loss (the head's rows only, both implementations) and transformers' on the same batch."""
    hidden = model.forward_hidden(idx[:, :-1]).flatten(0, 1)
    ours = [loss(hidden, model.lm_head_weight, idx[:, 1:].flatten())
            for loss in (linear_cross_entropy_reference, fused_linear_cross_entropy)]
    return ours, theirs(idx, labels=idx).loss


@pytest.mark.parametrize("rows, block_size", [(GPT2_VOCAB, None), (300, 64), (GPT2_VOCAB, 127), (300, None)])
def test_import_and_export_compute_transformers_logits_and_loss_on_each_variant(hf_gpt2, tmp_path, rows,
                                                                                 block_size):
    """A vocab that is a multiple of 64 or padded to one, the weights' full context or a shorter one: imported, our
    logits and loss are transformers' on windows filling the context; exported, transformers reads the model with
    our shape (config.json's vocab and positions, the tokenizer's model_max_length, generation's max_length) and
    computes the same, and importing the export gives back the same tensors."""
    from transformers import AutoTokenizer, GenerationConfig

    folder = hf_gpt2 if rows == GPT2_VOCAB else resized(hf_gpt2, tmp_path / f"gpt2-{rows}", rows)
    theirs, model = transformers_model(folder), imported(folder, block_size)
    context = block_size or 128
    assert (model.cfg.vocab_size, model.cfg.head_vocab, model.cfg.block_size) == (320, rows, context)
    assert model.wte.weight[rows:].abs().sum() == 0 and model.wpe.weight.shape[0] == context
    idx = windows(length=context) % rows
    with torch.no_grad():
        torch.testing.assert_close(model(idx), theirs(idx).logits, rtol=0, atol=1e-5)
        ours, expected = losses(model, theirs, idx)
        for loss in ours:
            torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)

    weights = Weights(model.cfg, model.state_dict(), pretrained_tokenizer(str(hf_gpt2)), folder)
    hf.export(weights, tmp_path / "out")
    config = json.loads((tmp_path / "out" / hf.CONFIG).read_text())
    assert (config["vocab_size"], config["n_positions"]) == (rows, context)
    exported = transformers_model(tmp_path / "out")
    assert exported.generation_config.max_length == GenerationConfig.from_pretrained(tmp_path / "out").max_length \
        == context
    assert AutoTokenizer.from_pretrained(tmp_path / "out").model_max_length == context
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, theirs(idx).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(exported(idx, labels=idx).loss, expected, rtol=0, atol=1e-5)
    again = open_weights(str(tmp_path / "out"))
    shape = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "head_vocab")
    assert [getattr(again.cfg, k) for k in shape] == [getattr(model.cfg, k) for k in shape]
    assert all(torch.equal(again.state[k], v) for k, v in model.state_dict().items())


def test_the_readmes_pipeline_one_liner_runs_on_a_short_context_without_a_warning(hf_gpt2, tmp_path):
    """The README's `python -c "... pipeline('text-generation', model='exported/gpt2-notes')('The meeting')"`, as it
    is written, on an export whose context (64) is shorter than the pipeline's default length (256 new tokens): it
    generates, and stderr holds nothing but transformers' loading bar (no torchao note, no length warning)."""
    import re
    import shlex
    import subprocess
    import sys

    from conftest import REPO

    command = next(line for line in (REPO / "README.md").read_text().splitlines()
                   if line.startswith("python -c") and "pipeline('text-generation'" in line)
    argv = shlex.split(command)
    model = imported(hf_gpt2, block_size=64)
    hf.export(Weights(model.cfg, model.state_dict(), pretrained_tokenizer(str(hf_gpt2)), hf_gpt2),
              tmp_path / "exported" / "gpt2-notes")
    out = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[{'generated_text': 'The meeting")
    loading_bar = re.compile(r"Loading weights: +\d+%\|.*")
    assert [line for line in re.split(r"[\r\n]", out.stderr) if line and not loading_bar.fullmatch(line)] == []


def test_a_trained_checkpoint_round_trips_through_the_export(make_cfg, gpt2_corpus, tmp_path):
    """Trained from scratch with our own tokenizer (vocab padded to 64 rows, all of them in the head): exported,
    transformers computes our logits, and importing the export gives them again."""
    cfg = make_cfg("data=files", f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05", "data.vocab_size=300",
                   "trainer.max_steps=3", "model.n_layer=2", "model.bias=false")
    trainer = Trainer(cfg, progress=False)
    trainer.fit()
    trained = open_weights(str(tmp_path / "run"))
    assert trained.cfg.vocab_size == 320 and trained.cfg.head_vocab is None
    assert trained.source == tmp_path / "run" / "checkpoints" / "latest"
    assert open_weights(str(trained.source)).state.keys() == trained.state.keys()  # the file itself
    hf.export(trained, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 320
    again = open_weights(str(tmp_path / "out"))
    idx = windows()
    with torch.no_grad():
        ours = trainer.model(idx)
        torch.testing.assert_close(transformers_model(tmp_path / "out")(idx).logits, ours, rtol=0, atol=1e-5)
        assert torch.equal(again.build("cpu")(idx), ours)
    assert again.tokenizer.to_str() == trainer.data.tokenizer.to_str()


def export_hf_py(monkeypatch, capsys, *argv):
    """`python scripts/export_hf.py ARGV`: exit code, stdout, stderr."""
    from conftest import run_script

    return run_script("export_hf", argv, monkeypatch, capsys)


def test_export_hf_py_as_a_user_runs_it(make_cfg, hf_gpt2, gpt2_corpus, tmp_path, monkeypatch, capsys):
    """CHECKPOINT as a run dir and as a checkpoint dir, OUT_DIR new and then holding the earlier export, --tokenizer
    for a run without its tokenizer.json; a directory holding anything else is refused in one line (exit 2), as is
    the run without --tokenizer. The run trained with dropout: config.json keeps it for training in transformers;
    evaluated (our build, transformers' eval) there is none, and the logits are ours."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    trainer = Trainer(make_cfg("data=files", f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05",
                               "data.vocab_size=300", "trainer.max_steps=2", "model.n_layer=2", "model.dropout=0.1"),
                      progress=False)
    trainer.fit()
    run, out = tmp_path / "run", tmp_path / "exported"
    code, stdout, stderr = export_hf_py(monkeypatch, capsys, run, out)
    assert (code, stderr) == (0, "")
    assert stdout == (f"exported {run / 'checkpoints' / 'latest'} (2 layers, {trainer.model.cfg.n_embd} wide) to "
                      f"{out}: config.json, model.safetensors, generation_config.json, tokenizer.json, "
                      "tokenizer_config.json, special_tokens_map.json\n")
    config = json.loads((out / hf.CONFIG).read_text())
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.1
    built, idx = open_weights(str(run)).build("cpu"), windows() % 300
    assert not built.training
    with torch.no_grad():
        expected = trainer.model.eval()(idx)
        torch.testing.assert_close(transformers_model(out)(idx).logits, expected, rtol=0, atol=1e-5)
        assert torch.equal(built(idx), expected)

    first = load_file(out / hf.WEIGHTS)
    assert export_hf_py(monkeypatch, capsys, run / "checkpoints" / "latest", out)[0] == 0  # over its own export
    again = load_file(out / hf.WEIGHTS)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)

    refusal = (2, "", f"error: {out} is neither empty nor an earlier export (its files would mix with this "
                      "model's); export into a new or empty directory\n")
    (out / "pytorch_model.bin").write_bytes(b"another model's weights")
    assert export_hf_py(monkeypatch, capsys, run, out)[0:3] == refusal
    other = tmp_path / "gpt2"  # another model's files under the names an export writes
    other.mkdir()
    for name in (hf.CONFIG, hf.WEIGHTS):
        shutil.copy(hf_gpt2 / name, other / name)
    refusal = (*refusal[:2], refusal[2].replace(str(out), str(other)))
    assert export_hf_py(monkeypatch, capsys, run, other) == refusal
    assert (other / hf.WEIGHTS).read_bytes() == (hf_gpt2 / hf.WEIGHTS).read_bytes()

    (tmp_path / "tokenizer").mkdir()
    (run / "tokenizer.json").rename(tmp_path / "tokenizer" / "tokenizer.json")
    code, stdout, stderr = export_hf_py(monkeypatch, capsys, run, tmp_path / "again")
    assert code == 2 and len(stderr.splitlines()) == 1 and "(--tokenizer gpt2, or " in stderr
    assert not (tmp_path / "again").exists()
    assert export_hf_py(monkeypatch, capsys, run, tmp_path / "again", "--tokenizer", tmp_path / "tokenizer")[0] == 0
    text = "def f(x):\n    return x <|endoftext|> café"
    exported_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "again")
    assert exported_tokenizer(text)["input_ids"] == trainer.data.tokenizer.encode(text).ids
    # and for Hugging Face weights, the tokenizer named instead of theirs
    assert open_weights(str(hf_gpt2), str(tmp_path / "tokenizer")).tokenizer.to_str() == \
        trainer.data.tokenizer.to_str()


def test_a_fine_tune_starts_at_transformers_loss_and_resumes_bit_for_bit(make_cfg, hf_gpt2, gpt2_corpus, tmp_path,
                                                                        monkeypatch):
    overrides = ("trainer.max_steps=6", "trainer.save_every=3", "trainer.log_every=2", "trainer.eval_every=6")
    straight = Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, *overrides, f"trainer.out_dir={tmp_path / 'a'}"),
                       progress=False)
    assert straight.plan.model.head_vocab == GPT2_VOCAB and straight.plan.model.block_size == 64
    x, y = straight.train_batches.get(0)
    with torch.no_grad():
        expected = transformers_model(hf_gpt2)(torch.cat([x, y[:, -1:]], 1), labels=torch.cat([x, y[:, -1:]], 1)).loss
        torch.testing.assert_close(straight.forward_loss(x, y), expected, rtol=0, atol=1e-5)
    straight.fit()

    crash_at(Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, *overrides, f"trainer.out_dir={tmp_path / 'b'}"),
                     progress=False), 4, monkeypatch)  # after the step-3 checkpoint
    resumed = Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, *overrides, f"trainer.out_dir={tmp_path / 'b'}",
                               "trainer.resume=auto"), progress=False)
    assert resumed.step == 3
    resumed.fit()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], transformers_model(hf_gpt2).transformer.wte.weight)  # it trained
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "b")


def logged_losses(run):
    keep = ("step", "train/loss", "val/loss", "opt/lr", "opt/grad_norm")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keep if k in r} for r in records if "step" in r]


@pytest.mark.parametrize("extra", [
    ("precision=bf16", "checkpointing=selective"),
    ("precision=fp16", "checkpointing=full", "loss=fused"),
    ("precision=amp_bf16", "optimizer.impl=fused", "checkpointing=every_k", "checkpointing.every_k=1"),
])
def test_fine_tuning_runs_in_each_precision_and_policy(make_cfg, hf_gpt2, gpt2_corpus, tmp_path, extra):
    """...and its checkpoint is exported in the dtype the run kept its weights in (config.json's dtype too), the
    trained values: transformers computes our logits."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    trainer = Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, "trainer.max_steps=2", "trainer.log_every=1",
                               *extra), progress=False)
    before = trainer.model.wte.weight.detach().float().clone()
    record = trainer.fit()
    assert torch.isfinite(torch.tensor(record["train/loss"])) and record["amp/skipped_steps"] == 0
    assert not torch.equal(trainer.model.wte.weight.detach().float(), before)

    dtype = trainer.model.wte.weight.dtype
    hf.export(open_weights(str(tmp_path / "run")), tmp_path / "out")
    assert {t.dtype for t in load_file(tmp_path / "out" / hf.WEIGHTS).values()} == {dtype}
    assert json.loads((tmp_path / "out" / hf.CONFIG).read_text())["dtype"] == str(dtype).removeprefix("torch.")
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ours = trainer.model.float().eval()
    idx = windows()
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)


def distributed_worker(rank, port, configs):
    import os

    from minitrain import distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    for cfg in configs:
        Trainer(cfg, progress=False).fit()
    distributed.teardown(finished=True)


def test_ddp_and_fsdp_fine_tunes_match_one_process_and_export_from_their_sharded_checkpoints(
        make_cfg, hf_gpt2, gpt2_corpus, tmp_path):
    """Two gloo processes, ddp then fsdp, from the imported weights: the single process's losses, and each sharded
    checkpoint (checkpoints/latest/) exported is the single process's model in transformers."""
    import socket

    import torch.multiprocessing as mp

    steps = ("trainer.max_steps=3", "trainer.log_every=1", "trainer.save_every=3", "trainer.eval_every=3")
    single = Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, *steps, f"trainer.out_dir={tmp_path / 'single'}"),
                     progress=False)
    single.fit()  # builds the data cache, so the ranks only read it
    configs = [finetune(make_cfg, hf_gpt2, gpt2_corpus, *steps, f"distributed={mode}", "distributed.timeout_s=60",
                        f"trainer.out_dir={tmp_path / mode}") for mode in ("ddp", "fsdp")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(distributed_worker, args=(port, configs), nprocs=2, join=True, start_method="spawn")
    idx = windows()
    with torch.no_grad():
        expected = single.model(idx)
    reference = logged_losses(tmp_path / "single")
    for mode in ("ddp", "fsdp"):
        losses = logged_losses(tmp_path / mode)
        assert [r["step"] for r in losses] == [r["step"] for r in reference] == [1, 2, 3]
        torch.testing.assert_close([r["train/loss"] for r in losses], [r["train/loss"] for r in reference],
                                   rtol=0, atol=1e-5)
        assert (tmp_path / mode / "checkpoints" / "latest" / ".metadata").is_file()
        hf.export(open_weights(str(tmp_path / mode / "checkpoints" / "latest")), tmp_path / f"{mode}-hf")
        with torch.no_grad():
            torch.testing.assert_close(transformers_model(tmp_path / f"{mode}-hf")(idx).logits, expected,
                                       rtol=0, atol=1e-4)


# -- the shape and the vocab ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, message", [
    ("model.n_layer", "3", r"model.n_layer=3 conflicts with .* n_layer=2\)"),
    ("model.n_embd", "32", r"model.n_embd=32 conflicts with .* n_embd=64\)"),
    ("model.block_size", "256", r"model.block_size=256 conflicts with .* n_positions=128\) \(a lower"),
    ("model.vocab_size", "256", r"model.vocab_size=256 conflicts with .* vocab_size=320\)"),
    ("model.bias", "false", r"model.bias=false conflicts with .*\): every GPT-2 layer has biases"),
])
def test_a_shape_key_that_contradicts_the_weights_is_refused_naming_both(make_cfg, hf_gpt2, gpt2_corpus, key, value,
                                                                        message):
    with pytest.raises(ConfigError, match=message):
        Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, f"{key}={value}"), progress=False)


def test_a_preset_that_matches_the_weights_is_accepted_and_one_that_does_not_is_refused(make_cfg, hf_gpt2):
    from minitrain.model_config import ModelConfig

    matching = ModelConfig(init_from=str(hf_gpt2), n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=384)
    assert hf.settle_shape(matching).vocab_size == 384  # more padding is allowed
    with pytest.raises(ConfigError, match=r"model.n_layer=4 conflicts with"):  # tiny's, chosen on purpose
        Trainer(make_cfg("model=tiny", f"model.init_from={hf_gpt2}"), progress=False)


def test_a_tokenizer_larger_than_the_weights_vocab_is_refused(make_cfg, hf_gpt2, gpt2_corpus, tmp_path):
    """Weights of 300 tokens (padded to 320 rows) with the fixture's tokenizer of 320: ids 300-319 would index
    padding, which the head never scores."""
    folder = resized(hf_gpt2, tmp_path / "gpt2-300", 300)
    with pytest.raises(ConfigError) as refused:
        Trainer(finetune(make_cfg, folder, gpt2_corpus), progress=False)
    assert str(refused.value) == (f"model.head_vocab=300 (model.init_from={folder}'s vocab) is smaller than the "
                                  f"tokenizer's vocabulary (320, from data.tokenizer={folder}); the weights need the "
                                  "tokenizer they were trained with: name it in data.tokenizer")
    with pytest.raises(ConfigError) as refused:  # a tokenizer trained on the corpus, asked for
        Trainer(finetune(make_cfg, hf_gpt2, gpt2_corpus, "data.tokenizer=train", "data.vocab_size=400"), progress=False)
    assert str(refused.value) == (f"model.head_vocab=320 (model.init_from={hf_gpt2}'s vocab) is smaller than the "
                                  "tokenizer's vocabulary (400, from data.vocab_size=400); the weights need the "
                                  "tokenizer they were trained with: leave data.tokenizer out (it follows "
                                  "model.init_from) or name that one")


def train_py(cwd, *argv: str):
    """scripts/train.py as a user runs it, offline."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_run_from_weights_tokenizes_with_their_own_tokenizer_unless_told_otherwise(hf_gpt2, gpt2_corpus,
                                                                                   data_cache, tmp_path):
    """As nanoGPT's init_from: model.init_from=DIR alone tokenizes with DIR's tokenizer, not with a BPE trained on
    the corpus, whose ids would mean other tokens to the weights (here it would also have more ids than their 320
    rows, and be refused)."""
    from tokenizers import Tokenizer

    out = train_py(tmp_path, f"model.init_from={hf_gpt2}", "data=files", f"data.paths={gpt2_corpus}/*.txt",
                   "data.val_fraction=0.05", f"data.cache_dir={data_cache}", "model.block_size=32",
                   "trainer.batch_size=2", "trainer.max_steps=1", "trainer.eval_batches=1", "trainer.sample_tokens=0",
                   "logger.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]
    ran_with = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    assert ran_with.to_str() == pretrained_tokenizer(str(hf_gpt2)).to_str()
    assert f"tokenizer: {hf_gpt2}" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()


def test_weights_without_a_tokenizer_need_data_tokenizer_and_run_with_the_one_it_names(hf_gpt2, gpt2_corpus,
                                                                                      make_cfg, tmp_path):
    """Refused before anything loads, in one line naming data.tokenizer; named, that one is used."""
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in (hf.CONFIG, hf.WEIGHTS):
        shutil.copy(hf_gpt2 / name, folder / name)
    out = train_py(tmp_path, f"model.init_from={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: model.init_from={folder} holds no tokenizer (tokenizer.json, or vocab.json + merges.txt) for "
        "data.tokenizer to follow; name the one its weights were trained with: data.tokenizer=gpt2, or a directory "
        "holding it"], out.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    trainer = Trainer(make_cfg(f"model.init_from={folder}", f"data.tokenizer={hf_gpt2}", "data=files",
                               f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05"), progress=False)
    try:
        assert trainer.cfg.data.tokenizer == str(hf_gpt2)
        assert trainer.data.tokenizer.to_str() == pretrained_tokenizer(str(hf_gpt2)).to_str()
    finally:
        trainer.close()


# -- errors: one line, naming the file or key -------------------------------------------------------------------
def broken_copy(hf_gpt2, tmp_path, edit):
    folder = tmp_path / "broken"
    shutil.copytree(hf_gpt2, folder)
    edit(folder)
    return folder


def truncate(folder):
    data = (folder / hf.WEIGHTS).read_bytes()
    (folder / hf.WEIGHTS).write_bytes(data[: len(data) // 2])


def llama(folder):
    config = json.loads((folder / hf.CONFIG).read_text())
    (folder / hf.CONFIG).write_text(json.dumps({**config, "model_type": "llama"}))


def exact_gelu(folder):
    config = json.loads((folder / hf.CONFIG).read_text())
    (folder / hf.CONFIG).write_text(json.dumps({**config, "activation_function": "gelu"}))


def one_layer_fewer(folder):
    config = json.loads((folder / hf.CONFIG).read_text())
    (folder / hf.CONFIG).write_text(json.dumps({**config, "n_layer": 1}))


def untied_config(folder):
    config = json.loads((folder / hf.CONFIG).read_text())
    (folder / hf.CONFIG).write_text(json.dumps({**config, "tie_word_embeddings": False}))


def with_head(folder, offset):
    """An lm_head.weight saved beside the embedding (older checkpoints hold one): the embedding plus `offset`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / hf.WEIGHTS)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + offset
    save_file(tensors, folder / hf.WEIGHTS, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda f: (f / hf.WEIGHTS).unlink(), r"model.init_from=.*broken: there is no model.safetensors in that directory"),
    (truncate, r".*broken/model.safetensors is unreadable \(.*\): a partial download"),
    (llama, r".*broken/config.json: model_type='llama' is not GPT-2"),
    (exact_gelu, r".*broken/config.json: activation_function='gelu', where minitrain's GPT computes 'gelu_new'"),
    (one_layer_fewer, r".*broken/model.safetensors holds h.1.attn.c_attn.bias, which the GPT-2 of its config.json"),
    (lambda f: (f / hf.CONFIG).write_text("{"), r".*broken/config.json is unreadable \(JSONDecodeError"),
    (untied_config, r".*broken/config.json: tie_word_embeddings=False, where minitrain's GPT computes True$"),
    (lambda f: with_head(f, 1e-3), r".*broken/model.safetensors: lm_head.weight is not the token embedding, and "
                                   r"minitrain's head is tied to it$"),
])
def test_unusable_weights_are_refused_in_one_line_naming_the_file(hf_gpt2, tmp_path, edit, message):
    folder = broken_copy(hf_gpt2, tmp_path, edit)
    with pytest.raises(ConfigError) as refused:
        open_weights(str(folder))
    assert "\n" not in str(refused.value)
    assert refused.match(message)


def test_a_head_saved_equal_to_the_embedding_is_read_as_the_tied_head(hf_gpt2, tmp_path):
    """A head not tied to the embedding is refused (above: transformers would compute with it, minitrain cannot);
    one saved with the embedding's values is that head, and transformers computes our logits with it."""
    folder = broken_copy(hf_gpt2, tmp_path, lambda f: with_head(f, 0.0))
    idx = windows()
    with torch.no_grad():
        ours = open_weights(str(folder)).build("cpu")(idx)
        torch.testing.assert_close(ours, transformers_model(folder)(idx).logits, rtol=0, atol=1e-5)


def test_a_name_is_read_from_the_hub_cache_offline_and_an_unknown_one_is_refused(hf_gpt2, tmp_path, monkeypatch):
    """The hub's cache layout (models--<name>/refs/main -> snapshots/<commit>/<files>) holding the fixture as if
    `gpt2` had been downloaded; offline, so nothing is asked of the network."""
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    shutil.copytree(hf_gpt2, snapshot)
    (tmp_path / "hub" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--gpt2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # where no directory is called gpt2
    weights = open_weights("gpt2")
    assert weights.cfg.n_layer == 2 and weights.tokenizer.get_vocab_size() == GPT2_VOCAB
    with pytest.raises(ConfigError, match=r"^model.init_from=gpt2-nowhere: not a local directory, not in the Hugging "
                                          r"Face cache \(.*hub\), and the hub cannot be reached"):
        open_weights("gpt2-nowhere")
    with pytest.raises(TokenizerError, match=r"^data.tokenizer=gpt2-nowhere: not a local directory"):
        pretrained_tokenizer("gpt2-nowhere")
    with pytest.raises(ConfigError, match=r"model.init_from='./no/such/dir': no such directory, and not a Hugging"):
        open_weights("./no/such/dir")


def test_train_py_refuses_an_unknown_name_offline_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "model.init_from=gpt2-nowhere",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: model.init_from=gpt2-nowhere: not a local directory, not in the Hugging Face cache "
        f"({tmp_path / 'hub'}), and the hub cannot be reached; run once online to download it, or give a directory "
        "holding its files"]
    assert not (tmp_path / "run").exists()


# -- tokenizers ---------------------------------------------------------------------------------------------
def test_a_vocab_and_merges_directory_tokenizes_as_its_tokenizer_json(hf_gpt2, tmp_path):
    from tokenizers import Tokenizer

    (tmp_path / "slow").mkdir()
    Tokenizer.from_file(str(hf_gpt2 / "tokenizer.json")).model.save(str(tmp_path / "slow"))  # the pair GPT-2 shipped
    assert {p.name for p in (tmp_path / "slow").iterdir()} == {"vocab.json", "merges.txt"}
    text = "class Template:\n    delimiter = '$'  # <|endoftext|> ünïcode"
    pair = pretrained_tokenizer(str(tmp_path / "slow"))
    assert pair.encode(text).ids == pretrained_tokenizer(str(hf_gpt2)).encode(text).ids
    assert pair.token_to_id(EOT) == pretrained_tokenizer(str(hf_gpt2)).token_to_id(EOT)


def test_a_tokenizer_that_is_not_a_byte_level_bpe_with_eot_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "wp").mkdir()
    wordpiece.save(str(tmp_path / "wp" / "tokenizer.json"))
    with pytest.raises(TokenizerError, match=r"wp/tokenizer.json is a WordPiece tokenizer without byte-level"):
        pretrained_tokenizer(str(tmp_path / "wp"))
    bpe = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    (tmp_path / "bpe").mkdir()
    bpe.save(str(tmp_path / "bpe" / "tokenizer.json"))
    with pytest.raises(TokenizerError, match=r"bpe/tokenizer.json has no <\|endoftext\|> token"):
        pretrained_tokenizer(str(tmp_path / "bpe"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError) as refused:
        pretrained_tokenizer(str(tmp_path / "empty"))
    assert str(refused.value) == f"data.tokenizer={tmp_path / 'empty'}: holds neither tokenizer.json nor vocab.json + " \
                                 "merges.txt"


def test_the_data_cache_is_keyed_by_the_tokenizer(hf_gpt2, gpt2_corpus, data_cache, tmp_path):
    """The same corpus tokenised by the fixture's tokenizer, by one trained on it and by that one read from a
    directory: three caches, each with its own."""
    from minitrain.config import DataConfig, DataSource
    from minitrain.data import prepare_data

    files = dict(name="files", source=DataSource.files, paths=f"{gpt2_corpus}/*.txt", val_fraction=0.05,
                 cache_dir=str(data_cache))
    trained = prepare_data(DataConfig(**files, vocab_size=300), 64, progress=False)
    pretrained = prepare_data(DataConfig(**files, vocab_size=300, tokenizer=str(hf_gpt2)), 64, progress=False)
    assert (trained.vocab_size, pretrained.vocab_size) == (300, GPT2_VOCAB) and trained.path != pretrained.path
    assert pretrained.tokenizer.to_str() == pretrained_tokenizer(str(hf_gpt2)).to_str()
    trained.tokenizer.save(str(tmp_path / "tokenizer.json"))
    other = prepare_data(DataConfig(**files, vocab_size=300, tokenizer=str(tmp_path)), 64, progress=False)
    assert other.vocab_size == 300 and other.path not in (trained.path, pretrained.path)
