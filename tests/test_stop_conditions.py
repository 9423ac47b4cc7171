"""When a run stops as diverged, and what it leaves: the skipped-step limit at its exact value, a divergence
between two log steps with a save due before the next one, and the message naming the checkpoint kept (its step
and the loss it was trained to) or saying there is none; when the checkpointer saves and guards; a run that stops at
its target validation loss (trainer.target_loss), at the limit, and resumed."""

import json
import math

import pytest

from minitrain import checkpoint, checkpointer, divergence
from minitrain.divergence import NonFiniteLossError
from minitrain.loop import TARGET_REACHED
from minitrain.trainer import Trainer

from conftest import saved_state

SMALL = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "trainer.batch_size=4",
         "trainer.eval_every=100", "trainer.eval_batches=1", "trainer.sample_tokens=0")
TRY = " — try a lower trainer.lr, or precision=fp16 only if fp16 overflow is the cause"


def poison(monkeypatch, t: Trainer, factors: dict[int, float]) -> list[float]:
    """Multiply the loss of each 1-based step in `factors` by its factor (inf/NaN: the step's gradients are too);
    returns the list each step's loss is appended to, as the step returned it."""
    forward, step, losses = t.train_step.forward_loss, t.train_step, []

    def poisoned(x, y):
        return forward(x, y) * factors.get(t.step + 1, 1.0)

    def recorded(i):
        loss = step(i)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(t.train_step, "forward_loss", poisoned)
    monkeypatch.setattr(t.parts, "train_step", recorded)
    return losses


def step_of(path) -> int:
    return saved_state(path)["progress"]["step"]


@pytest.mark.parametrize("in_a_row, stops", [(2, False), (3, True)])
def test_the_skipped_step_limit_stops_a_run_at_its_value_and_not_one_before(make_cfg, monkeypatch, in_a_row, stops):
    """fp16: an overflowing step is skipped and the scale backs off, which is no divergence unless it happens
    max_skipped_steps times in a row. Steps 3-5 skipped: the run of three spans the log step 4, where it is 2."""
    t = Trainer(make_cfg(*SMALL, "precision=fp16", "trainer.max_skipped_steps=3", "trainer.max_steps=8",
                         "trainer.log_every=2", "trainer.save_every=100"), progress=False)
    poison(monkeypatch, t, dict.fromkeys(range(3, 3 + in_a_row), math.inf))
    if stops:
        with pytest.raises(NonFiniteLossError, match=r"^3 optimizer steps in a row were skipped \(inf/NaN gradients\) "
                                                     r"by step 6 \(precision=fp16\); stopping, with no checkpoint"):
            t.fit()
    else:
        assert t.fit()["amp/skipped_steps"] == in_a_row  # skipped, and not stopped for it


@pytest.mark.parametrize("loss_scaling, limit", [(False, 3), (True, 25)])
def test_the_default_limit_is_3_steps_without_loss_scaling_and_25_with_it(make_cfg, loss_scaling, limit):
    """With loss scaling each skip halves the scale (25 halvings: a diverged run); without, a skip is an inf/NaN
    gradient the loss did not show."""
    t = Trainer(make_cfg(*SMALL, "precision=fp16" if loss_scaling else "precision=fp32"), progress=False)
    t.close()
    assert (t.plan.precision.loss_scaling, t.plan.max_skipped_steps) == (loss_scaling, limit)


def test_a_divergence_between_log_steps_stops_at_the_save_before_the_next_log_step(make_cfg, monkeypatch, tmp_path):
    """Logs at 5 and 10, saves at 3, 6, 9: the loss is NaN from step 7, so the save due at step 9 would publish a
    diverged state as the checkpoint to resume from. It stops the run instead; the message names the checkpoint
    kept with the loss it was trained to, here a finite but exploded one (step 6), and does not call it good."""
    t = Trainer(make_cfg(*SMALL, "precision=fp32", "trainer.max_steps=20", "trainer.log_every=5",
                         "trainer.save_every=3"), progress=False)
    losses = poison(monkeypatch, t, {6: 1e4, **dict.fromkeys(range(7, 21), math.nan)})
    with pytest.raises(NonFiniteLossError) as stop:
        t.fit()
    ckpts = checkpoint.checkpoint_dir(tmp_path / "run")
    assert (step_of(ckpts / checkpoint.LATEST), step_of(ckpts / checkpoint.PREVIOUS)) == (6, 3)
    assert losses[5] > 1e4
    assert str(stop.value) == (f"the training loss became inf/NaN by step 9 (precision=fp32); stopping, keeping the "
                               f"checkpoint of step 6 ({ckpts / checkpoint.LATEST}), whose training loss at that step was "
                               f"{losses[5]:.4g}{TRY}")


