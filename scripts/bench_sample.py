"""Decode tokens/s of minitrain's sampler beside transformers' generate: same weights, same dtype (bf16), greedy.

For each model (GPT-2 shapes, random weights, or --init-from a name or directory) and batch: transformers'
GPT2LMHeadModel is built on the GPU and minitrain's GPT imports its tensors (minitrain/hf.py), so both hold the
same weights. Before any timing, the two must produce the same greedy tokens: in fp32 (TF32 off), gpt2-124m's
shape, minitrain's compiled, graphed decode against transformers' eager generate; in bf16 the share of tokens
that agree is printed (rounding differs between kernels, so bf16 greedy texts part after a while).

Timed: generate with N new tokens and with 1 (the prompt's prefill and the first token), decode tokens/s =
batch x (N - 1) / (t_N - t_1), the same arithmetic for every implementation, in rounds that alternate them;
medians with their min-max. Implementations: minitrain (KV cache, decode step under torch.compile
mode=reduce-overhead: CUDA graphs, one sampler per cell), transformers with one static cache per cell, reset and
passed to each call (generate compiles the forward itself, transformers >= 4.48; older versions get
torch.compile(forward, mode="reduce-overhead", fullgraph=True), the recipe of their docs), and transformers'
default (dynamic cache, eager).

    python scripts/bench_sample.py --models gpt2-124m --out bench_sample_124m.json
    python scripts/bench_sample.py --models gpt2-1.5b --out bench_sample_15b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain import hf  # noqa: E402
from minitrain.config import KernelImpl, ModelConfig  # noqa: E402
from minitrain.generate import Sampler, Sampling  # noqa: E402
from minitrain.model import GPT  # noqa: E402

SHAPES = {"gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768), "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600),
          "tiny": dict(n_layer=2, n_head=2, n_embd=64)}  # tiny: a smoke run of this script (--device cpu)
GREEDY = Sampling(temperature=0)


def transformers_model(name: str, init_from: str | None, dtype: torch.dtype, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel

    if init_from:
        return GPT2LMHeadModel.from_pretrained(init_from).to(device, dtype).eval()
    # Wider than GPT-2's 0.02, so that greedy text varies and a wrong cache shows in the tokens.
    config = GPT2Config(**SHAPES[name], n_positions=1024, vocab_size=50257, initializer_range=0.1)
    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(config).to(dtype).eval()


def ours_from(theirs) -> GPT:
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
    from transformers import StaticCache

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
        from transformers import GenerationConfig

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
    def __init__(self, model: GPT, batch: int, length: int):
        self.sampler = Sampler(model, batch, length, GREEDY)

    def __call__(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        return self.sampler.generate(prompt, n).tokens


def timed(fn, prompt, n) -> float:
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    fn(prompt, n)
    sync()
    return time.perf_counter() - start


def random_prompt(batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def agreement(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> float:
    """The share of the new tokens before each row's first disagreement."""
    same = (a[:, prompt_len:] == b[:, prompt_len:]).int().cumprod(1)
    return same.float().mean().item()


def check_fp32(name: str, init_from, prompt_len: int, n: int, device: torch.device) -> None:
    """minitrain's graphed decode and transformers' generate, greedy in fp32: the same tokens, or no timing."""
    torch.backends.cuda.matmul.allow_tf32 = False
    theirs = transformers_model(name, init_from, torch.float32, device)
    ours = ours_from(theirs)
    prompt = random_prompt(2, prompt_len, device, seed=1)
    a = Minitrain(ours, 2, prompt_len + n)(prompt, n)
    b = Transformers(theirs, False, 2, prompt_len + n)(prompt, n)
    share = agreement(a, b, prompt_len)
    distinct = len(set(a[0, prompt_len:].tolist()))
    print(f"check {name} fp32: {share:.0%} of {n} greedy tokens equal to transformers' ({distinct} distinct)",
          flush=True)
    if share < 1 or distinct < 5:
        sys.exit(f"minitrain's decode does not give transformers' greedy tokens ({share:.0%}); nothing timed")
    del theirs, ours
    torch.backends.cuda.matmul.allow_tf32 = True


def bench_cell(name: str, theirs, ours: GPT, batch: int, args) -> dict:
    P, N = args.prompt_len, args.new_tokens
    prompt = random_prompt(batch, P, theirs.device, seed=batch)
    impls = {"minitrain": Minitrain(ours, batch, P + N),
             "transformers static+compile": Transformers(theirs, True, batch, P + N),
             "transformers eager": Transformers(theirs, False, batch, P + N)}
    outputs = {}
    for label, fn in impls.items():  # compile, record the graphs, warm the allocator
        start = time.perf_counter()
        for n in (N, 1, N):
            outputs[label] = fn(prompt, n)
        print(f"  {name} B={batch} {label}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
    agree = agreement(outputs["minitrain"], outputs["transformers static+compile"], P)
    rates = {label: [] for label in impls}
    for _ in range(args.rounds):
        for label, fn in impls.items():
            t_n, t_1 = timed(fn, prompt, N), timed(fn, prompt, 1)
            rates[label].append(batch * (N - 1) / (t_n - t_1))
    row = {"model": name, "batch": batch, "prompt": P, "new_tokens": N, "bf16_greedy_agreement": agree}
    for label, r in rates.items():
        row[label] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    best = max(row["transformers static+compile"]["median"], row["transformers eager"]["median"])
    row["ratio_to_best_transformers"] = row["minitrain"]["median"] / best
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-124m", "gpt2-1.5b"], choices=list(SHAPES))
    ap.add_argument("--init-from", nargs="*", default=None, help="per model: a Hugging Face name or directory "
                    "(e.g. gpt2 gpt2-xl) instead of random weights")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-model", default="gpt2-124m", choices=list(SHAPES),
                    help="the shape (random weights) of the fp32 greedy check run before any timing")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (--models tiny --check-model tiny)")
    ap.add_argument("--out", default="bench_sample.json")
    args = ap.parse_args()
    import warnings

    import transformers
    from torch._dynamo.utils import counters

    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)  # renamed in 5.x
    started = time.perf_counter()
    sources = dict(zip(args.models, args.init_from or [None] * len(args.models)))
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{device_name}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    check_fp32(args.check_model, None, args.prompt_len, 32, device)
    rows = []
    for name in args.models:
        theirs = transformers_model(name, sources[name], torch.bfloat16, device)
        ours = ours_from(theirs)
        for batch in args.batches:
            rows.append(bench_cell(name, theirs, ours, batch, args))
            r = rows[-1]
            print(f"{name} B={batch}: " + ", ".join(
                f"{label} {r[label]['median']:,.0f} ({r[label]['min']:,.0f}-{r[label]['max']:,.0f})"
                for label in ("minitrain", "transformers static+compile", "transformers eager")) +
                f" tokens/s | {r['ratio_to_best_transformers']:.2f}x the best transformers | bf16 greedy "
                f"agreement {r['bf16_greedy_agreement']:.0%}", flush=True)
        del theirs, ours
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    print(f"cudagraph skips: {skips}; {time.perf_counter() - started:.0f} s in all")
    Path(args.out).write_text(json.dumps({"device": device_name, "torch": torch.__version__,
                                          "transformers": transformers.__version__, "cudagraph_skips": skips,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
