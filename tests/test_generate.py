"""Sampling (minitrain/generate.py): the KV-cached path against the uncached one and against transformers'
generate on the same weights; the filters against transformers' logits warpers; the draws against their
probabilities; padding and ids beyond the tokenizer never drawn. CPU only (fp32 models built on the CPU;
gpu_suite's `tests` leaves it out): the GPU's graphed decode is tests/test_decode.py's."""

from dataclasses import replace

import pytest
import torch

from minitrain.weights import open_weights
from minitrain.generate import GenerationError, Sampler, Sampling, filtered_logits, generate, next_token
from minitrain.model import GPT
from minitrain.model_config import ModelConfig

from conftest import GPT2_VOCAB


@pytest.fixture(scope="module")
def gpt2(hf_gpt2):
    """Our import of the fixture and transformers' own model of it."""
    from transformers import GPT2LMHeadModel

    return open_weights(str(hf_gpt2)).build("cpu"), GPT2LMHeadModel.from_pretrained(hf_gpt2).eval()


def prompts(n=2, length=6, seed=0):
    return torch.randint(0, GPT2_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_with_and_without_the_cache_is_transformers_greedy(gpt2):
    ours, theirs = gpt2
    prompt, greedy = prompts(), Sampling(temperature=0)
    cached = generate(ours, prompt, 60, greedy).tokens
    assert torch.equal(generate(ours, prompt, 60, greedy, kv_cache=False).tokens, cached)
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=60, do_sample=False,
                               pad_token_id=0, eos_token_id=None)  # no stop at EOT, no prompt token taken for padding
    assert torch.equal(cached, expected)
    assert len(set(cached[0, 6:].tolist())) > 10  # text, not one token repeated: a wrong cache would show


def test_seeded_sampling_is_repeatable_the_same_with_and_without_the_cache_and_leaves_the_global_rng(gpt2):
    model, _ = gpt2
    prompt, s = prompts(), Sampling(temperature=0.9, top_k=100, top_p=0.95)
    before = torch.get_rng_state()
    first = generate(model, prompt, 40, s, seed=7).tokens
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(generate(model, prompt, 40, s, seed=7).tokens, first)
    assert torch.equal(generate(model, prompt, 40, s, seed=7, kv_cache=False).tokens, first)
    assert not torch.equal(generate(model, prompt, 40, s, seed=8).tokens, first)


def test_a_sampler_is_reused_across_generations(gpt2):
    model, _ = gpt2
    sampler, prompt = Sampler(model, 2, 30, Sampling(temperature=0)), prompts()
    once = sampler.generate(prompt, 24)
    assert torch.equal(sampler.generate(prompts(seed=1), 20).tokens, generate(model, prompts(seed=1), 20,
                                                                             Sampling(temperature=0)).tokens)
    assert torch.equal(sampler.generate(prompt, 24).tokens, once.tokens)
    assert once.decode_tokens_per_s > 0 and once.tokens.shape == (2, 30)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.7, None, None), (1.0, 5, None), (1.3, None, 0.8), (0.8, 40, 0.6), (1.0, 1, 0.5), (2.0, None, 0.999),
])
def test_the_filters_are_transformers_logits_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = 3 * torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = filtered_logits(logits, Sampling(temperature, top_k, top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert bool(torch.isinf(ours).any()) == bool(top_k or top_p)  # the case filters something
    torch.testing.assert_close(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


def test_top_p_keeps_the_fewest_tokens_that_reach_it():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in binary): 0.5 is reached by the first token alone, 0.75 by two."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0]]) * torch.log(torch.tensor(2.0))
    kept = lambda p: (~torch.isinf(filtered_logits(logits, Sampling(1.0, top_p=p)))).sum().item()  # noqa: E731
    assert [kept(p) for p in (0.4, 0.5, 0.6, 0.75, 0.8, 1.0)] == [1, 1, 2, 2, 3, 4]


def test_draws_follow_the_probabilities():
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    torch.manual_seed(0)
    draws = next_token(p.log().expand(40000, 5), Sampling(temperature=1.0))
    frequencies = torch.bincount(draws, minlength=5) / 40000
    torch.testing.assert_close(frequencies, p, rtol=0, atol=0.01)  # 4 standard deviations or more
    tempered = torch.bincount(next_token(p.log().expand(40000, 5), Sampling(temperature=0.5)), minlength=5) / 40000
    torch.testing.assert_close(tempered, p.square() / p.square().sum(), rtol=0, atol=0.01)


def test_padding_rows_and_ids_beyond_the_tokenizer_are_never_drawn():
    """Every hidden state is ln_f's bias (its weight zeroed); the padding rows (50..63) and the ids 40..49 are
    that bias times 100, so each would win every draw if the head or the sampler let it take part."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=64, head_vocab=50)).eval()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.normal_()
        model.wte.weight[40:] = 100 * model.ln_f.bias
    prompt = torch.zeros((4, 2), dtype=torch.long)
    for s in (Sampling(temperature=0), Sampling(temperature=1.0), Sampling(temperature=2.0, top_p=0.99)):
        assert generate(model, prompt, 20, s, seed=0).tokens[:, 2:].max() in range(40, 50)  # the head: rows < 50
        assert generate(model, prompt, 20, replace(s, vocab=40), seed=0).tokens[:, 2:].max() < 40


def test_sample_texts_never_draw_the_padding_past_the_tokenizers_vocabulary(hf_gpt2):
    """A model whose vocabulary is padded past its tokenizer's 320 ids (to 384, as model.vocab_size pads GPT-2's
    50257): every hidden state is ln_f's bias, the padding rows (320..383) that bias times 100 and the tokenizer's
    last ids (300..319) that bias times 50, so a padding id would win every draw if sample_texts let it take part,
    and the tokenizer's last ids win where it does not (an id past the vocabulary would vanish from the text)."""
    from minitrain.data.tokenizer import pretrained_tokenizer
    from minitrain.generate import sample_texts

    tokenizer = pretrained_tokenizer(str(hf_gpt2))
    assert tokenizer.get_vocab_size() == GPT2_VOCAB == 320
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=384)).eval()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.normal_()
        model.wte.weight[300:320] = 50 * model.ln_f.bias
        model.wte.weight[320:] = 100 * model.ln_f.bias
    for s in (Sampling(temperature=0), Sampling(temperature=1.0), Sampling(temperature=1.0, top_k=5),
              Sampling(temperature=2.0, top_p=0.99)):
        _, out = sample_texts(model, tokenizer, "def wrap(", 4, 12, s, seed=0)
        drawn = out.tokens[:, len(tokenizer.encode("def wrap(").ids):]
        assert drawn.min() >= 300 and drawn.max() < 320, s