def test_a_divergence_before_the_first_save_says_there_is_no_checkpoint(make_cfg, monkeypatch, tmp_path):
    t = Trainer(make_cfg(*SMALL, "precision=fp32", "trainer.max_steps=10", "trainer.log_every=2",
                         "trainer.save_every=100"), progress=False)
    poison(monkeypatch, t, dict.fromkeys(range(2, 11), math.nan))
    with pytest.raises(NonFiniteLossError) as stop:
        t.fit()
    assert str(stop.value) == ("the training loss became inf/NaN by step 2 (precision=fp32); stopping, with no "
                               f"checkpoint saved (the first was due at step 10, the last){TRY}")
    assert not checkpoint.checkpoint_dir(tmp_path / "run").exists()


def test_a_resumed_run_that_diverges_before_its_first_save_names_the_checkpoint_it_resumed_from(make_cfg,
                                                                                                 monkeypatch, tmp_path):
    """The checkpoint carries the loss its last step had: the resumed run can name it without having logged it."""
    first = Trainer(make_cfg(*SMALL, "trainer.max_steps=4", "trainer.log_every=3", "trainer.save_every=4"),
                    progress=False)
    losses = poison(monkeypatch, first, {})
    first.fit()
    resumed = Trainer(make_cfg(*SMALL, "trainer.max_steps=10", "trainer.log_every=3", "trainer.save_every=4",
                               "trainer.resume=auto"), progress=False)
    poison(monkeypatch, resumed, dict.fromkeys(range(5, 11), math.nan))
    with pytest.raises(NonFiniteLossError) as stop:
        resumed.fit()
    latest = checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.LATEST
    assert f"by step 6 (precision=fp32); stopping, keeping the checkpoint of step 4 ({latest}), whose training loss " \
           f"at that step was {losses[3]:.4g} —" in str(stop.value)
    assert step_of(latest) == 4


def test_the_checkpointer_saves_at_its_cadence_and_the_last_step_and_guards_each_step_once(make_cfg, monkeypatch):
    """save_every=3 over 7 steps, log_every=2: saves after steps 3 and 6 and the last, 7; the divergence guard reads
    the device once at each step that logs or saves (2, 3, 4, 6, 7), once too on those that do both (6, 7)."""
    t = Trainer(make_cfg(*SMALL, "trainer.max_steps=7", "trainer.log_every=2", "trainer.save_every=3"), progress=False)
    guarded, saved = [], []
    check, save = divergence.check, checkpoint.save_checkpoint
    monkeypatch.setattr(divergence, "check", lambda progress, *rest: guarded.append(progress.step) or
                        check(progress, *rest))
    monkeypatch.setattr(checkpointer.checkpoint, "save_checkpoint", lambda *a, **kw: saved.append(t.step) or
                        save(*a, **kw))
    t.fit()
    assert (saved, guarded) == ([3, 6, 7], [2, 3, 4, 6, 7])


# -- trainer.target_loss: the run ends at its first evaluation at or below it -------------------------------------
# Evaluated every 2 steps of 8, logged every 5: an evaluation the run may stop at falls between log steps.
TARGETED = (*SMALL, "precision=fp32", "trainer.deterministic=true", "trainer.max_steps=8", "trainer.eval_every=2",
            "trainer.log_every=5", "trainer.save_every=100")


def test_an_evaluation_reaches_the_target_at_or_below_it_and_never_with_a_nan_loss(make_cfg):
    """The rule alone: equal reaches (and marks the record), one ulp above does not, nor does NaN, nor any loss
    without a target."""
    from minitrain.config import resolve
    from minitrain.loop import reached_target

    t, off = (resolve(make_cfg(*overrides)).trainer for overrides in (["trainer.target_loss=3.5"], []))
    for loss, reached in ((3.5, True), (1.0, True), (math.nextafter(3.5, 4), False), (math.nan, False)):
        record = {"step": 2, "val/loss": loss}
        assert (reached_target(record, t), record) == (reached, {"step": 2, "val/loss": loss,
                                                                 **({TARGET_REACHED: 3.5} if reached else {})}), loss
    assert not reached_target({"step": 2, "val/loss": 1.0}, off)


