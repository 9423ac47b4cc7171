"""scripts/bench_recipe.py without a GPU (minitrain.tools.benchmarks.recipe): the target, the step that reaches it and
the wall times to it on run dirs written as the trainer writes them (a run made before trainer.target_loss existed
among them), which modern run is timed (the fastest to the target; a run stopped at its target counts, one stopped
otherwise not), where the modern runs' target comes from, the refusals, and the script end to end at the tiny
model's scale (its runs, their settings and targets, the comparison's lines and record)."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from minitrain.loop import TARGET_REACHED, UNTIMED_STEPS_COMPILED, UNTIMED_STEPS_EAGER
from minitrain.tools.benchmarks import recipe

from conftest import REPO, run_script

SCRIPT = str(REPO / "scripts" / "bench_recipe.py")


def write_run(root, name, optimizer, val, lr=6e-4, muon_lr=0.02, step_ms=100.0, warmup_s=30.0, max_steps=None,
              batch_size=4, block_size=64, compiled=True, stopped_at=None):
    """A run dir as the trainer leaves it: .hydra/config.yaml, and metrics.jsonl's plan then a record at each of
    `val`'s steps, logged and evaluated (step_ms: one figure for every interval, or a figure per step); the record of
    step `stopped_at` marked as the one that reached the run's target."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    steps = sorted(val)
    config = {"model": {"name": "tiny", "block_size": block_size},
              "optimizer": {"name": optimizer, "muon": {"lr": muon_lr}},
              "trainer": {"lr": lr, "batch_size": batch_size, "max_steps": max_steps or steps[-1]}}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    untimed = UNTIMED_STEPS_COMPILED if compiled else UNTIMED_STEPS_EAGER
    records = [{"plan": {"optimizer_name": optimizer, "compile_mode": "max-autotune" if compiled else "eager"}}]
    for i, s in enumerate(steps):
        r = {"step": s, "tokens": s * batch_size * block_size, "train/loss": val[s]}
        if i == 0 and warmup_s is not None:
            r["perf/warmup_s"] = warmup_s
        if s > untimed:
            r["perf/step_ms"] = step_ms[s] if isinstance(step_ms, dict) else step_ms
        records.append({**r, "val/loss": val[s], **({TARGET_REACHED: val[s]} if s == stopped_at else {})})
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    return run


def compare(*runs):
    return recipe.compare([recipe.read_run(r) for r in runs])


def test_the_target_is_the_best_gpt2_runs_final_loss_and_a_loss_equal_to_it_reaches_it(tmp_path):
    target = 3.5
    gpt2 = [write_run(tmp_path, "g1", "adamw", {10: 4.5, 20: 4.0, 30: 3.75}),
            write_run(tmp_path, "g2", "adamw", {10: 4.4, 20: 3.2, 30: target}, lr=1.2e-3),  # best final, not best
            write_run(tmp_path, "g3", "adamw", {10: 4.0, 20: 3.0}, max_steps=30)]  # stopped early: no candidate
    equal = write_run(tmp_path, "m1", "muon", {10: 4.0, 20: target, 30: 3.0})
    result = compare(*gpt2, equal)
    assert result["target"] == target and result["gpt2"]["dir"].endswith("g2") and result["gpt2"]["lr"] == 1.2e-3
    assert (result["modern"]["step"], result["modern"]["loss"], result["modern"]["tokens"]) == (20, target, 20 * 256)
    above = write_run(tmp_path, "m2", "muon", {10: 4.0, 20: math.nextafter(target, math.inf), 30: 3.0})
    assert compare(*gpt2, above)["modern"]["step"] == 30  # one ulp above the target does not reach it


