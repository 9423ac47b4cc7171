"""The package's shape: its modules import each other without a cycle (so each can be read, and imported,
after the ones it uses), training never imports the tools (reports, plots, benchmarks), the loop calls back into no
trainer, no function takes a long list of loose values, the schema and the README keep their length, and tests
import the package, never a script."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, at its top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            target = ".".join(part for part in (base, node.module) if part)
            named = {f"{target}.{alias.name}" for alias in node.names} & modules
            found |= named or {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return (found & modules) - {name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted((REPO / "minitrain").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for used in sorted(graph[node]):
            if state.get(used) == "open":
                return path[path.index(used):] + [used]
            if used not in state and (found := visit(used, path + [used])):
                return found
        state[node] = "done"
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node, [node]))), None)


def test_the_cycle_finder_finds_a_cycle_and_none_in_a_graph_without_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_imports_without_a_cycle():
    graph = import_graph()
    assert "minitrain.data.prepare" in graph["minitrain.data"]  # the graph sees relative and package imports
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_training_imports_no_tools():
    graph = import_graph()
    assert {"minitrain.tools.bench", "minitrain.trainer"} <= graph["minitrain.tools.benchmarks.step"]
    leaks = {(name, used) for name, uses in graph.items() if not name.startswith("minitrain.tools")
             for used in uses if used.startswith("minitrain.tools")}
    assert not leaks


def test_tests_import_no_script():
    scripts = {p.stem for p in (REPO / "scripts").glob("*.py")}
    for path in sorted(set((REPO / "tests").glob("*.py")) - {Path(__file__)}):  # this file names what it looks for
        text = path.read_text()
        assert "spec_from_file_location" not in text, f"{path.name} loads a file as a module"
        for node in ast.walk(ast.parse(text)):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.split(".")[0] in {"scripts", *scripts} for n in names), f"{path.name} imports {names}"


# -- the loop and its composer; how many values a function takes ---------------------------------------------------
MAX_PARAMETERS = 10  # more, and the values belong together in an object (a config group, the plan, a Candidate)
TRAINER_MAX_LINES = 120  # the composer only: each service is a part of its own
# The schema and its checks, each group's own (model_config.py, optimizer_config.py, the command line's cli.py
# apart); the user's guide, the measurements in docs/benchmarks.md.
MAX_LINES = {"minitrain/config.py": 480, "README.md": 300}


def test_the_loop_imports_no_trainer_and_the_trainer_only_composes():
    """loop.fit(parts, services, settings) reads what it is given; it cannot call back into the object that made
    them, which it would have to import."""
    graph = import_graph()
    assert "minitrain.loop" in graph["minitrain.trainer"]  # the graph sees the trainer's import of the loop
    assert "minitrain.trainer" not in graph["minitrain.loop"]
    assert len((REPO / "minitrain" / "trainer.py").read_text().splitlines()) <= TRAINER_MAX_LINES


@pytest.mark.parametrize("path", list(MAX_LINES))
def test_the_schema_and_the_guide_stay_within_their_length(path):
    assert len((REPO / path).read_text().splitlines()) <= MAX_LINES[path]


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The values a caller can pass: positional and keyword-only parameters, *args and **kwargs; a method's
    self or cls is not one."""
    a = function.args
    named = [arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(named) - (named[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def long_signatures(source: str) -> list[str]:
    """The functions of `source` that take more than MAX_PARAMETERS values, Triton kernels aside (a kernel's
    arguments are its pointers, strides and block sizes: what it reads, one by one)."""
    return [node.name for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameters(node) > MAX_PARAMETERS
            and not any(ast.unparse(d).startswith("triton.") for d in node.decorator_list)]


def test_the_signature_check_counts_every_kind_of_parameter():
    ten = ", ".join(f"a{i}" for i in range(10))
    assert long_signatures(f"def f({ten}): pass\nclass C:\n    def m(self, {ten}): pass") == []
    assert long_signatures(f"def f({ten}, b): pass") == ["f"]
    assert long_signatures(f"def f(a0, *, {ten[4:]}, b): pass") == ["f"]
    assert long_signatures(f"def f({ten}, *args): pass\nasync def g({ten}, **kw): pass") == ["f", "g"]
    assert long_signatures(f"class C:\n    def m(self, {ten}, b): pass") == ["m"]
    assert long_signatures(f"@triton.jit\ndef kernel({ten}, b, BLOCK: tl.constexpr): pass") == []


def test_no_function_takes_more_than_ten_values():
    """Outside ops/ (kernels and their launchers, argument for argument) and Triton kernels."""
    long = [f"{path.relative_to(REPO)}: {name}" for path in sorted((REPO / "minitrain").rglob("*.py"))
            if "ops" not in path.relative_to(REPO / "minitrain").parts for name in long_signatures(path.read_text())]
    assert not long, long
