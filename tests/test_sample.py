"""scripts/sample.py as a user runs it (its `main(argv)` in this process, or the script itself), on the tiny GPT-2
of tests/conftest.py (`hf_gpt2`: 128 positions): every option changes the text or the report as it says, against
minitrain/generate.py's own sample_texts on the same weights; the context's limit exactly full, one short and one
over; a numeric option out of its range refused in one line, before any weights load."""

import inspect
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

from minitrain import generate
from minitrain.generate import Sampling, sample_texts
from minitrain.weights import open_weights
from minitrain.model import KVCache

from conftest import REPO, fake_gpu

SCRIPT = REPO / "scripts" / "sample.py"
CONTEXT = 128  # hf_gpt2's positions
PROMPT = "def wrap(text"
SEPARATOR = "\n---------------\n"
GREEDY = Sampling(temperature=0)
DEFAULTS = Sampling(temperature=0.8, top_k=200)  # the script's


def sample(capsys, *argv: str) -> tuple[int, list[str], str]:
    """main(argv)'s exit code, the texts it printed and its stderr."""
    code = runpy.run_path(str(SCRIPT))["main"](list(argv))
    out, err = capsys.readouterr()
    assert out.endswith(SEPARATOR) or not out
    return code, out.split(SEPARATOR)[:-1], err


@pytest.fixture(scope="module")
def weights(hf_gpt2):
    return open_weights(str(hf_gpt2))


@pytest.fixture(scope="module")
def expected(weights):
    """sample_texts' texts on the same weights (fp32 unless `dtype`): what the script must print."""
    models = {}

    def texts(sampling, new_tokens, num_samples=1, seed=1337, prompt=PROMPT, dtype=torch.float32):
        if dtype not in models:
            models[dtype] = weights.build("cpu", dtype)
        return sample_texts(models[dtype], weights.tokenizer, prompt, num_samples, new_tokens, sampling, seed)[0]

    return texts


def test_the_defaults_draw_seeded_samples_and_a_seed_draws_the_same_text_again(capsys, hf_gpt2, expected):
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "30")
    assert code == 0 and texts == expected(DEFAULTS, 30) and "1 x 30 new tokens" in err
    assert texts != expected(GREEDY, 30)  # drawn, not greedy: the greedy options below are seen
    again = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "30", "--seed", "1337")[1]
    other = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "30", "--seed", "7")[1]
    assert again == texts and other == expected(DEFAULTS, 30, seed=7) and other != texts


@pytest.mark.parametrize("greedy", [["--temperature", "0"], ["--top-k", "1"], ["--top-p", "1e-6"]],
                         ids=["temperature", "top_k", "top_p"])
def test_each_greedy_option_gives_the_greedy_text_under_any_seed(capsys, hf_gpt2, expected, greedy):
    """A top-p below the top token's probability keeps that token alone, as top-k 1 does."""
    for seed in ("1", "2"):
        code, texts, _ = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "30", "--seed", seed,
                                *greedy)
        assert code == 0 and texts == expected(GREEDY, 30)


def test_num_samples_draws_a_batch_and_reports_the_decode_rate_of_all_its_sequences(capsys, hf_gpt2, expected,
                                                                                     monkeypatch):
    """A clock of known times (start, after the prefill's first token, after the other 8): 3 x 8 tokens in 0.5 s."""
    drawn = expected(Sampling(0.8, 200, 0.9), 9, num_samples=3)
    times = [10.0, 10.25, 10.75]
    monkeypatch.setattr(generate, "device_clock", lambda device: times.pop(0))
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "9",
                              "--num-samples", "3", "--top-p", "0.9")
    assert code == 0 and texts == drawn and len(set(texts)) == 3
    assert f"on cpu (float32): prefill 250.0 ms, decode 48 tokens/s (3 x 9 new tokens)\n" in err


