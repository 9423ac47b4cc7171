"""The plan: what `auto` resolves to per device, the auto-fit of micro-batch and checkpointing, and the refusals."""

import json
import re

import pytest
import torch

from minitrain import plan as plan_module
from minitrain.config import ConfigError, compose_config, resolve
from minitrain.memory import GB
from minitrain.plan import PlanError, _compile_mode, make_plan
from minitrain.schedule import LRSchedule

CPU = torch.device("cpu")
VOCAB = 4096


def plan_for(*overrides, memory_gb=None, monkeypatch=None, device=CPU, world_size=1):
    if memory_gb is not None:
        monkeypatch.setattr(plan_module, "device_memory", lambda device: int(memory_gb * GB))
    return make_plan(resolve(compose_config(["trainer.out_dir=.", *overrides])), VOCAB, device, world_size)


def test_cpu_defaults_resolve_to_the_fast_cpu_step():
    p = plan_for()
    assert (p.precision.name, p.compile_mode, p.loss_impl, p.optimizer_impl, p.model.gelu.value) == \
        ("fp32", None, "torch", "foreach", "torch")
    assert not p.precision.tf32  # TF32 acts on CUDA only
    assert p.micro_batch == 32 and p.grad_accum == 1 and p.checkpointing.policy.value == "none"
    assert {"precision", "compile", "kernels", "micro_batch", "checkpointing", "warmup"} <= set(p.auto)
    assert p.schedule.warmup_steps == 30  # 10% of the default 300 steps
    json.dumps(p.as_dict())  # what metrics.jsonl's first line and the wandb config hold
    text = p.describe()
    for word in ("fp32 (auto)", "eager (auto)", "micro-batch 32 x 1", "checkpointing  none (auto)", "GB budget"):
        assert word in text, word


@pytest.mark.parametrize("has_bf16", [False, True])
def test_explicit_settings_win_and_a_slow_cpu_precision_is_named(monkeypatch, has_bf16):
    """bf16 is slow only on a CPU without bf16 instructions (on one with them it measured 1.37x fp32's speed)."""
    monkeypatch.setattr(plan_module, "cpu_has_bf16", lambda: has_bf16)
    p = plan_for("precision=bf16", "trainer.micro_batch=8", "checkpointing=full", "trainer.compile=true",
                 "trainer.warmup_steps=3", "loss=fused", "optimizer.impl=loop")
    assert (p.precision.name, p.micro_batch, p.grad_accum, p.checkpointing.policy.value) == ("bf16", 8, 4, "full")
    assert (p.compile_mode, p.loss_impl, p.optimizer_impl, p.schedule.warmup_steps) == ("default", "fused", "loop", 3)
    assert not {"precision", "micro_batch", "checkpointing", "warmup"} & set(p.auto)
    assert [note for note in p.notes if "bf16" in note] == ([] if has_bf16 else [
        "precision=bf16 on a CPU without bf16 instructions (AVX512-BF16, AMX): bf16 matmuls run many times slower "
        "than fp32 here (precision=auto picks fp32)"])
    assert any("fp16" in note and "slower" in note for note in plan_for("precision=fp16").notes)
    assert not plan_for("precision=fp32").notes


def test_compile_auto_uses_cuda_graphs_in_one_process_only():
    one = resolve(compose_config(["trainer.out_dir=."]))
    ddp = resolve(compose_config(["trainer.out_dir=.", "distributed=ddp"]))
    cuda = torch.device("cuda")  # only its type is read
    assert _compile_mode(one, cuda) == "reduce-overhead" and _compile_mode(ddp, cuda) == "default"
    assert _compile_mode(one, CPU) is None
    off = resolve(compose_config(["trainer.out_dir=.", "trainer.compile=false"]))
    assert _compile_mode(off, cuda) is None


def test_auto_precision_refuses_a_dtype_field_it_would_overwrite():
    with pytest.raises(ConfigError, match=r"precision\.param_dtype"):
        plan_for("precision.param_dtype=bf16")


def test_short_runs_warm_up_over_a_tenth_of_their_steps():
    assert plan_for("trainer.max_steps=20").schedule.warmup_steps == 2
    assert plan_for("trainer.max_steps=5").schedule.warmup_steps == 0


def test_schedule_warms_up_linearly_then_decays_to_min_lr():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the first step moves; the last warmup step is lr
    assert s(4) == 1.0 and s(9) == pytest.approx(0.55) and s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    assert LRSchedule(1.0, 0.0, 0, 10)(0) == 1.0  # no warmup: the first step at the peak


