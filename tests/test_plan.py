"""The plan: what `auto` resolves to per device, the auto-fit of micro-batch and checkpointing, and the refusals."""

import json
import re
from dataclasses import replace

import pytest
import torch
from conftest import fake_gpu

from minitrain import memory, plan as plan_module
from minitrain.cli import compose_config
from minitrain.config import CheckpointingConfig, CheckpointPolicy, resolve
from minitrain.errors import ConfigError
from minitrain.memory import GB
from minitrain.optimizer_config import OptimizerName
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


def test_short_runs_warm_up_over_a_tenth_of_their_steps():
    assert plan_for("trainer.max_steps=20").schedule.warmup_steps == 2
    assert plan_for("trainer.max_steps=5").schedule.warmup_steps == 0


def test_schedule_warms_up_linearly_then_decays_to_min_lr():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the first step moves; the last warmup step is lr
    assert s(4) == 1.0 and s(9) == pytest.approx(0.55) and s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    assert LRSchedule(1.0, 0.0, 0, 10)(0) == 1.0  # no warmup: the first step at the peak


# -- the auto-fit: every candidate's peak as the budget, ranked by the throughput model ---------------------------------
GPT2_T, GPT2_LAYERS = 1024, 12
# The throughput model of docs/benchmarks.md ("The plan's auto-fit"), written out here rather than read from plan.py:
# a micro-batch of n tokens runs at n / (n + 1024) of the large-batch rate; recompute costs 3% (selective) or 17%
# of the step for full recompute, every_k in proportion to the blocks it reruns.
RECOMPUTED_SHARE = {("none", 0): 0.0, ("every_k", 4): 3 / 12, ("every_k", 2): 6 / 12, ("full", 0): 1.0}
CANDIDATE_POLICIES = [CheckpointingConfig(CheckpointPolicy.none), CheckpointingConfig(CheckpointPolicy.selective),
                      CheckpointingConfig(CheckpointPolicy.every_k, 4), CheckpointingConfig(CheckpointPolicy.every_k, 2),
                      CheckpointingConfig(CheckpointPolicy.full)]


def expected_rate(micro: int, policy: CheckpointingConfig) -> float:
    tokens = micro * GPT2_T
    cost = 0.03 if policy.policy == CheckpointPolicy.selective else \
        0.17 * RECOMPUTED_SHARE[(policy.policy.value, policy.every_k if policy.policy == CheckpointPolicy.every_k else 0)]
    return tokens / (tokens + 1024) / (1 + cost)


@pytest.fixture(scope="module")
def gpt2_candidates():
    """gpt2-124m, a global batch of 64 on the CPU: (micro-batch, policy, predicted peak) of every pair the auto-fit
    may pick (micro-batches dividing 64; none, selective, every_k 4 and 2, full), fastest first."""
    p = make_plan(resolve(compose_config(["trainer.out_dir=.", "model=gpt2-124m", "trainer.batch_size=64"])),
                  VOCAB, CPU)
    pairs = [(m, c) for c in CANDIDATE_POLICIES for m in (64, 32, 16, 8, 4, 2, 1)]
    peaks = {(m, c.policy.value, c.every_k): memory.predict(memory.Candidate(
        p.model, p.precision, m, c, grad_accum=64 // m, loss_impl=p.loss_impl, optimizer_impl=p.optimizer_impl,
        device="cpu")).peak for m, c in pairs}
    ranked = sorted(pairs, key=lambda mc: expected_rate(*mc), reverse=True)
    return [(m, c.policy.value, c.every_k if c.policy == CheckpointPolicy.every_k else None,
             peaks[(m, c.policy.value, c.every_k)]) for m, c in ranked]


def chosen(p) -> tuple:
    policy = p.checkpointing.policy.value
    return p.micro_batch, policy, p.checkpointing.every_k if policy == "every_k" else None


def test_recompute_costs_and_rates_of_the_throughput_model():
    n = GPT2_LAYERS
    for policy in CANDIDATE_POLICIES:
        for micro in (1, 4, 64):
            assert plan_module.predicted_rate(micro * GPT2_T, policy, n) == pytest.approx(expected_rate(micro, policy),
                                                                                          rel=1e-12)
    assert plan_module.recompute_cost(CheckpointingConfig(CheckpointPolicy.every_k, 4), 6) == pytest.approx(0.17 / 6)
    # four sequences with full recompute outrun two without: halving the micro-batch is the dearer trade there
    assert expected_rate(4, CANDIDATE_POLICIES[-1]) > expected_rate(2, CANDIDATE_POLICIES[0])


