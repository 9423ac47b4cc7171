"""Sampling with the KV cache from every block option (model.position, norm, qk_norm, mlp, tie_head, logit_softcap):
the cached step (prefill, then one token at a time), in the model's own ops and in the decode kernels, against the
uncached full forward at every position up to the exactly full context; greedy continuations against transformers'
Llama; scripts/sample.py on a trained run of the modern preset.

On the CPU in fp32, the kernels through Triton's interpreter. Under MINITRAIN_TEST_DEVICE=cuda (scripts/gpu_suite.sh's
`tests`) on the GPU, the kernels compiled: the cached step's logits in bf16 (sample.py's dtype there) within bf16's
rounding, and what only fp32 can hold exactly (seeded draws alike through every path, transformers' greedy tokens,
sample.py's draws with and without the cache) in fp32 with TF32 off."""

import contextlib
import runpy

import pytest
import torch
import torch.nn.functional as F

from minitrain.generate import GenerationError, Sampler, Sampling, decode_logits, generate, head_logits, \
    sample_texts
from minitrain.model import GPT, KVCache
from minitrain.model_config import MlpActivation, ModelConfig, NormKind, PositionEncoding
from minitrain.ops.decode import decode_linear
from minitrain.trainer import Trainer
from minitrain.weights import open_weights

from conftest import REPO, TEST_DEVICE, llama_state_as_minitrain

DEVICE = torch.device(TEST_DEVICE)
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16  # what scripts/sample.py decodes in on each
ROPE, RMS, SWIGLU, RELU2 = PositionEncoding.rope, NormKind.rmsnorm, MlpActivation.swiglu, MlpActivation.relu2
CONTEXT, PROMPT = 16, 5  # a prompt of 5 and 11 new tokens fill the context exactly
FUSED_FROM = CONTEXT - 3  # the decode kernels (interpreted: slow) step the last three positions, after a prefill
CASES = {  # each option alone, then the gpt2-124m-modern preset's choices (configs/model/gpt2-124m-modern.yaml)
    "rope": dict(position=ROPE),
    "rmsnorm": dict(norm=RMS),
    "qk_norm": dict(qk_norm=True),
    "relu2": dict(mlp=RELU2),
    "swiglu": dict(mlp=SWIGLU),
    "untied": dict(tie_head=False),
    "softcap": dict(logit_softcap=1.0),
    "modern-preset": dict(position=ROPE, norm=RMS, qk_norm=True, mlp=RELU2, tie_head=False, zero_init_proj=True,
                          logit_softcap=30.0, bias=False),
}


def cpu_randn(*shape, generator) -> torch.Tensor:
    """Drawn on the CPU (whatever torch's default device), so that every device sees the same numbers."""
    return torch.randn(*shape, generator=generator, device="cpu")


def wide_model(options: dict, seed: int = 0, dtype: torch.dtype = DTYPE, **shape) -> GPT:
    """Heads of 16 (the decode kernels' attention takes powers of two); matrices drawn at 3 / sqrt(fan-in), norms'
    weights at 1 +- 0.2 and biases at +- 0.2: no option near the identity or zero, and greedy tokens that vary, so a
    part left out or misplaced changes them. On DEVICE, in `dtype`."""
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=CONTEXT, vocab_size=96, bias=True),
                         **shape, **options})
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = cpu_randn(p.shape, generator=g)
            p.copy_(r * 3 / p.shape[-1] ** 0.5 if p.dim() == 2 else float(name.endswith("weight")) + 0.2 * r)
    return model.to(DEVICE, dtype)


def prompts(n=2, length=PROMPT, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g, device="cpu").to(DEVICE)


def rounding(expected: torch.Tensor, uncapped: float | None = None) -> dict:
    """assert_close's tolerances against `expected` (logits in the tens, or a cache's keys and values), at the scale
    of its largest value: fp32's rounding; bf16's on a GPU, carried through two blocks of wide weights to every value
    however small (the decode kernels' rounding points emulated in torch on a CPU, over 25 draws of the weights: 0.6%
    of the scale beyond 2% of the value typically, 3.1% at most), and for logits at the scale of the largest uncapped
    one, `uncapped` (a soft-cap of 1 squashes the large logits, not the rounding a small one carries from the large
    terms it was summed from)."""
    if expected.dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    return dict(rtol=2e-2, atol=5e-2 * (uncapped or expected.abs().max().item()))


def assert_close(got: torch.Tensor, expected: torch.Tensor, tolerance: dict) -> None:
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


