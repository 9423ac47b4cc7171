"""A `-m` sweep: a process per cell (the default launcher), a GPU per cell side by side, the summary at the end
from what each cell's process recorded, and a Ctrl-C that leaves no cell running."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from minitrain import sweep
from minitrain.sweep import CellDevices, SweepSummary, cell_device, read_outcomes
from minitrain.tools.report import load_sweep

from conftest import REPO, ctrl_c_as_in_a_terminal

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # the cells' steps: a loaded CPU's spinning threads slow them
SMALL = ["trainer.max_steps=2", "trainer.log_every=1", "trainer.batch_size=4", "model.block_size=32",
         "trainer.warmup_steps=1", "trainer.eval_batches=1", "trainer.sample_tokens=0", "logger.mode=disabled"]


def sweep_command(data_cache, sweep_dir, *overrides):
    """`overrides` after the small defaults: the last value of a key wins."""
    return [sys.executable, str(REPO / "scripts" / "train.py"), "-m", *SMALL, f"data.cache_dir={data_cache}",
            *overrides, f"hydra.sweep.dir={sweep_dir}"]


def plan_records(sweep_dir):
    return {int(path.parent.name): json.loads(path.read_text().splitlines()[0])["plan"]
            for path in sweep_dir.glob("*/metrics.jsonl")}


def test_each_cell_runs_in_a_process_of_its_own_and_a_cell_that_cannot_run_is_named(data_cache, tmp_path):
    """Three cells: the first cannot run (a bad value), the other two still run, each in a process of its own;
    the sweep ends with the one that could not, and why, and exits 2."""
    sweep_dir = tmp_path / "sweep"
    out = subprocess.run(sweep_command(data_cache, sweep_dir, "model.n_head=5,4,2"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env=ONE_THREAD)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    overrides = " ".join([*SMALL, f"data.cache_dir={data_cache}", "model.n_head=5"])
    assert (f"sweep {sweep_dir}: 3 cells, 2 ran, 1 could not:\n  0 ({overrides}): model.n_embd: 128 is not "
            f"divisible by model.n_head=5\ncompare them: python scripts/report.py {sweep_dir}") in out.stderr
    plans = plan_records(sweep_dir)
    assert sorted(plans) == [1, 2]
    pids = {plans[1]["pid"], plans[2]["pid"]}
    assert len(pids) == 2 and os.getpid() not in pids  # and not this test's, whose child started the sweep
    assert plans[1]["host"] == socket.gethostname()
    cells, failed = load_sweep(sweep_dir)  # the report names the cell that did not run, and why
    assert [c.name for c in cells] == ["model.n_head=4", "model.n_head=2"]
    assert failed == [("model.n_head=5", "model.n_embd: 128 is not divisible by model.n_head=5")]


def test_the_basic_launcher_runs_the_cells_in_the_sweeps_own_process(data_cache, tmp_path):
    sweep_dir = tmp_path / "sweep"
    out = subprocess.run(sweep_command(data_cache, sweep_dir, "hydra/launcher=basic", "model.n_layer=1,2"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"sweep {sweep_dir}: 2 cells, 2 ran\n" in out.stderr
    plans = plan_records(sweep_dir)
    assert plans[0]["pid"] == plans[1]["pid"]


def start(command, cwd):
    """The sweep as a terminal's job: a process group of its own, with Ctrl-C's default action."""
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ONE_THREAD, start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal)


def wait_until_training(cell_dir, sweep_process, timeout_s=300):
    log, deadline = cell_dir / "train.log", time.monotonic() + timeout_s
    while not (log.exists() and "minitrain: " in log.read_text()):  # the line that starts the loop
        assert time.monotonic() < deadline and sweep_process.poll() is None, "the cell never started training"
        time.sleep(0.5)


def test_ctrl_c_stops_the_sweep_and_leaves_no_cell_running(data_cache, tmp_path):
    """A terminal's Ctrl-C reaches every process of the sweep: the running cell stops (submitit gives it a second
    to save a checkpoint), the cells after it never start, and nothing of the sweep outlives it."""
    sweep_dir = tmp_path / "sweep"
    command = sweep_command(data_cache, sweep_dir, "model.n_layer=1,2", "trainer.max_steps=100000",
                            "trainer.log_every=1000", "trainer.eval_every=100000")
    sweep_process = start(command, tmp_path)
    wait_until_training(sweep_dir / "0", sweep_process)
    processes = [psutil.Process(sweep_process.pid), *psutil.Process(sweep_process.pid).children(recursive=True)]
    assert len(processes) >= 2  # the sweep and its cell's
    os.killpg(sweep_process.pid, signal.SIGINT)
    _, stderr = sweep_process.communicate(timeout=120)
    assert sweep_process.returncode == 130, stderr[-3000:]
    assert stderr.strip().endswith("the cells after them did not run")
    assert "Traceback" not in stderr, stderr[-3000:]  # submitit's controller of the cell leaves Ctrl-C to it
    _, alive = psutil.wait_procs(processes, timeout=5)
    assert not alive
    assert "interrupted (Ctrl-C)" in (sweep_dir / "0" / "train.log").read_text()
    assert not (sweep_dir / "1").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_sweeps_process_alone_stops_its_cells(data_cache, tmp_path, signum):
    """`kill -INT` of the starting process only (no terminal), or `kill` / a scheduler's SIGTERM: it passes the
    interrupt on to its cells before it exits."""
    sweep_dir = tmp_path / "sweep"
    command = sweep_command(data_cache, sweep_dir, "model.n_layer=1", "trainer.max_steps=100000",
                            "trainer.log_every=1000", "trainer.eval_every=100000")
    sweep_process = start(command, tmp_path)
    wait_until_training(sweep_dir / "0", sweep_process)
    processes = psutil.Process(sweep_process.pid).children(recursive=True)
    sweep_process.send_signal(signum)
    _, stderr = sweep_process.communicate(timeout=120)
    assert sweep_process.returncode == 130, stderr[-3000:]
    _, alive = psutil.wait_procs(processes, timeout=5)
    assert not alive
    assert "interrupted (Ctrl-C)" in (sweep_dir / "0" / "train.log").read_text()  # told, not killed unawares


def test_the_cells_controllers_start_with_ctrl_c_ignored_and_the_cells_take_it_back(tmp_path):
    """The default launcher's `setup` runs in the shell that starts a cell's controller (submitit's local executor):
    the controller, and the cell it starts, ignore Ctrl-C, while the sweep's own process keeps its handler. Only in
    a sweep's cell is it taken back (a run started with Ctrl-C ignored, as by nohup, keeps it ignored)."""
    import submitit
    from hydra import compose, initialize_config_dir

    from minitrain.config import CONFIG_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        launcher = compose("config", return_hydra_config=True).hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"

    def ignores_ctrl_c(pid):  # SigIgn: the signals a process ignores, bit n-1 for signal n
        line = next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:"))
        return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)

    def controller_and_cell():
        return ignores_ctrl_c(os.getppid()), ignores_ctrl_c(os.getpid())

    # Python's own handler, as under a terminal: a suite started in the background (`make test &`) inherits
    # Ctrl-C ignored, which the checks below would take for the setup's doing
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
        executor.update_parameters(timeout_min=1, local_setup=list(launcher.setup))  # as the launcher passes it on
        assert executor.submit(controller_and_cell).result() == (True, True)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        for mode, expected in ((RunMode.RUN, signal.SIG_IGN), (RunMode.MULTIRUN, signal.default_int_handler)):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sweep.CtrlCToCells().on_job_start(cell_config(0, 1, mode))
            assert signal.getsignal(signal.SIGINT) is expected
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_the_plan_record_says_where_the_cell_ran(monkeypatch):
    """host, pid and the devices CUDA lets the process see: what tells a sweep's cells apart in their records."""
    from minitrain import plan as plan_module
    from minitrain.config import resolve
    from minitrain.cli import compose_config
    from minitrain.plan import make_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    config = resolve(compose_config(["trainer.out_dir=."]))
    record = make_plan(config, 4096, torch.device("cpu")).as_dict()
    assert (record["host"], record["pid"], record["cuda_visible_devices"], record["device_index"]) == \
        (socket.gethostname(), os.getpid(), "3,5", None)
    json.dumps(record)
    monkeypatch.setattr(plan_module, "device_memory", lambda device: 80 * 2**30)  # a GPU, of which only the type
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")  # and index are read
    assert make_plan(config, 4096, torch.device("cuda")).as_dict()["device_index"] == 0  # torch's current device
    assert make_plan(config, 4096, torch.device("cuda", 1)).as_dict()["device_index"] == 1  # a torchrun rank's