@pytest.mark.parametrize("n_layer, every_k", [(1, []), (2, [2]), (3, [2]), (4, [4, 2]), (12, [4, 2])])
def test_auto_checkpointing_tries_every_k_only_where_it_reruns_fewer_blocks_than_full(n_layer, every_k):
    policies = plan_module._policies(CheckpointingConfig(CheckpointPolicy.auto), n_layer)
    assert [(c.policy.value, c.every_k) for c in policies] == \
        [("none", 2), ("selective", 2), *[("every_k", k) for k in every_k], ("full", 2)]  # cheapest recompute first


@pytest.mark.parametrize("slack", [0, -1])  # the budget exactly at a candidate's peak, then one byte short of it
def test_auto_fit_picks_the_fastest_candidate_within_the_budget_to_the_byte(monkeypatch, gpt2_candidates, slack):
    """Each candidate's predicted peak in turn as the budget (half the device's memory): the plan takes the fastest
    candidate whose peak is at most the budget (exactly at it fits; one byte over does not), by the throughput
    model."""
    cfg = resolve(compose_config(["trainer.out_dir=.", "model=gpt2-124m", "trainer.batch_size=64",
                                  "trainer.memory_budget=0.5"]))
    picked = set()
    for *_, peak in gpt2_candidates:
        budget = peak + slack
        monkeypatch.setattr(plan_module, "device_memory", lambda device: 2 * budget)
        fits = [c for c in gpt2_candidates if c[3] <= budget]
        if not fits:
            with pytest.raises(PlanError):
                make_plan(cfg, VOCAB, CPU)
            continue
        p = make_plan(cfg, VOCAB, CPU)
        assert chosen(p) == fits[0][:3], budget
        assert p.memory.peak == fits[0][3] and p.memory_budget == budget
        picked.add(p.checkpointing.policy.value)
    assert picked == {"none", "selective", "every_k", "full"}  # every policy's cost steered some choice


def test_with_one_setting_fixed_auto_fits_the_other(monkeypatch, gpt2_candidates):
    def plan_within(budget, *overrides):
        monkeypatch.setattr(plan_module, "device_memory", lambda device: budget)
        return make_plan(resolve(compose_config(["trainer.out_dir=.", "model=gpt2-124m", "trainer.batch_size=64",
                                                 "trainer.memory_budget=1", *overrides])), VOCAB, CPU)

    peak = {c[:3]: c[3] for c in gpt2_candidates}
    full = plan_within(peak[(32, "full", None)], "checkpointing=full")
    assert chosen(full) == (32, "full", None) and "checkpointing" not in full.auto and "micro_batch" in full.auto
    eight = plan_within(peak[(8, "every_k", 2)], "trainer.micro_batch=8")
    assert chosen(eight) == (8, "every_k", 2) and "micro_batch" not in eight.auto and "checkpointing" in eight.auto


def test_on_a_tie_the_plan_prefers_less_recompute_then_the_larger_micro_batch(monkeypatch, gpt2_candidates):
    """With every candidate predicted equally fast, no recomputation wins over any micro-batch that needs it."""
    monkeypatch.setattr(plan_module, "predicted_rate", lambda *args: 1.0)
    peak = {c[:3]: c[3] for c in gpt2_candidates}
    budget = peak[(64, "full", None)]  # fits full recompute at 64 and no recompute at 32, not at 64
    assert peak[(32, "none", None)] <= budget < peak[(64, "none", None)]
    monkeypatch.setattr(plan_module, "device_memory", lambda device: budget)
    p = make_plan(resolve(compose_config(["trainer.out_dir=.", "model=gpt2-124m", "trainer.batch_size=64",
                                          "trainer.memory_budget=1"])), VOCAB, CPU)
    assert chosen(p) == (32, "none", None)