def test_the_modern_recipes_best_run_reaches_the_target_in_the_least_wall_time_else_it_ends_lowest(tmp_path):
    """Target 3.5. Compile excluded: `slow` reaches it at step 10 in 10 s (1 s steps), `fast` at step 20 in 2 s (after
    the longest compile: 100 s), `low` at step 30 in 3 s and ends lowest: `fast` is timed, neither the fewest steps,
    the least time with the compile nor the lowest final loss. Where no run reaches the target, the lowest final loss
    is the run reported."""
    gpt2 = write_run(tmp_path, "g", "adamw", {10: 4.0, 20: 3.8, 30: 3.5})
    slow = write_run(tmp_path, "slow", "muon", {10: 3.4, 20: 3.3, 30: 3.2}, muon_lr=0.04, step_ms=1000.0)
    fast = write_run(tmp_path, "fast", "muon", {10: 3.9, 20: 3.45, 30: 3.3}, muon_lr=0.02, warmup_s=100.0)
    low = write_run(tmp_path, "low", "muon", {10: 3.9, 20: 3.6, 30: 2.0}, muon_lr=0.01)
    result = compare(gpt2, slow, fast, low)
    assert (result["modern"]["dir"], result["modern"]["lr"], result["modern"]["step"]) == (str(fast), 0.02, 20)
    assert result["modern"]["wall_s_compile_excluded"] == pytest.approx(2.0)
    above = [write_run(tmp_path, f"a{i}", "muon", {10: 3.9, 20: final, 30: final}, muon_lr=lr)
             for i, (final, lr) in enumerate([(3.7, 0.04), (3.6, 0.02), (3.8, 0.01)])]
    result = compare(gpt2, *above)
    assert (result["modern"]["dir"], result["modern"]["step"], result["modern"]["final"]) == (str(above[1]), None, 3.6)


def test_a_modern_run_stopped_at_its_target_is_a_candidate_and_one_stopped_otherwise_is_not(tmp_path):
    """Budget 30 steps, target 3.5 (the GPT-2 run's). `at_target` stopped at step 20 at its own target (marked): it
    reaches the target there, before `full` (which ran its budget, as every run made before trainer.target_loss did).
    The same run unmarked (a crash, a stop request), marked but logging on after (resumed, then stopped), or stopped
    at a higher target of its own that this one is below is no candidate; nor sets a GPT-2 run stopped short of its
    budget the target, marked or not."""
    gpt2 = write_run(tmp_path, "g", "adamw", {10: 4.0, 20: 3.8, 30: 3.5})
    full = write_run(tmp_path, "full", "muon", {10: 3.9, 20: 3.6, 30: 3.4}, muon_lr=0.01)
    at_target = write_run(tmp_path, "at_target", "muon", {10: 3.9, 20: 3.45}, max_steps=30, stopped_at=20)
    result = compare(gpt2, full, at_target)
    assert (result["modern"]["dir"], result["modern"]["step"], result["modern"]["loss"]) == (str(at_target), 20, 3.45)
    runs = [recipe.read_run(r) for r in (gpt2, full, at_target)]
    assert recipe.compare_report(runs, recipe.compare(runs))[2] == (
        "modern recipe optimizer.muon.lr=0.02: stopped at its target (trainer.target_loss) at step 20 of 30, "
        "validation loss 3.4500")
    not_candidates = {"killed": dict(val={10: 3.9, 20: 3.45}),
                      "resumed_then_killed": dict(val={10: 3.9, 20: 3.45, 25: 3.44}, stopped_at=20),
                      "higher_target": dict(val={10: 3.55}, stopped_at=10)}
    for name, kw in not_candidates.items():
        run = write_run(tmp_path, name, "muon", max_steps=30, **kw)
        assert compare(gpt2, full, run)["modern"]["dir"] == str(full), name
    short = write_run(tmp_path, "g_short", "adamw", {10: 3.0}, max_steps=30, stopped_at=10, lr=1.2e-3)
    assert compare(gpt2, short, full)["target"] == 3.5


def test_the_modern_runs_target_is_given_else_the_gpt2_runs_in_work_set_it(tmp_path):
    """--target wins; else the best final loss of the finished GPT-2 runs in WORK/gpt2, exact (a stopped one lower
    sets nothing), passed as trainer.target_loss; none there, no target; GPT-2 runs of another budget are refused."""
    budget = 30 * 4 * 64
    gpt2 = tmp_path / "work" / "gpt2"
    assert recipe.modern_target(None, gpt2, budget) == ([], (
        f"modern recipe: no target known (no finished run of the GPT-2 recipe in {gpt2}, no --target): its runs run "
        "their whole budget"))
    write_run(gpt2, "stopped", "adamw", {10: 3.0}, max_steps=30)
    assert recipe.modern_target(None, gpt2, budget)[0] == []
    best = write_run(gpt2, "best", "adamw", {10: 4.0, 20: 3.8, 30: 3.4999999999999996})
    write_run(gpt2, "worse", "adamw", {10: 4.0, 20: 3.8, 30: 3.6}, lr=1.2e-3)
    assert recipe.modern_target(None, gpt2, budget) == (["trainer.target_loss=3.4999999999999996"], (
        f"modern recipe: its runs stop at their first evaluation at or below 3.4999999999999996 (the GPT-2 recipe's "
        f"best final validation loss, {best})"))
    assert recipe.modern_target(3.25, gpt2, budget) == (["trainer.target_loss=3.25"], (
        "modern recipe: its runs stop at their first evaluation at or below 3.25 (--target)"))
    with pytest.raises(recipe.RecipeError, match=r"ran a budget of 7,680 tokens, not this one's 15,360"):
        recipe.modern_target(None, gpt2, 2 * budget)


