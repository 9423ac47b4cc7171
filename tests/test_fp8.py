"""precision=fp8: the option, the plan's refusal, which linears torchao converts, what they compute and save, and
whole runs (every checkpointing policy, compiled, resumed, ddp and fsdp).

torch._scaled_mm runs on the CPU too (torch 2.13), so torchao's Float8Linear computes here for real. The tests of
whole runs pass the plan's device check on a CPU and emulate the float8 GEMMs there (`float8_trainers`); on a GPU
with fp8 tensor cores the ones on the `fp8_trainers` fixture run torchao's real kernels, compiled with CUDA graphs
(`scripts/gpu_suite.sh OUT fp8_tests` picks them). The rest are CPU tests wherever they run: they count the bytes
of CPU tensors and run our Triton kernels through the interpreter (so never under MINITRAIN_TEST_DEVICE=cuda).
"""

import gc
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from minitrain import checkpoint, fp8
from minitrain import plan as plan_module
from minitrain.cli import compose_config
from minitrain.config import BLOCK_LINEARS, CheckpointingConfig, CheckpointPolicy, Float8Kernels, Float8Recipe, resolve
from minitrain.errors import ConfigError
from minitrain.memory import GB, Candidate, _float8_saved_delta, _minitrain_float8_block_delta, predict
from minitrain.model import GPT, Block
from minitrain.model_config import KernelImpl, MlpActivation, ModelConfig
from minitrain.ops import Float8Linear as MinitrainFloat8Linear, fused_linear_cross_entropy
from minitrain.optim import AdamW, Numerics
from minitrain.optim.dtensor import _is_float8_all_gather_weight
from minitrain.plan import PlanError, make_plan
from minitrain.precision import preset, resolve_precision
from minitrain.recompute import apply_policy
from minitrain.tools.benchmarks import fp8 as bench_fp8
from minitrain.tools.live_bytes import LiveBytes
from minitrain.tools.report import read_step_records
from minitrain.trainer import RunInfo, Trainer

from conftest import REPO, train_steps

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

CPU = torch.device("cpu")
ALL = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
GPT2_124M = ("attn.c_attn", "mlp.c_fc")  # what torchao's tensorwise filter converts at width 768 (and 1024)
MINITRAIN_FP8 = resolve_precision(preset("fp8"), CPU)
FP8 = replace(MINITRAIN_FP8, float8_kernels=Float8Kernels.torchao)  # what the torchao models below run
BF16 = resolve_precision(preset("bf16"), CPU)


GELU, RELU2, SWIGLU = MlpActivation.gelu, MlpActivation.relu2, MlpActivation.swiglu


def model_cfg(n_embd=64, n_layer=2, gelu=KernelImpl.torch, block_size=32, vocab_size=512, mlp=GELU):
    """mlp=swiglu: a hidden width of 8/3 n_embd (192 at 64), c_fc's output twice that, not GELU's 4 n_embd."""
    return ModelConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size,
                       gelu=gelu, mlp=mlp)


def bf16_model(cfg, linears=(), seed=0, kernels=Float8Kernels.torchao):
    torch.manual_seed(seed)
    model = GPT(cfg).to(torch.bfloat16)
    fp8.convert(model.blocks, linears, Float8Recipe.tensorwise, kernels)
    return model


def emulated_float8_config(recipe, fsdp_all_gather=False):
    """torch._scaled_mm's CPU kernel takes a second for a 512x128x512 GEMM: torchao's emulation multiplies the same
    float8 values in fp32 (torch.mm), for the tests that train whole models."""
    return replace(REAL_FLOAT8_CONFIG(recipe, fsdp_all_gather), emulate=True)


REAL_FLOAT8_CONFIG = fp8.float8_config


def emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None):
    """torch._scaled_mm as torchao emulates it: the same float8 values multiplied in fp32."""
    product = (a.float() * scale_a) @ (b.float() * scale_b)
    return (product if bias is None else product + bias.float()).to(out_dtype)


def float8_trainers(patch, device):
    """`patch(module, name, value)`: every linear of the small test models converted (torchao's filter finds them
    too narrow to gain); where `device` cannot multiply in float8 (a CPU), the plan's device check passed and the
    float8 GEMMs emulated."""
    patch(fp8, "float8_linears", lambda cfg, recipe: ALL if recipe != Float8Recipe.none else ())
    if fp8.unavailable_reason(device) is not None:
        patch(fp8, "unavailable_reason", lambda device: None)
        patch(fp8, "float8_config", emulated_float8_config)
        patch(torch, "_scaled_mm", emulated_scaled_mm)  # minitrain's float8 linear


