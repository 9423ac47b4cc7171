"""Sampling from a GPT: the prompt once into a KV cache (prefill), then one token per step (decode).

A step scores the next token over the LM head's rows (never the embedding's padding: model.head_vocab), drops
ids beyond the tokenizer's vocabulary, then applies temperature, top-k and top-p (in transformers' order) and
draws by the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i, in tensor ops
only (no host sync, one graph). temperature=0 is greedy.

On a GPU the decode step is compiled with CUDA graphs (torch.compile mode=reduce-overhead): its shapes are the
same at every position (minitrain/model.py's KVCache), so one recorded graph replays each token without the host
launching kernels. On a CPU everything runs eagerly in fp32. Without the cache (kv_cache=False) each step runs
the whole sequence again: slower, and the reference the cached path is tested against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from .compat import mark_static_address
from .model import GPT, KVCache
from .model_config import MlpActivation
from .ops.decode import cached_attention, decode_linear


class GenerationError(ValueError):
    """Sampling settings or a prompt that cannot work; the message names the setting."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: Optional[int] = None  # keep the k most likely tokens
    top_p: Optional[float] = None  # keep the fewest most likely tokens whose probability reaches p
    vocab: Optional[int] = None  # ids at or above it are never drawn (the tokenizer's vocabulary)

    def __post_init__(self):
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")


def filtered_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(B, V) logits -> the fp32 logits of the ids below s.vocab, tempered, -inf where top-k or top-p removes a
    token (transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in that order)."""
    logits = logits[:, : s.vocab].float()
    if s.temperature == 0:
        return logits
    logits = logits / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # the probability of the tokens more likely than each
        logits = logits.masked_fill(torch.zeros_like(before, dtype=torch.bool).scatter(1, order, before >= s.top_p),
                                    float("-inf"))
    return logits


def next_token(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids drawn as `s` says."""
    logits = filtered_logits(logits, s)
    if s.temperature == 0:
        return logits.argmax(-1)
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(-1)


def head_logits(model: GPT, hidden: torch.Tensor) -> torch.Tensor:
    """The last position's logits (B, head_vocab), soft-capped as in training (model.logit_softcap)."""
    return model.soft_capped(F.linear(hidden[:, -1], model.lm_head_weight))


def _decode(model: GPT, cache: KVCache, token: torch.Tensor, pos: torch.Tensor, s: Sampling) -> torch.Tensor:
    """One step: the token (B, 1) at position pos (1,) into the cache, the next token (B,) out."""
    return next_token(head_logits(model, model.forward_hidden(token, cache, pos)), s)


_decode_graphed = torch.compile(_decode, mode="reduce-overhead", fullgraph=True, dynamic=False)


