"""The package's shape: its modules import each other without a cycle (so each can be read, and imported,
after the ones it uses), training never imports the tools (reports, plots, benchmarks), and tests import the
package, never a script."""

from __future__ import annotations

import ast
from pathlib import Path

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