def test_the_prompt_file_is_the_prompt(capsys, hf_gpt2, expected, tmp_path):
    text = "class Wrapper:\n    def __init__(self, width=70):\n        "
    (tmp_path / "prompt.txt").write_text(text)
    code, texts, _ = sample(capsys, str(hf_gpt2), "--prompt", "ignored", "--prompt-file", str(tmp_path / "prompt.txt"),
                            "--temperature", "0", "--max-new-tokens", "20")
    assert code == 0 and texts == expected(GREEDY, 20, prompt=text) and texts[0].startswith(text)


def test_an_empty_prompt_starts_a_new_document(capsys, hf_gpt2, expected):
    code, texts, err = sample(capsys, str(hf_gpt2), "--temperature", "0", "--max-new-tokens", "20")
    assert code == 0 and texts == expected(GREEDY, 20, prompt="") and "1 x 20 new tokens" in err


def test_max_new_tokens_draws_that_many(capsys, hf_gpt2, expected):
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "7")
    assert code == 0 and texts == expected(GREEDY, 7) and texts != expected(GREEDY, 8)
    assert "(1 x 7 new tokens)\n" in err


def test_without_the_kv_cache_the_same_text_is_drawn_and_no_cache_is_made(capsys, hf_gpt2, monkeypatch):
    argv = [str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "30", "--num-samples", "2", "--top-p", "0.95"]
    code, cached, _ = sample(capsys, *argv)
    assert code == 0

    def no_cache(*args, **kwargs):
        raise AssertionError("a KV cache was made")

    monkeypatch.setattr(KVCache, "__init__", no_cache)
    code, uncached, _ = sample(capsys, *argv, "--no-kv-cache")
    assert code == 0 and uncached == cached


def test_no_compile_asks_the_sampler_for_no_graphs(capsys, hf_gpt2, monkeypatch):
    """A CPU decodes eagerly either way (a GPU's graphed decode is tests/test_decode.py's): what is seen here is the
    request, None (graphs where the device is a GPU) by default and False with --no-compile."""
    asked, init = [], generate.Sampler.__init__

    def spy(self, *args, **kwargs):
        asked.append(inspect.signature(init).bind(self, *args, **kwargs).arguments.get("graphs"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(generate.Sampler, "__init__", spy)
    for extra in ([], ["--no-compile"]):
        assert sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--max-new-tokens", "2", *extra)[0] == 0
    assert asked == [None, False]


def test_dtype_bf16_samples_from_the_model_in_bf16(capsys, hf_gpt2, expected):
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "60",
                              "--dtype", "bf16")
    assert code == 0 and texts == expected(GREEDY, 60, dtype=torch.bfloat16) and "on cpu (bfloat16)" in err
    assert texts != expected(GREEDY, 60)  # fp32's text is another


def test_device_cpu_runs_on_the_cpu_where_a_gpu_is_the_default(capsys, hf_gpt2, expected, monkeypatch):
    fake_gpu(monkeypatch, bf16=True)
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "9",
                              "--device", "cpu")
    assert code == 0 and texts == expected(GREEDY, 9) and "on cpu (float32)" in err


def test_tokenizer_serves_weights_that_came_without_one(capsys, hf_gpt2, expected, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_gpt2 / name, bare / name)
    code, texts, err = sample(capsys, str(bare), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "9")
    assert code == 2 and not texts and err.startswith("error: ") and err.count("\n") == 1
    code, texts, _ = sample(capsys, str(bare), "--tokenizer", str(hf_gpt2), "--prompt", PROMPT, "--temperature", "0",
                            "--max-new-tokens", "9")
    assert code == 0 and texts == expected(GREEDY, 9)


def prompt_of(tokens: int, weights) -> str:
    """A prompt of exactly `tokens` tokens."""
    text = "@" * tokens
    assert len(weights.tokenizer.encode(text).ids) == tokens
    return text


@pytest.mark.parametrize("new_tokens", [CONTEXT - 11, CONTEXT - 10])  # one short of the context, exactly full
def test_a_prompt_and_new_tokens_up_to_the_whole_context_are_drawn(capsys, hf_gpt2, expected, weights, new_tokens):
    prompt = prompt_of(10, weights)
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", prompt, "--temperature", "0",
                              "--max-new-tokens", str(new_tokens))
    assert code == 0 and texts == expected(GREEDY, new_tokens, prompt=prompt)
    assert f"(1 x {new_tokens} new tokens)\n" in err