@pytest.mark.parametrize("fraction, total_for_peak", [(1.0, lambda peak: peak), (0.5, lambda peak: 2 * peak)])
def test_an_explicit_step_at_the_budget_fits_and_one_byte_over_stops_the_plan(monkeypatch, fraction, total_for_peak):
    """trainer.memory_budget is a fraction of the device's bytes, rounded down: a step predicted exactly at it
    runs; one byte over is refused."""
    args = ("model=gpt2-124m", "trainer.micro_batch=8", "checkpointing=none", f"trainer.memory_budget={fraction}")
    peak = plan_for(*args, memory_gb=1000, monkeypatch=monkeypatch).memory.peak
    monkeypatch.setattr(plan_module, "device_memory", lambda device: total_for_peak(peak))
    p = plan_for(*args)
    assert (p.memory.peak, p.memory_budget, p.device_memory) == (peak, peak, total_for_peak(peak))
    monkeypatch.setattr(plan_module, "device_memory", lambda device: total_for_peak(peak) - 1)
    with pytest.raises(PlanError, match="does not fit"):
        plan_for(*args)


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
    assert not [n for n in tight.notes if "memory_budget" in n] and any("memory_budget" in n for n in near.notes)


def test_the_global_batch_must_split_over_ranks():
    with pytest.raises(ConfigError, match=r"trainer\.batch_size"):
        plan_for("trainer.batch_size=6", world_size=4)
    assert plan_for("trainer.batch_size=8", world_size=4).micro_batch == 2


# -- the refusal's advice ---------------------------------------------------------------------------------------------
def test_a_step_that_cannot_fit_names_its_smallest_candidate(monkeypatch, gpt2_candidates):
    micro, policy, every_k, peak = min(gpt2_candidates, key=lambda c: c[3])
    assert (micro, policy) == (1, "full")
    monkeypatch.setattr(plan_module, "device_memory", lambda device: peak - 1)
    with pytest.raises(PlanError) as refused:
        plan_for("model=gpt2-124m", "trainer.batch_size=64", "trainer.memory_budget=1")
    message = str(refused.value)
    assert f"its smallest predicted peak is {peak / GB:.2f} GB (micro-batch 1), over trainer.memory_budget=1.0 " \
           "of the RAM available" in message
    assert message.splitlines()[-1].split()[-2] == f"{peak / GB:.3f}"  # the table is the smallest candidate's


@pytest.mark.parametrize("micro_batch, checkpointing, named", [
    ("8", "none", ["trainer.micro_batch=auto", "checkpointing=auto"]),
    ("auto", "none", ["checkpointing=auto"]),
    ("8", "auto", ["trainer.micro_batch=auto"]),
    ("auto", "auto", []),
])
def test_the_refusal_advises_auto_only_for_settings_that_are_not(monkeypatch, micro_batch, checkpointing, named):
    with pytest.raises(PlanError) as refused:
        plan_for("model=gpt2-1.5b", "trainer.batch_size=8", f"trainer.micro_batch={micro_batch}",
                 f"checkpointing={checkpointing}", memory_gb=16, monkeypatch=monkeypatch)
    advice = str(refused.value).split("Try ")[1].split(".\n")[0]
    assert advice == ", ".join(named + ["a smaller model", "or distributed=fsdp over more devices"])


def test_the_budget_advised_is_the_smallest_hundredth_that_fits(monkeypatch):
    args = ("model=gpt2-124m", "trainer.micro_batch=8", "checkpointing=none")
    peak = plan_for(*args, memory_gb=1000, monkeypatch=monkeypatch).memory.peak
    total = int(peak / 0.4731)  # the step needs 47.31% of this machine
    monkeypatch.setattr(plan_module, "device_memory", lambda device: total)
    with pytest.raises(PlanError) as refused:
        plan_for(*args, "trainer.memory_budget=0.3")
    assert "checkpointing=auto, trainer.memory_budget=0.48, a smaller model" in str(refused.value)
    assert plan_for(*args, "trainer.memory_budget=0.48").memory.peak == peak
    with pytest.raises(PlanError):
        plan_for(*args, "trainer.memory_budget=0.47")