def cell_config(num, at_a_time, mode=RunMode.MULTIRUN):
    return OmegaConf.create({"hydra": {"mode": mode, "job": {"num": num}, "sweeper": {"max_batch_size": at_a_time},
                                       "sweep": {"dir": "unused"}}})


@pytest.mark.parametrize("devices, at_a_time, expected", [
    (["0", "1", "2", "3"], 4, ["0", "1", "2", "3", "0", "1", "2", "3", "0", "1"]),  # side by side, one GPU each
    (["0", "1", "2", "3"], 2, ["0", "1", "0", "1", "0", "1", "0", "1", "0", "1"]),  # two at a time use two GPUs
    (["5", "7"], None, ["5", "7"] * 5),  # all at once: round robin over the GPUs the sweep started with
    (["0"], 3, ["0"] * 10),  # three at a time on one GPU (each process's allocator counts its own peak)
    (["2"], 1, ["2"] * 10),  # one at a time: the GPU the sweep started with, not GPU 0
])
def test_cells_run_at_a_time_take_distinct_gpus_while_there_are_enough(devices, at_a_time, expected):
    assert [cell_device(devices, n, at_a_time) for n in range(10)] == expected


def test_a_cell_in_a_process_of_its_own_on_the_sweeps_host_is_given_its_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    for name in (sweep.DEVICES_ENV, sweep.STARTER_ENV):  # what the hooks set is undone after the test
        monkeypatch.setenv(name, "")
    CellDevices().on_multirun_start(cell_config(0, 2))
    assert os.environ[sweep.DEVICES_ENV] == "4,6"
    monkeypatch.setenv(sweep.STARTER_ENV, f"{socket.gethostname()}:{os.getpid() + 1}")  # another process started it
    CellDevices().on_job_start(cell_config(3, 2))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setenv(sweep.STARTER_ENV, f"{socket.gethostname()}:{os.getpid()}")  # the basic launcher: this process
    CellDevices().on_job_start(cell_config(3, 2))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    monkeypatch.setenv(sweep.STARTER_ENV, f"login-node:{os.getpid() + 1}")  # a cluster's node: its scheduler decides
    CellDevices().on_job_start(cell_config(3, 2))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    monkeypatch.setenv(sweep.STARTER_ENV, f"{socket.gethostname()}:{os.getpid() + 1}")
    CellDevices().on_job_start(OmegaConf.create({"hydra": {"mode": RunMode.RUN}}))  # a single run, in a cell's env
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_the_summary_reads_what_each_cells_process_recorded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # this process's own handlers stay
    config = cell_config(0, 1)
    config.hydra.sweep.dir = str(tmp_path)
    (tmp_path / sweep.OUTCOMES).write_text('{"num": 7, "overrides": "old sweep", "failure": null}\n')
    summary = SweepSummary()
    summary.on_multirun_start(config)  # the same sweep dir again: the earlier sweep's cells are not counted
    for num, status, value in [(2, JobStatus.COMPLETED, "it does not fit"), (0, JobStatus.COMPLETED, None),
                               (1, JobStatus.COMPLETED, None)]:
        config.hydra.job.num = num
        summary.on_job_end(config, JobReturn(overrides=[f"model.n_layer={num}"], status=status, _return_value=value))
    assert read_outcomes(tmp_path / sweep.OUTCOMES) == [(0, "model.n_layer=0", None), (1, "model.n_layer=1", None),
                                                        (2, "model.n_layer=2", "it does not fit")]
    with pytest.raises(SystemExit) as exit_:
        summary.on_multirun_end(config)
    assert exit_.value.code == sweep.FAILED_CELL_EXIT_CODE
    assert capsys.readouterr().err == (f"sweep {tmp_path}: 3 cells, 2 ran, 1 could not:\n"
                                       f"  2 (model.n_layer=2): it does not fit\n"
                                       f"compare them: python scripts/report.py {tmp_path}\n")
    config.hydra.mode = RunMode.RUN  # a single run records nothing (its sweep dir is Hydra's default, unmade)
    summary.on_job_end(config, JobReturn(overrides=["x=1"], status=JobStatus.COMPLETED))
    assert len(read_outcomes(tmp_path / sweep.OUTCOMES)) == 3


