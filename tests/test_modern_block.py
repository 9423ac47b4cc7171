"""The block's options (model.position, norm, qk_norm, mlp, tie_head, zero_init_proj, logit_softcap): each against
the block written out from its definitions here, against transformers' Llama and Qwen3, the soft-cap inside the fused
loss's kernels against its plain definition, and every option through the trainer with every checkpointing policy,
the precisions, a resume and the modern preset."""

import math

import pytest
import torch
import torch.nn.functional as F

from minitrain import checkpoint
from minitrain.config import BLOCK_LINEARS, CheckpointingConfig, CheckpointPolicy, Float8Recipe, resolve
from minitrain.errors import ConfigError
from minitrain.model import GPT, KVCache
from minitrain.model_config import KernelImpl, MlpActivation, ModelConfig, NormKind, PositionEncoding
from minitrain.ops import fused_linear_cross_entropy, linear_cross_entropy_reference
from minitrain.recompute import apply_policy, recompute_flops_per_token
from minitrain.trainer import Trainer

from conftest import llama_state_as_minitrain, saved_state

ROPE, RMS, SWIGLU, RELU2 = PositionEncoding.rope, NormKind.rmsnorm, MlpActivation.swiglu, MlpActivation.relu2
# Every option away from GPT-2's, at once (mlp takes one value: relu2 has its own case).
MODERN = dict(position=ROPE, norm=RMS, qk_norm=True, mlp=SWIGLU, tie_head=False, zero_init_proj=True,
              logit_softcap=2.0, bias=False)
CASES = {  # each option alone, at head sizes that are not powers of two (rope's 10 turns 5 pairs, qk_norm's 9 is odd)
    "gpt2": dict(),
    "rope": dict(position=ROPE, n_embd=40, rope_base=500.0),
    "rmsnorm": dict(norm=RMS),
    "qk_norm": dict(qk_norm=True, n_embd=36),
    "relu2": dict(mlp=RELU2),
    "swiglu": dict(mlp=SWIGLU, n_embd=36),
    "untied": dict(tie_head=False),
    "softcap": dict(logit_softcap=2.0),
    "modern": dict(MODERN, n_embd=40),
}
FUSED = KernelImpl.fused  # model.qk_kernel's Triton op (through the interpreter here) in place of torch's modules
FUSED_CASES = {f"{name}-fused": dict(CASES[name], qk_kernel=FUSED) for name in ("rope", "qk_norm", "modern")}


def model_cfg(**options) -> ModelConfig:
    return ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64), **options})