@pytest.fixture
def fp8_trainers(monkeypatch):
    """For trainers on the device `trainer.device=auto` picks."""
    float8_trainers(monkeypatch.setattr, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


# -- the option and the plan -------------------------------------------------------------------------------------
def test_fp8_composes_as_bf16_with_float8_linears_and_auto_never_picks_it(monkeypatch):
    for name, recipe, kernels in (("fp8", Float8Recipe.tensorwise, "minitrain"),
                                  ("fp8_rowwise", Float8Recipe.rowwise, "torchao")):
        cfg = resolve(compose_config(["trainer.out_dir=.", f"precision={name}"]))
        p = resolve_precision(cfg.precision, CPU)
        assert (p.name, p.float8, p.float8_kernels.value, p.param_dtype, p.master_weights, p.loss_scaling) == \
            (name, recipe, kernels, torch.bfloat16, True, False)
        assert p.describe() == f"bf16 params, fp32 masters, float8 matmuls ({recipe.value} scales, {kernels}'s kernels)"
    auto = resolve(compose_config(["trainer.out_dir=."])).precision
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision(auto, torch.device("cuda")).float8 == Float8Recipe.none
    with pytest.raises(ConfigError, match="^precision.float8: precision=auto chooses it per device"):
        resolve_precision(resolve(compose_config(["trainer.out_dir=.", "precision.float8=tensorwise"])).precision,
                          CPU)
    with pytest.raises(ConfigError, match="^precision.float8: float8 matmuls cast from bf16 params.*fp16"):
        resolve(compose_config(["trainer.out_dir=.", "precision=fp16", "precision.float8=tensorwise"]))
    theirs = resolve_precision(resolve(compose_config(["trainer.out_dir=.", "precision=fp8",
                                                       "precision.float8_kernels=torchao"])).precision, CPU)
    assert theirs.describe() == "bf16 params, fp32 masters, float8 matmuls (tensorwise scales, torchao's kernels)"
    with pytest.raises(ConfigError, match="^precision.float8_kernels: minitrain's float8 kernels scale per tensor"):
        resolve(compose_config(["trainer.out_dir=.", "precision=fp8_rowwise", "precision.float8_kernels=minitrain"]))


def plan_on(device, *overrides, monkeypatch, capability=(9, 0), torchao=True):
    monkeypatch.setattr(plan_module, "device_memory", lambda device: int(141 * GB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if not torchao:
        real = fp8.importlib.util.find_spec
        monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    return make_plan(resolve(compose_config(["trainer.out_dir=.", *overrides])), 50257, device)


def test_the_plan_refuses_fp8_where_it_cannot_run_in_one_line(monkeypatch):
    cuda = torch.device("cuda")  # only its type is read; the capability is faked
    cases = [(CPU, {}, "float8 matmuls need an NVIDIA GPU with fp8 tensor cores .* not a CPU"),
             (cuda, {"capability": (8, 0)}, r"NVIDIA H200 \(compute capability 8.0\) has no fp8 tensor cores"),
             (cuda, {"torchao": False},
              r"float8 training runs on torchao, which is not installed: pip install 'minitrain\[fp8\]'")]
    assert plan_on(cuda, "model=gpt2-124m", "precision=fp8", monkeypatch=monkeypatch, capability=(8, 9)).float8_linears
    for device, fakes, reason in cases:
        with pytest.raises(PlanError, match=f"^precision=fp8: {reason}") as refused:
            plan_on(device, "model=gpt2-124m", "precision=fp8", monkeypatch=monkeypatch, **fakes)
        assert "\n" not in str(refused.value)


def test_the_plan_names_the_linears_torchao_converts(monkeypatch):
    cuda = torch.device("cuda")
    small = plan_on(cuda, "model=gpt2-124m", "precision=fp8", monkeypatch=monkeypatch)
    assert small.float8_linears == GPT2_124M and not small.float8_all_gather
    assert ("float8 matmuls (tensorwise scales, minitrain's kernels) in each block's attn.c_attn, mlp.c_fc"
            in small.describe())
    assert small.as_dict()["float8_linears"] == list(GPT2_124M) and small.as_dict()["float8"] == "tensorwise"
    assert plan_on(cuda, "model=gpt2-1.5b", "precision=fp8", "trainer.batch_size=16",
                   monkeypatch=monkeypatch).float8_linears == ALL
    assert plan_on(cuda, "model=gpt2-1.5b", "precision=fp8_rowwise", "trainer.batch_size=16",
                   monkeypatch=monkeypatch).float8_linears == ("attn.c_attn", "mlp.c_fc")
    narrow = plan_on(cuda, "model=tiny", "precision=fp8", monkeypatch=monkeypatch)
    assert narrow.float8_linears == () and any("every matmul runs in bf16" in n for n in narrow.notes)
    assert plan_on(cuda, "model=gpt2-124m", "precision=bf16", monkeypatch=monkeypatch).float8_linears == ()


def test_precision_float8_linears_names_them_in_place_of_torchaos_filter(monkeypatch):
    """The user's list, checked where the config is read, in the block's order, even where the filter takes none;
    without float8 it is not read."""
    block = Block(resolve(compose_config(["trainer.out_dir=.", "model=tiny"])).model)
    assert BLOCK_LINEARS == ALL == tuple(name for name, m in block.named_modules() if isinstance(m, torch.nn.Linear))
    cuda = torch.device("cuda")
    assert plan_on(cuda, "model=gpt2-350m", "precision=fp8", monkeypatch=monkeypatch).float8_linears == GPT2_124M
    chosen = plan_on(cuda, "model=gpt2-350m", "precision=fp8", "precision.float8_linears=[mlp.c_proj,attn.c_attn]",
                     monkeypatch=monkeypatch)
    assert chosen.float8_linears == ("attn.c_attn", "mlp.c_proj") and "in each block's attn.c_attn, mlp.c_proj" in \
        chosen.describe()
    assert plan_on(cuda, "model=tiny", "precision=fp8", "precision.float8_linears=[mlp.c_proj]",
                   monkeypatch=monkeypatch).float8_linears == ("mlp.c_proj",)
    # a sweep over precision=bf16,fp8 sets it for both cells: bf16's does not read it
    assert plan_on(cuda, "model=gpt2-350m", "precision=bf16", "precision.float8_linears=[mlp.c_proj]",
                   monkeypatch=monkeypatch).float8_linears == ()
    with pytest.raises(PlanError, match="^precision.float8_linears: float8 GEMMs need dimensions in multiples of 16, "
                                        "and tiny has n_embd=120$"):
        plan_on(cuda, "model=tiny", "model.n_embd=120", "precision=fp8",
                "precision.float8_linears=[mlp.c_proj]", monkeypatch=monkeypatch)
    for overrides, reason in (
            (["precision=fp8", "precision.float8_linears=[attn.c_attn,mlp.fc]"],
             "'mlp.fc' is not one of a block's linears: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj"),
            (["precision=fp8", "precision.float8_linears=[]"], "is empty: every matmul in bf16 is precision=bf16")):
        with pytest.raises(ConfigError, match=f"^precision.float8_linears: {re.escape(reason)}$"):
            resolve(compose_config(["trainer.out_dir=.", *overrides]))


def test_fsdp_gathers_tensorwise_float8_weights_in_float8_unless_told_not_to(monkeypatch):
    cuda = torch.device("cuda")
    args = ("model=gpt2-124m", "distributed=fsdp", "trainer.compile_mode=default")
    torchao = ("precision=fp8", "precision.float8_kernels=torchao")
    assert plan_on(cuda, *args, *torchao, monkeypatch=monkeypatch).float8_all_gather
    assert not plan_on(cuda, *args, *torchao, "distributed.fsdp_float8_all_gather=false",
                       monkeypatch=monkeypatch).float8_all_gather
    assert not plan_on(cuda, "model=gpt2-1.5b", "distributed=fsdp", "trainer.compile_mode=default",
                       "precision=fp8_rowwise", monkeypatch=monkeypatch).float8_all_gather  # tensorwise only
    assert not plan_on(cuda, "model=gpt2-124m", "precision=fp8", monkeypatch=monkeypatch).float8_all_gather
    assert not plan_on(cuda, *args, "precision=fp8", monkeypatch=monkeypatch).float8_all_gather  # torchao's only


def test_train_py_stops_an_fp8_run_on_a_cpu_with_exit_2_and_one_line(data_cache, tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "precision=fp8", "trainer.device=cpu",
                          f"data.cache_dir={data_cache}", "logger.mode=disabled"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1].startswith("error: precision=fp8: float8 matmuls need an NVIDIA GPU")


# -- the conversion and what it computes ---------------------------------------------------------------------------
@pytest.mark.parametrize("kernels, linear", [(Float8Kernels.torchao, Float8Linear),
                                             (Float8Kernels.minitrain, MinitrainFloat8Linear)])
def test_convert_swaps_exactly_the_named_linears_and_keeps_every_parameter(kernels, linear):
    cfg = model_cfg()
    model = bf16_model(cfg)
    before, groups = dict(model.named_parameters()), [[id(p) for p in g["params"]] for g in model.param_groups(0.1)]
    fp8.convert(model.blocks, GPT2_124M, Float8Recipe.tensorwise, kernels)
    swapped = {name for name, m in model.named_modules() if isinstance(m, linear)}
    assert swapped == {f"blocks.{i}.{name}" for i in range(cfg.n_layer) for name in GPT2_124M}
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # the optimizer's tensors
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.bfloat16 for p in after.values())
    assert [[id(p) for p in g["params"]] for g in model.param_groups(0.1)] == groups  # decay groups unchanged


def test_float8_forward_and_gradients_are_bf16s_within_float8_rounding():
    cfg = model_cfg(n_embd=128, n_layer=1)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1))
    outputs = {}
    for name, linears in (("bf16", ()), ("fp8", ALL)):
        model = bf16_model(cfg, linears)
        hidden = model.forward_hidden(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        outputs[name] = (hidden.float(), loss.item(), {k: p.grad.float() for k, p in model.named_parameters()})
    (h16, l16, g16), (h8, l8, g8) = outputs["bf16"], outputs["fp8"]
    relative = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert 1e-4 < relative(h8, h16) < 0.05  # float8 rounding: present, and small
    assert abs(l8 - l16) < 0.01
    for k in g16:
        assert relative(g8[k], g16[k]) < 0.15, k
    w = "blocks.0.mlp.c_fc.weight"
    assert relative(g8[w], g16[w]) > 1e-4  # the weight gradient's GEMM ran in float8 too


# -- the memory model's float8 terms ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["none", "every_k", "selective"])
def test_eager_float8_blocks_save_what_bf16_ones_do(policy):
    """torchao keeps each linear's bf16 input, as a bf16 linear does; selective falls back to torch's save tags."""
    cfg, B, T = model_cfg(), 8, 32
    ckpt = CheckpointingConfig(CheckpointPolicy[policy])
    held = {}
    for linears in ((), ALL):
        model = bf16_model(cfg, linears)
        apply_policy(model, ckpt)
        with LiveBytes() as live:
            hidden = model.forward_hidden(torch.randint(0, cfg.vocab_size, (B, T)))
        est = predict(Candidate(cfg, FP8 if linears else BF16, B, ckpt, loss_impl="torch", device="cpu",
                                float8_linears=linears))
        assert est.activations_total + hidden.nbytes == live.current, (policy, linears)
        held[linears] = live.current
    if policy != "selective":
        assert held[()] == held[ALL]


@pytest.mark.parametrize("policy", ["none", "every_k", "selective", "full"])
@pytest.mark.parametrize("linears, gelu, mlp", [(ALL, KernelImpl.torch, GELU), (ALL, KernelImpl.fused, GELU),
                                                (GPT2_124M, KernelImpl.fused, GELU), (ALL, KernelImpl.torch, SWIGLU)])
def test_minitrain_float8_blocks_save_what_the_model_says(policy, linears, gelu, mlp):
    """Each linear keeps its input's and its weight's transposed float8 copies; a kept block frees the bf16 inputs
    (the norms' and the activation's outputs, mlp.c_proj's SwiGLU's narrower one) it held for bf16 linears."""
    cfg, B, T = model_cfg(gelu=gelu, mlp=mlp), 8, 32
    ckpt = CheckpointingConfig(CheckpointPolicy[policy])
    model = bf16_model(cfg, linears, kernels=Float8Kernels.minitrain)
    apply_policy(model, ckpt)
    with LiveBytes() as live:
        hidden = model.forward_hidden(torch.randint(0, cfg.vocab_size, (B, T)))
        gc.collect()  # the checkpoint's frames free the custom ops' outputs through reference cycles
    est = predict(Candidate(cfg, MINITRAIN_FP8, B, ckpt, loss_impl="torch", device="cpu", float8_linears=linears))
    assert est.activations_total + hidden.nbytes == live.current


@pytest.mark.parametrize("linears, gelu, mlp", [(GPT2_124M, KernelImpl.fused, GELU), (ALL, KernelImpl.fused, GELU),
                                                (ALL, KernelImpl.torch, GELU), (ALL, KernelImpl.torch, SWIGLU)])
def test_compiled_minitrain_float8_blocks_save_what_eager_ones_do(linears, gelu, mlp):
    """The float8 op is opaque to Inductor: the partitioner keeps its float8 copies and frees the bf16 inputs."""
    cfg, B = model_cfg(gelu=gelu, n_layer=1, mlp=mlp), 8
    N = B * cfg.block_size
    measured = compiled_block_saves(cfg, linears, B, Float8Kernels.minitrain) - compiled_block_saves(cfg, (), B)
    # beside the modelled bytes: the norms' statistics, which the bf16 block saves in bf16 on a CPU (8 bytes a token)
    modelled = _minitrain_float8_block_delta(cfg, linears, N, 2, True, "kept")
    assert abs(measured - modelled) <= 8 * N, (measured - modelled) / N


def compiled_block_saves(cfg, linears, B=8, kernels=Float8Kernels.torchao):
    """Bytes the compiled block saves for backward, beyond its input and the parameters (pack hooks see them). Each
    block compiled afresh: Block.forward's earlier graphs would count towards dynamo's recompile limit, past which
    it runs eagerly."""
    model = bf16_model(cfg, linears, kernels=kernels)
    torch.compiler.reset()
    block = torch.compile(model.blocks[0])
    x = torch.randn(B, cfg.block_size, cfg.n_embd, dtype=torch.bfloat16, requires_grad=True)
    known = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(saved.values())


@pytest.mark.parametrize("linears, gelu, mlp", [(GPT2_124M, KernelImpl.fused, GELU), (ALL, KernelImpl.fused, GELU),
                                                (ALL, KernelImpl.torch, GELU), (ALL, KernelImpl.fused, RELU2),
                                                (ALL, KernelImpl.torch, SWIGLU)])
def test_compiled_float8_blocks_save_what_the_model_says(linears, gelu, mlp):
    """Inductor's partitioner recomputes the norms' outputs and keeps GELU's in float8 (our kernel) or not at all;
    ReLU^2's and SwiGLU's (torch's ops, whatever model.gelu says) it recomputes."""
    cfg, B = model_cfg(gelu=gelu, n_layer=1, mlp=mlp), 8
    N, C = B * cfg.block_size, cfg.n_embd
    measured = compiled_block_saves(cfg, linears, B) - compiled_block_saves(cfg, (), B)
    # beside the modelled bytes: the casts' 0-d scales, and the norms' statistics, which the bf16 block saves in
    # bf16 on a CPU (8 bytes a token)
    assert abs(measured - _float8_saved_delta(cfg, linears, N, 2)) <= 8 * N + 256, measured / (N * C)


@pytest.mark.parametrize("policy, linears, mlp", [("none", ALL, GELU), ("none", GPT2_124M, GELU), ("full", ALL, GELU),
                                                 ("selective", ALL, GELU), ("none", ALL, SWIGLU)])
def test_eager_float8_steps_peak_where_the_model_says(policy, linears, mlp):
    """Model, optimizer and two steps under LiveBytes: the casts' fp32 temporaries in the MLP's backward set the
    peak (SwiGLU's: c_fc's output twice its hidden width)."""
    cfg, B, T = model_cfg(n_embd=32, vocab_size=128, mlp=mlp), 32, 32  # small: the real float8 GEMMs, slow on a CPU
    ckpt = CheckpointingConfig(CheckpointPolicy[policy])
    with LiveBytes() as live:
        model = bf16_model(cfg, linears)
        apply_policy(model, ckpt)
        opt = AdamW(model.param_groups(0.1), impl="foreach", numerics=Numerics(master_weights=True))
        train_steps(model, opt, fused_linear_cross_entropy, B, T)
    est = predict(Candidate(cfg, FP8, B, ckpt, optimizer_impl="foreach", device="cpu", float8_linears=linears))
    assert est.peak == pytest.approx(live.peak, rel=0.05)
    assert est.backward_transient > est.loss_workspace  # the casts set the predicted peak: the check is theirs


def test_float8_all_gather_halves_the_gathered_weights_of_the_converted_linears():
    cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
    kw = dict(world_size=2, sharded=True, fsdp_unit_blocks=2, float8_linears=GPT2_124M)
    no_recompute = CheckpointingConfig(CheckpointPolicy.none)
    bf16, fp8_gather = (predict(Candidate(cfg, FP8, 16, no_recompute, float8_all_gather=g, **kw))
                        for g in (False, True))
    C = cfg.n_embd
    assert bf16.gathered - fp8_gather.gathered == 4 * (3 * C * C + 4 * C * C)  # 4 blocks' c_attn, c_fc: 2 -> 1 B
    assert fp8_gather.state == bf16.state


# -- whole runs on the CPU -------------------------------------------------------------------------------------------
def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class Crash(Exception):
    pass


def crash_at(trainer, step):
    real_step = trainer.parts.train_step

    def step_then_crash(s):
        if s == step:
            raise Crash
        return real_step(s)

    trainer.parts.train_step = step_then_crash


def test_an_fp8_run_trains_ordinary_bf16_parameters_as_bf16_does_and_resumes_bit_for_bit(make_cfg, tmp_path,
                                                                                         fp8_trainers, monkeypatch):
    overrides = ("trainer.batch_size=4", "model.block_size=32", "trainer.max_steps=4", "trainer.save_every=2",
                 "trainer.log_every=2", "trainer.eval_every=4", "trainer.sample_tokens=0", "trainer.deterministic=true",
                 "precision.float8_kernels=torchao")
    straight = Trainer(make_cfg("precision=fp8", *overrides, f"trainer.out_dir={tmp_path / 'straight'}"),
                       progress=False)
    assert straight.plan.float8_linears == ALL
    assert sum(isinstance(m, Float8Linear) for m in straight.model.modules()) == 4 * straight.model.cfg.n_layer
    owned = [p for b in straight.optimizer.buckets for p in b.owners]
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.bfloat16 for p in owned)
    fp8_record = straight.fit()
    bf16_record = Trainer(make_cfg("precision=bf16", *overrides, f"trainer.out_dir={tmp_path / 'bf16'}"),
                          progress=False).fit()
    assert fp8_record["train/loss"] == pytest.approx(bf16_record["train/loss"], abs=0.05)
    assert fp8_record["train/loss"] != bf16_record["train/loss"]  # float8 did compute

    crashed = Trainer(make_cfg("precision=fp8", *overrides, f"trainer.out_dir={tmp_path / 'crashed'}"),
                      progress=False)
    crash_at(crashed, 3)
    with pytest.raises(Crash):
        crashed.fit()
    resumed = Trainer(make_cfg("precision=fp8", *overrides, f"trainer.out_dir={tmp_path / 'crashed'}",
                               "trainer.resume=auto"), progress=False)
    assert resumed.step == 2
    resumed.fit()
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(checkpoint.CheckpointError, match=r"precision.float8: saved tensorwise, now none"):
        Trainer(make_cfg("precision=bf16", *overrides, f"trainer.out_dir={tmp_path / 'crashed'}",
                         "trainer.resume=auto"), progress=False)
    # torchao's filter, moved by an upgrade between the crash and the resume, would convert other linears
    monkeypatch.setattr(fp8, "float8_linears", lambda cfg, recipe: GPT2_124M)
    with pytest.raises(checkpoint.CheckpointError, match=r"plan.float8_linears: saved \['attn.c_attn', 'attn.c_proj', "):
        Trainer(make_cfg("precision=fp8", *overrides, f"trainer.out_dir={tmp_path / 'crashed'}",
                         "trainer.max_steps=6", "trainer.resume=auto"), progress=False)