def test_the_budget_advice_reaches_the_whole_device_and_no_further(monkeypatch):
    args = ("model=gpt2-124m", "trainer.micro_batch=8", "checkpointing=none", "trainer.memory_budget=0.9")
    peak = plan_for(*args, memory_gb=1000, monkeypatch=monkeypatch).memory.peak
    monkeypatch.setattr(plan_module, "device_memory", lambda device: peak)  # all of it: the step just fits
    with pytest.raises(PlanError, match=r"Try trainer\.micro_batch=auto, checkpointing=auto, trainer\.memory_budget=1, a"):
        plan_for(*args)
    plan_for(*args[:-1], "trainer.memory_budget=1")
    monkeypatch.setattr(plan_module, "device_memory", lambda device: peak - 1)  # one byte short: no fraction helps
    with pytest.raises(PlanError) as refused:
        plan_for(*args)
    assert "trainer.memory_budget=" not in str(refused.value).split("Try ")[1]


@pytest.mark.parametrize("device, precision, advised", [
    ("cuda", "fp32", True), ("cuda", "amp_bf16", True), ("cuda", "bf16", False), ("cuda", "fp16", False),
    ("cpu", "fp32", False),  # bf16 matmuls are many times slower than fp32 on most CPUs
])
def test_the_refusal_advises_bf16_where_two_byte_params_would_help_and_run_fast(monkeypatch, device, precision,
                                                                                advised):
    fake_gpu(monkeypatch, bf16=True, memory=16 * 10**9)
    monkeypatch.setattr(plan_module, "device_memory", lambda device: 16 * 10**9)
    with pytest.raises(PlanError) as refused:
        plan_for("model=gpt2-1.5b", f"precision={precision}", device=torch.device(device))
    message = str(refused.value)
    assert ("precision=bf16" in message.split("Try ")[1]) == advised
    assert ("of the RAM available" if device == "cpu" else "of the device's memory") in message


# -- every `auto`, per kind of device ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu, resolved", [
    (None, dict(device="cpu", name="cpu", precision="fp32", tf32=False, compile_mode=None, loss="torch",
                optimizer="foreach", gelu="torch", qk="torch", max_skipped_steps=3, memory=12 * 10**9)),
    ("bf16", dict(device="cuda", name="a fake GPU", precision="bf16", tf32=True, compile_mode="reduce-overhead",
                  loss="fused", optimizer="fused", gelu="fused", qk="fused", max_skipped_steps=3, memory=80 * 10**9)),
    ("fp16", dict(device="cuda", name="a fake GPU", precision="fp16", tf32=True, compile_mode="reduce-overhead",
                  loss="fused", optimizer="fused", gelu="fused", qk="fused", max_skipped_steps=25, memory=80 * 10**9)),
])
def test_every_auto_resolves_for_the_kind_of_device(monkeypatch, gpu, resolved):
    """The default config (every setting `auto`) on a CPU, a GPU with bf16 and a GPU without: what each gets."""
    import types

    if gpu is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:
        fake_gpu(monkeypatch, bf16=gpu == "bf16")
    monkeypatch.setattr(plan_module.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=12 * 10**9))
    device = plan_module.pick_device("auto")
    p = plan_for(device=device)
    assert dict(device=device.type, name=p.device_name, precision=p.precision.name, tf32=p.precision.tf32,
                compile_mode=p.compile_mode, loss=p.loss_impl, optimizer=p.optimizer_impl, gelu=p.model.gelu.value,
                qk=p.model.qk_kernel.value, max_skipped_steps=p.max_skipped_steps, memory=p.device_memory) == resolved
    assert p.cuda_graphs == (gpu is not None) and p.memory_budget == int(0.9 * resolved["memory"])
    assert set(p.auto) == {"device", "precision", "compile", "kernels", "micro_batch", "checkpointing", "warmup"}
    assert (p.micro_batch, p.checkpointing.policy.value, p.schedule.warmup_steps) == (32, "none", 30)
    assert not p.notes


def test_device_auto_and_an_absent_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_module.pick_device("auto") == CPU and plan_module.pick_device("cpu") == CPU
    with pytest.raises(ConfigError, match=r"^trainer\.device: cuda was asked for but torch sees no CUDA device"):
        plan_module.pick_device("cuda")
    assert "device" not in plan_for("trainer.device=cpu").auto


