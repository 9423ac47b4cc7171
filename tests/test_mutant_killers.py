"""Tests written for bugs of scripts/mutants.toml that the rest of the suite let through, or caught only in a
whole resumed training run: the state a checkpoint must carry (the skipped-step count, the loop's running sums and
skip runs), what a step reports and runs at (its mean loss, its lr), when a run counts as diverged, where data
windows may start, and the memory model's optimizer terms for shapes that leave padding in the flat buffers."""

import io

import numpy as np
import pytest
import torch

from minitrain.amp import LossScaling
from minitrain.config import CheckpointingConfig, CheckpointPolicy, ModelConfig
from minitrain.data import Batches
from minitrain.memory import predict
from minitrain.model import GPT
from minitrain.optim import AdamW, TorchAdamW
from minitrain.precision import preset, resolve_precision
from minitrain.trainer import NonFiniteLossError, Progress, Trainer

from test_trainer import read_jsonl

CPU = torch.device("cpu")
SMALL_MODEL = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "trainer.eval_batches=1",
               "trainer.sample_tokens=0")


def round_trip(state):
    """A state_dict as a checkpoint gives it back: saved and loaded."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("impl", ["foreach", "torch"])
def test_skipped_steps_survive_a_resume(impl):
    """amp/skipped_steps is logged from the optimizer's count: a resumed run must go on counting from it."""
    def build():
        p = torch.nn.Parameter(torch.ones(5))
        if impl == "torch":
            return TorchAdamW([p], loss_scaling=LossScaling(init_scale=2.0**8))
        return AdamW([p], impl=impl, loss_scaling=LossScaling(init_scale=2.0**8))

    def overflowing_step(opt):
        param = opt.param_groups[0]["params"][0]
        opt.scale((param * float("inf")).sum()).backward()  # an inf gradient
        opt.step()
        opt.zero_grad()

    saved = build()
    overflowing_step(saved)
    resumed = build()
    resumed.load_state_dict(round_trip(saved.state_dict()))
    assert resumed.stats()["skipped_steps"].item() == 1
    overflowing_step(resumed)
    assert resumed.stats()["skipped_steps"].item() == 2


def record(progress, steps, losses, skipped_totals):
    for s in steps:
        progress.record(torch.tensor(losses[s]), torch.tensor(skipped_totals[s], dtype=torch.int32))


def test_progress_resumed_mid_log_window_logs_what_an_unbroken_one_does():
    """Logging every 4 steps, a checkpoint after step 6, two steps into a log window and into a run of skipped
    steps: the resumed loop's next mean loss and its skip bookkeeping must equal the unbroken loop's."""
    losses = [5.0, 4.0, 3.5, 3.0, 2.75, 2.5, 2.25, 2.0]
    skipped = [0, 0, 0, 0, 1, 2, 3, 3]  # the optimizer's count after each step: steps 5, 6 and 7 skipped in a row
    straight = Progress(CPU)
    record(straight, range(4), losses, skipped)
    straight.take_mean_loss()
    record(straight, range(4, 8), losses, skipped)

    crashed = Progress(CPU)
    record(crashed, range(4), losses, skipped)
    crashed.take_mean_loss()
    record(crashed, range(4, 6), losses, skipped)
    resumed = Progress(CPU)
    resumed.load_state_dict(round_trip(crashed.state_dict()))
    record(resumed, range(6, 8), losses, skipped)

    assert resumed.step == straight.step == 8
    assert resumed.take_mean_loss().item() == straight.take_mean_loss().item() == pytest.approx(2.375)
    assert resumed.longest_skip_run.item() == straight.longest_skip_run.item() == 3
    for key in ("skip_run", "skipped_seen"):
        assert getattr(resumed, key).item() == getattr(straight, key).item(), key


def test_skip_run_counts_skips_in_a_row_only():
    """Sporadic skips (an fp16 scaler backing off now and then) are not a diverged run; skips in a row are."""
    progress = Progress(CPU)
    skipped = [1, 1, 2, 2, 3, 3, 4, 5, 6]  # skipped: steps 1, 3, 5, then 7, 8, 9 in a row
    record(progress, range(6), [1.0] * 9, skipped)
    assert progress.longest_skip_run.item() == 1
    record(progress, range(6, 9), [1.0] * 9, skipped)
    assert progress.longest_skip_run.item() == 3 and progress.skip_run.item() == 3


