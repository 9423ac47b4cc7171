"""Runs `scripts/train.py` in forked children of one process that has imported torch and minitrain once.

A fault-injection test starts and kills many training processes; paying the imports at each start would
make it several times slower. Each child is still a process of its own (its own pid, run-dir lock and
file descriptors), so a SIGKILL hits it exactly as it hits `python scripts/train.py`.

Protocol, one line each way: the test writes `{"args": [...], "log": path}` as JSON; this process forks
a child that runs the script with those arguments (stdout and stderr to `log`), answers `pid <pid>`,
then `exit <code>` once the child is gone (a negative code: killed by that signal).
"""

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import minitrain.trainer  # noqa: F401  (torch, hydra and minitrain: what each start would import again)

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "train.py")


def run_child(args: list[str], log: str) -> None:
    """In the forked child: the script as `python scripts/train.py ARGS` would run it; never returns."""
    code = 1
    try:
        null, out = os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.argv = [SCRIPT, *args]
        runpy.run_path(SCRIPT, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request["args"], request["log"])
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