def test_auto_fit_trades_micro_batch_and_recompute_within_the_budget(monkeypatch):
    args = ("model=gpt2-124m", "trainer.batch_size=64")
    roomy = plan_for(*args, memory_gb=1000, monkeypatch=monkeypatch)
    assert (roomy.micro_batch, roomy.checkpointing.policy.value) == (64, "none")
    budgets = [60, 30, 15, 9]
    plans = [plan_for(*args, memory_gb=gb / 0.9, monkeypatch=monkeypatch) for gb in budgets]
    for gb, p in zip(budgets, plans):
        assert p.memory.peak <= gb * GB
        # the chosen pair is the best-ranked one that fits: nothing that fits ranks higher
        rate = plan_module.predicted_rate(p.micro_batch * 1024, p.checkpointing, 12)
        assert rate == max(plan_module.predicted_rate(m * 1024, c, 12)
                           for c in plan_module._policies(p.checkpointing.__class__(plan_module.CheckpointPolicy.auto), 12)
                           for m in (64, 32, 16, 8, 4, 2, 1)
                           if plan_module.memory.predict(p.model, p.precision, c, m, 1024, p.loss_impl, None,
                                                         grad_accum=64 // m, device="cpu",
                                                         optimizer_impl=p.optimizer_impl).peak <= gb * GB)
    tokens_per_forward = [p.micro_batch for p in plans]
    assert tokens_per_forward == sorted(tokens_per_forward, reverse=True) and plans[-1].micro_batch < 64


def test_a_step_that_cannot_fit_stops_at_the_plan_naming_what_to_change(monkeypatch):
    with pytest.raises(PlanError, match=r"trainer\.micro_batch=auto.*checkpointing=auto"):
        plan_for("model=gpt2-124m", "trainer.micro_batch=32", "checkpointing=none", memory_gb=8,
                 monkeypatch=monkeypatch)
    with pytest.raises(PlanError, match="does not fit"):  # gpt2-1.5b's 16 B/param alone exceed a small machine
        plan_for("model=gpt2-1.5b", memory_gb=23, monkeypatch=monkeypatch)


def test_a_step_that_cannot_fit_names_the_budget_and_precision_that_would_help(monkeypatch):
    cuda = torch.device("cuda")  # only its type is read
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a 16 GB GPU")
    tight = ("model=gpt2-124m", "trainer.memory_budget=0.1")
    with pytest.raises(PlanError) as fp32:
        plan_for(*tight, "precision=fp32", memory_gb=16, monkeypatch=monkeypatch, device=cuda)
    budget = float(re.search(r"trainer\.memory_budget=(0\.\d+),", str(fp32.value)).group(1))
    assert "precision=bf16" in str(fp32.value)
    plan_for("model=gpt2-124m", f"trainer.memory_budget={budget}", "precision=fp32", memory_gb=16,
             monkeypatch=monkeypatch, device=cuda)  # the budget it names is enough
    with pytest.raises(PlanError) as bf16:
        plan_for(*tight, "precision=bf16", memory_gb=16, monkeypatch=monkeypatch, device=cuda)
    assert "precision=bf16" not in str(bf16.value)  # already 2-byte params: no advice to take them
    with pytest.raises(PlanError) as whole:  # no budget fraction of this device can hold it
        plan_for("model=gpt2-1.5b", "trainer.memory_budget=0.9", memory_gb=23, monkeypatch=monkeypatch)
    assert "trainer.memory_budget=" not in str(whole.value).split("Try ")[1]


def test_explicit_setting_close_to_the_budget_gets_a_note(monkeypatch):
    tight = plan_for("model=gpt2-124m", "trainer.micro_batch=8", "checkpointing=none", memory_gb=1000,
                     monkeypatch=monkeypatch)
    near = plan_for("model=gpt2-124m", "trainer.micro_batch=8", "checkpointing=none",
                    memory_gb=tight.memory.peak / GB / 0.9 / 0.97, monkeypatch=monkeypatch)
    assert not tight.notes and any("memory_budget" in n for n in near.notes)


def test_the_global_batch_must_split_over_ranks():
    with pytest.raises(ConfigError, match=r"trainer\.batch_size"):
        plan_for("trainer.batch_size=6", world_size=4)
    assert plan_for("trainer.batch_size=8", world_size=4).micro_batch == 2


@pytest.mark.parametrize("cpuinfo, has_bf16", [
    ("flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n", False),
    ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", True),
    ("flags\t\t: fpu avx512f amx_tile amx_bf16 amx_int8\n", True),
    ("Features\t: fp asimd sve bf16 i8mm\n", True),  # Arm
    ("Features\t: fp asimd sve i8mm\n", False),
    (None, False),  # no /proc/cpuinfo: unknown
])
def test_bf16_instructions_are_read_from_the_cpus_flags(tmp_path, monkeypatch, cpuinfo, has_bf16):
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text("processor\t: 0\n" + cpuinfo)
    monkeypatch.setattr(plan_module, "CPUINFO", path)
    assert plan_module.cpu_has_bf16() is has_bf16