def assert_greedy(logits: torch.Tensor, tokens: torch.Tensor, tolerance: dict) -> None:
    """`tokens` (B,) are the argmax of `logits` (B, V): exactly in fp32; in bf16, where the path that chose them
    rounds otherwise and two logits may swap, each within `tolerance` of the largest."""
    if logits.dtype == torch.float32:
        assert torch.equal(logits.argmax(-1), tokens)
    else:
        assert_close(logits.gather(1, tokens[:, None])[:, 0], logits.max(-1).values, tolerance)


@contextlib.contextmanager
def true_fp32():
    """fp32 matmuls in fp32, as a fresh process has them (cuBLAS's; the decode kernels multiply fp32 in fp32): a
    trainer run earlier in the process leaves TF32 on (trainer.tf32), whose rounding would draw the paths apart."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_the_cached_steps_logits_are_the_full_forwards_last_position_up_to_the_full_context(case):
    """Greedy through the cache == greedy through the whole sequence's forward at each step (its argmax), the
    context filled exactly (one more token refused); at every step both decode paths (the model's cached forward
    and, over the last three positions, the decode kernels) score the next token as the full forward's last
    position does, soft-cap included. In bf16 on a GPU the greedy tokens (chosen there by the kernels, captured as a
    CUDA graph) feed every path alike, and each is the full forward's argmax within bf16's rounding."""
    model = wide_model(CASES[case])
    prompt, greedy = prompts(), Sampling(temperature=0)
    tokens = generate(model, prompt, CONTEXT - PROMPT, greedy).tokens
    assert len(set(tokens[:, PROMPT:].flatten().tolist())) > 6  # text, not one token repeated
    with pytest.raises(GenerationError, match=f"{CONTEXT + 1} in all, exceed model.block_size={CONTEXT}"):
        generate(model, prompt, CONTEXT - PROMPT + 1, greedy)
    raw = F.linear(model.forward_hidden(tokens), model.lm_head_weight)  # every position's logits, uncapped
    uncapped = raw.abs().max().item()
    plain, fused = (KVCache(model.cfg, 2, CONTEXT, DTYPE, DEVICE) for _ in range(2))
    positions = torch.arange(CONTEXT, device=DEVICE)
    model.forward_hidden(prompt, plain, positions[:PROMPT])
    model.forward_hidden(tokens[:, :FUSED_FROM], fused, positions[:FUSED_FROM])
    first = model(prompt)[:, -1]
    assert_greedy(first, tokens[:, PROMPT], rounding(first, uncapped))
    for i in range(PROMPT, CONTEXT):
        full = model(tokens[:, :i + 1])[:, -1]
        tolerance = rounding(full, uncapped)
        if i + 1 < CONTEXT:
            assert_greedy(full, tokens[:, i + 1], tolerance)
        token, pos = tokens[:, i:i + 1], positions[i:i + 1]
        assert_close(head_logits(model, model.forward_hidden(token, plain, pos)), full, tolerance)
        if i >= FUSED_FROM:
            assert_close(decode_logits(model, fused, token, pos), full, tolerance)
    for name, buffer in fused.named_buffers():  # the kernels' cache: the keys as the model's own step wrote them
        want = plain.get_buffer(name)
        assert_close(buffer, want, rounding(want))
    if model.cfg.logit_softcap == 1.0:  # the cap bites at these logits: leaving it out would show
        assert not torch.allclose(raw[:, -1], full, atol=1e-2)


@true_fp32()
def test_seeded_draws_are_alike_cached_uncached_and_fused():
    """Drawn tokens from the modern preset's block (a soft-cap of 1, which changes every probability) are the same
    through every path: the model's cached forward, the whole sequence's, and the decode kernels (on a GPU captured
    as a CUDA graph, then replayed from the first step). In fp32 on a GPU too: bf16's rounding would draw them
    apart."""
    model = wide_model(dict(CASES["modern-preset"], logit_softcap=1.0), seed=2, dtype=torch.float32)
    s = Sampling(1.0, top_k=40)
    drawn = generate(model, prompts(), CONTEXT - PROMPT, s, seed=3, graphs=False).tokens
    assert torch.equal(generate(model, prompts(), CONTEXT - PROMPT, s, seed=3, kv_cache=False).tokens, drawn)
    sampler = Sampler(model, 2, CONTEXT, s, fused=True)
    assert sampler.fused and torch.equal(sampler.generate(prompts(), CONTEXT - PROMPT, seed=3).tokens, drawn)
    if DEVICE.type == "cuda":
        assert torch.equal(sampler.generate(prompts(), CONTEXT - PROMPT, seed=3).tokens, drawn)  # the graph replayed


@pytest.mark.parametrize("rows", [1, 3])  # the prologue in the kernel (one row), or torch's RMSNorm first (several)
@pytest.mark.parametrize("K", [200, 300])  # one K step; two slices, each program normalising its row itself
def test_decode_linears_rmsnorm_prologue_is_torchs_rmsnorm(rows, K):
    """Rows of mean 1.5 (which a LayerNorm would subtract) and a tiny one (RMSNorm's eps decides its scale). The
    reference in fp32 from the kernel's inputs (bf16 on a GPU)."""
    g = torch.Generator().manual_seed(0)
    x = cpu_randn(rows, K, generator=g) * 3 + 1.5
    x[0] *= 1e-4
    weight, bias = cpu_randn(90, K, generator=g) * 0.1, cpu_randn(90, generator=g)
    norm = torch.nn.RMSNorm(K, eps=1e-6, device="cpu")
    with torch.no_grad():
        norm.weight.copy_(cpu_randn(K, generator=g))
    x, weight, bias, norm = (t.to(DEVICE, DTYPE) for t in (x, weight, bias, norm))
    with torch.no_grad():
        expected = F.gelu(F.linear(F.rms_norm(x.float(), (K,), norm.weight.float(), norm.eps), weight.float(),
                                   bias.float()), approximate="tanh")
        got = decode_linear(x, weight, bias, norm=norm, gelu=True)
    assert got.dtype == DTYPE
    assert_close(got, expected, dict(rtol=1e-5, atol=1e-5) if DTYPE == torch.float32 else dict(rtol=2e-2, atol=2e-2))


# -- transformers' Llama: rope + rmsnorm + swiglu + an untied head --------------------------------------------------

def llama_and_ours():
    """A tiny random LlamaForCausalLM (weights drawn wide, its norms' too) and our modern block with its weights,
    both in fp32 on DEVICE."""
    import transformers

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=96, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)).to(DEVICE).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(cpu_randn(p.shape, generator=g) * 0.5)
    mine = llama_state_as_minitrain(theirs, 2)
    ours = wide_model(dict(position=ROPE, norm=RMS, mlp=SWIGLU, tie_head=False, bias=False), dtype=torch.float32)
    ours.load_state_dict(mine, strict=True)
    return theirs, ours