def test_settings_and_lengths_that_cannot_work_are_refused(gpt2):
    model, _ = gpt2
    for bad, message in [(dict(temperature=-1), "temperature must be >= 0"), (dict(top_k=0), "top_k must be >= 1"),
                         (dict(top_p=0.0), r"top_p must be in \(0, 1\]")]:
        with pytest.raises(GenerationError, match=message):
            Sampling(**bad)
    with pytest.raises(GenerationError, match="the prompt and the new tokens, 130 in all, exceed model.block_size=128"):
        generate(model, prompts(length=10), 120)
    with pytest.raises(GenerationError, match="6 prompt tokens \\+ 30 new ones: between 1 and 24 new tokens fit"):
        Sampler(model, 2, 30, Sampling()).generate(prompts(), 30)


def test_a_sequence_that_fills_the_context_exactly_is_drawn_and_one_token_more_is_refused(gpt2):
    """128 positions: a 10-token prompt and 118 new tokens reach the last one, cached as uncached; 117 fit too,
    119 do not (in a Sampler of the whole context, and in generate's)."""
    ours, _ = gpt2
    prompt, greedy = prompts(n=1, length=10), Sampling(temperature=0)
    assert generate(ours, prompt, 117, greedy).tokens.shape == (1, 127)
    full = generate(ours, prompt, 118, greedy).tokens
    assert torch.equal(generate(ours, prompt, 118, greedy, kv_cache=False).tokens, full)
    sampler = Sampler(ours, 1, 128, greedy)
    assert torch.equal(sampler.generate(prompt, 118).tokens, full)
    with pytest.raises(GenerationError, match="10 prompt tokens \\+ 119 new ones: between 1 and 118 new tokens fit"):
        sampler.generate(prompt, 119)
    with pytest.raises(GenerationError, match="129 in all, exceed model.block_size=128"):
        generate(ours, prompt, 119, greedy)


def test_sample_texts_continue_the_prompt_or_a_new_document(hf_gpt2, gpt2):
    from minitrain.generate import sample_texts
    from minitrain.data.tokenizer import pretrained_tokenizer

    model, _ = gpt2
    tokenizer = pretrained_tokenizer(str(hf_gpt2))
    texts, out = sample_texts(model, tokenizer, "def wrap(", 3, 12, Sampling(temperature=1.0, top_k=20), seed=0)
    assert len(texts) == 3 and all(t.startswith("def wrap(") for t in texts) and len(set(texts)) == 3
    assert out.tokens.shape == (3, len(tokenizer.encode("def wrap(").ids) + 12)
    texts, out = sample_texts(model, tokenizer, "", 1, 5, Sampling(temperature=0))
    assert out.tokens[0, 0] == tokenizer.token_to_id("<|endoftext|>") and out.tokens.shape == (1, 6)