def wide(model: GPT, seed: int = 0) -> GPT:
    """Every parameter drawn at 0.3 (norm weights and biases too): no option is near the identity or zero, so a
    part that is wrong or left out shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


# -- the block from its definitions --------------------------------------------------------------------------------

def reference_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The model's forward written out in fp64 from the definitions, reading its parameters by name: LayerNorm and
    RMSNorm by their formulas, attention as softmax(q k^T / sqrt(D)) under a causal mask, rope as a complex
    multiplication of each pair (x_i, x_{i+D/2}) by e^(i pos base^(-2i/D)), GELU by its tanh formula, relu^2,
    SwiGLU as silu(the gate half) * (the up half), the soft-cap as c tanh(z / c)."""
    cfg, P = model.cfg, {name: p.double() for name, p in model.named_parameters()}
    (B, T), C, H = idx.shape, cfg.n_embd, cfg.n_head
    D = C // H

    def rms(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def norm(x, name):
        if cfg.norm == RMS:
            return rms(x, P[f"{name}.weight"])
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        return y * P[f"{name}.weight"] + (P[f"{name}.bias"] if cfg.bias else 0)

    def linear(x, name):
        return x @ P[f"{name}.weight"].T + (P[f"{name}.bias"] if f"{name}.bias" in P else 0)

    def rope(t):
        half = D // 2
        turns = torch.polar(torch.ones(T, half, dtype=torch.float64),
                            torch.arange(T, dtype=torch.float64)[:, None] * cfg.rope_base ** (-2 * torch.arange(
                                half, dtype=torch.float64) / D))
        z = torch.complex(t[..., :half], t[..., half:]) * turns
        return torch.cat([z.real, z.imag], -1)

    x = P["wte.weight"][idx] + (P["wpe.weight"][:T] if cfg.position == PositionEncoding.learned else 0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        block = f"blocks.{i}"
        q, k, v = (t.reshape(B, T, H, D).transpose(1, 2)
                   for t in linear(norm(x, f"{block}.ln_1"), f"{block}.attn.c_attn").split(C, -1))
        if cfg.qk_norm:
            q, k = rms(q, P[f"{block}.attn.q_norm.weight"]), rms(k, P[f"{block}.attn.k_norm.weight"])
        if cfg.position == ROPE:
            q, k = rope(q), rope(k)
        att = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + linear((att @ v).transpose(1, 2).reshape(B, T, C), f"{block}.attn.c_proj")
        h = linear(norm(x, f"{block}.ln_2"), f"{block}.mlp.c_fc")
        if cfg.mlp == RELU2:
            a = h.clamp_min(0) ** 2
        elif cfg.mlp == SWIGLU:
            gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]
            a = gate * torch.sigmoid(gate) * up
        else:
            a = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + linear(a, f"{block}.mlp.c_proj")
    logits = norm(x, "ln_f") @ P["wte.weight" if cfg.tie_head else "lm_head.weight"].T
    c = cfg.logit_softcap
    return logits if c is None else c * torch.tanh(logits / c)


def loss_and_grads(model, logits_of, idx, targets):
    model.zero_grad()
    logits = logits_of(model, idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES) + list(FUSED_CASES))
def test_each_option_computes_its_definition_and_its_gradients(case):
    model = wide(GPT(model_cfg(**{**CASES, **FUSED_CASES}[case])))
    idx, targets = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    ours, our_grads = loss_and_grads(model, GPT.__call__, idx, targets)
    want, want_grads = loss_and_grads(model, reference_logits, idx, targets)
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():  # fp32 against fp64: within 1e-5 of the gradient's largest entry
        assert (our_grads[name].double() - grad).abs().max() <= 1e-5 * grad.abs().max(), name
    assert ("lm_head.weight" in want_grads) == (not model.cfg.tie_head)
    assert ("wpe.weight" in want_grads) == (model.cfg.position == PositionEncoding.learned)


def test_the_soft_cap_bends_the_logits_the_model_returns_into_its_bound():
    model = wide(GPT(model_cfg(logit_softcap=2.0)))
    with torch.no_grad():
        model.ln_f.weight.mul_(100)  # logits in the hundreds
        logits = model(torch.randint(0, 64, (2, 16)))
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.99  # tanh rounds to 1 in fp32 far out


@pytest.mark.parametrize("options", [dict(MODERN, n_embd=40), dict(mlp=RELU2, qk_norm=True),
                                     FUSED_CASES["modern-fused"]], ids=["modern", "relu2", "modern-fused"])