@pytest.mark.parametrize("overrides, skipped", [
    (["precision=fp16"], 25), (["precision=bf16"], 3), (["precision=fp32"], 3),
    (["precision=fp32", "precision.autocast_dtype=fp16", "precision.loss_scaling=true", "optimizer.impl=torch"], 25),
    (["precision=fp16", "trainer.max_skipped_steps=7"], 7), (["precision=fp32", "trainer.max_skipped_steps=1"], 1),
])
def test_the_skipped_step_limit_follows_loss_scaling_unless_set(overrides, skipped):
    """With loss scaling each overflow halves the scale, so 25 skips in a row is a diverged run; without, 3."""
    assert plan_for(*overrides).max_skipped_steps == skipped


@pytest.mark.parametrize("overrides, device, mode, tagged", [
    ([], "cpu", None, True),
    (["trainer.compile=true"], "cpu", "default", True),  # compile_mode=auto still chose
    (["trainer.compile=true", "trainer.compile_mode=max-autotune"], "cpu", "max-autotune", False),
    (["trainer.compile=false"], "cuda", None, False),
    (["trainer.compile_mode=default"], "cuda", "default", True),  # compile=auto chose to compile
    (["distributed=fsdp"], "cuda", "default", True),
])
def test_compile_is_tagged_auto_where_auto_chose(monkeypatch, overrides, device, mode, tagged):
    fake_gpu(monkeypatch, bf16=True)
    p = plan_for(*overrides, device=torch.device(device))
    assert (p.compile_mode, "compile" in p.auto) == (mode, tagged)


KERNELS = ["loss=fused", "model.gelu=torch", "optimizer.impl=loop"]  # each chosen: no kernel left to auto


@pytest.mark.parametrize("key", ["model.gelu", "model.qk_kernel"])
def test_a_kernel_asked_for_is_kept_on_a_cpu_beside_the_others_auto(key):
    """fused on a CPU (the interpreter's road, as the tests take it): that kernel alone, the other resolved to torch."""
    p = plan_for(f"{key}=fused")
    assert (p.model.gelu.value, p.model.qk_kernel.value) == \
        (("fused", "torch") if key == "model.gelu" else ("torch", "fused"))


@pytest.mark.parametrize("overrides, tagged", [
    (KERNELS, False),
    ([*KERNELS, "loss=auto"], True),
    ([*KERNELS, "model.gelu=auto"], True),
    ([*KERNELS, "optimizer.impl=auto"], True),
    ([*KERNELS, "model.position=rope"], True),  # model.qk_kernel=auto, which GPT-2's block does not use
    ([*KERNELS, "model.qk_norm=true", "model.qk_kernel=torch"], False),
])
def test_kernels_are_tagged_auto_when_any_of_them_was(overrides, tagged):
    p = plan_for(*overrides)
    assert ("kernels" in p.auto) == tagged
    assert ("qk=" in p.describe()) == p.model.remakes_qk


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


# -- the vocabulary against the tokenizer ------------------------------------------------------------------------
def step_flops(model_cfg) -> int:
    """GPT.flops_per_token of a model of `model_cfg`, built on the meta device."""
    from minitrain.model import GPT

    with torch.device("meta"):
        return GPT(model_cfg).flops_per_token(model_cfg.block_size)


@pytest.mark.parametrize("vocab_size, surplus", [(None, 0), (4096, 0), (4160, 64), (50304, 46208)])
def test_a_vocabulary_beyond_the_tokenizer_s_padded_ids_is_said_with_its_share_of_the_step(vocab_size, surplus):
    """gpt2-124m's 50304 rows over the built-in corpus's 4096-token BPE: 46208 rows of logits that no token has.
    Their share is checked against the step's FLOPs with and without them (MFU's count): a quarter."""
    from dataclasses import replace

    p = plan_for("model=gpt2-124m", f"model.vocab_size={'null' if vocab_size is None else vocab_size}")
    assert p.model.vocab_size == (vocab_size or VOCAB)
    said = [note for note in p.notes if "rows more than the tokenizer" in note]
    if not surplus:
        assert said == []
        return
    share = 1 - step_flops(replace(p.model, vocab_size=VOCAB)) / step_flops(p.model)
    assert said == [f"model.vocab_size={vocab_size} scores {surplus:,} rows more than the tokenizer's 4,096 ids need "
                    f"(padded to 4,096): logits of tokens that never occur, {share:.1%} of the step's FLOPs; "
                    "model.vocab_size=null sizes the vocabulary to the tokenizer"]
    assert vocab_size != 50304 or said[0].count("24.9%") == 1
    assert f"  note: {said[0]}" in p.describe().splitlines()


