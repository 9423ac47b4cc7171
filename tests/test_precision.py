"""precision=auto on each kind of device, and what a resolved precision tells the rest of the step.

The CPU cannot show the GPU branches, so the GPU is faked: torch.cuda's answers are monkeypatched, and only
the device's type is read by the code under test. A GPU that computes in bf16 gets bf16 + fp32 masters; one
that only emulates bf16 (torch reports it with `including_emulation=True`, e.g. a V100 or a T4) gets fp16 +
masters + dynamic loss scaling; a CPU gets fp32.
"""

import pytest
import torch
from conftest import fake_gpu

from minitrain.config import DType, PrecisionConfig, resolve
from minitrain.cli import compose_config
from minitrain.errors import ConfigError
from minitrain.optimizer_config import OptimizerImpl
from minitrain.loss_scale import LossScaling
from minitrain.precision import Precision, auto_name, preset, resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def auto(*overrides, device=CPU, **kwargs) -> Precision:
    cfg = resolve(compose_config(["trainer.out_dir=.", *overrides]))
    return resolve_precision(cfg.precision, device, **kwargs)


def test_auto_on_a_gpu_with_bf16_is_bf16_params_with_fp32_masters(monkeypatch):
    fake_gpu(monkeypatch, bf16=True)
    p = auto(device=CUDA)
    assert auto_name(CUDA) == "bf16"
    assert (p.name, p.param_dtype, p.autocast_dtype, p.master_weights, p.loss_scaling) == \
        ("bf16", torch.bfloat16, None, True, False)
    assert (p.grad_dtype, p.compute_dtype, p.tf32, p.mfu_dtype) == (torch.bfloat16, torch.bfloat16, True, "bf16")


def test_auto_on_a_gpu_without_bf16_is_fp16_with_masters_and_loss_scaling(monkeypatch):
    fake_gpu(monkeypatch, bf16=False)
    p = auto(device=CUDA)
    assert auto_name(CUDA) == "fp16"  # not the emulated bf16, many times slower than fp16 there
    assert (p.name, p.param_dtype, p.autocast_dtype, p.master_weights, p.loss_scaling) == \
        ("fp16", torch.float16, None, True, True)
    assert (p.compute_dtype, p.mfu_dtype) == (torch.float16, "fp16")
    assert p.loss_scale == LossScaling()  # torch's defaults (tests/test_amp.py)


@pytest.mark.parametrize("gpu_bf16", [None, True, False])  # None: no GPU at all
def test_auto_on_a_cpu_is_fp32_whatever_gpu_the_machine_has(monkeypatch, gpu_bf16):
    if gpu_bf16 is not None:
        fake_gpu(monkeypatch, bf16=gpu_bf16)
    p = auto(device=CPU)
    assert auto_name(CPU) == "fp32"
    assert (p.name, p.param_dtype, p.autocast_dtype, p.master_weights, p.loss_scaling) == \
        ("fp32", torch.float32, None, False, False)
    assert not p.tf32 and p.mfu_dtype == "fp32"  # TF32 acts on CUDA only, whatever trainer.tf32 says


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_takes_the_preset_of_its_choice_whole(monkeypatch, bf16):
    """Every field a preset sets comes from the chosen preset's yaml (a new field there reaches auto too)."""
    fake_gpu(monkeypatch, bf16=bf16)
    chosen = preset("bf16" if bf16 else "fp16")
    assert auto(device=CUDA) == resolve_precision(chosen, CUDA)


def test_trainer_tf32_is_the_user_s_on_cuda_and_off_on_a_cpu(monkeypatch):
    fake_gpu(monkeypatch, bf16=True)
    assert auto("precision=fp32", device=CUDA).tf32 and auto("precision=fp32", device=CUDA).mfu_dtype == "tf32"
    assert not auto("precision=fp32", device=CUDA, tf32=False).tf32
    assert auto("precision=fp32", device=CUDA, tf32=False).mfu_dtype == "fp32"
    assert not auto("precision=fp32", device=CPU, tf32=True).tf32


