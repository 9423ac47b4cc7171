import pytest
import torch

from minitrain.recompute import apply_policy, recompute_flops_per_token, recomputed_blocks
from minitrain.config import CheckpointingConfig, CheckpointPolicy, resolve
from minitrain.errors import ConfigError
from minitrain.model import GPT
from minitrain.model_config import KernelImpl, ModelConfig

POLICIES = [CheckpointingConfig(CheckpointPolicy.none), CheckpointingConfig(CheckpointPolicy.full),
            CheckpointingConfig(CheckpointPolicy.every_k, every_k=2), CheckpointingConfig(CheckpointPolicy.selective)]


def grads(policy: CheckpointingConfig, dropout: float, compile_backend=None, gelu=KernelImpl.auto,
          autocast=False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=dropout, gelu=gelu))
    apply_policy(model, policy, compiled=compile_backend is not None)
    idx = torch.randint(0, 64, (2, 16))

    def loss_of(i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return torch.nn.functional.cross_entropy(model(i).flatten(0, 1).float(), i.roll(-1, 1).flatten())

    if compile_backend:
        loss_of = torch.compile(loss_of, backend=compile_backend)
    torch.manual_seed(1)  # the dropout masks: checkpointing must replay the same ones
    loss_of(idx).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.policy.value)
def test_gradients_equal_no_checkpointing(policy, dropout):
    reference, got = grads(POLICIES[0], dropout), grads(policy, dropout)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("gelu, autocast", [(KernelImpl.fused, False), (KernelImpl.torch, True)])
def test_selective_gradients_with_the_fused_gelu_and_under_autocast(gelu, autocast):
    """selective runs its own backward for the norms, the GELU (Triton's or torch's) and their linear
    layers, in the dtypes autocast gave their forward (fp32 params, bf16 matmuls)."""
    reference, got = (grads(p, 0.0, gelu=gelu, autocast=autocast) for p in (POLICIES[0], POLICIES[3]))
    for name in reference:
        assert got[name].dtype == reference[name].dtype == torch.float32
        torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.policy.value)
def test_policies_trace_under_torch_compile(policy):
    # aot_eager: Dynamo + AOTAutograd (where checkpoint regions are handled) without Inductor's codegen.
    reference, got = grads(POLICIES[0], 0.0), grads(policy, 0.0, compile_backend="aot_eager")
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_which_blocks_recompute():
    assert recomputed_blocks(POLICIES[2], 5) == [False, True, False, True, False]
    assert recomputed_blocks(CheckpointingConfig(CheckpointPolicy.every_k, every_k=1), 3) == [True] * 3
    assert recomputed_blocks(POLICIES[3], 3) == [False] * 3  # selective reruns no whole block


def test_recompute_flops():
    cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
    block = 24 * 768 ** 2 + 4 * 768 * 1024
    assert recompute_flops_per_token(cfg, POLICIES[0], 1024) == 0
    assert recompute_flops_per_token(cfg, POLICIES[1], 1024) == 12 * block
    assert recompute_flops_per_token(cfg, POLICIES[2], 1024) == 6 * block
    assert recompute_flops_per_token(cfg, POLICIES[3], 1024) == 0


@pytest.mark.parametrize("k", [0, 5])
def test_bad_every_k_fails_at_start(make_cfg, k):
    with pytest.raises(ConfigError, match="checkpointing.every_k"):
        resolve(make_cfg("checkpointing=every_k", f"checkpointing.every_k={k}", "model.n_layer=4"))


@pytest.mark.parametrize("name", ["every_k", "selective"])
def test_config_group_has_the_policy(make_cfg, name):
    assert resolve(make_cfg(f"checkpointing={name}")).checkpointing.policy == CheckpointPolicy(name)