def test_new_tokens_past_the_context_are_refused_in_one_line_naming_the_option(capsys, hf_gpt2, weights):
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", prompt_of(10, weights), "--max-new-tokens",
                              str(CONTEXT - 9))
    assert code == 2 and not texts
    assert err == (f"error: --max-new-tokens {CONTEXT - 9}: the prompt's 10 tokens and {CONTEXT - 9} new ones exceed "
                   f"the model's context of {CONTEXT} tokens (at most {CONTEXT - 10} new ones fit; leave "
                   "--max-new-tokens out to draw what fits)\n")


def test_by_default_the_new_tokens_fit_what_the_context_leaves(capsys, hf_gpt2, expected, weights):
    """The default 200 new tokens exceed the context of 128: the script draws what fits and says so."""
    for prompt_tokens in (10, CONTEXT - 1):
        prompt = prompt_of(prompt_tokens, weights)
        code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", prompt, "--temperature", "0")
        new_tokens = CONTEXT - prompt_tokens
        assert code == 0 and texts == expected(GREEDY, new_tokens, prompt=prompt)
        assert (f"(1 x {new_tokens} new tokens, not the default 200: all that the model's context of {CONTEXT} "
                "tokens leaves after the prompt)\n") in err
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", prompt_of(CONTEXT, weights))
    assert code == 2 and not texts
    assert err == (f"error: the prompt's {CONTEXT} tokens fill the model's context of {CONTEXT} tokens: no new token "
                   "fits\n")


@pytest.mark.parametrize("option, value, allowed", [
    ("--num-samples", "0", ">= 1"), ("--max-new-tokens", "0", ">= 1"), ("--max-new-tokens", "-5", ">= 1"),
    ("--temperature", "-0.1", ">= 0 (0: greedy)"), ("--top-k", "0", ">= 1"), ("--top-p", "0.0", "in (0, 1]"),
    ("--top-p", "1.5", "in (0, 1]")])
def test_a_numeric_option_out_of_range_is_refused_in_one_line(capsys, tmp_path, option, value, allowed):
    """Before any weights load: the source does not even exist."""
    code, texts, err = sample(capsys, str(tmp_path / "nothing"), option, value)
    assert code == 2 and not texts and err == f"error: {option} must be {allowed}, got {value}\n"


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: this machine has 0 CUDA device(s)"),
    ("cuda:1", "--device cuda:1: this machine has 0 CUDA device(s)"),
    ("gpu", "--device must be cpu, cuda or cuda:N, got 'gpu'")])
def test_a_device_this_machine_lacks_is_refused_in_one_line(capsys, tmp_path, monkeypatch, device, message):
    """Before any weights load, as eval.py refuses it (one rule: minitrain/weights.py's device_problem)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code, texts, err = sample(capsys, str(tmp_path / "nothing"), "--device", device)
    assert code == 2 and not texts and err == f"error: {message}\n"


def test_each_numeric_option_at_the_edge_of_its_range_is_accepted(capsys, hf_gpt2, expected):
    code, texts, err = sample(capsys, str(hf_gpt2), "--prompt", PROMPT, "--num-samples", "1", "--max-new-tokens", "1",
                              "--temperature", "0", "--top-k", "1", "--top-p", "1")
    assert code == 0 and texts == expected(GREEDY, 1) and "(1 x 1 new tokens)" in err


def test_the_script_refuses_zero_samples_in_one_line_with_exit_2(hf_gpt2):
    """As a user runs it: the script's own process, its exit code and its whole stderr (an empty batch was a
    ValueError's traceback, exit 1)."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(hf_gpt2), "--max-new-tokens", "10", "--num-samples", "0"],
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", "error: --num-samples must be >= 1, got 0\n")
