"""Sampling with the KV cache from every block option (model.position, norm, qk_norm, mlp, tie_head, logit_softcap):
the cached step (prefill, then one token at a time), in the model's own ops and in the decode kernels (Triton's
interpreter here), against the uncached full forward at every position up to the exactly full context; greedy
continuations against transformers' Llama; scripts/sample.py on a trained run of the modern preset. CPU only (fp32
models built on the CPU, as tests/test_generate.py's; gpu_suite's `tests` leaves it out)."""

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

from conftest import REPO, llama_state_as_minitrain

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


def wide_model(options: dict, seed: int = 0, **shape) -> GPT:
    """Heads of 16 (the decode kernels' attention takes powers of two); matrices drawn at 3 / sqrt(fan-in), norms'
    weights at 1 +- 0.2 and biases at +- 0.2: no option near the identity or zero, and greedy tokens that vary, so a
    part left out or misplaced changes them."""
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=CONTEXT, vocab_size=96, bias=True),
                         **shape, **options})
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(r * 3 / p.shape[-1] ** 0.5 if p.dim() == 2 else float(name.endswith("weight")) + 0.2 * r)
    return model


def prompts(n=2, length=PROMPT, vocab=96, seed=1):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_the_cached_steps_logits_are_the_full_forwards_last_position_up_to_the_full_context(case):
    """Greedy through the cache == greedy through the whole sequence's forward at each step (its argmax), the
    context filled exactly (one more token refused); at every step both decode paths (the model's cached forward
    and, over the last three positions, the decode kernels) score the next token as the full forward's last
    position does, soft-cap included."""
    model = wide_model(CASES[case])
    prompt, greedy = prompts(), Sampling(temperature=0)
    tokens = generate(model, prompt, CONTEXT - PROMPT, greedy).tokens
    assert len(set(tokens[:, PROMPT:].flatten().tolist())) > 6  # text, not one token repeated
    with pytest.raises(GenerationError, match=f"{CONTEXT + 1} in all, exceed model.block_size={CONTEXT}"):
        generate(model, prompt, CONTEXT - PROMPT + 1, greedy)
    plain, fused = (KVCache(model.cfg, 2, CONTEXT, torch.float32) for _ in range(2))
    positions = torch.arange(CONTEXT)
    model.forward_hidden(prompt, plain, positions[:PROMPT])
    model.forward_hidden(tokens[:, :FUSED_FROM], fused, positions[:FUSED_FROM])
    assert torch.equal(model(prompt)[:, -1].argmax(-1), tokens[:, PROMPT])
    for i in range(PROMPT, CONTEXT):
        full = model(tokens[:, :i + 1])[:, -1]
        if i + 1 < CONTEXT:
            assert torch.equal(full.argmax(-1), tokens[:, i + 1])
        token, pos = tokens[:, i:i + 1], positions[i:i + 1]
        fp32_rounding = dict(rtol=1e-5, atol=1e-5 * full.abs().max().item())  # of logits in the tens
        torch.testing.assert_close(head_logits(model, model.forward_hidden(token, plain, pos)), full,
                                   **fp32_rounding)
        if i >= FUSED_FROM:
            torch.testing.assert_close(decode_logits(model, fused, token, pos), full, **fp32_rounding)
    for name, buffer in fused.named_buffers():  # the kernels' cache: the keys as the model's own step wrote them
        want = plain.get_buffer(name)
        torch.testing.assert_close(buffer, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if model.cfg.logit_softcap == 1.0:  # the cap bites at these logits: leaving it out would show
        assert not torch.allclose(F.linear(model.forward_hidden(tokens)[:, -1], model.lm_head_weight), full,
                                  atol=1e-2)


def test_seeded_draws_are_alike_cached_uncached_and_fused():
    """Drawn tokens from the modern preset's block (a soft-cap of 1, which changes every probability) are the same
    through every path."""
    model, s = wide_model(dict(CASES["modern-preset"], logit_softcap=1.0), seed=2), Sampling(1.0, top_k=40)
    drawn = generate(model, prompts(), CONTEXT - PROMPT, s, seed=3).tokens
    assert torch.equal(generate(model, prompts(), CONTEXT - PROMPT, s, seed=3, kv_cache=False).tokens, drawn)
    sampler = Sampler(model, 2, CONTEXT, s, fused=True)
    assert sampler.fused and torch.equal(sampler.generate(prompts(), CONTEXT - PROMPT, seed=3).tokens, drawn)


@pytest.mark.parametrize("rows", [1, 3])  # the prologue in the kernel (one row), or torch's RMSNorm first (several)
@pytest.mark.parametrize("K", [200, 300])  # one K step; two slices, each program normalising its row itself
def test_decode_linears_rmsnorm_prologue_is_torchs_rmsnorm(rows, K):
    """Rows of mean 1.5 (which a LayerNorm would subtract) and a tiny one (RMSNorm's eps decides its scale)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, K, generator=g) * 3 + 1.5
    x[0] *= 1e-4
    weight, bias = torch.randn(90, K, generator=g) * 0.1, torch.randn(90, generator=g)
    norm = torch.nn.RMSNorm(K, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(K, generator=g))
        expected = F.gelu(F.linear(norm(x), weight, bias), approximate="tanh")
        torch.testing.assert_close(decode_linear(x, weight, bias, norm=norm, gelu=True), expected,
                                   rtol=1e-5, atol=1e-5)


# -- transformers' Llama: rope + rmsnorm + swiglu + an untied head --------------------------------------------------

def llama_and_ours():
    """A tiny random LlamaForCausalLM (weights drawn wide, its norms' too) and our modern block with its weights."""
    import transformers

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=96, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    mine = llama_state_as_minitrain(theirs, 2)
    ours = wide_model(dict(position=ROPE, norm=RMS, mlp=SWIGLU, tie_head=False, bias=False))
    ours.load_state_dict(mine, strict=True)
    return theirs, ours


def test_greedy_continuations_are_transformers_llamas_generate():
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
    runs it (its main): greedy, the continuation of sample_texts on the run's weights; drawn, the same text with and
    without the KV cache."""
    cfg = make_cfg("model=gpt2-124m-modern", "model.vocab_size=null", "model.n_layer=2", "model.n_embd=64",
                   "model.n_head=4", "model.block_size=32", "data=files", f"data.paths={gpt2_corpus}/*.txt",
                   "data.vocab_size=300", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.eval_batches=1",
                   "trainer.sample_tokens=0")
    Trainer(cfg, progress=False).fit()
    capsys.readouterr()
    run = str(tmp_path / "run")
    main = runpy.run_path(str(REPO / "scripts" / "sample.py"))["main"]
    weights = open_weights(run)
    assert weights.cfg.position == ROPE and weights.cfg.logit_softcap == 30.0 and not weights.cfg.tie_head
    model = weights.build("cpu")
    assert main([run, "--prompt", "def f(", "--temperature", "0", "--max-new-tokens", "20"]) == 0
    text = capsys.readouterr().out.split("\n---------------\n")[0]
    assert text == sample_texts(model, weights.tokenizer, "def f(", 1, 20, Sampling(temperature=0))[0][0]
    drawn = [run, "--prompt", "def f(", "--max-new-tokens", "24", "--num-samples", "2"]
    assert main(drawn) == 0
    cached = capsys.readouterr().out
    assert main([*drawn, "--no-kv-cache"]) == 0
    assert capsys.readouterr().out == cached