def decode_logits(model: GPT, cache: KVCache, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The LM head's logits (B, head_vocab) of one token per sequence (B, 1) at position `pos` (1,) in the decode
    kernels of minitrain/ops/decode.py: what head_logits(model, model.forward_hidden(token, cache, pos)) computes,
    the cache written alike. The kernels fuse GPT-2's block and RMSNorm; the block options they do not (qk_norm and rope on
    the new q and k, a ReLU^2 or SwiGLU MLP, the soft-cap) run as the model's own torch ops between them, which a
    CUDA graph captures as well."""
    x = model.wte(token[:, 0]) if model.wpe is None else model.wte(token[:, 0]) + model.wpe(pos)
    x = x.contiguous()
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        qkv = decode_linear(x, attn.c_attn.weight, attn.c_attn.bias, norm=block.ln_1)
        if attn.q_norm is not None or attn.rope_base is not None:
            qkv = torch.cat([attn.merge(t) for t in attn.heads(qkv[:, None], pos)], -1)[:, 0]
        y = cached_attention(qkv, getattr(cache, f"k{i}"), getattr(cache, f"v{i}"), pos)
        x = decode_linear(y, attn.c_proj.weight, attn.c_proj.bias, residual=x)
        gelu = mlp.kind == MlpActivation.gelu
        h = decode_linear(x, mlp.c_fc.weight, mlp.c_fc.bias, norm=block.ln_2, gelu=gelu)
        if not gelu:
            h = mlp.activation(h)
        x = decode_linear(h, mlp.c_proj.weight, mlp.c_proj.bias, residual=x)
    return model.soft_capped(decode_linear(x, model.lm_head_weight, norm=model.ln_f))


def _decode_fused(model: GPT, cache: KVCache, token: torch.Tensor, pos: torch.Tensor, s: Sampling) -> torch.Tensor:
    """_decode through decode_logits: the decode kernels of minitrain/ops/decode.py."""
    return next_token(decode_logits(model, cache, token, pos), s)


class _CapturedStep:
    """A decode step captured once as a CUDA graph and replayed at every later token. The first call runs it
    (compiling the kernels), then records it reading the token and position from fixed buffers."""

    def __init__(self, step):
        self.step, self.graph = step, None

    def __call__(self, model: GPT, cache: KVCache, token: torch.Tensor, pos: torch.Tensor,
                 s: Sampling) -> torch.Tensor:
        if self.graph is None:
            self.token, self.pos = token.clone(), pos.clone()
            first = self.step(model, cache, token, pos, s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.next = self.step(model, cache, self.token, self.pos, s)
            return first
        self.token.copy_(token)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.next


def device_clock(device: torch.device) -> float:
    """Seconds, once `device` has run what was queued: Generation's times (a module function, so that a test can
    set a clock of known times and check the rates' arithmetic exactly)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, prompt + new)
    new_tokens: int
    prefill_s: float  # the prompt's forward and the first new token
    decode_s: float  # the other new tokens

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens of all sequences per second of decoding, after the first (which the prefill draws)."""
        return self.tokens.shape[0] * (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else float("nan")


class Sampler:
    """Generation for `batch` sequences of up to `length` tokens: one KV cache, and on CUDA one graphed decode
    step, reused by every call (a new Sampler of the same shape reuses the compiled code, not the recorded graphs).
    `fused` (default: with `graphs`): the step in minitrain/ops/decode.py's kernels, captured as one CUDA graph,
    the faster on a GPU (docs/benchmarks.md); else the model's cached forward (compiled, with `graphs`)."""

    def __init__(self, model: GPT, batch: int, length: int, sampling: Sampling, kv_cache: bool = True,
                 graphs: Optional[bool] = None, dtype: Optional[torch.dtype] = None,
                 fused: Optional[bool] = None):
        if length > model.cfg.block_size:
            raise GenerationError(f"the prompt and the new tokens, {length} in all, exceed model.block_size="
                                  f"{model.cfg.block_size} positions")
        device = model.wte.weight.device
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else model.wte.weight.dtype
        self.model, self.sampling, self.length, self.device = model, sampling, length, device
        self.cache = KVCache(model.cfg, batch, length, dtype, device) if kv_cache else None
        self.graphs = kv_cache and (device.type == "cuda" if graphs is None else graphs)
        self.fused = kv_cache and (self.graphs if fused is None else fused)
        if self.fused:
            self.step = _CapturedStep(_decode_fused) if self.graphs else _decode_fused
        else:
            self.step = _decode_graphed if self.graphs else _decode
        if self.graphs and not self.fused:  # written in place by every replay: the graph's inputs at fixed
            for buffer in self.cache.buffers():  # addresses, not copies
                mark_static_address(buffer)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, seed: Optional[int] = None) -> Generation:
        """`prompt` (B, T) token ids, continued by `max_new_tokens` tokens; `seed` fixes the draws (the global
        generators are left as they were)."""
        B, T = prompt.shape
        if max_new_tokens < 1 or T + max_new_tokens > self.length:
            raise GenerationError(f"{T} prompt tokens + {max_new_tokens} new ones: between 1 and "
                                  f"{self.length - T} new tokens fit this sampler")
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            return self._generate(prompt.to(self.device), max_new_tokens)

    def _generate(self, prompt: torch.Tensor, n: int) -> Generation:
        (B, T), model, s = prompt.shape, self.model, self.sampling
        tokens = torch.empty((B, T + n), dtype=torch.long, device=self.device)
        tokens[:, :T] = prompt
        positions = torch.arange(T + n, device=self.device)
        start = device_clock(self.device)
        hidden = model.forward_hidden(prompt) if self.cache is None else \
            model.forward_hidden(prompt, self.cache, positions[:T])
        tokens[:, T] = next_token(head_logits(model, hidden), s)
        prefilled = device_clock(self.device)
        for i in range(T + 1, T + n):
            if self.cache is None:
                tokens[:, i] = next_token(head_logits(model, model.forward_hidden(tokens[:, :i])), s)
            else:
                tokens[:, i] = self.step(model, self.cache, tokens[:, i - 1:i], positions[i - 1:i], s)
        return Generation(tokens, n, prefilled - start, device_clock(self.device) - prefilled)


def generate(model: GPT, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(),
             seed: Optional[int] = None, kv_cache: bool = True, graphs: Optional[bool] = None) -> Generation:
    """`prompt` (B, T) continued by `max_new_tokens` tokens (a Sampler of exactly that length, used once)."""
    sampler = Sampler(model, prompt.shape[0], prompt.shape[1] + max_new_tokens, sampling, kv_cache, graphs)
    return sampler.generate(prompt, max_new_tokens, seed)


DEFAULT_NEW_TOKENS = 200  # scripts/sample.py's, where the model's context leaves room for them


def sample_texts(model: GPT, tokenizer, prompt: str, num_samples: int, max_new_tokens: Optional[int],
                 sampling: Sampling, seed: Optional[int] = None, kv_cache: bool = True,
                 graphs: Optional[bool] = None) -> tuple[list[str], Generation]:
    """`num_samples` continuations of `prompt` (an empty one starts from `<|endoftext|>`, as a new document), as
    text; the ids beyond the tokenizer's vocabulary are never drawn. `max_new_tokens` None: DEFAULT_NEW_TOKENS,
    or as many as the model's context leaves after the prompt (Generation.new_tokens says how many); a number
    that does not fit is refused (scripts/sample.py's engine: its errors name the script's options)."""
    from .data import EOT

    ids = tokenizer.encode(prompt).ids or [tokenizer.token_to_id(EOT)]
    context = model.cfg.block_size
    room = context - len(ids)
    if room < 1:
        raise GenerationError(f"the prompt's {len(ids)} tokens fill the model's context of {context} tokens: no "
                              "new token fits")
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
    elif max_new_tokens > room:
        raise GenerationError(f"--max-new-tokens {max_new_tokens}: the prompt's {len(ids)} tokens and "
                              f"{max_new_tokens} new ones exceed the model's context of {context} tokens (at most "
                              f"{room} new ones fit; leave --max-new-tokens out to draw what fits)")
    prompt_ids = torch.tensor([ids] * num_samples)
    sampling = replace(sampling, vocab=tokenizer.get_vocab_size())
    sampler = Sampler(model, num_samples, len(ids) + max_new_tokens, sampling, kv_cache, graphs)
    out = sampler.generate(prompt_ids, max_new_tokens, seed)
    return [tokenizer.decode(row.tolist()) for row in out.tokens.cpu()], out