def test_wall_times_to_a_step_sum_the_timed_intervals_and_count_the_warm_up_either_way(tmp_path):
    """Compiled runs: steps 1-3 warm up (30 s and 20 s measured); log intervals of 10 steps. The GPT-2 run's 40 steps:
    7 timed steps at 0.1 s, then 10 at 0.2, 10 at 0.3, 10 at 0.1 = 6.7 s timed; the modern run reaches the target at
    step 20: 7 x 0.05 + 10 x 0.1 = 1.35 s."""
    gpt2 = write_run(tmp_path, "g", "adamw", {10: 4.0, 20: 3.8, 30: 3.6, 40: 3.5},
                     step_ms={10: 100.0, 20: 200.0, 30: 300.0, 40: 100.0})
    modern = write_run(tmp_path, "m", "muon", {10: 3.9, 20: 3.45, 30: 3.3, 40: 3.2},
                       step_ms={10: 50.0, 20: 100.0, 30: 100.0, 40: 100.0}, warmup_s=20.0)
    result = compare(gpt2, modern)
    g, m = result["gpt2"], result["modern"]
    assert g["wall_s_compile_excluded"] == pytest.approx(6.7 / 37 * 40)
    assert g["wall_s_compile_included"] == pytest.approx(6.7 + 30.0)
    assert m["wall_s_compile_excluded"] == pytest.approx(1.35 / 17 * 20)
    assert m["wall_s_compile_included"] == pytest.approx(1.35 + 20.0)
    assert result["ratio_compile_excluded"] == pytest.approx((1.35 / 17 * 20) / (6.7 / 37 * 40))
    assert result["ratio_compile_included"] == pytest.approx(21.35 / 36.7)
    eager = recipe.read_run(write_run(tmp_path, "e", "adamw", {2: 4.0, 4: 3.0}, step_ms=100.0, compiled=False))
    assert recipe.wall_times(eager, 4) == pytest.approx((0.3 / 3 * 4, 0.3 + 30.0))  # an eager run warms up 1 step
    unrecorded = recipe.read_run(write_run(tmp_path, "u", "adamw", {10: 4.0}, warmup_s=None))
    assert recipe.wall_times(unrecorded, 10) == pytest.approx((0.7 / 7 * 10, None))


def test_a_modern_recipe_that_never_reaches_the_target_is_reported_as_such(tmp_path):
    gpt2 = write_run(tmp_path, "g", "adamw", {10: 4.0, 20: 3.5})
    modern = write_run(tmp_path, "m", "muon", {10: 4.1, 20: 3.6})
    diverged = write_run(tmp_path, "d", "muon", {10: 3.0, 20: None})  # below the target first, then non-finite
    runs = [recipe.read_run(r) for r in (gpt2, modern, diverged)]
    result = recipe.compare(runs)
    assert result["modern"]["step"] is None and result["ratio_compile_excluded"] is None
    assert result["modern"]["dir"] == str(modern)
    lines = recipe.compare_report(runs, result)
    assert lines[-1] == "modern recipe (optimizer.muon.lr=0.02): never reaches the target in 5,120 tokens (its final " \
                        "validation loss 3.6000)"
    assert any(line.endswith("NON-FINITE") for line in lines)
    assert recipe.compare(runs[::2])["modern"]["step"] is None  # a diverged run reaches nothing, even before it
    alone = [recipe.read_run(diverged)]
    with pytest.raises(recipe.RecipeError, match="no runs of the GPT-2 recipe"):
        recipe.compare(alone)