# Eager and deterministic: the policies' runs must end with the same bits (compiled, Inductor fuses each policy's
# graph its own way; on a GPU, attention's backward adds in any order without trainer.deterministic).
LEARNING = ("trainer.batch_size=8", "model.block_size=32", "trainer.max_steps=24", "trainer.lr=2e-3",
            "trainer.warmup_steps=2", "trainer.log_every=4", "trainer.eval_every=12", "trainer.eval_batches=2",
            "trainer.save_every=100", "trainer.sample_tokens=0", "trainer.compile=false", "trainer.deterministic=true")


def test_fp8_learns_as_bf16_does_and_every_checkpointing_policy_computes_the_same_run(make_cfg, tmp_path,
                                                                                      fp8_trainers):
    """Recomputation reruns the same float8 casts: each policy ends with the bits of no checkpointing (eager
    selective falls back to save tags around torchao's linears). The runs are read as the fp8 benchmark reads a
    sweep's cells."""
    def run(name, *overrides):
        trainer = Trainer(make_cfg(*LEARNING, *overrides, f"trainer.out_dir={tmp_path / name}"),
                          run=RunInfo(overrides=list(overrides)), progress=False)
        trainer.fit()
        return trainer

    bf16 = run("bf16", "precision=bf16", "checkpointing=none")
    policies = {p: run(p, "precision=fp8", "precision.float8_kernels=torchao", f"checkpointing={p}")
                for p in ("none", "full", "every_k", "selective")}
    assert {p: t.plan.checkpointing.policy.value for p, t in policies.items()} == {p: p for p in policies}
    reference = params(policies["none"])
    for policy, trainer in policies.items():
        assert all(torch.equal(v, reference[k]) for k, v in params(trainer).items()), policy

    runs = {name: bench_fp8.read_run(tmp_path / name) for name in ("bf16", "none")}
    (b16, f8) = (read_step_records(tmp_path / name / "metrics.jsonl") for name in ("bf16", "none"))
    losses = {name: [r["train/loss"] for r in records if "train/loss" in r] for name, records in
              (("bf16", b16), ("fp8", f8))}
    assert losses["bf16"][-1] < 7.0 and losses["fp8"][-1] < 7.0  # they learn (chance: ln(4096) = 8.3)
    assert max(abs(a - b) for a, b in zip(losses["fp8"], losses["bf16"])) < 0.05
    assert losses["fp8"] != losses["bf16"]  # float8 rounding, present
    assert (runs["none"]["precision"], runs["none"]["seed"], runs["none"]["skipped"], runs["none"]["finite"]) == \
        ("fp8", 1337, 0, True)
    val = {name: {r["step"]: r["val/loss"] for r in records if "val/loss" in r} for name, records in
           (("bf16", b16), ("fp8", f8))}
    assert runs["none"]["val"] == val["fp8"] and sorted(val["fp8"]) == [12, 24]
    gaps = bench_fp8.relative_gaps(runs["none"], runs["bf16"])
    assert gaps == {s: val["fp8"][s] / val["bf16"][s] - 1 for s in (12, 24)}
    assert f"fp8 precision.float8_kernels=torchao: final validation loss against bf16's of the same seed: " \
           f"{gaps[24]:+.2%}" in \
        bench_fp8.quality_report(list(runs.values()))