def targeted_run(make_cfg, out_dir, *overrides) -> tuple[dict, list[dict]]:
    """A run of TARGETED's settings in `out_dir`: what fit returns, and metrics.jsonl's step records."""
    returned = Trainer(make_cfg(*TARGETED, f"trainer.out_dir={out_dir}", *overrides), progress=False).fit()
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return returned, [r for r in map(json.loads, lines) if "step" in r]


def val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in records if "val/loss" in r}


def first_at_or_below(val: dict[int, float], target: float, after: int = 0) -> int:
    """The step an uncut run's evaluations say a run with this target stops at: the first at or below it, else the
    last."""
    return next((s for s, v in sorted(val.items()) if s > after and v <= target), max(val))


def test_a_run_stops_at_its_first_evaluation_at_or_below_the_target_and_ends_as_at_its_last_step(make_cfg, tmp_path):
    """The uncut run's evaluations (2, 4, 6, 8) set the targets. Its loss at step 4 exactly stops a run there: that
    step's record, complete as a last step's (the training columns too, though 4 is no log step) and marked, the
    checkpoint of step 4, the same losses as the uncut run, the console's line; one ulp lower goes on to the next
    evaluation below it (with trainer.save_every=0: no checkpoint), and below every evaluation the run is the uncut
    one. Resumed with its target, the stopped run trains to its next evaluation and stops there again."""
    _, uncut = targeted_run(make_cfg, tmp_path / "uncut")
    val = val_losses(uncut)
    assert sorted(val) == [2, 4, 6, 8] and not any(TARGET_REACHED in r for r in uncut)
    assert "train/loss" not in next(r for r in uncut if r["step"] == 2)  # without a target, evaluations log alone
    target = val[4]
    stop = first_at_or_below(val, target)
    assert stop < 8
    returned, cut = targeted_run(make_cfg, tmp_path / "cut", f"trainer.target_loss={target!r}")
    last = cut[-1]
    assert (last["step"], returned["step"], last[TARGET_REACHED], returned[TARGET_REACHED]) == (stop, stop, target,
                                                                                                target)
    assert val_losses(cut) == {s: v for s, v in val.items() if s <= stop}
    assert not any(TARGET_REACHED in r for r in cut[:-1])
    assert "train/loss" in last and "mem/peak_rss_gb" in last
    assert "mem/peak_rss_gb" in json.loads((tmp_path / "cut" / "memory.json").read_text())
    latest = checkpoint.checkpoint_dir(tmp_path / "cut") / checkpoint.LATEST
    assert step_of(latest) == stop
    said = (tmp_path / "cut" / "train.log").read_text()
    assert (f"target reached: validation loss {val[stop]:.4f} <= trainer.target_loss={target!r} at step {stop} of 8; "
            "the run ends here\n") in said
    assert f"finished: step {stop} of 8, " in said

    lower = math.nextafter(target, 0)
    _, below = targeted_run(make_cfg, tmp_path / "below", f"trainer.target_loss={lower!r}", "trainer.save_every=0")
    assert below[-1]["step"] == first_at_or_below(val, lower) > stop
    assert not checkpoint.checkpoint_dir(tmp_path / "below").exists()

    never = math.nextafter(min(val.values()), 0)
    _, whole = targeted_run(make_cfg, tmp_path / "never", f"trainer.target_loss={never!r}")
    assert whole[-1]["step"] == 8 and val_losses(whole) == val and not any(TARGET_REACHED in r for r in whole)
    assert step_of(checkpoint.checkpoint_dir(tmp_path / "never") / checkpoint.LATEST) == 8

    _, resumed = targeted_run(make_cfg, tmp_path / "cut", f"trainer.target_loss={target!r}", "trainer.resume=auto")
    again = first_at_or_below(val, target, after=stop)
    assert resumed[-1]["step"] == again and val_losses(resumed) == {s: v for s, v in val.items() if s <= again}
    assert (TARGET_REACHED in resumed[-1]) == (val[again] <= target) and step_of(latest) == again
