"""`make mutants`: plausible one-line bugs, each injected into a copy of the repo, must fail the tests that guard
against them. `python scripts/mutants.py [--only ID ...] [--list] [--file LIST.toml]`

A suite can pass while the code is wrong: a tolerance wide enough to hide a bug, a piece of checkpoint state
that no test loses, a formula no case is sensitive to. scripts/mutants.toml lists such bugs, each with the
small test selection that must catch it. For each, the working tree's files (tracked, and untracked ones git
does not ignore) are copied to a temporary directory, the bug is applied there (its snippet must occur exactly
once, so the list cannot silently drift from the code), and the selection runs with `minitrain` imported from
the copy. Before any mutant, a control run of every selection on the unmutated copy must pass: a mutant only
counts as caught by tests that pass without it. Exits 1 if a mutant survived or could not be judged, 2 if
the list does not match the code or the control run fails.

The stdlib token cache (built once per pytest session by tests/conftest.py's `data_cache`) takes longer to
build than most selections take to run, so the control run's cache is handed to every later run, which still
checks it against its meta.json at start. A mutant in the cache's build path must therefore select tests that
build their own corpus (tests/test_data.py's small ones do).

Loaded with `-p mutants`, this module is also the pytest plugin of those runs (the fixture and hooks below).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTANTS_FILE = REPO / "scripts" / "mutants.toml"
PYTEST_ARGS = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "mutants"]
DEFAULT_TIMEOUT_S = 300
CONTROL_TIMEOUT_S = 1800
TAIL_LINES = 30

# The runner tells its pytest runs (through the plugin below) where the copy is and where the shared cache lives.
ENV_COPY = "MINITRAIN_MUTANTS_COPY"  # the copy's root: minitrain must be imported from under it
ENV_CACHE = "MINITRAIN_MUTANTS_DATA_CACHE"  # the token caches handed from the control run to the mutant runs
ENV_EXPORT = "MINITRAIN_MUTANTS_EXPORT_CACHE"  # set in the control run only: it fills ENV_CACHE

CAUGHT, SURVIVED, ERROR = "caught", "SURVIVED", "ERROR"


class MutantListError(Exception):
    """scripts/mutants.toml is malformed, or a snippet no longer matches the code."""


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    files: tuple[str, ...]  # test files of the selection
    keyword: str | None  # its -k expression, if any
    description: str
    timeout_s: int

    @property
    def selection(self) -> list[str]:
        return [*self.files, *(["-k", self.keyword] if self.keyword else [])]


def parse_selection(text: str, where: str) -> tuple[tuple[str, ...], str | None]:
    """`tests/a.py tests/b.py -k EXPR`: test files and one optional -k, the form the control run can merge."""
    words, files, keyword = shlex.split(text), [], None
    while words:
        word = words.pop(0)
        if word == "-k":
            if not words or keyword is not None:
                raise MutantListError(f"{where}: `tests` takes test files and one `-k EXPR`, got {text!r}")
            keyword = words.pop(0)
        elif word.startswith("-") or "::" in word or not word.endswith(".py"):
            raise MutantListError(f"{where}: `tests` takes test files and one `-k EXPR` (no node ids or other "
                                  f"options, so the control run can merge the selections), got {word!r}")
        elif not (REPO / word).is_file():
            raise MutantListError(f"{where}: no test file {word}")
        else:
            files.append(word)
    if not files:
        raise MutantListError(f"{where}: `tests` names no test file")
    return tuple(files), keyword


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    required = {"id", "file", "original", "replacement", "tests", "description"}
    mutants, seen = [], set()
    for n, entry in enumerate(entries, 1):
        where = f"{path.name} mutant {entry.get('id', f'#{n}')}"
        missing, unknown = required - entry.keys(), entry.keys() - required - {"timeout_s"}
        if missing or unknown:
            raise MutantListError(f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}")
        if entry["id"] in seen:
            raise MutantListError(f"{where}: the id is used twice")
        seen.add(entry["id"])
        if entry["original"] == entry["replacement"]:
            raise MutantListError(f"{where}: the replacement is the original")
        files, keyword = parse_selection(entry["tests"], where)
        mutants.append(Mutant(entry["id"], entry["file"], entry["original"], entry["replacement"], files, keyword,
                              entry["description"], int(entry.get("timeout_s", DEFAULT_TIMEOUT_S))))
    return mutants


def mutated_text(mutant: Mutant, root: Path) -> str:
    """The mutant's file under `root` with the bug in; the original snippet must occur exactly once."""
    path = root / mutant.file
    if not path.is_file():
        raise MutantListError(f"mutant {mutant.id}: no file {mutant.file}")
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise MutantListError(f"mutant {mutant.id}: its original snippet occurs {count} times in {mutant.file} "
                              f"(must be exactly once): update scripts/mutants.toml to the current code\n"
                              f"  snippet: {mutant.original!r}")
    return text.replace(mutant.original, mutant.replacement)