def test_minitrain_float8_kernels_train_as_torchaos_and_every_checkpointing_policy_computes_the_same_run(
        make_cfg, tmp_path, fp8_trainers):
    """The same recipe through either kernels trains the same (torchao's learning is tested above); recomputation
    reruns the same casts, so each policy ends with the bits of no checkpointing (eager selective runs on save tags
    that keep the float8 op's outputs)."""
    def run(name, *overrides):
        trainer = Trainer(make_cfg(*LEARNING, "precision=fp8", "trainer.max_steps=8", "trainer.eval_every=8",
                                   *overrides, f"trainer.out_dir={tmp_path / name}"), progress=False)
        trainer.fit()
        return trainer

    torchao = run("torchao", "precision.float8_kernels=torchao", "checkpointing=none")
    policies = {p: run(p, f"checkpointing={p}") for p in ("none", "full", "selective")}  # minitrain's, the default
    assert all(isinstance(m, MinitrainFloat8Linear) for t in policies.values() for m in t.model.modules()
               if isinstance(m, torch.nn.Linear))
    reference = params(policies["none"])
    for policy, trainer in policies.items():
        assert all(torch.equal(v, reference[k]) for k, v in params(trainer).items()), policy
    losses = {name: [r["train/loss"] for r in read_step_records(tmp_path / name / "metrics.jsonl")
                     if "train/loss" in r] for name in ("torchao", "none")}
    assert len(losses["none"]) == 2 and losses["none"] != losses["torchao"]
    assert max(abs(a - b) for a, b in zip(losses["none"], losses["torchao"])) < 0.02