def test_a_cached_prefill_then_one_token_steps_compute_the_full_forward(options):
    """Rope takes each token's position from the cache's `pos`: a prompt of 5, then tokens one at a time, give
    every position the hidden state of the whole sequence's forward."""
    model = wide(GPT(model_cfg(**options))).eval()
    idx = torch.randint(0, 64, (3, 16))
    with torch.no_grad():
        full = model.forward_hidden(idx)
        cache = KVCache(model.cfg, 3, 16, torch.float32)
        steps = [model.forward_hidden(idx[:, :5], cache, torch.arange(5))]
        steps += [model.forward_hidden(idx[:, t:t + 1], cache, torch.tensor([t])) for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_the_compiled_forward_takes_rope_tables_from_their_op_and_computes_no_cos_or_sin_itself():
    """Traced as Inductor receives it, the rotations' cos and sin come from minitrain::rope_tables (one node per
    block, which Inductor runs once per forward) and no cos or sin is left for it to fuse into the rotating kernels,
    where it would be computed per element of q and k."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = GPT(model_cfg(**CASES["rope"]))
    torch.compile(model.forward_hidden, backend=capture, fullgraph=True)(torch.randint(0, 64, (2, 16)))
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert sum("rope_tables" in t for t in targets) == model.cfg.n_layer  # one per block, q's and k's
    assert not [t for t in targets if "cos" in t or "sin" in t]


# -- transformers' Llama (rope + rmsnorm + swiglu + untied head) and Qwen3 (and qk_norm) ---------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_llama_and_qwen3_compute_our_modern_block_with_their_weights_copied(arch):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=128, max_position_embeddings=32, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attention_bias=False)
    if arch == "llama":
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, mlp_bias=False))
    else:
        theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    theirs = wide(theirs.eval(), seed=3)  # their norms' weights too (they start at one)
    ours = GPT(model_cfg(n_layer=2, n_embd=64, block_size=32, vocab_size=128, position=ROPE, norm=RMS, mlp=SWIGLU,
                         tie_head=False, bias=False, qk_norm=arch == "qwen3"))
    assert ours.cfg.mlp_hidden == 192
    mine = llama_state_as_minitrain(theirs, 2)
    ours.load_state_dict(mine, strict=True)
    idx = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=0, atol=1e-5)


# -- init, counts and the config -------------------------------------------------------------------------------------

def test_zero_init_starts_the_output_projections_and_the_untied_head_at_zero_and_nothing_else():
    for tie in (True, False):
        model = GPT(model_cfg(zero_init_proj=True, tie_head=tie, mlp=SWIGLU))
        zero = {n for n, p in model.named_parameters() if not p.any()}
        assert zero == {n for n in dict(model.named_parameters()) if n.endswith(("c_proj.weight", ".bias"))
                        or n == "lm_head.weight"}, tie
    untied = GPT(model_cfg(tie_head=False, qk_norm=True, norm=RMS))
    assert untied.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)  # GPT-2's draw, not zero
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in untied.named_parameters() if "norm" in n or "ln_" in n)


def test_swiglu_keeps_the_mlps_weights_and_the_flops_count_what_is_multiplied():
    gpt2, swiglu = (ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, mlp=m,
                                bias=False) for m in (MlpActivation.gelu, SWIGLU))  # the weights (biases differ)
    assert swiglu.mlp_hidden == 2048 and ModelConfig(n_embd=128, mlp=SWIGLU).mlp_hidden == 384  # 341.3 up to 64s
    with torch.device("meta"):
        a, b = GPT(gpt2), GPT(swiglu)
    assert a.num_params() == b.num_params()
    policy = CheckpointingConfig(CheckpointPolicy.full)
    assert recompute_flops_per_token(gpt2, policy, 1024) == recompute_flops_per_token(swiglu, policy, 1024)
    tiny = ModelConfig(n_layer=1, n_head=2, n_embd=128, block_size=32, vocab_size=64, mlp=SWIGLU)
    assert recompute_flops_per_token(tiny, policy, 32) == 2 * (4 * 128 ** 2 + 3 * 384 * 128) + 4 * 128 * 32
    # An untied head is the matmul, the embedding a lookup; rope has no position table to leave out.
    with torch.device("meta"):
        tied, untied = GPT(model_cfg(position=ROPE)), GPT(model_cfg(position=ROPE, tie_head=False))
    assert untied.num_params() == tied.num_params() + 64 * 32
    assert untied.flops_per_token(16) == tied.flops_per_token(16)


@pytest.mark.parametrize("override, message", [
    ("model.rope_base=1", "model.rope_base: must be > 1, got 1.0"),
    ("model.rope_base=500", "model.rope_base: is set, but model.position=learned does not use it: add "
                            "model.position=rope"),
    ("model.logit_softcap=0", "model.logit_softcap: must be > 0 or null, got 0.0"),
    ("model.position=rope model.n_embd=36", "model.position: rope turns pairs of a head's features: model.n_embd=36 / "
                                            "model.n_head=4 = 9 is odd"),
])
def test_a_bad_value_or_combination_is_refused_in_one_line_naming_the_keys(make_cfg, override, message):
    with pytest.raises(ConfigError) as err:
        resolve(make_cfg(*override.split()))
    assert str(err.value) == message


def test_a_misspelt_option_names_its_choices():
    from minitrain.cli import check_overrides

    with pytest.raises(ConfigError) as err:
        check_overrides(["model.mlp=geglu"])
    assert str(err.value) == "model.mlp: one of ('gelu', 'relu2', 'swiglu'), got 'geglu'"


def test_float8s_filter_takes_the_modern_blocks_linears_by_the_same_names():
    """SwiGLU's gate and up projections are one linear (mlp.c_fc): torchao's filter sees the block's four linears,
    the widest two of them converted at gpt2-124m's width as for GPT-2's block."""
    from minitrain import fp8

    pytest.importorskip("torchao")
    cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, **MODERN)
    picked = fp8.float8_linears(cfg, Float8Recipe.tensorwise)
    assert set(picked) <= set(BLOCK_LINEARS) and "mlp.c_fc" in picked


# -- recomputation, compiled or not ----------------------------------------------------------------------------------

POLICIES = [CheckpointingConfig(CheckpointPolicy.none), CheckpointingConfig(CheckpointPolicy.full),
            CheckpointingConfig(CheckpointPolicy.every_k, every_k=2), CheckpointingConfig(CheckpointPolicy.selective)]


def policy_grads(options, policy, backend=None, autocast=False):
    model = wide(GPT(model_cfg(n_layer=3, **options)))
    apply_policy(model, policy, compiled=backend is not None)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))

    def loss_of(i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return F.cross_entropy(model(i).flatten(0, 1).float(), i.roll(-1, 1).flatten())

    (torch.compile(loss_of, backend=backend) if backend else loss_of)(idx).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("options, policy, backend, autocast", [
    *[(options, policy, None, autocast) for options in ("modern", "relu2")
      for policy, autocast in ((POLICIES[3], False), (POLICIES[3], True), (POLICIES[1], False))],
    ("modern", POLICIES[3], "aot_eager", False), ("modern-fused", POLICIES[3], None, False),
    ("modern-fused", POLICIES[3], "aot_eager", False)],
    ids=lambda v: getattr(getattr(v, "policy", None), "value", None) or str(v))
def test_every_policy_computes_the_gradients_of_no_checkpointing(options, policy, backend, autocast):
    """selective's eager path reruns the RMSNorms and the ReLU^2 / SwiGLU in its own backward (under autocast too:
    fp32 params, bf16 matmuls); compiled (aot_eager: Dynamo and AOTAutograd without Inductor), torch's selective
    checkpointing tags its ops and rope's and the q/k norms' are recomputed."""
    options = {"modern": dict(MODERN, n_embd=40), "relu2": dict(mlp=RELU2, qk_norm=True, position=ROPE),
               "modern-fused": FUSED_CASES["modern-fused"]}[options]
    want = policy_grads(options, POLICIES[0], autocast=autocast)
    got = policy_grads(options, policy, backend, autocast)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


# -- the soft-cap inside the fused loss --------------------------------------------------------------------------------

N, H, V = 47, 31, 123  # past the kernels' tiles in every dimension below; V a multiple of no block


def capped_inputs(seed, scale=40.0):
    """Logits in the hundreds (|z| up to ~400), a quarter of the rows ignored, targets in the first and last column."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g) * scale / H ** 0.5
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < 0.25] = -100
    targets[0], targets[1] = 0, V - 1
    return hidden, weight, targets


