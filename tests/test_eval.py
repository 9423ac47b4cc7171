"""Evaluation: HellaSwag scored as lm-evaluation-harness scores it (a hand-made fixture, and per example against a
plain reference of the harness's definition with byte-level BPEs), validation loss against a direct computation and
at its limits, a checkpoint evaluated twice, another corpus (or the run's own, changed) tokenized as the run was,
the trainer's eval records, and every option of scripts/eval.py as a user runs it."""

import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minitrain import loop
from minitrain.config import DataConfig
from minitrain.cli import compose_config
from minitrain.data import DataError, TokenStream, cache_path, prepare_data
from minitrain.evaluate import (HellaSwagExample, ending_losses, evaluate_checkpoint, hellaswag, load_hellaswag,
                                load_run, perplexity, validation_loss)
from minitrain.model import GPT
from minitrain.trainer import train

from conftest import REPO

CPU = torch.device("cpu")
LN2 = math.log(2)
EVAL = REPO / "scripts" / "eval.py"
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


def hellaswag_row(context: str, endings: list[str], label) -> dict:
    """A HellaSwag line as its authors publish it, with the fields the harness reads (its context is
    "ctx: <context>", the unknown `:` costing nothing as no ending holds it)."""
    return {"activity_label": "ctx", "ctx_a": context, "ctx_b": "", "endings": endings, "label": label}


# Bits of each ending over its characters, and which one each rule picks (the sum: acc; per character: acc_norm):
FIXTURE = [
    # yes 1/3, no no 4/5, maybe 3/5, so 4/2: both pick 0, right
    hellaswag_row("ctx", ["yes", "no no", "maybe", "so"], 0),
    # no 2/2, yes yes yes 3/11, maybe maybe 6/11, so 4/2: the sum picks 0 (wrong), per character 1 (right)
    hellaswag_row("ctx ctx", ["no", "yes yes yes", "maybe maybe", "so"], "1"),
    # maybe 3/5, no yes 3/6, so so 8/5, yes maybe maybe maybe 10/21: the sum picks 0 (the first of a tie, wrong),
    # per character 3 (right; per token, as llm.c normalises, it would be 1)
    hellaswag_row("ctx ctx ctx", ["maybe", "no yes", "so so", "yes maybe maybe maybe"], 3),
    # yes 1/3, so so 8/5, maybe 3/5, no 2/2: both pick 0, right
    hellaswag_row("ctx", ["yes", "so so", "maybe", "no"], 0),
    # so 4/2, no 2/2, yes 1/3, maybe 3/5: both pick 2, wrong
    hellaswag_row("ctx", ["so", "no", "yes", "maybe"], 3),
]
ACC, ACC_NORM = 2 / 5, 4 / 5


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    return str(path)


@pytest.fixture
def hellaswag_file(tmp_path):
    return write_jsonl(tmp_path / "hellaswag_val.jsonl", FIXTURE)


def test_hellaswag_accuracy_of_a_hand_made_fixture(hellaswag_file):
    examples = load_hellaswag(hellaswag_file)
    for batch in (1, 3, 8):  # padding rows of different lengths together changes nothing; 3: a last partial batch
        scores = hellaswag(unigram_logits, word_tokenizer(), examples, block_size=16, device=CPU, batch_examples=batch)
        assert scores == {"hellaswag/acc_norm": ACC_NORM, "hellaswag/acc": ACC, "hellaswag/examples": 5}


def test_an_endings_loss_counts_its_own_tokens_only(hellaswag_file):
    """The second example's endings cost 2, 3, 6 and 4 bits: the context's words (and its unknown `:`) count
    nowhere, also when the context must be cut to fit the block."""
    example = load_hellaswag(hellaswag_file)[1]
    for block_size in (16, 3):  # 3: "yes yes yes" fills the block, the context is cut to its last word
        summed = ending_losses(unigram_logits, word_tokenizer(), [example], block_size, CPU)
        torch.testing.assert_close(summed, torch.tensor([2.0, 3.0, 6.0, 4.0]) * LN2)