@pytest.mark.parametrize("kernels", list(Float8Kernels))
@pytest.mark.parametrize("policy", ["none", "every_k", "selective", "full"])
def test_an_fp8_run_compiles_with_every_checkpointing_policy_and_passes_the_compile_check(make_cfg, fp8_trainers,
                                                                                          policy, kernels):
    """selective compiled runs on save tags; full and every_k recompute blocks through torch.utils.checkpoint."""
    trainer = Trainer(make_cfg("precision=fp8", f"precision.float8_kernels={kernels.value}", "trainer.compile=true",
                               f"checkpointing={policy}", "trainer.max_steps=2", "trainer.batch_size=4",
                               "model.block_size=32", "trainer.sample_tokens=0"), progress=False)
    linear = {Float8Kernels.torchao: Float8Linear, Float8Kernels.minitrain: MinitrainFloat8Linear}[kernels]
    assert sum(isinstance(m, linear) for m in trainer.model.modules()) == 4 * trainer.model.cfg.n_layer
    trainer.fit()  # the compile check raises if the compiled float8 step computes another function
    assert "compile check: first-step loss" in (trainer.out_dir / "train.log").read_text()


# -- ddp and fsdp on the CPU (gloo) --------------------------------------------------------------------------------
WORLD = 2


def worker(rank, port, jobs, results_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from minitrain import distributed

    float8_trainers(setattr, CPU)  # as the fp8_trainers fixture, in this spawned process
    torch.set_num_threads(1)
    for name, job in jobs.items():
        trainer = Trainer(compose_config(job["overrides"]), progress=False)
        if job.get("crash_at"):
            crash_at(trainer, job["crash_at"])
        try:
            trainer.fit()
        except Crash:
            torch.save({"crashed_at": trainer.step}, f"{results_dir}/{name}.rank{rank}.pt")
            continue
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
                   for k, v in trainer.model.state_dict().items()}
        float8_weights = sum(_is_float8_all_gather_weight(getattr(p, "_local_tensor", p))
                             for p in trainer.model.parameters())
        ours = sum(isinstance(m, MinitrainFloat8Linear) for m in trainer.model.modules())
        torch.save({"params": weights, "float8_all_gather_weights": float8_weights, "minitrain_linears": ours},
                   f"{results_dir}/{name}.rank{rank}.pt")
    distributed.teardown(finished=True)