def capped_truth(logits, targets, cap, label_smoothing=0.0, z_loss=0.0):
    """Each row's loss (0 where ignored) of the soft-capped logits, by the definitions, in fp64."""
    capped = cap * torch.tanh(logits.double() / cap)
    losses = F.cross_entropy(capped, targets, reduction="none", label_smoothing=label_smoothing)
    return torch.where(targets != -100, losses + z_loss * capped.logsumexp(1) ** 2, 0.0), capped


@pytest.mark.parametrize("low_memory, reduction, cap", [(False, "mean", 30.0), (True, "mean", 1.5),
                                                        (False, "none", 1.5), (True, "none", 30.0)])
def test_the_fused_loss_soft_caps_inside_its_kernels(low_memory, reduction, cap):
    """Row chunks of 8 rows (6 of them, the last 7 rows) or, low_memory, two of 24 and vocab blocks of 16 columns
    (8, the last 11 wide): the loss and both gradients are those of the capped logits' cross-entropy;
    reduction="none" reruns the passes in backward with per-row factors. The PyTorch reference (loss.impl=torch)
    computes the same."""
    hidden, weight, targets = capped_inputs(1)
    grad_output = torch.rand(N, generator=torch.Generator().manual_seed(2)) if reduction == "none" else None
    kwargs = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-4)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    losses, _ = capped_truth(h @ w.T, targets, cap, 0.1, 1e-4)
    want = losses if reduction == "none" else losses.sum() / (targets != -100).sum()
    want.backward(None if grad_output is None else grad_output.double())
    chunk = 16 * N * 4 if low_memory else 8 * V * 4
    for fn, extra in ((fused_linear_cross_entropy, dict(chunk_bytes=chunk, low_memory=low_memory)),
                      (linear_cross_entropy_reference, {})):
        hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(hg, wg, targets, softcap=cap, **kwargs, **extra)
        loss.backward(grad_output)
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5, msg=fn.__name__)
        torch.testing.assert_close(hg.grad.double(), h.grad, rtol=1e-4, atol=1e-6, msg=fn.__name__)
        torch.testing.assert_close(wg.grad.double(), w.grad, rtol=1e-4, atol=1e-6, msg=fn.__name__)
    uncapped = fused_linear_cross_entropy(hidden, weight, targets, **kwargs)
    assert not torch.allclose(uncapped, want.float(), rtol=1e-2)  # the cap mattered at these logits


