"""Train a GPT: `python scripts/train.py [group=option ...] [key=value ...]` (Hydra; -m for sweeps)."""

import os
import signal
import sys
from pathlib import Path

ABORTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended
ABORTED_STARTING = "minitrain: aborted (Ctrl-C) while starting, before the run began"
MAIN_PID = os.getpid()


def ctrl_c(signum, frame):
    """SIGINT until fit's own handler is on: KeyboardInterrupt, reported in one line. A terminal's Ctrl-C also
    reaches any child a library forks (a fork-started worker pool), which inherits this handler: there it passes,
    and this process's teardown of the pool ends it. Each would otherwise print a traceback of its own, and a
    pool whose workers die of it can hang in its teardown (the replacements it forks hold its queue's lock)."""
    if os.getpid() == MAIN_PID:
        raise KeyboardInterrupt


signal.signal(signal.SIGINT, ctrl_c)

try:  # the command line's check first, in the time it takes to read the schema: a typo is refused before torch loads
    from minitrain.cli import command_line
    from minitrain.errors import ConfigError
    from minitrain.sweep import FAILED_CELL_EXIT_CODE
except KeyboardInterrupt:
    print(ABORTED_STARTING, file=sys.stderr)
    sys.exit(ABORTED_EXIT_CODE)

if __name__ == "__main__":
    try:  # before Hydra reads the command line: its message for an unknown key advises a `+` the schema refuses too
        sys.argv[1:] = command_line(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(FAILED_CELL_EXIT_CODE)
    except KeyboardInterrupt:
        print(ABORTED_STARTING, file=sys.stderr)
        sys.exit(ABORTED_EXIT_CODE)

try:  # the imports take seconds (torch): a Ctrl-C in them ends in one line, not a traceback
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    from minitrain.checkpoint import holds_checkpoint
    from minitrain.compile_check import CompileMismatchError
    from minitrain.config import register_configs
    from minitrain.data import DataError
    from minitrain.rundir import RunDirBusyError, RunDirError, RunInfo, remove_if_empty
    from minitrain.sweep import stop_cells
    from minitrain.divergence import NonFiniteLossError
    from minitrain.interrupts import TrainingInterrupted
    from minitrain.trainer import train

    register_configs()
except KeyboardInterrupt:
    print(ABORTED_STARTING, file=sys.stderr)
    sys.exit(ABORTED_EXIT_CODE)


def aborted(cfg: DictConfig, hydra_dir: str) -> str:
    """The line a Ctrl-C that saves nothing ends with: whether the run dir keeps checkpoints saved before, said only
    where it holds some (a Ctrl-C before the first step usually finds none, or no run dir at all)."""
    try:
        out_dir = Path(cfg.trainer.out_dir).expanduser()
    except OmegaConfBaseException:  # trainer.out_dir does not resolve: the run used Hydra's dir, if any
        out_dir = Path(hydra_dir)
    kept = f"; the checkpoints saved before in {out_dir} are kept" if holds_checkpoint(out_dir) else ""
    return f"minitrain: aborted (Ctrl-C) without saving a checkpoint{kept}"


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> str | None:
    """None, or in a -m sweep the message of a cell that could not run (minitrain/sweep.py reports it)."""
    run, runtime = RunInfo.from_hydra(), HydraConfig.get().runtime
    try:
        train(cfg, run)
    except TrainingInterrupted as e:
        if e.main:
            print(f"minitrain: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (ConfigError, DataError, RunDirError, NonFiniteLossError, CompileMismatchError) as e:
        # A user-facing problem: one clear line, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        if run.group is not None:
            if not isinstance(e, RunDirBusyError):  # a busy dir is another run's: its record stays as it is
                run.write_failure(Path(runtime.output_dir), str(e))
            return str(e)  # the next cells still run; the sweep's end names this one and exits non-zero
        sys.exit(FAILED_CELL_EXIT_CODE)
    except KeyboardInterrupt:  # Ctrl-C before fit's own handler is on (data, tokenizer, compile), or a second one
        print(aborted(cfg, runtime.output_dir), file=sys.stderr)
        sys.exit(ABORTED_EXIT_CODE)
    finally:  # Hydra made its run dir before any code of ours ran: a refused run, or one whose trainer.out_dir is
        # elsewhere (command_line cannot point Hydra at an interpolated one), leaves it empty, and then no trace
        if run.group is None:
            remove_if_empty(Path(runtime.output_dir), below=Path(runtime.cwd) / "runs")
    return None


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # in Hydra's composing, before main's own handler; or in the process that started a
        # -m sweep of cells in processes of their own
        if any(a in ("-m", "--multirun") for a in sys.argv[1:]):
            stop_cells()
            print("minitrain: sweep interrupted (Ctrl-C): its running cells stopped (submitit gives each a second to "
                  "save a checkpoint; one that cannot keeps its last periodic one); the cells after them did not run",
                  file=sys.stderr)
        else:
            print(ABORTED_STARTING, file=sys.stderr)
        sys.exit(ABORTED_EXIT_CODE)