def working_tree_files(repo: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore: the code as it is now, without build outputs."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         check=True, capture_output=True).stdout
    return sorted({name for name in out.decode().split("\0") if name and (repo / name).is_file()})


def copy_tree(repo: Path, files: list[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, target)


@dataclass
class Outcome:
    result: str
    seconds: float
    detail: str  # the first failing test, or why the run could not be judged
    output: str


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].split(" ", 1)[1]
    return ""


def summary_line(output: str) -> str:
    """pytest's last line, e.g. `95 passed, 210 deselected in 46.01s`."""
    lines = output.strip().splitlines()
    return lines[-1].strip("= ") if lines else ""


def run_pytest(copy: Path, selection: list[str], timeout_s: int, env: dict[str, str]) -> Outcome:
    """pytest exit 1 (a test failed) is a catch, 0 a survivor; anything else (a collection error, no test
    selected, a timeout) leaves the mutant unjudged."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, *PYTEST_ARGS, *selection], cwd=copy, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: its test subprocesses too
        output, _ = proc.communicate()
        return Outcome(ERROR, time.monotonic() - start, f"timed out after {timeout_s} s", output)
    except BaseException:  # Ctrl-C: the run is in its own session, out of the terminal's reach
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return Outcome(SURVIVED, seconds, "", output)
    if proc.returncode == 1:
        return Outcome(CAUGHT, seconds, first_failure(output), output)
    return Outcome(ERROR, seconds, f"pytest exit {proc.returncode}", output)


def run_env(copy: Path, cache: Path, export_cache: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_EXPORT}
    # The copy first (and its scripts/, for `-p mutants`): ahead of the editable install of the working tree.
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "scripts"), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV_COPY], env[ENV_CACHE] = str(copy), str(cache)
    if export_cache:
        env[ENV_EXPORT] = "1"
    return env


def control_selection(mutants: list[Mutant]) -> list[str]:
    """Every mutant's selection in one run: the union of their files, and a -k that keeps, per mutant, the
    tests of its files (a test's keywords hold its module's file name) that its own -k keeps."""
    files = sorted({f for m in mutants for f in m.files})
    terms = []
    for m in mutants:
        in_files = " or ".join(Path(f).name for f in m.files)
        terms.append(f"(({in_files}) and ({m.keyword}))" if m.keyword else f"({in_files})")
    return [*files, "-k", " or ".join(dict.fromkeys(terms))]


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def tail(output: str) -> str:
    return "\n".join("    " + line for line in output.splitlines()[-TAIL_LINES:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their selections, run nothing")
    ap.add_argument("--file", type=Path, default=MUTANTS_FILE,
                    help="another list in the same form (a road's candidate bugs, before they join the main list)")
    args = ap.parse_args()
    try:
        mutants = load_mutants(args.file)
        if args.only:
            unknown = set(args.only) - {m.id for m in mutants}
            if unknown:
                raise MutantListError(f"--only: no mutant {', '.join(sorted(unknown))} in {args.file.name}")
            mutants = [m for m in mutants if m.id in args.only]
        for m in mutants:  # every snippet checked before anything runs
            mutated_text(m, REPO)
    except MutantListError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        print_table([(m.id, m.file, shlex.join(m.selection), m.description) for m in mutants],
                    ("id", "file", "tests", "description"))
        return 0

    files = working_tree_files(REPO)
    with tempfile.TemporaryDirectory(prefix="minitrain-mutants-") as tmp:
        cache = Path(tmp) / "data-cache"
        cache.mkdir()
        control = Path(tmp) / "control"
        copy_tree(REPO, files, control)
        print(f"control: every selection on the unmutated code ({len(mutants)} mutants)", flush=True)
        outcome = run_pytest(control, control_selection(mutants), CONTROL_TIMEOUT_S, run_env(control, cache, True))
        shutil.rmtree(control)
        if outcome.result != SURVIVED:  # the control must pass
            print(f"error: the control run failed ({outcome.detail or outcome.result}); a selection fails without "
                  f"any mutant, so it cannot judge one:\n{tail(outcome.output)}", file=sys.stderr)
            return 2
        print(f"control passed: {summary_line(outcome.output)}", flush=True)

        rows, failed = [], []
        for m in mutants:
            copy = Path(tmp) / m.id
            copy_tree(REPO, files, copy)
            try:
                (copy / m.file).write_text(mutated_text(m, copy))
            except MutantListError as e:  # the code changed while the list ran
                outcome = Outcome(ERROR, 0.0, str(e).splitlines()[0], "")
            else:
                outcome = run_pytest(copy, m.selection, m.timeout_s, run_env(copy, cache, False))
            shutil.rmtree(copy)
            rows.append((m.id, m.file, m.description, outcome.result, f"{outcome.seconds:.0f}", outcome.detail))
            print(f"{outcome.result:8} {m.id} ({outcome.seconds:.0f} s) {outcome.detail}", flush=True)
            if outcome.result != CAUGHT:
                failed.append((m, outcome))
    print()
    print_table(rows, ("id", "file", "description", "result", "s", "caught by / why"))
    for m, outcome in failed:
        print(f"\n{m.id}: {outcome.result} ({shlex.join(m.selection)}):\n{tail(outcome.output)}", file=sys.stderr)
    survived = sum(o.result == SURVIVED for _, o in failed)
    print(f"\n{len(rows) - len(failed)} caught, {survived} survived, {len(failed) - survived} could not be judged")
    return 1 if failed else 0


# -- the pytest plugin of the runs above (`-p mutants`) -------------------------------------------------------
def pytest_sessionstart(session) -> None:
    """Refuse to judge a run that imports minitrain from anywhere but the copy (e.g. the editable install)."""
    copy = os.environ.get(ENV_COPY)
    if copy is None:
        return
    import minitrain
    import pytest

    where = Path(minitrain.__file__).resolve()
    if not where.is_relative_to(Path(copy).resolve()):
        raise pytest.UsageError(f"minitrain was imported from {where}, not from the mutated copy {copy}")


def _share_data_cache(request):
    """Session-wide: the control run's token caches copied into this run's `data_cache` before its first test;
    the control run copies its own out after its last."""
    if ENV_CACHE not in os.environ:
        yield
        return
    shared = Path(os.environ[ENV_CACHE])
    cache = Path(request.getfixturevalue("data_cache"))
    for built in shared.iterdir():
        shutil.copytree(built, cache / built.name, dirs_exist_ok=True)
    yield
    if os.environ.get(ENV_EXPORT):
        for built in cache.iterdir():
            if built.is_dir() and not built.name.endswith((".tmp", ".old")):  # whole caches only
                shutil.copytree(built, shared / built.name, dirs_exist_ok=True)


if __name__ == "__main__":
    sys.exit(main())
else:  # imported by pytest as the plugin
    import pytest

    shared_data_cache = pytest.fixture(scope="session", autouse=True)(_share_data_cache)