def test_gpt2_runs_of_different_token_budgets_are_refused_and_a_modern_runs_own_budget_is_not(tmp_path):
    """Steps alike but a larger batch, or batch alike but more steps: either is another budget, which the GPT-2 runs
    may not differ in (their best final loss is the target); a modern run of its own budget is timed to the target,
    and told as never reaching it in its own budget."""
    gpt2 = write_run(tmp_path, "g", "adamw", {10: 4.0, 20: 3.5})
    for name, settings in {"batch": dict(batch_size=8), "steps": dict(max_steps=40)}.items():
        other = write_run(tmp_path, name, "adamw", {10: 3.9, 20: 3.4}, **settings)
        with pytest.raises(recipe.RecipeError, match="the GPT-2 recipe's runs' token budgets differ"):
            compare(gpt2, other, write_run(tmp_path, f"m-{name}", "muon", {10: 3.9, 20: 3.4}))
    longer = write_run(tmp_path, "longer", "muon", {10: 3.9, 20: 3.4, 40: 3.0}, stopped_at=20, max_steps=40)
    result = compare(gpt2, longer)
    assert (result["budget_tokens"], result["modern"]["step"], result["modern"]["budget_tokens"]) == (5120, 20, 10240)
    never = [recipe.read_run(r) for r in (gpt2, write_run(tmp_path, "short", "muon", {10: 3.9}))]
    assert recipe.compare_report(never, recipe.compare(never))[-1] == (
        "modern recipe (optimizer.muon.lr=0.02): never reaches the target in 2,560 tokens (its final validation "
        "loss 3.9000)")
    out = subprocess.run([sys.executable, SCRIPT, "--compare", str(gpt2), str(tmp_path / "batch"), str(longer),
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("error: --compare: the GPT-2 recipe's runs' token budgets differ: ")
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("target", ["0", "-1", "nan", "inf"])
def test_a_target_that_is_no_loss_above_0_is_refused(tmp_path, monkeypatch, capsys, target):
    """Refused before any run is made or read (--compare here: a bad target must not start a GPT-2 run)."""
    argv = ["--target", target, "--compare", tmp_path / "none", "--out", tmp_path / "r.json"]
    code, out, err = run_script("bench_recipe", argv, monkeypatch, capsys)
    assert (code, out) == (2, "") and err.endswith(f"error: --target must be a validation loss > 0, got "
                                                   f"{float(target)}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, value, message", [
    ("--tokens", "255", "--tokens 255 is less than one step of 8 x 32"),
    ("--modern-tokens", "255", "--modern-tokens 255 is less than one step of 8 x 32"),
    ("--modern-tokens", "0", "--modern-tokens must be at least 1")])
def test_a_budget_under_one_step_is_refused_naming_its_option(tmp_path, monkeypatch, capsys, option, value, message):
    """Refused before any run is made or read (--compare: a budget let through must not start a run)."""
    argv = ["--compare", tmp_path / "none", "--batch-size", "8", "--block-size", "32", option, value]
    code, out, err = run_script("bench_recipe", argv, monkeypatch, capsys)
    assert (code, out) == (2, "") and err.endswith(f"error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_that_holds_a_run_is_not_run_into(tmp_path):
    """A second run there would be refused by the trainer's lock only while the first runs; a finished one stays."""
    done = write_run(tmp_path, "done", "adamw", {10: 4.0})
    with pytest.raises(recipe.RecipeError, match=f"--work: {done} already holds a run"):
        recipe.run_cell(done, ["model=tiny"])
    assert not (tmp_path / "done.log").exists()


def test_the_script_runs_both_recipes_and_compares_them(tmp_path, data_cache):
    """Both sides at the tiny model's scale, 4 steps of 8 x 32 tokens evaluated every 2 on 1 batch (each option a
    value of its own, so that one passed as another is seen; --recipes in the other order: the GPT-2 side still runs
    first): each run's settings as the script sets them, the modern run's the GPT-2 runs' target, the lines it
    prints, its record and plot; then --compare on the same dirs prints the same."""
    work, out = tmp_path / "work", tmp_path / "r.json"
    args = ["--work", str(work), "--tokens", "1100", "--batch-size", "8", "--block-size", "32", "--eval-every", "2",
            "--eval-batches", "1", "--gpt2", "model=tiny", "--modern", "model=tiny", "optimizer=muon",
            "model.position=rope", "--gpt2-lrs", "1e-3,2e-3", "--modern-lrs", "0.02", "--data", "data=stdlib",
            "--extra", f"data.cache_dir={data_cache}", "logger.mode=disabled", "--out", str(out), "--recipes", "modern",
            "gpt2"]
    run = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    cells = {"gpt2/0.001": ("trainer", "lr", 1e-3), "gpt2/0.002": ("trainer", "lr", 2e-3),
             "modern/0.02": ("optimizer", "muon", 0.02)}
    for cell, (group, key, lr) in cells.items():
        config = yaml.safe_load((work / cell / ".hydra" / "config.yaml").read_text())
        t = config["trainer"]
        assert (t["max_steps"], t["batch_size"], config["model"]["block_size"]) == (4, 8, 32)  # 1100 // 256 steps
        assert (t["eval_every"], t["log_every"], t["eval_batches"], t["save_every"], t["deterministic"]) == \
            (2, 2, 1, 4, True)
        assert (config[group][key] if key == "lr" else config[group][key]["lr"]) == lr
    assert yaml.safe_load((work / "modern/0.02/.hydra/config.yaml").read_text())["model"]["position"] == "rope"
    finals = {cell: recipe.read_run(work / cell) for cell in cells}
    target = min(finals["gpt2/0.001"]["val"][4], finals["gpt2/0.002"]["val"][4])
    targets = {cell: yaml.safe_load((work / cell / ".hydra" / "config.yaml").read_text())["trainer"]["target_loss"]
               for cell in cells}
    assert targets == {"gpt2/0.001": None, "gpt2/0.002": None, "modern/0.02": target}
    modern = finals["modern/0.02"]
    reached = recipe.steps_to_reach(modern, target)  # the run's first evaluation at or below the target: its last
    assert (modern["last_step"], modern["stopped_at_target"]) == ((reached, True) if reached else (4, False))
    best = min(("gpt2/0.001", "gpt2/0.002"), key=lambda cell: finals[cell]["val"][4])
    assert run.stdout.splitlines()[2] == ("modern recipe: its runs stop at their first evaluation at or below "
                                          f"{target!r} (the GPT-2 recipe's best final validation loss, {work / best})")
    assert "exit code" not in run.stdout
    saved = json.loads(out.read_text())
    assert saved["target"] == target and saved["budget_tokens"] == 1024 and len(saved["runs"]) == 3
    assert all(r["warmup_s"] > 0 for r in saved["runs"])  # the trainer's first log record holds its warm-up's time
    assert f"target: {target:.4f}, the GPT-2 recipe's best final validation loss" in run.stdout
    assert "GPT-2 recipe: 4 steps, 1,024 tokens, wall time " in run.stdout
    assert "modern recipe (optimizer.muon.lr=0.02): " in run.stdout
    assert (tmp_path / "r.png").stat().st_size > 0
    again = subprocess.run([sys.executable, SCRIPT, "--compare", str(work / "gpt2"), str(work / "modern"), "--out",
                            str(tmp_path / "again.json"), "--plot", str(tmp_path / "again.png")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines()[:-1] == run.stdout.splitlines()[4:-1]  # the same lines, after the runs' own


def test_the_script_stops_the_modern_runs_at_the_target_of_the_gpt2_runs_in_work_or_at_target(tmp_path, data_cache):
    """The modern side alone, after GPT-2 runs of the same budget (4 steps of 8 x 32) in WORK/gpt2 whose best final
    loss is 9.0, above the tiny model's first evaluation (about ln 4096 = 8.3): its run stops there, at step 2 of 4,
    with its checkpoint, its own budget (--modern-tokens: 8 steps) not the one WORK/gpt2's runs are checked against;
    a second call's --target 8.75 wins over WORK/gpt2's. --compare then times those runs, each stopped at its
    target."""
    work = tmp_path / "work"
    write_run(work / "gpt2", "6e-04", "adamw", {2: 9.5, 4: 9.0}, batch_size=8, block_size=32)
    args = ["--work", str(work), "--recipes", "modern", "--tokens", "1100", "--batch-size", "8", "--block-size", "32",
            "--eval-every", "2", "--eval-batches", "1", "--modern", "model=tiny", "optimizer=muon", "--data",
            "data=stdlib", "--extra", f"data.cache_dir={data_cache}", "logger.mode=disabled"]
    for lr, given, target, steps in (("0.02", ["--modern-tokens", "2200"], 9.0, 8), ("0.01", ["--target", "8.75"],
                                                                               8.75, 4)):
        run = subprocess.run([sys.executable, SCRIPT, *args, "--modern-lrs", lr, *given], capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0 and "exit code" not in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
        assert run.stdout.splitlines()[0].startswith(f"modern recipe: its runs stop at their first evaluation at or "
                                                     f"below {target} (")
        cell = work / "modern" / lr
        trainer = yaml.safe_load((cell / ".hydra" / "config.yaml").read_text())["trainer"]
        assert (trainer["target_loss"], trainer["max_steps"]) == (target, steps)
        ran = recipe.read_run(cell)
        assert (ran["last_step"], ran["stopped_at_target"], ran["finished"]) == (2, True, False)
        assert (cell / "checkpoints" / "latest").is_dir()
    again = subprocess.run([sys.executable, SCRIPT, "--compare", str(work / "gpt2"), str(work / "modern"), "--out",
                            str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (saved["target"], saved["modern"]["step"]) == (9.0, 2)


def test_each_ablation_undoes_one_option_of_the_modern_recipe_and_together_they_undo_all(tmp_path):
    """After the modern recipe's overrides, each ablation's override sets one key to the GPT-2 recipe's value and
    leaves every other as the modern recipe has it; every key on which the two recipes differ has its ablation."""
    from minitrain.cli import compose_config

    def settings(overrides):
        cfg = compose_config([*overrides, f"trainer.out_dir={tmp_path}"])
        return {f"model.{k}": v for k, v in cfg.model.items() if k != "name"} | {"optimizer": cfg.optimizer.name}

    modern, gpt2 = settings(recipe.RECIPES["modern"]), settings(recipe.RECIPES["gpt2"])
    differ = {k for k in modern if modern[k] != gpt2[k]}
    undone = {}
    for name, override in recipe.ABLATIONS.items():
        changed = {k for k, v in settings([*recipe.RECIPES["modern"], override]).items() if v != modern[k]}
        assert len(changed) == 1, (name, changed)
        key = changed.pop()
        assert settings([*recipe.RECIPES["modern"], override])[key] == gpt2[key] and name in key, name
        undone[key] = name
    assert set(undone) == differ
    assert {name: recipe.ablation_side(name) for name in recipe.ABLATIONS} == {
        **{name: "modern" for name in recipe.ABLATIONS if name != "optimizer"}, "optimizer": "gpt2"}


def write_ablation(work, name, val, **kw):
    optimizer = "adamw" if name == "optimizer" else "muon"
    return write_run(work / recipe.ABLATE_DIR / name, str(kw.pop("muon_lr", 0.02)), optimizer, val, **kw)


def test_the_ablation_compares_each_options_best_run_with_the_modern_recipes_best(tmp_path):
    """No target: the lowest final loss of each dir is its row (WORK/modern's the reference), with its difference from
    the reference's and its median step time; a row with a target: the first evaluation at or below it, the wall time
    there (compile excluded) and its ratio to the reference's; a row that never reaches it says so, and one stopped
    at a target has no final loss."""
    work = tmp_path / "work"
    write_run(work / "modern", "0.01", "muon", {10: 3.9, 20: 3.25, 30: 3.2}, muon_lr=0.01, step_ms=50.0)
    ref = write_run(work / "modern", "0.02", "muon", {10: 3.8, 20: 3.4, 30: 3.0}, step_ms=100.0)
    qk = write_ablation(work, "qk_norm", {10: 3.9, 20: 3.3, 30: 3.25}, step_ms=80.0)
    write_ablation(work, "qk_norm", {10: 3.9, 20: 3.6, 30: 3.5}, muon_lr=0.01)  # listed first, not the best
    adamw = write_ablation(work, "optimizer", {10: 4.0, 20: 3.9, 30: 3.75}, lr=6e-4,
                           step_ms={10: 20.0, 20: 30.0, 30: 100.0})
    write_ablation(work, "mlp", {10: 3.9, 20: 3.3}, max_steps=30, stopped_at=20)  # at a target of its own
    result = recipe.ablation(work, None)
    assert (result["target"], result["budget_tokens"], result["modern"]["dir"]) == (None, 30 * 256, str(ref))
    assert list(result["ablations"]) == ["qk_norm", "mlp", "optimizer"]  # ABLATIONS' order
    assert (result["ablations"]["mlp"]["final"], result["ablations"]["mlp"]["final_delta"]) == (None, None)
    row = result["ablations"]["qk_norm"]
    assert (row["dir"], row["override"], row["lr_key"], row["lr"]) == (str(qk), "model.qk_norm=false",
                                                                        "optimizer.muon.lr", 0.02)
    assert (row["final"], row["final_delta"], row["median_step_ms"]) == (3.25, pytest.approx(0.25), 80.0)
    assert (row["step"], row["wall_s_compile_excluded"], row["wall_ratio"]) == (None, None, None)
    row = result["ablations"]["optimizer"]
    assert (row["dir"], row["lr_key"], row["lr"], row["median_step_ms"]) == (str(adamw), "trainer.lr", 6e-4, 30.0)
    assert recipe.ablation_report(result) == [
        "ablation, 7,680 tokens a run, target none: each runs its budget",
        "modern recipe (optimizer.muon.lr=0.02): final validation loss 3.0000 | 100.00 ms/step",
        "  model.qk_norm=false (optimizer.muon.lr=0.02): final validation loss 3.2500 (+0.2500) | 80.00 ms/step",
        "  model.mlp=gelu (optimizer.muon.lr=0.02): final validation loss none (stopped at the target) | 100.00 ms/step",
        "  optimizer=adamw (trainer.lr=0.0006): final validation loss 3.7500 (+0.7500) | 30.00 ms/step"]
    result = recipe.ablation(work, 3.3)  # the 0.01 run reaches it at step 20 in 1 s, `ref` at step 30 in 3 s
    assert (result["modern"]["lr"], result["modern"]["step"], result["modern"]["wall_s_compile_excluded"]) == \
        (0.01, 20, pytest.approx(1.0))
    assert (result["ablations"]["qk_norm"]["step"], result["ablations"]["qk_norm"]["wall_ratio"]) == \
        (20, pytest.approx(1.6))
    assert recipe.ablation_report(result)[1:3] == [
        "modern recipe (optimizer.muon.lr=0.01): final validation loss 3.2000 | the target at step 20, 1.0 s | "
        "50.00 ms/step",
        "  model.qk_norm=false (optimizer.muon.lr=0.02): final validation loss 3.2500 (+0.0500) | the target at step "
        "20, 1.6 s (1.600x) | 80.00 ms/step"]
    assert recipe.ablation_report(result)[3:] == [
        "  model.mlp=gelu (optimizer.muon.lr=0.02): final validation loss none (stopped at the target) | the target at "
        "step 20, 2.0 s (2.000x) | 100.00 ms/step",
        "  optimizer=adamw (trainer.lr=0.0006): final validation loss 3.7500 (+0.5500) | never reaches the target | "
        "30.00 ms/step"]


def test_the_ablation_refuses_rows_of_another_budget_and_needs_its_reference(tmp_path):
    """A row of 20 steps against a reference of 30 is refused (its loss would differ for that alone); no reference in
    WORK/modern, or no row, is an error naming the dir."""
    work = tmp_path / "work"
    write_ablation(work, "mlp", {10: 3.9, 20: 3.25})
    with pytest.raises(recipe.RecipeError, match=f"no run of the modern recipe in {work / 'modern'}"):
        recipe.ablation(work, None)
    write_run(work / "modern", "0.02", "muon", {10: 3.8, 20: 3.0, 30: 2.9})
    with pytest.raises(recipe.RecipeError, match=r"mlp/0.02 ran a budget of 5,120 tokens, not the modern recipe's "
                                                 r"7,680 \(.*modern/0.02\): an ablation runs its reference's budget"):
        recipe.ablation(work, None)
    alone = tmp_path / "alone"
    write_run(alone / "modern", "0.02", "muon", {10: 3.8, 20: 3.0})
    with pytest.raises(recipe.RecipeError, match=f"no ablation run in {alone / recipe.ABLATE_DIR}"):
        recipe.ablation(alone, None)


def test_the_script_ablates_the_options_named_against_the_modern_runs_in_work(tmp_path, data_cache):
    """The modern side (model=tiny with QK-norm, Muon), then --ablate qk_norm optimizer in a second call, at its own
    budget (--modern-tokens: 8 steps of 8 x 32, not --tokens' 4, the budget of the GPT-2 run in WORK/gpt2 whose final
    loss 9.0 is the target, above the tiny model's first evaluation): each cell's settings (the option undone, the
    rest the recipe's; the optimizer row AdamW at --gpt2-lrs' trainer.lr; every one stopping at the target), the
    lines it prints and its record, which --ablate --compare WORK prints again without running; --ablate with
    --recipes is refused, so is --compare with options, and an option it does not know."""
    work, out = tmp_path / "work", tmp_path / "a.json"
    gpt2 = write_run(work / "gpt2", "6e-04", "adamw", {2: 9.5, 4: 9.0}, batch_size=8, block_size=32)
    args = ["--work", str(work), "--tokens", "1100", "--modern-tokens", "2200", "--batch-size", "8", "--block-size",
            "32", "--eval-every", "2", "--eval-batches", "1", "--modern", "model=tiny", "optimizer=muon",
            "model.qk_norm=true", "--gpt2-lrs", "1e-3", "--modern-lrs", "0.02", "--data", "data=stdlib", "--extra",
            f"data.cache_dir={data_cache}", "logger.mode=disabled"]
    for more in (["--recipes", "modern"], ["--ablate", "qk_norm", "optimizer", "--out", str(out)]):
        run = subprocess.run([sys.executable, SCRIPT, *args, *more], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "exit code" not in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    configs = {cell: yaml.safe_load((work / cell / ".hydra" / "config.yaml").read_text())
               for cell in ("modern/0.02", "ablate/qk_norm/0.02", "ablate/optimizer/0.001")}
    settings = {cell: (c["model"]["qk_norm"], c["optimizer"]["name"], c["trainer"]["lr"], c["optimizer"]["muon"]["lr"],
                       c["trainer"]["max_steps"], c["trainer"]["target_loss"]) for cell, c in configs.items()}
    assert settings == {"modern/0.02": (True, "muon", 1e-3, 0.02, 8, 9.0),
                        "ablate/qk_norm/0.02": (False, "muon", 1e-3, 0.02, 8, 9.0),
                        "ablate/optimizer/0.001": (True, "adamw", 1e-3, 0.02, 8, 9.0)}
    result = recipe.ablation(work, 9.0)
    rows = (result["modern"], *result["ablations"].values())
    assert [(row["step"], row["final"]) for row in rows] == [(2, None)] * 3  # stopped there: no final loss
    lines = run.stdout.splitlines()
    assert lines[:3] == ["modern recipe: its runs stop at their first evaluation at or below 9.0 (the GPT-2 recipe's "
                         f"best final validation loss, {gpt2})",
                         "modern recipe with model.qk_norm=false optimizer.muon.lr=0.02: "
                         f"{work / 'ablate/qk_norm/0.02'}",
                         f"modern recipe with optimizer=adamw trainer.lr=0.001: {work / 'ablate/optimizer/0.001'}"]
    assert lines[3:] == [*recipe.ablation_report(result), f"record {out}"]
    assert lines[3] == "ablation, 2,048 tokens a run, target 9.0000"
    saved = json.loads(out.read_text())
    assert {k: saved[k] for k in result} == json.loads(json.dumps(result))
    again = subprocess.run([sys.executable, SCRIPT, "--tokens", "1100", "--batch-size", "8", "--block-size", "32",
                            "--ablate", "--compare", str(work), "--out", str(tmp_path / "again.json")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.splitlines() == [*lines[3:-1], f"record {tmp_path / 'again.json'}"]
    for more, message in ((["--recipes", "modern", "--ablate"], "--ablate runs instead of --recipes: give one"),
                          (["--ablate", "qk_norm", "--compare", str(work)], "--ablate --compare WORK reports the "
                           "ablation runs made in WORK: no option, one dir"),
                          (["--ablate", "rope"], "argument --ablate: invalid choice: 'rope'")):
        run = subprocess.run([sys.executable, SCRIPT, *args, *more], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
