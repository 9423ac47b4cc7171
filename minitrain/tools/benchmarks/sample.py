"""Decode tokens/s of minitrain's sampler beside transformers' generate: same weights, same dtype (bf16), greedy
(`scripts/bench_sample.py` is the command line).

For each model (GPT-2 shapes, random weights, or --init-from a name or directory) and batch: transformers'
GPT2LMHeadModel is built on the GPU and minitrain's GPT imports its tensors (minitrain/hf.py), so both hold the
same weights. Before any timing, the two must produce the same greedy tokens: in fp32 (TF32 off), gpt2-124m's
shape, minitrain's graphed decode against transformers' eager generate; in bf16 the share of tokens
that agree is printed (rounding differs between kernels, so bf16 greedy texts part after a while).

Timed: generate with N new tokens and with 1 (the prompt's prefill and the first token), decode tokens/s = batch x
(N - 1) / (t_N - t_1), the same arithmetic for every implementation, in rounds that alternate them
(bench.take_turns); medians with their min-max. Implementations: minitrain (KV cache, on a GPU the decode step in
minitrain/ops/decode.py's kernels captured as one CUDA graph, one sampler per cell), minitrain's compiled step (the
model's cached forward under torch.compile mode=reduce-overhead: CUDA graphs), transformers with one static cache
per cell, reset and passed to each call (generate compiles the forward itself, transformers >= 4.48; older versions
get torch.compile(forward, mode="reduce-overhead", fullgraph=True), the recipe of their docs), and transformers'
default (dynamic cache, eager).
"""

from __future__ import annotations

import time
import warnings
from typing import Optional, Sequence

import torch
import transformers
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, StaticCache

from minitrain import hf
from minitrain.compat import inductor_counter
from minitrain.generate import Sampler, Sampling
from minitrain.model import GPT
from minitrain.model_config import KernelImpl, ModelConfig
from minitrain.tools import bench

SHAPES = {"gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768), "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600),
          "tiny": dict(n_layer=2, n_head=2, n_embd=64)}  # tiny: a smoke run of the benchmark (--device cpu)
GREEDY = Sampling(temperature=0)
CHECK_TOKENS = 32  # new tokens of the fp32 check
CHECK_DISTINCT = 5  # fewer distinct tokens in the check's text: a repeated token, which a wrong cache can match
IMPLEMENTATIONS = ("minitrain", "minitrain compiled step", "transformers static+compile", "transformers eager")


class DecodeMismatch(RuntimeError):
    """minitrain's greedy tokens are not transformers' in fp32: a timing would compare different computations."""


def transformers_model(name: str, init_from: Optional[str], dtype: torch.dtype, device: torch.device):
    if init_from:
        return GPT2LMHeadModel.from_pretrained(init_from).to(device, dtype).eval()
    # Wider than GPT-2's 0.02, so that greedy text varies and a wrong cache shows in the tokens.
    config = GPT2Config(**SHAPES[name], n_positions=1024, vocab_size=50257, initializer_range=0.1)
    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(config).to(dtype).eval()


def ours_from(theirs) -> GPT:
    """minitrain's GPT holding the tensors of transformers' `theirs` (its device and dtype)."""
    c = theirs.config
    cfg = ModelConfig(name="bench", init_from="transformers", n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                      block_size=c.n_positions, vocab_size=-(-c.vocab_size // 64) * 64, head_vocab=c.vocab_size,
                      gelu=KernelImpl.torch)
    weight = theirs.transformer.wte.weight
    with torch.device(weight.device):
        model = GPT(cfg).to(weight.dtype).eval()
    hf.load_hf_state(model.state_dict(), cfg, theirs.state_dict(), "transformers' model")
    return model


def static_cache(model, batch: int, length: int):
    """transformers' StaticCache for `batch` sequences of `length` tokens (its constructor differs by version)."""
    try:
        return StaticCache(config=model.config, max_cache_len=length)  # >= 5: shapes and device from first use
    except TypeError:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=length, device=model.device,
                           dtype=model.dtype)


class Transformers:
    """transformers' generate, greedy, to exactly N new tokens (no stop at EOS). static: one StaticCache, reset and
    passed to every call (so the compiled forward's CUDA graphs are recorded once, not per call), which generate
    compiles itself on a GPU (transformers >= 4.48; before, forward is compiled as their docs did)."""

    def __init__(self, model, static: bool, batch: int, length: int):
        self.model = model
        self.cache = static_cache(model, batch, length) if static else None
        if static and not hasattr(GenerationConfig(), "compile_config"):
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def __call__(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        extra = {}
        if self.cache is not None:
            self.cache.reset()
            extra = {"past_key_values": self.cache}
        with torch.no_grad():
            return self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                       do_sample=False, pad_token_id=0, eos_token_id=None, **extra)