@pytest.mark.parametrize("bf16, refused", [(True, "bf16"), (False, "fp16")])
def test_auto_with_torch_adamw_is_refused_where_it_picks_masters(monkeypatch, bf16, refused):
    """torch.optim.AdamW keeps no fp32 masters: precision=auto may only pick what it can run, per device."""
    assert auto("optimizer.impl=torch", device=CPU, optimizer_impl=OptimizerImpl.torch).name == "fp32"
    fake_gpu(monkeypatch, bf16=bf16)
    with pytest.raises(ConfigError, match=rf"optimizer\.impl: .*precision={refused}"):
        auto("optimizer.impl=torch", device=CUDA, optimizer_impl=OptimizerImpl.torch)


@pytest.mark.parametrize("field, value", [("param_dtype", "bf16"), ("autocast_dtype", "bf16"),
                                          ("master_weights", "true"), ("loss_scaling", "true")])
def test_auto_refuses_each_field_it_would_choose_itself(field, value):
    with pytest.raises(ConfigError, match=rf"^precision\.{field}: precision=auto chooses it per device"):
        auto(f"precision.{field}={value}")


def test_auto_keeps_the_settings_it_does_not_choose(monkeypatch):
    fake_gpu(monkeypatch, bf16=False)
    p = auto("precision.init_scale=1024", "precision.growth_interval=100", "precision.grad_dtype=fp32", device=CUDA)
    assert (p.name, p.loss_scale, p.grad_dtype) == ("fp16", LossScaling(init_scale=1024.0, growth_interval=100),
                                                    torch.float32)


@pytest.mark.parametrize("name, params, compute, masters, main_grads, scaled, said", [
    ("fp32", torch.float32, torch.float32, False, False, False, "fp32 params, TF32 matmuls"),
    ("amp_bf16", torch.float32, torch.bfloat16, False, False, False, "fp32 params, bf16 autocast"),
    ("bf16", torch.bfloat16, torch.bfloat16, True, False, False, "bf16 params, fp32 masters"),
    ("bf16_no_master", torch.bfloat16, torch.bfloat16, False, False, False, "bf16 params"),
    ("fp16", torch.float16, torch.float16, True, False, True, "fp16 params, fp32 masters, dynamic loss scaling"),
])
def test_each_preset_resolves_to_its_dtypes(monkeypatch, name, params, compute, masters, main_grads, scaled, said):
    fake_gpu(monkeypatch, bf16=True)
    p = resolve_precision(preset(name), CUDA)
    assert (p.name, p.param_dtype, p.compute_dtype, p.master_weights, p.fp32_main_grads, p.loss_scaling) == \
        (name, params, compute, masters, main_grads, scaled)
    assert p.describe() == said


def test_fp32_main_grads_are_named_and_widen_only_the_gradients():
    p = resolve_precision(PrecisionConfig(name="bf16", param_dtype=DType.bf16, master_weights=True,
                                          grad_dtype=DType.fp32), CPU)
    assert (p.param_dtype, p.grad_dtype, p.fp32_main_grads) == (torch.bfloat16, torch.float32, True)
    assert p.describe() == "bf16 params, fp32 masters, fp32 main grads"


def test_under_fsdp_the_masters_are_the_stored_params():
    bf16, no_master = resolve_precision(preset("bf16"), CPU), resolve_precision(preset("bf16_no_master"), CPU)
    assert (bf16.stored_param_dtype(sharded=False), bf16.stored_param_dtype(sharded=True)) == \
        (torch.bfloat16, torch.float32)
    assert no_master.stored_param_dtype(sharded=True) == torch.bfloat16


def test_tf32_flags_follow_the_precision_on_cuda_only(monkeypatch):
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        resolve_precision(preset("fp32"), CUDA, tf32=True).apply_matmul_precision()  # torch sees no GPU: untouched
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        fake_gpu(monkeypatch, bf16=True)
        resolve_precision(preset("fp32"), CUDA, tf32=True).apply_matmul_precision()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        resolve_precision(preset("fp32"), CUDA, tf32=False).apply_matmul_precision()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