def test_a_padded_tokenizer_and_a_model_s_own_weights_rows_are_not_a_surplus():
    """4000 ids pad to 4032 rows, which model.vocab_size=null gives: nothing to say at 4032; with weights to start
    from, their rows are theirs (a GPT-2 checkpoint's 50257 over a smaller tokenizer is the user's choice)."""
    from dataclasses import replace

    cfg = resolve(compose_config(["trainer.out_dir=.", "model=gpt2-124m", "model.vocab_size=4032"]))
    assert not [n for n in make_plan(cfg, 4000, CPU).notes if "rows more" in n]
    assert [n for n in make_plan(cfg, 3968, CPU).notes if "rows more" in n]  # 3968 ids pad to 3968: 64 rows more
    weights = replace(cfg, model=replace(cfg.model, init_from="gpt2", vocab_size=50304, head_vocab=50257))
    assert not [n for n in make_plan(weights, 4000, CPU).notes if "rows more" in n]


@pytest.mark.parametrize("overrides, message", [
    (["model.vocab_size=512"], "model.vocab_size=512 is smaller than the tokenizer's vocabulary (4096, from "
                               "data.vocab_size=4096); model.vocab_size=null sizes it to the tokenizer"),
    # no vocab_size: the tokenizer's, but the head scores its first 300 rows only, which ids up to 4095 overrun
    (["model.head_vocab=300"], "model.head_vocab=300 is smaller than the tokenizer's vocabulary (4096, from "
                               "data.vocab_size=4096); model.head_vocab=null sizes it to the tokenizer"),
])
def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError) as refused:
        plan_for(*overrides)
    assert str(refused.value) == message


# -- the candidate the plan prices: each setting reaches its field of memory.Candidate, and only it -----------------
PRICED = ("trainer.micro_batch=8", "checkpointing=none", "loss=fused")  # each rank's 8 sequences at once


FSDP = ("distributed=fsdp",), {"world_size": 2, "sharded": True}


@pytest.mark.parametrize("base, override, fields", [
    (((), {}), "trainer.micro_batch=4", {"micro_batch": 4, "grad_accum": 2}),
    (((), {}), "checkpointing=full", {"policy": CheckpointingConfig(CheckpointPolicy.full)}),
    (((), {}), "loss=torch", {"loss_impl": "torch"}),
    (((), {}), "loss.chunk_bytes=65536", {"chunk_bytes": 65536}),
    (((), {}), "loss.low_memory=true", {"loss_low_memory": True}),
    (((), {}), "optimizer=muon", {"optimizer": OptimizerName.muon}),
    (((), {}), "optimizer.impl=loop", {"optimizer_impl": "loop"}),
    (((), {"world_size": 2}), "distributed=fsdp", {"sharded": True}),
    (FSDP, "distributed.fsdp_unit_blocks=1", {"fsdp_unit_blocks": 1}),
    ((FSDP[0] + ("distributed.fsdp_unit_blocks=1",), {**FSDP[1], "fsdp_unit_blocks": 1}),
     "distributed.reshard_after_forward=false", {"reshard_after_forward": False}),
])
def test_every_setting_the_memory_model_reads_reaches_the_candidate_the_plan_prices(base, override, fields):
    """The plan's estimate is memory.predict of the candidate written out here; one setting changed alone changes
    its own field of it, and a term of the estimate with it."""
    (overrides, base_fields), world_size = base, base[1].get("world_size", 1)
    batch = f"trainer.batch_size={8 * world_size}"
    before = plan_for(*PRICED, batch, *overrides, world_size=world_size)
    candidate = memory.Candidate(before.model, before.precision, 8, CheckpointingConfig(CheckpointPolicy.none),
                                 optimizer_impl="foreach", device="cpu", **base_fields)
    assert before.memory == memory.predict(candidate)
    after = plan_for(*PRICED, batch, *overrides, override, world_size=world_size)
    assert after.memory == memory.predict(replace(candidate, **fields))
    assert after.memory.as_dict() != before.memory.as_dict()  # a term moved, not only the notes