@true_fp32()
def test_greedy_continuations_are_transformers_llamas_generate():
    """In fp32 on a GPU too (TF32 off), our decode kernels captured as a CUDA graph: two implementations' greedy
    tokens agree only where both round as little (minitrain/tools/benchmarks/sample.py checks it so)."""
    pytest.importorskip("transformers")
    theirs, ours = llama_and_ours()
    prompt, greedy = prompts(), Sampling(temperature=0)
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=CONTEXT - PROMPT,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
    assert len(set(expected[:, PROMPT:].flatten().tolist())) > 8
    assert torch.equal(generate(ours, prompt, CONTEXT - PROMPT, greedy).tokens, expected)


# -- scripts/sample.py on a trained run of the modern preset -------------------------------------------------------

def test_sample_py_draws_from_a_run_of_the_modern_preset(make_cfg, gpt2_corpus, tmp_path, capsys):
    """model=gpt2-124m-modern at a small width, trained for 2 steps on its own tokenizer, then the script as a user
    runs it (its main; on a GPU its default device, the decode kernels captured): greedy, the continuation of
    sample_texts on the run's weights in the script's dtype; drawn, the same text with and without the KV cache (in
    fp32, TF32 off: on a GPU bf16's rounding would draw the two paths apart)."""
    cfg = make_cfg("model=gpt2-124m-modern", "model.vocab_size=null", "model.n_layer=2", "model.n_embd=64",
                   "model.n_head=4", "model.block_size=32", "data=files", f"data.paths={gpt2_corpus}/*.txt",
                   "data.vocab_size=300", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.eval_batches=1",
                   "trainer.sample_tokens=0", "trainer.compile=false")  # (eager on a GPU too: no compile to wait for)
    Trainer(cfg, progress=False).fit()
    capsys.readouterr()
    run = str(tmp_path / "run")
    main = runpy.run_path(str(REPO / "scripts" / "sample.py"))["main"]
    weights = open_weights(run)
    assert weights.cfg.position == ROPE and weights.cfg.logit_softcap == 30.0 and not weights.cfg.tie_head
    model = weights.build(DEVICE, DTYPE)
    assert main([run, "--prompt", "def f(", "--temperature", "0", "--max-new-tokens", "20"]) == 0
    text = capsys.readouterr().out.split("\n---------------\n")[0]
    assert text == sample_texts(model, weights.tokenizer, "def f(", 1, 20, Sampling(temperature=0))[0][0]
    drawn = [run, "--prompt", "def f(", "--max-new-tokens", "24", "--num-samples", "2", "--dtype", "fp32"]
    with true_fp32():
        assert main(drawn) == 0
        cached = capsys.readouterr().out
        assert main([*drawn, "--no-kv-cache"]) == 0
    assert capsys.readouterr().out == cached