class Minitrain:
    """minitrain's Sampler, greedy: on a GPU its graphed decode step in the decode kernels (default) or the model's
    cached forward compiled (`fused=False`)."""

    def __init__(self, model: GPT, batch: int, length: int, fused: Optional[bool] = None):
        self.fused = fused
        self.sampler = Sampler(model, batch, length, GREEDY, fused=fused)

    def __call__(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        return self.sampler.generate(prompt, n).tokens


def timed(fn, prompt: torch.Tensor, n: int) -> float:
    """Wall seconds of `fn(prompt, n)`, the device synced before and after."""
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    fn(prompt, n)
    sync()
    return time.perf_counter() - start


def decode_tokens_per_s(batch: int, new_tokens: int, t_n: float, t_1: float) -> float:
    """New tokens after the first, of all sequences, per second that a generate of `new_tokens` takes beyond a
    generate of 1 (`t_n` against `t_1`): the prefill and the first token cancel out."""
    return batch * (new_tokens - 1) / (t_n - t_1)


def random_prompt(batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def agreement(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> float:
    """The share of the new tokens before each row's first disagreement."""
    same = (a[:, prompt_len:] == b[:, prompt_len:]).int().cumprod(1)
    return same.float().mean().item()


def check_fp32(name: str, init_from: Optional[str], prompt_len: int, n: int, device: torch.device) -> None:
    """minitrain's graphed decode and transformers' generate, greedy in fp32 (TF32 off): the same tokens, and a
    text of at least CHECK_DISTINCT tokens, or DecodeMismatch."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        theirs = transformers_model(name, init_from, torch.float32, device)
        prompt = random_prompt(2, prompt_len, device, seed=1)
        a = Minitrain(ours_from(theirs), 2, prompt_len + n)(prompt, n)
        b = Transformers(theirs, False, 2, prompt_len + n)(prompt, n)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    share = agreement(a, b, prompt_len)
    distinct = len(set(a[0, prompt_len:].tolist()))
    print(f"check {name} fp32: {share:.0%} of {n} greedy tokens equal to transformers' ({distinct} distinct)",
          flush=True)
    if share < 1 or distinct < CHECK_DISTINCT:
        raise DecodeMismatch(f"minitrain's decode does not give transformers' greedy tokens ({share:.0%}, "
                             f"{distinct} distinct); nothing timed")


def bench_cell(name: str, theirs, ours: GPT, batch: int, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    """One model and batch: each implementation warmed up (compiled, graphs recorded), then timed in `rounds`."""
    P, N = prompt_len, new_tokens
    prompt = random_prompt(batch, P, theirs.device, seed=batch)
    impls = dict(zip(IMPLEMENTATIONS, (Minitrain(ours, batch, P + N), Minitrain(ours, batch, P + N, fused=False),
                                       Transformers(theirs, True, batch, P + N),
                                       Transformers(theirs, False, batch, P + N))))
    outputs = {}
    for label, fn in impls.items():  # compile, record the graphs, warm the allocator
        start = time.perf_counter()
        for n in (N, 1, N):
            outputs[label] = fn(prompt, n)
        print(f"  {name} B={batch} {label}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
    agree = agreement(outputs["minitrain"], outputs["transformers static+compile"], P)

    def rate(fn):
        return lambda: decode_tokens_per_s(batch, N, timed(fn, prompt, N), timed(fn, prompt, 1))

    rates = bench.take_turns({label: rate(fn) for label, fn in impls.items()}, rounds)
    row = {"model": name, "batch": batch, "prompt": P, "new_tokens": N, "bf16_greedy_agreement": agree}
    for label, r in rates.items():
        spread = bench.Spread.of(r)
        row[label] = {"median": spread.median, "min": spread.low, "max": spread.high}
    best = max(row["transformers static+compile"]["median"], row["transformers eager"]["median"])
    row["ratio_to_best_transformers"] = row["minitrain"]["median"] / best
    return row


def cell_line(row: dict) -> str:
    """A cell's printed line: each implementation's median tokens/s (min-max), the ratio, the bf16 agreement."""
    def figure(label: str) -> str:
        return bench.Spread(row[label]["median"], row[label]["min"], row[label]["max"]).format(",.0f")

    figures = ", ".join(f"{label} {figure(label)}" for label in IMPLEMENTATIONS)
    return (f"{row['model']} B={row['batch']}: {figures} tokens/s | {row['ratio_to_best_transformers']:.2f}x the best "
            f"transformers | bf16 greedy agreement {row['bf16_greedy_agreement']:.0%}")


def environment(device: torch.device) -> dict:
    """What a result file says beyond bench.run_header: the device's name and transformers' version."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "transformers": transformers.__version__}


def cudagraph_skips() -> int:
    """CUDA graphs that inductor skipped in this process (each a decode step that would run ungraphed)."""
    return inductor_counter("cudagraph_skips")


def run(models: Sequence[str], batches: Sequence[int], prompt_len: int, new_tokens: int, rounds: int,
        check_model: str, device: torch.device, init_from: Optional[Sequence[str]] = None) -> list[dict]:
    """The fp32 check on `check_model`'s shape, then one row per model and batch (`init_from`: per model, a
    Hugging Face name or directory instead of random weights). Raises DecodeMismatch before any timing."""
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)  # renamed in 5.x
    env = environment(device)
    print(f"{env['device']}, torch {torch.__version__}, transformers {env['transformers']}", flush=True)
    check_fp32(check_model, None, prompt_len, CHECK_TOKENS, device)
    sources = dict(zip(models, init_from or [None] * len(models)))
    rows = []
    for name in models:
        theirs = transformers_model(name, sources[name], torch.bfloat16, device)
        ours = ours_from(theirs)
        for batch in batches:
            rows.append(bench_cell(name, theirs, ours, batch, prompt_len, new_tokens, rounds))
            print(cell_line(rows[-1]), flush=True)
        del theirs, ours
        torch.compiler.reset()
        torch.cuda.empty_cache()
    return rows
