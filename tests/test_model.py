import pytest
import torch
import torch.nn.functional as F

from minitrain.model import GPT
from minitrain.model_config import ModelConfig


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=97, **kw))


def test_shapes_and_tied_head():
    model = tiny()
    idx = torch.randint(0, 97, (3, 16))
    hidden = model.forward_hidden(idx)
    assert hidden.shape == (3, 16, 32)
    assert model(idx).shape == (3, 16, 97)
    assert model.lm_head_weight is model.wte.weight
    torch.testing.assert_close(model(idx), hidden @ model.wte.weight.T)


def test_tied_head_gets_gradient_from_both_uses():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    # Rows of tokens never seen as input still get a gradient through the head.
    unseen = torch.ones(97, dtype=torch.bool)
    unseen[idx.unique()] = False
    assert unseen.any() and model.wte.weight.grad[unseen].abs().sum() > 0


def test_causal():
    model = tiny()
    idx = torch.randint(0, 97, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 97
    a, b = model.forward_hidden(idx), model.forward_hidden(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt2_124m_parameter_count_and_flops():
    with torch.device("meta"):
        model = GPT(ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304))
    assert model.num_params(exclude_positions=False) == 124_475_904  # GPT-2 small with vocab padded to 50304
    n = 124_475_904 - 1024 * 768
    assert model.flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024


def test_no_bias_and_decay_groups():
    model = tiny(bias=False)
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert any(p is model.wte.weight for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=8, n_head=4, n_embd=256, block_size=16, vocab_size=128))
    std_proj = model.blocks[0].attn.c_proj.weight.std().item()
    std_fc = model.blocks[0].mlp.c_fc.weight.std().item()
    assert abs(std_fc - 0.02) < 0.002
    assert abs(std_proj - 0.02 / 4) < 0.001


def test_fused_gelu_model_matches_torch_gelu():
    """model.gelu=fused (the Triton kernel, interpreted on CPU) trains the same function as F.gelu: loss and
    every gradient, with biases that are not zero (the init's zeros hide what the kernel's input is)."""
    from minitrain.model_config import KernelImpl

    idx = torch.randint(0, 97, (2, 16))
    outs = []
    for impl in (KernelImpl.fused, KernelImpl.torch):
        model = tiny(gelu=impl)
        with torch.no_grad():
            for p in (p for name, p in model.named_parameters() if name.endswith(".bias")):
                p.normal_(0.0, 0.5)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        outs.append((loss.detach(), *(p.grad for p in model.parameters())))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_cached_prefill_then_one_token_steps_compute_the_full_forward():
    """A prompt of 5 into a 16-position cache, then tokens one at a time: each position's hidden state is the
    one the whole sequence's causal forward gives it."""
    from minitrain.model import KVCache

    model = tiny(dropout=0.0).eval()
    with torch.no_grad():
        for p in model.parameters():  # wide weights: attention far from uniform, so a wrong mask shows
            p.normal_(0.0, 0.5)
    idx = torch.randint(0, 97, (3, 16))
    full = model.forward_hidden(idx)
    cache = KVCache(model.cfg, 3, 16, torch.float32)
    steps = [model.forward_hidden(idx[:, :5], cache, torch.arange(5))]
    steps += [model.forward_hidden(idx[:, t:t + 1], cache, torch.tensor([t])) for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="a cache of 17 positions exceeds model.block_size=16"):
        KVCache(model.cfg, 1, 17, torch.float32)


def test_the_head_scores_the_head_vocab_rows_only():
    model = tiny(head_vocab=90)
    idx = torch.randint(0, 90, (2, 16))
    assert model(idx).shape == (2, 16, 90) and model.lm_head_weight.shape == (90, 32)
    assert model.lm_head_weight.data_ptr() == model.wte.weight.data_ptr()  # the tied rows, not a copy