def test_a_sweep_cell_that_diverged_is_in_the_report_with_its_reason(data_cache, tmp_path):
    """It ran, so its logged steps are a row of the table; why it stopped is listed under it. Run again into the
    same sweep dir, a cell that then finishes is no longer listed."""
    from minitrain.tools.report import write_report

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "-m", "trainer.lr=1e4,1e-3", "trainer.max_steps=10",
           "trainer.log_every=5", "trainer.save_every=100", "trainer.batch_size=4", "model.block_size=32",
           "trainer.eval_batches=1", "trainer.sample_tokens=0", f"data.cache_dir={data_cache}", "logger.mode=disabled",
           f"hydra.sweep.dir={sweep}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=ONE_THREAD)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    cells, failed = load_sweep(sweep)
    assert [c.name for c in cells] == ["trainer.lr=10000.0", "trainer.lr=0.001"]
    assert [name for name, _ in failed] == ["trainer.lr=10000.0"]
    assert "by step 5 (precision=fp32); stopping, with no checkpoint saved" in failed[0][1]
    assert f"Did not finish:\n- trainer.lr=10000.0: {failed[0][1]}\n" in write_report(sweep)["report"].read_text()
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- trainer.lr=1e-3\n")  # the cell, fixed, run again
    (sweep / "0" / "metrics.jsonl").unlink()
    subprocess.run([*cmd[:2], "trainer.lr=1e-3", *cmd[4:-1], f"hydra.run.dir={sweep / '0'}"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=600, env=ONE_THREAD)
    assert not (sweep / "0" / "error.txt").exists()