@pytest.mark.parametrize("block", [32, 256])  # rows of 123 columns streamed in four blocks (the last 27 wide), or one
def test_the_row_kernel_caps_every_column_and_leaves_the_masked_lanes_out(block):
    from minitrain.ops.cross_entropy_triton import cross_entropy_rows

    """Row 2's logits all lie below -50, all capped to about -5: were the lanes past V (filled with -inf) capped
    too, they would weigh in its log-sum-exp as much as a column does."""
    hidden, weight, targets = capped_inputs(3)
    logits = hidden @ weight.T
    logits[2], targets[2] = -logits[2].abs() - 50, 7
    scale = torch.rand(N, generator=torch.Generator().manual_seed(4))
    grad, losses, lse = logits.clone(), torch.empty(N), torch.empty(N)
    cross_entropy_rows(grad, targets, losses, lse, scale, ignore_index=-100, label_smoothing=0.1, z_loss=1e-4,
                       write_grad=True, softcap=5.0, programs=3, block=block)
    exact = logits.double().requires_grad_()
    want, capped = capped_truth(exact, targets, 5.0, 0.1, 1e-4)
    (scale.double() * want).sum().backward()
    valid = targets != -100
    torch.testing.assert_close(losses.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double()[valid], capped.detach().logsumexp(1)[valid], rtol=1e-6, atol=1e-6)
    # tanh' = 1 - (x / c)^2 from the capped fp32 logit: near saturation its absolute error is fp32's epsilon
    torch.testing.assert_close(grad.double(), exact.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tile", [(4, 32), None])
def test_the_gradient_blocks_cap_every_tile(tile):
    """Columns [23, 123) of every row, in 4 x 32 tiles (12 x 4 programs, the last of each partial) or the default."""
    from minitrain.ops.cross_entropy_triton import logit_grad_block

    hidden, weight, targets = capped_inputs(5)
    logits = hidden @ weight.T
    exact = logits.double().requires_grad_()
    want, capped = capped_truth(exact, targets, 5.0, 0.1, 1e-4)
    want.sum().backward()
    lse = torch.where(targets != -100, capped.detach().logsumexp(1), 0.0).float()
    col0 = 23
    block = logits[:, col0:].contiguous()
    logit_grad_block(block, col0, V, targets, lse, torch.tensor(1.0), ignore_index=-100, label_smoothing=0.1,
                     z_loss=1e-4, softcap=5.0, tile=tile)
    torch.testing.assert_close(block.double(), exact.grad[:, col0:], rtol=1e-4, atol=1e-6)


# -- through the trainer ---------------------------------------------------------------------------------------------

SMALL = ("model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=32", "trainer.batch_size=4",
         "trainer.eval_batches=1", "trainer.sample_tokens=0", "trainer.log_every=1", "trainer.eval_every=100",
         "trainer.save_every=100", "trainer.lr=3e-3")
SETS = {  # between them every option away from GPT-2's
    "modern": ("model.position=rope", "model.norm=rmsnorm", "model.qk_norm=true", "model.mlp=swiglu",
               "model.tie_head=false", "model.zero_init_proj=true", "model.logit_softcap=0.5", "model.bias=false"),
    "relu2": ("model.mlp=relu2", "model.qk_norm=true", "model.logit_softcap=0.5"),
    "qk-fused": ("model.position=rope", "model.qk_norm=true", "model.qk_kernel=fused"),  # the Triton op's road
}


def run_losses(make_cfg, tmp_path, name, *overrides, steps=3):
    t = Trainer(make_cfg(*SMALL, f"trainer.max_steps={steps}", f"trainer.out_dir={tmp_path / name}", *overrides),
                progress=False)
    losses = [t.train_step(step).item() for step in range(steps)]
    t.close()
    return t, losses


@pytest.mark.parametrize("options", list(SETS))
def test_every_option_trains_alike_under_every_checkpointing_policy(make_cfg, tmp_path, options):
    """Three steps, each policy computing the same losses and weights as none; the soft-cap (0.5, which the logits
    pass at once) reaches the loss through the trainer."""
    runs = {p: run_losses(make_cfg, tmp_path, p, *SETS[options], f"checkpointing={p}")
            for p in ("none", "full", "every_k", "selective")}
    (first, losses), weights = runs["none"], saved_weights(runs["none"][0])
    assert losses[-1] < losses[0], losses
    for policy, (t, got) in runs.items():
        assert got == pytest.approx(losses, rel=1e-5), policy
        for name, p in saved_weights(t).items():
            torch.testing.assert_close(p, weights[name], rtol=1e-4, atol=1e-6, msg=f"{policy} {name}")


def saved_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("precision, options", [(p, "modern") for p in ("bf16", "fp16", "amp_bf16", "fp8")]
                         + [(p, "qk-fused") for p in ("bf16", "fp16", "amp_bf16")])
def test_the_modern_block_trains_in_every_precision(make_cfg, tmp_path, monkeypatch, precision, options):
    """fp8: minitrain's float8 linears in every block linear (SwiGLU's c_fc too), the device check passed and the
    float8 GEMMs emulated on this CPU (torch._scaled_mm's values, multiplied in fp32)."""
    extra = ()
    if precision == "fp8":
        from minitrain import fp8

        monkeypatch.setattr(fp8, "unavailable_reason", lambda device: None)
        monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, scale_a, scale_b, bias=None, out_dtype=None:
                            ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype))
        extra = (f"precision.float8_linears=[{','.join(BLOCK_LINEARS)}]",)
    t, losses = run_losses(make_cfg, tmp_path, precision, *SETS[options], f"precision={precision}", *extra, steps=4)
    assert t.plan.float8_linears == (BLOCK_LINEARS if precision == "fp8" else ())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_the_fused_loss_in_the_trainer_caps_as_the_reference_does(make_cfg, tmp_path):
    """loss.impl=fused (the Triton kernels, interpreted) and torch give the soft-capped loss alike (a cap of 0.05,
    below the logits at init); uncapped, the same weights score another loss."""
    small = ("trainer.batch_size=2", "model.block_size=16", "model.logit_softcap=0.05")
    _, fused = run_losses(make_cfg, tmp_path, "fused", *SETS["relu2"], "loss.impl=fused", *small, steps=2)
    _, torch_loss = run_losses(make_cfg, tmp_path, "torch", *SETS["relu2"], "loss.impl=torch", *small, steps=2)
    _, uncapped = run_losses(make_cfg, tmp_path, "uncapped", *SETS["relu2"], *small, "model.logit_softcap=null",
                             steps=2)
    assert fused == pytest.approx(torch_loss, rel=1e-5)
    assert uncapped[0] != pytest.approx(fused[0], rel=1e-4)