def test_fp8_under_ddp_and_fsdp_matches_one_process_and_fsdp_resumes(data_cache, tmp_path, monkeypatch):
    import json
    import socket

    float8_trainers(monkeypatch.setattr, CPU)  # on gloo, so on the CPU, as the workers (a GPU machine too)

    def overrides(out, *extra, kernels="torchao"):
        return [f"data.cache_dir={data_cache}", f"trainer.out_dir={tmp_path / out}", "logger.mode=disabled",
                "precision=fp8", f"precision.float8_kernels={kernels}", "trainer.batch_size=8", "model.block_size=16", "trainer.max_steps=4",
                "trainer.log_every=1", "trainer.eval_every=4", "trainer.save_every=2", "trainer.eval_batches=1",
                "trainer.sample_tokens=0", "trainer.warmup_steps=2", "distributed.timeout_s=60", "trainer.device=cpu",
                *extra]

    unstepped = Trainer(compose_config(overrides("initial")), progress=False)
    initial = params(unstepped)
    unstepped.close()
    single = Trainer(compose_config(overrides("single")), progress=False)
    single.fit()
    single_update = {k: v.float() - initial[k].float() for k, v in params(single).items()}
    jobs = {"ddp": {"overrides": overrides("ddp", "distributed=ddp")},
            "fsdp": {"overrides": overrides("fsdp", "distributed=fsdp", "optimizer.impl=fused")},
            "fsdp_bf16_gather": {"overrides": overrides("fsdp_bf16_gather", "distributed=fsdp",
                                                        "distributed.fsdp_float8_all_gather=false")},
            "fsdp_minitrain": {"overrides": overrides("fsdp_minitrain", "distributed=fsdp", kernels="minitrain")},
            "crash": {"overrides": overrides("resumed", "distributed=fsdp", "optimizer.impl=fused"), "crash_at": 3},
            "resumed": {"overrides": overrides("resumed", "distributed=fsdp", "optimizer.impl=fused",
                                               "trainer.resume=auto")}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, jobs, str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    reports = {f"{name}.{r}": torch.load(tmp_path / f"{name}.rank{r}.pt") for name in jobs for r in range(WORLD)}

    def losses(out):
        records = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return [r["train/loss"] for r in records if "train/loss" in r]

    # each rank scales its own half of the batch: float8 rounding apart, the one-process run
    for mode in ("ddp", "fsdp", "fsdp_bf16_gather", "fsdp_minitrain"):
        torch.testing.assert_close(losses(mode), losses("single"), rtol=0, atol=0.02)
        update = {k: v - initial[k].float() for k, v in reports[f"{mode}.0"]["params"].items()}
        gap = sum((update[k] - single_update[k]).norm() ** 2 for k in update) ** 0.5
        size = sum(u.norm() ** 2 for u in single_update.values()) ** 0.5
        assert gap < 0.5 * size, (mode, float(gap / size))
    n_layer = single.model.cfg.n_layer
    assert reports["fsdp.0"]["float8_all_gather_weights"] == 4 * n_layer
    assert reports["fsdp_bf16_gather.0"]["float8_all_gather_weights"] == 0
    assert reports["fsdp_minitrain.0"]["float8_all_gather_weights"] == 0  # torchao's gather only
    assert reports["fsdp_minitrain.0"]["minitrain_linears"] == 4 * n_layer
    assert reports["fsdp.0"]["minitrain_linears"] == 0
    assert reports["crash.0"] == {"crashed_at": 3}
    assert losses("resumed")[-1] == losses("fsdp")[-1]
    a, b = reports["fsdp.0"]["params"], reports["resumed.0"]["params"]
    assert all(torch.equal(a[k], b[k]) for k in a)