def test_hellaswag_examples_are_read_and_refused_with_their_line(tmp_path, hellaswag_file):
    assert load_hellaswag(hellaswag_file, limit=2) == [
        HellaSwagExample("ctx: ctx", ("yes", "no no", "maybe", "so"), 0),
        HellaSwagExample("ctx: ctx ctx", ("no", "yes yes yes", "maybe maybe", "so"), 1)]
    bad = tmp_path / "bad.jsonl"
    for line, message in [(json.dumps(hellaswag_row("a", ["b"], 1)), r"bad.jsonl:2: label 1 names none"),
                          ('{"ctx": "a", "endings": ["b"], "label": 0}', r"bad.jsonl:2: not a HellaSwag example "
                                                                         r"\(KeyError: 'activity_label'\)"),
                          ("not json", r"bad.jsonl:2: not a JSON line")]:
        bad.write_text(json.dumps(FIXTURE[0]) + "\n" + line + "\n")
        with pytest.raises(DataError, match=message):
            load_hellaswag(str(bad))
    with pytest.raises(DataError, match="cannot read it"):
        load_hellaswag(str(tmp_path / "missing.jsonl"))


# Examples in HellaSwag's form: ActivityNet ones (ctx_b the start of the sentence the ending completes, lower case),
# a WikiHow one in its bracketed markup, a context longer than the blocks below and endings of very different
# lengths, so that the sum, the sum per character and the sum per token pick differently.
HARNESS_ROWS = [
    {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": 0},
    {"activity_label": "Home and Garden", "ctx_b": "",
     "ctx_a": "[header] How to clean a grill [title] Heat the grill. [step] Turn every burner to high and close the "
              "lid for",
     "endings": ["ten minutes. [substeps] The heat loosens the grease.", "a week [title] Sell the grill.", "it.",
                 "[step] an hour, then scrub the grates with a wire brush until they shine."], "label": 2},
    {"activity_label": "Playing the violin", "ctx_b": "the girl",
     "ctx_a": "A girl stands on a stage holding a violin. She lifts the bow, plays a long slow note, then a quick "
              "run of notes up the strings, and the audience watches in silence as the music fills the hall.",
     "endings": ["bows.", "puts the violin down and eats a sandwich.",
                 "keeps playing, faster and faster, until the piece ends and everyone claps.", "swims."], "label": 2},
    {"activity_label": "Making a sandwich", "ctx_a": "A man lays two slices of bread on a board.", "ctx_b": "he",
     "endings": ["spreads butter on both slices, adds cheese, ham, lettuce and tomato, presses the slices together "
                 "and cuts the sandwich in half.", "sings.", "throws the bread at the wall.", "eats the board."],
     "label": 0},
]


def harness_preprocess(text: str) -> str:
    """lm-evaluation-harness's lm_eval/tasks/hellaswag/utils.py `preprocess`, as it is written there."""
    text = text.strip()
    # NOTE: Brackets are artifacts of the WikiHow dataset portion of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def harness_requests(tokenizer, row: dict) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """The harness's hellaswag task, zero-shot: process_docs' query and choices; each choice after the target
    delimiter " " as the continuation of the query, tokenized by HFLM._encode_pair (the whole text encoded, the
    continuation's tokens those past the context's). Returns the (context, continuation) ids and the choices."""
    query = harness_preprocess(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    choices = [harness_preprocess(ending) for ending in row["endings"]]
    pairs = []
    for choice in choices:
        context, continuation = query, " " + choice
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
        context_enc = tokenizer.encode(context, add_special_tokens=False).ids
        pairs.append((context_enc, whole[len(context_enc):]))
    return pairs, choices


def harness_loglikelihood(logits_fn, context_enc: list[int], continuation_enc: list[int], max_length: int) -> float:
    """HFLM._loglikelihood_tokens for one pair, one forward: the last max_length + 1 tokens, the last one dropped,
    log-softmax, the continuation's tokens' log-probabilities summed. A continuation longer than max_length, which
    the harness refuses, is scored on its last max_length tokens (minitrain's extension)."""
    if len(continuation_enc) > max_length:
        context_enc, continuation_enc = context_enc + continuation_enc[:-max_length], continuation_enc[-max_length:]
    inp = (context_enc + continuation_enc)[-(max_length + 1):][:-1]
    logprobs = torch.log_softmax(logits_fn(torch.tensor([inp]))[0].double(), dim=-1)
    first = len(inp) - len(continuation_enc)
    return sum(float(logprobs[first + i, token]) for i, token in enumerate(continuation_enc))


def harness_scores(logits_fn, tokenizer, rows: list[dict], max_length: int):
    """Each ending's log-likelihood (in order), acc (argmax of the log-likelihood) and acc_norm (argmax of the
    log-likelihood over the choice's length in characters), and what a per-token normalisation would pick."""
    lls, right, right_norm, picks = [], 0, 0, []
    for row in rows:
        pairs, choices = harness_requests(tokenizer, row)
        row_lls = np.array([harness_loglikelihood(logits_fn, c, e, max_length) for c, e in pairs])
        lls.extend(row_lls)
        pick, pick_norm = int(np.argmax(row_lls)), int(np.argmax(row_lls / [float(len(c)) for c in choices]))
        right, right_norm = right + (pick == int(row["label"])), right_norm + (pick_norm == int(row["label"]))
        picks.append((pick, pick_norm, int(np.argmax(row_lls / [len(e) for _, e in pairs]))))
    return torch.tensor(lls), right / len(rows), right_norm / len(rows), picks


def test_hellaswag_examples_are_worded_as_the_harness_words_them(tmp_path):
    """The query "activity_label: ctx_a Ctx_b" and the endings, cleaned of WikiHow's markup ([title] ends a
    sentence, the rest goes, a leading space of an ending stays as the harness leaves it)."""
    roof, grill = load_hellaswag(write_jsonl(tmp_path / "h.jsonl", HARNESS_ROWS), limit=2)
    assert roof.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert grill.context == ("Home and Garden: How to clean a grill. Heat the grill. Turn every burner to high and "
                             "close the lid for")
    assert grill.endings == ("ten minutes. The heat loosens the grease.", "a week. Sell the grill.", "it.",
                             " an hour, then scrub the grates with a wire brush until they shine.")
    assert (roof.label, grill.label) == (0, 2)


def test_hellaswag_is_the_harness_definition_per_example_with_a_byte_level_bpe(hf_gpt2, tmp_path):
    """Each ending's log-likelihood as lm-evaluation-harness computes it (one forward per pair), and acc and
    acc_norm from them, in every batching; at a block that holds every whole row, at one that the longest ending
    fills exactly (the contexts cut to fit), and at one a token shorter than that ending."""
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    tokenizer = Tokenizer.from_file(str(hf_gpt2 / "tokenizer.json"))
    model = GPT2LMHeadModel.from_pretrained(hf_gpt2).eval()

    def logits_fn(ids):
        return model(ids).logits

    examples = load_hellaswag(write_jsonl(tmp_path / "h.jsonl", HARNESS_ROWS))
    pairs = [pair for row in HARNESS_ROWS for pair in harness_requests(tokenizer, row)[0]]
    longest = max(len(continuation) for _, continuation in pairs)
    assert any(len(c) + len(e) > longest + 1 for c, e in pairs) and longest < model.config.n_positions
    with torch.no_grad():
        for block_size in (model.config.n_positions, longest, longest - 1):
            lls, acc, acc_norm, picks = harness_scores(logits_fn, tokenizer, HARNESS_ROWS, block_size)
            torch.testing.assert_close(-ending_losses(logits_fn, tokenizer, examples, block_size, CPU),
                                       lls.float(), rtol=1e-5, atol=1e-4)
            for batch in (1, 3, 8):
                assert hellaswag(logits_fn, tokenizer, examples, block_size, CPU, batch) == \
                    {"hellaswag/acc_norm": acc_norm, "hellaswag/acc": acc, "hellaswag/examples": 4}
            if block_size == model.config.n_positions:  # the fixture tells the three rules apart
                assert any(p != p_norm for p, p_norm, _ in picks)
                assert any(p_norm != p_token for _, p_norm, p_token in picks)


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
    pq_rows = [{**hellaswag_row("a b", ["c", "d", "a", "b"], 2), "label": "2"}]  # the parquet's label: text

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
        return F.cross_entropy(unigram_logits(x).transpose(1, 2), y, reduction="none")

    # windows of 10 predictions: all of them, a part, a part not a multiple of 10, exactly one window (11 tokens
    # read), one more token
    for max_tokens, predicted in [(None, 100), (50, 50), (57, 50), (10, 10), (11, 10)]:
        results = [validation_loss(loss_fn, stream, 10, batch_size, CPU, max_tokens)
                   for batch_size in (1, 4, 100)]  # 4: a last partial batch
        assert results[0] == results[1] == results[2]  # the same numbers in every batching
        expected = float(nats[tokens[1:predicted + 1].astype(np.int64)].mean())
        assert results[0]["eval/val_tokens"] == predicted
        assert results[0]["eval/val_loss"] == pytest.approx(expected, rel=1e-6)
        assert results[0]["eval/val_ppl"] == pytest.approx(math.exp(expected), rel=1e-6)
    with pytest.raises(DataError, match="9 validation tokens asked for, fewer than one window of "
                                        "model.block_size=10: ask for at least 10"):
        validation_loss(loss_fn, stream, 10, 1, CPU, 9)  # one token fewer


def test_a_split_of_exactly_one_window_is_scored_and_one_token_less_is_refused():
    tokens = np.random.default_rng(1).integers(0, len(WORDS), size=11).astype(np.uint16)
    nats = -torch.log(torch.tensor(list(WORDS.values())))

    def loss_fn(x, y):
        return F.cross_entropy(unigram_logits(x).transpose(1, 2), y, reduction="none")

    result = validation_loss(loss_fn, TokenStream([tokens[:6], tokens[6:]]), 10, 8, CPU)
    assert result["eval/val_tokens"] == 10
    assert result["eval/val_loss"] == pytest.approx(float(nats[tokens[1:].astype(np.int64)].mean()), rel=1e-6)
    with pytest.raises(DataError, match="the validation split holds 10 tokens, fewer than one window of "
                                        r"model.block_size=10 \+ 1"):
        validation_loss(loss_fn, TokenStream([tokens[:10]]), 10, 1, CPU)


def test_perplexity_of_a_diverged_loss_is_infinite():
    assert perplexity(1.0) == pytest.approx(math.e) and perplexity(1e6) == math.inf
    assert math.isnan(perplexity(float("nan")))


def test_the_trainer_logs_perplexity_and_hellaswag_at_eval_steps(make_cfg, tmp_path, hellaswag_file, monkeypatch):
    """Its HellaSwag is eval.py's (the same model at the last step, the same numbers), and after each eval the
    model trains again in train mode (dropout on, where the run has it)."""
    modes = []

    def eval_record(parts, run):
        record = evaluate(parts, run)
        modes.append(parts.model.training)
        return record

    evaluate = loop.eval_record
    monkeypatch.setattr(loop, "eval_record", eval_record)
    train(make_cfg("trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=2", "trainer.save_every=4",
                   f"trainer.eval_hellaswag={hellaswag_file}", "trainer.eval_hellaswag_examples=3"), progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and modes == [True, True]
    for r in evals:
        assert r["val/ppl"] == pytest.approx(math.exp(r["val/loss"]))
        assert r["hellaswag/examples"] == 3 and 0 <= r["hellaswag/acc_norm"] <= 1
    assert "| ppl " in (tmp_path / "run" / "train.log").read_text()
    scored = evaluate_checkpoint(str(tmp_path / "run"), CPU, val_tokens=0, hellaswag_source=hellaswag_file,
                                 hellaswag_examples=3, progress=False)
    assert {k: v for k, v in evals[-1].items() if k.startswith("hellaswag/")} == \
        {k: v for k, v in scored.items() if k.startswith("hellaswag/")}


# -- a saved run, evaluated ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(data_cache, gpt2_corpus, tmp_path_factory):
    """Two steps on a few standard-library modules as text files (a byte-level BPE of 512 tokens trained on them,
    block_size 64, a validation split small enough to score whole), saved: what eval.py reads."""
    out = tmp_path_factory.mktemp("saved") / "run"
    train(compose_config(["data=files", f"data.paths={gpt2_corpus / '*.txt'}", "data.vocab_size=512",
                          "data.val_fraction=0.2", f"data.cache_dir={data_cache}", f"trainer.out_dir={out}",
                          "logger.mode=disabled", "trainer.batch_size=8", "model.block_size=64", "trainer.max_steps=2",
                          "trainer.warmup_steps=1", "trainer.eval_every=2", "trainer.save_every=2",
                          "trainer.eval_batches=1", "trainer.sample_tokens=0"]), progress=False)
    return out


def eval_main(capsys, *argv) -> tuple[int, str, str]:
    """scripts/eval.py's main(argv) in this process: (exit code, stdout, stderr)."""
    code = runpy.run_path(str(EVAL))["main"]([str(arg) for arg in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def eval_json(capsys, tmp_path, *argv) -> dict:
    """What scripts/eval.py's --json writes, for these arguments."""
    path = tmp_path / "eval.json"
    code, _, err = eval_main(capsys, *argv, "--json", path)
    assert code == 0, err
    return json.loads(path.read_text())


def window_losses(saved_run) -> list[float]:
    """The saved model's mean loss on each consecutive window of its validation split, computed directly (all the
    windows in one forward): window i reads tokens [64 i, 64 (i + 1)] and predicts the last 64 of them."""
    run = load_run(str(saved_run), CPU)
    val = prepare_data(run.data_config(), 64, progress=False).val
    tokens = np.empty(len(val), dtype=np.int64)
    val.read(0, tokens)
    ids, n = torch.from_numpy(tokens), (len(tokens) - 1) // 64
    with torch.no_grad():
        logits = run.logits(ids[:64 * n].view(n, 64)).float()
    return F.cross_entropy(logits.transpose(1, 2), ids[1:64 * n + 1].view(n, 64), reduction="none").mean(1).tolist()


def test_eval_script_output_is_what_a_user_sees(saved_run, tmp_path, hellaswag_file):
    """One line of true numbers (those --json writes); a request with nothing to evaluate is refused in one line."""
    def run(*argv):
        return subprocess.run([sys.executable, str(EVAL), str(saved_run), *map(str, argv)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})

    out = run("--val-tokens", 128, "--hellaswag", hellaswag_file, "--json", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert out.returncode == 0, out.stderr
    assert out.stdout == (f"{saved_run} at step 2: eval/val_loss {r['eval/val_loss']:.4f}, "
                          f"eval/val_ppl {r['eval/val_ppl']:.2f}, eval/val_tokens 128, "
                          f"hellaswag/acc_norm {r['hellaswag/acc_norm']:.4f}, "
                          f"hellaswag/acc {r['hellaswag/acc']:.4f}, hellaswag/examples 5\n")
    out = run("--val-tokens", 0, "--hellaswag", hellaswag_file)
    assert out.returncode == 0
    assert out.stdout == (f"{saved_run} at step 2: hellaswag/acc_norm {r['hellaswag/acc_norm']:.4f}, "
                          f"hellaswag/acc {r['hellaswag/acc']:.4f}, hellaswag/examples 5\n")
    out = run("--val-tokens", 0)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == ("error: nothing to evaluate: --val-tokens 0 leaves the validation loss out "
                                           "and no --hellaswag was given")


def test_val_tokens_of_one_window_one_more_and_one_less(saved_run, tmp_path, capsys):
    """--val-tokens 64 is exactly one window of model.block_size=64 (65 tokens read); 65 still one; 63 none, refused
    in one line; 320 five windows; by default all of the split's; the mean of the windows' losses computed
    directly."""
    losses = window_losses(saved_run)
    assert len(losses) > 5
    for val_tokens, windows in [(64, 1), (65, 1), (128, 2), (320, 5), (None, len(losses))]:
        r = eval_json(capsys, tmp_path, saved_run, *(("--val-tokens", val_tokens) if val_tokens else ()))
        assert r["eval/val_tokens"] == 64 * windows
        assert set(r) == {"step", "eval/val_loss", "eval/val_ppl", "eval/val_tokens"}
        assert r["eval/val_loss"] == pytest.approx(np.mean(losses[:windows]), rel=1e-5)
    code, out, err = eval_main(capsys, saved_run, "--val-tokens", 63)
    assert (code, out) == (2, "")
    assert err == "error: 63 validation tokens asked for, fewer than one window of model.block_size=64: ask for at " \
                  "least 64\n"


def test_batch_size_sets_the_forwards_and_changes_no_number(saved_run, tmp_path, capsys, monkeypatch):
    """--batch-size windows, or HellaSwag examples (their endings' rows), per forward, a last partial batch
    included; the numbers the same in every batching."""
    batches = []
    forward = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, idx: batches.append(len(idx)) or forward(self, idx))
    hellaswag_file = write_jsonl(tmp_path / "h.jsonl", HARNESS_ROWS)
    results = {}
    for batch_size in (1, 3, 8):  # 3: a last partial batch of windows and of examples; 8: one of each
        batches.clear()
        results[batch_size] = eval_json(capsys, tmp_path, saved_run, "--val-tokens", 320, "--hellaswag",
                                        hellaswag_file, "--batch-size", batch_size)
        windows = [min(batch_size, 5 - first) for first in range(0, 5, batch_size)]
        examples = [min(batch_size, 4 - first) for first in range(0, 4, batch_size)]
        assert batches == windows + [4 * n for n in examples]
    assert results[1] == results[3] == results[8]


def test_eval_script_scores_hellaswag_as_the_harness_with_the_runs_tokenizer(saved_run, tmp_path, capsys):
    """--hellaswag SOURCE as the harness scores it, with the run's byte-level BPE and block_size (64: contexts
    cut, one ending longer than the block); --hellaswag-examples N: the first N."""
    from tokenizers import Tokenizer

    run = load_run(str(saved_run), CPU)
    tokenizer = Tokenizer.from_file(str(saved_run / "tokenizer.json"))
    path = write_jsonl(tmp_path / "h.jsonl", HARNESS_ROWS)
    for n in (4, 3):
        with torch.no_grad():
            _, acc, acc_norm, _ = harness_scores(run.logits, tokenizer, HARNESS_ROWS[:n], 64)
        limit = ("--hellaswag-examples", n) if n < 4 else ()
        r = eval_json(capsys, tmp_path, saved_run, "--val-tokens", 0, "--hellaswag", path, *limit)
        assert r == {"step": 2, "hellaswag/acc_norm": acc_norm, "hellaswag/acc": acc, "hellaswag/examples": n}


def test_device_is_the_one_evaluated_on(saved_run, tmp_path, capsys, monkeypatch):
    """--device reaches the model (cpu:0, not the default cpu); one this machine lacks is refused in one line."""
    devices = []
    load = load_run
    monkeypatch.setattr("minitrain.evaluate.load_run",
                        lambda path, device: devices.append(device) or load(path, device))
    assert eval_json(capsys, tmp_path, saved_run, "--val-tokens", 64, "--device", "cpu:0") == \
        eval_json(capsys, tmp_path, saved_run, "--val-tokens", 64)
    assert devices == [torch.device("cpu", 0), torch.device("cpu")]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert eval_main(capsys, saved_run, "--device", "cuda") == \
        (2, "", "error: --device cuda: this machine has 0 CUDA device(s)\n")


@pytest.mark.parametrize("argv, message", [
    (["--val-tokens", "-1"], "--val-tokens must be >= 0 (0: no validation loss), got -1"),
    (["--val-tokens", "0"], "nothing to evaluate: --val-tokens 0 leaves the validation loss out and no --hellaswag "
                            "was given"),
    (["--hellaswag-examples", "2"], "--hellaswag-examples needs --hellaswag SOURCE"),
    (["--hellaswag", "h.jsonl", "--hellaswag-examples", "0"], "--hellaswag-examples must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--device", "gpu"], "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    (["--device", "meta"], "--device must be cpu, cuda or cuda:N, got 'meta'"),
    (["trainer.max_steps=3"], "trainer.max_steps=3: eval.py takes data settings only (data=NAME, data.KEY=VALUE)"),
    (["data.no_such_key=1"], "data.no_such_key"),
])
def test_eval_script_refuses_what_it_cannot_do_in_one_line(tmp_path, capsys, argv, message):
    code, out, err = eval_main(capsys, tmp_path / "nothing", *argv)
    assert (code, out) == (2, "") and err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_json_is_the_record_and_its_folder_is_made(saved_run, tmp_path, capsys):
    """--json writes the record (a run dir's or its checkpoint's: the same) into a folder it makes; a path it
    cannot write is one line, the numbers printed all the same."""
    path = tmp_path / "results" / "of" / "eval.json"
    code, out, _ = eval_main(capsys, saved_run, "--val-tokens", 64, "--json", path)
    assert code == 0 and json.loads(path.read_text()) == evaluate_checkpoint(str(saved_run), CPU, val_tokens=64,
                                                                             progress=False)
    assert eval_json(capsys, tmp_path, saved_run / "checkpoints" / "latest", "--val-tokens", 64) == \
        json.loads(path.read_text())
    (tmp_path / "a_file").write_text("")
    code, again, err = eval_main(capsys, saved_run, "--val-tokens", 64, "--json", tmp_path / "a_file" / "eval.json")
    assert (code, again) == (2, out)  # the numbers printed all the same
    assert err.startswith(f"error: --json {tmp_path / 'a_file' / 'eval.json'}: cannot write it (")


def test_a_checkpoint_evaluated_twice_gives_identical_numbers(saved_run, hellaswag_file):
    results = [evaluate_checkpoint(str(saved_run), CPU, val_tokens=1000, hellaswag_source=hellaswag_file,
                                   progress=False) for _ in range(2)]
    assert results[0] == results[1]
    assert results[0]["step"] == 2 and results[0]["eval/val_tokens"] == 1000 - 1000 % 64
    assert results[0]["hellaswag/examples"] == 5
    same = evaluate_checkpoint(str(saved_run / "checkpoints" / "latest"), CPU, val_tokens=1000, progress=False)
    assert same["eval/val_loss"] == results[0]["eval/val_loss"]


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
    assert sharded["eval/val_loss"] == pytest.approx(single["eval/val_loss"], rel=1e-4)


def test_another_corpus_is_evaluated_with_the_runs_tokenizer(saved_run, tmp_path, data_cache, capsys):
    """The data overrides name the corpus; it is tokenized with the run's tokenizer, no tokenizer of its own
    trained."""
    (tmp_path / "other").mkdir()
    for i in range(30):
        (tmp_path / "other" / f"{i}.txt").write_text(f"def other_{i}(x):\n    return x * {i}\n" * 40)
    overrides = ["data=files", f"data.paths={tmp_path / 'other' / '*.txt'}", f"data.cache_dir={data_cache}",
                 "data.val_fraction=0.2"]
    other = DataConfig(name="files", source="files", paths=str(tmp_path / "other" / "*.txt"),
                       cache_dir=str(data_cache), val_fraction=0.2)
    r = eval_json(capsys, tmp_path, saved_run, *overrides, "--val-tokens", 640)
    assert r == evaluate_checkpoint(str(saved_run), CPU, data_cfg=other, val_tokens=640, progress=False)
    own = eval_json(capsys, tmp_path, saved_run, "--val-tokens", 640)
    assert r["eval/val_tokens"] == own["eval/val_tokens"] == 640 and r["eval/val_loss"] != own["eval/val_loss"]
    prepared = cache_path(replace(other, tokenizer=str(saved_run)))
    assert (prepared / "tokenizer.json").read_text() == (saved_run / "tokenizer.json").read_text()
    assert not cache_path(other).exists()  # no tokenizer of its own was trained


def test_a_run_whose_corpus_changed_is_evaluated_with_its_own_tokenizer(make_cfg, tmp_path, gpt2_corpus, capsys):
    """The run's corpus, changed after training, retrains another tokenizer; evaluating the run on it tokenizes it
    with the run's tokenizer.json, as evaluating it on that corpus as another one does."""
    corpus = tmp_path / "corpus"
    shutil.copytree(gpt2_corpus, corpus)
    train(make_cfg("data=files", f"data.paths={corpus / '*.txt'}", "data.vocab_size=512", "data.val_fraction=0.2",
                   "trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.eval_every=1", "trainer.save_every=1"),
          progress=False)
    run = tmp_path / "run"
    (corpus / "textwrap.py.txt").write_text((gpt2_corpus / "shlex.py.txt").read_text().upper())
    cfg = load_run(str(run), CPU).data_config()
    assert prepare_data(cfg, 64, progress=False).tokenizer.to_str() != (run / "tokenizer.json").read_text()
    r = eval_json(capsys, tmp_path, run, "--val-tokens", 64)
    assert r == evaluate_checkpoint(str(run), CPU, data_cfg=replace(cfg, tokenizer=str(run)), val_tokens=64,
                                    progress=False)


def test_eval_script_refuses_a_missing_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, str(EVAL), str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error: " in out.stderr and "no such run dir or checkpoint" in out.stderr