def test_the_modern_preset_learns_resumes_bit_for_bit_and_refuses_a_changed_option(make_cfg, tmp_path, monkeypatch):
    """model=gpt2-124m-modern at a small width: the loss falls within eight steps (from ln V: the zeroed head), a
    run stopped after step 6 and resumed from its checkpoint at step 4 ends with the weights of an unbroken one (and
    samples, through the KV cache), and a resume with one option changed is refused naming it. The plan says which
    block it trains."""
    preset = ("model=gpt2-124m-modern", "model.vocab_size=null", "model.n_layer=2", "model.n_embd=64",
              "model.n_head=4", "model.block_size=32", "trainer.batch_size=4", "trainer.eval_batches=1",
              "trainer.sample_tokens=4", "trainer.log_every=1", "trainer.eval_every=100", "trainer.lr=3e-3")
    straight = Trainer(make_cfg(*preset, "trainer.max_steps=8", f"trainer.out_dir={tmp_path / 'straight'}"),
                       progress=False)
    assert "block          rope positions (base 10000), rmsnorm, qk_norm, relu2 MLP, untied head, zero-init " \
           "projections, logit soft-cap 30" in straight.plan.describe()
    straight.fit()
    losses = [r["train/loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if "train/loss" in r]
    assert losses[0] == pytest.approx(math.log(straight.plan.model.vocab_size), abs=1e-3)  # the zeroed head
    assert losses[-1] < losses[0] - 0.3, losses
    broken = (*preset, "trainer.max_steps=8", "trainer.save_every=4", f"trainer.out_dir={tmp_path / 'broken'}")
    crashing = Trainer(make_cfg(*broken), progress=False)
    real_step = crashing.parts.train_step

    def step_then_crash(step):
        if step == 6:
            raise RuntimeError("simulated crash")
        return real_step(step)

    monkeypatch.setattr(crashing.parts, "train_step", step_then_crash)
    with pytest.raises(RuntimeError, match="simulated"):
        crashing.fit()
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.qk_norm: saved True, now False"):
        Trainer(make_cfg(*broken, "trainer.resume=auto", "model.qk_norm=false"), progress=False)
    resumed = Trainer(make_cfg(*broken, "trainer.resume=auto"), progress=False)
    assert resumed.step == 4
    resumed.fit()
    want, got = saved_state(tmp_path / "straight" / "checkpoints" / "latest"), \
        saved_state(tmp_path / "broken" / "checkpoints" / "latest")
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])


def read_jsonl(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]