def test_step_loss_is_the_mean_over_micro_batches(make_cfg, tmp_path):
    """The loss a step returns (and the run logs) is the global batch's mean, however it is split."""
    losses = []
    for micro in (8, 2):
        t = Trainer(make_cfg(*SMALL_MODEL, f"trainer.micro_batch={micro}", f"trainer.out_dir={tmp_path / str(micro)}"),
                    progress=False)
        losses.append(t.train_step(0).item())
        t.close()
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_logged_lr_is_the_lr_each_step_ran_at(make_cfg, tmp_path, monkeypatch):
    """Warmup over 3 steps: step 1 runs at lr/3, and each step's logged opt/lr is the lr it ran at."""
    t = Trainer(make_cfg(*SMALL_MODEL, "trainer.max_steps=5", "trainer.warmup_steps=3", "trainer.log_every=1",
                         "trainer.eval_every=100", "trainer.save_every=100"), progress=False)
    ran_at, set_lr = [], t.optimizer.set_lr

    def recording(lr):
        ran_at.append(lr)
        set_lr(lr)

    monkeypatch.setattr(t.optimizer, "set_lr", recording)
    t.fit()
    logged = [r["opt/lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert ran_at[0] == pytest.approx(t.cfg.trainer.lr / 3)
    assert logged == ran_at


def test_single_nan_loss_stops_an_fp32_run(make_cfg, monkeypatch):
    """Without loss scaling an inf/NaN loss is divergence, not an overflow to back off from: one such step stops
    the run at the next log step, though it skipped fewer than max_skipped_steps steps."""
    t = Trainer(make_cfg(*SMALL_MODEL, "precision=fp32", "trainer.max_steps=10", "trainer.log_every=5"),
                progress=False)
    real = t.train_step.forward_loss

    def one_nan(x, y):
        loss = real(x, y)
        return loss * float("nan") if t.step == 2 else loss

    monkeypatch.setattr(t.train_step, "forward_loss", one_nan)
    with pytest.raises(NonFiniteLossError, match="loss became inf/NaN by step 5"):
        t.fit()


def test_windows_reach_the_last_token_and_stay_inside():
    """T + 2 tokens hold two windows of T + 1: both are drawn, and none reads past the end."""
    T = 8
    batches = Batches(np.arange(T + 2, dtype=np.uint16), T, batch_size=16, seed=0, device=CPU)
    firsts = set()
    for step in range(4):
        x, y = batches.get(step)
        firsts |= set(x[:, 0].tolist())
        assert torch.equal(y, x + 1)
    assert firsts == {0, 1}


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_predicted_optimizer_state_counts_the_padding_of_odd_shapes(name):
    """n_embd=40: no parameter fills a whole number of the layout's ALIGN-element blocks, so every flat buffer of
    the optimizer holds padding beside the parameters; the prediction must be the bytes it really allocates."""
    cfg = ModelConfig(n_layer=1, n_head=4, n_embd=40, block_size=30, vocab_size=250)
    precision = resolve_precision(preset(name), CPU)
    opt = AdamW(GPT(cfg).to(precision.param_dtype).param_groups(0.1), impl="foreach",
                master_weights=precision.master_weights)
    est = predict(cfg, precision, CheckpointingConfig(CheckpointPolicy.none), 2, 30, "torch", None, device="cpu",
                  optimizer_impl="foreach")

    def allocated(buffer):
        return sum(getattr(b.state, buffer).nbytes for b in opt.buckets if getattr(b.state, buffer) is not None)

    assert est.adam_m > 4 * est.n_params  # the case has padding to get wrong
    assert (est.masters, est.adam_m, est.adam_v) == (allocated("master"), allocated("exp_avg"), allocated("exp_avg_sq"))
    assert est.grads == sum(b.layout.size * b.grads.dtype.itemsize for b in opt.buckets)
