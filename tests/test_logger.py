import json

import pytest

from minitrain import logger as logger_module
from minitrain.config import LoggerConfig, LoggerMode
from minitrain.errors import ConfigError
from minitrain.logger import RunLogger

QUIET = LoggerConfig(mode=LoggerMode.disabled)


def run_logger(out_dir, **kwargs) -> RunLogger:
    return RunLogger(QUIET, out_dir, config={}, run_id=None, group=None, name=None, **kwargs)


def strict_records(path) -> list[dict]:
    """Every line as a strict JSON reader sees it: a bare NaN or Infinity fails the test."""
    def reject(constant):
        raise AssertionError(f"non-JSON constant {constant} in {path.name}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def steps(out_dir) -> list:
    return [r.get("step") for r in strict_records(out_dir / "metrics.jsonl")]


def test_non_finite_values_are_written_as_null_at_any_depth(tmp_path):
    log = run_logger(tmp_path)
    log.log({"step": 1, "train/loss": float("nan"), "opt/grad_norm": float("inf"), "amp/loss_scale": 1024.0,
             "per_rank": {"loss": [1.5, float("-inf")], "inner": {"x": float("nan")}}}, console=False)
    log.log({"step": 2, "train/loss": 2.5}, console=False)
    first, second = strict_records(tmp_path / "metrics.jsonl")
    assert first == {"step": 1, "train/loss": None, "opt/grad_norm": None, "amp/loss_scale": 1024.0,
                     "per_rank": {"loss": [1.5, None], "inner": {"x": None}}}
    assert second == {"step": 2, "train/loss": 2.5}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_a_resumed_run_drops_the_records_after_its_checkpoint(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    write_lines(jsonl, [json.dumps({"plan": {"micro_batch": 4}})]
                + [json.dumps({"step": s, "train/loss": 10.0 - s}) for s in range(2, 12, 2)]
                + ['{"step": 12, "train/lo'])  # the torn line of the killed run
    log = run_logger(tmp_path, resume_step=6)
    assert steps(tmp_path) == [None, 2, 4, 6]
    log.log({"step": 8, "train/loss": 2.0}, console=False)
    assert steps(tmp_path) == [None, 2, 4, 6, 8]
    assert strict_records(jsonl)[0] == {"plan": {"micro_batch": 4}}


def test_a_fresh_start_drops_the_records_of_a_run_that_saved_no_checkpoint_and_counts_them(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    write_lines(jsonl, [json.dumps({"plan": {"micro_batch": 4}})] + [json.dumps({"step": s}) for s in (1, 2)])
    log = run_logger(tmp_path)  # a fresh start is a resume from step 0: the dead run's records would be continued
    assert steps(tmp_path) == [None] and log.dropped_records == 2
    assert run_logger(tmp_path).dropped_records == 0


def test_a_failed_rewrite_leaves_the_old_file_whole(tmp_path, monkeypatch):
    jsonl = tmp_path / "metrics.jsonl"
    write_lines(jsonl, [json.dumps({"step": s}) for s in range(1, 6)])
    before = jsonl.read_text()
    real, written = logger_module._json_line, []

    def fail_on_the_third(record):
        written.append(record)
        if len(written) == 3:
            raise OSError("disk full")
        return real(record)

    monkeypatch.setattr(logger_module, "_json_line", fail_on_the_third)
    with pytest.raises(OSError):
        run_logger(tmp_path, resume_step=4)
    assert jsonl.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_console_lines_also_go_to_train_log(tmp_path, capsys):
    log = run_logger(tmp_path)
    log.print("minitrain: tiny on cpu")
    log.log({"step": 5, "train/loss": 3.25})
    assert (tmp_path / "train.log").read_text() == "minitrain: tiny on cpu\nstep      5 | loss 3.2500\n"
    assert "loss 3.2500" in capsys.readouterr().out


def test_ranks_other_than_0_write_nothing(tmp_path):
    log = run_logger(tmp_path, enabled=False, resume_step=3)
    log.print("hello")
    log.log({"step": 1, "train/loss": 1.0})
    log.log_plan({"world_size": 2})
    assert list(tmp_path.iterdir()) == []


class FakeWandbRun:
    def __init__(self):
        self.config_updates = []
        self.config = self

    def update(self, values, allow_val_change=False):
        self.config_updates.append((values, allow_val_change))

    def log(self, values, step):
        pass


def test_the_plan_is_the_first_line_and_in_wandbs_config(tmp_path):
    log = run_logger(tmp_path)
    log.wandb_run = FakeWandbRun()
    log.log_plan({"micro_batch": 4, "peak": float("nan")})
    log.log({"step": 1, "train/loss": 5.0}, console=False)
    assert strict_records(tmp_path / "metrics.jsonl") == [{"plan": {"micro_batch": 4, "peak": None}},
                                                          {"step": 1, "train/loss": 5.0}]
    assert log.wandb_run.config_updates[0][1] is True  # allow_val_change: a resumed run may have a new plan
    assert log.wandb_run.config_updates[0][0]["plan"]["micro_batch"] == 4

    resumed = run_logger(tmp_path, resume_step=1)  # a resume writes its own plan, in the same first line
    resumed.log_plan({"micro_batch": 2})
    assert strict_records(tmp_path / "metrics.jsonl") == [{"plan": {"micro_batch": 2}},
                                                          {"step": 1, "train/loss": 5.0}]


def test_wandb_online_without_a_key_fails_at_start_saying_what_to_do(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = LoggerConfig(mode=LoggerMode.online, project="minitrain-test")
    with pytest.raises(ConfigError, match=r"logger.mode=online: wandb could not start the run \(.*API key.*\)"
                                          r".*wandb login.*logger.mode=offline"):
        RunLogger(cfg, tmp_path, {}, run_id=None, group=None, name=None)
