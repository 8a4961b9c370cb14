"""Imports go only downward: the layer rules of the README's layout section, checked on the AST
of every module of the package, and no import cycle. Both count every import: at module level,
under ``if TYPE_CHECKING:`` and inside functions (a type-only or deferred import still ties the
two modules together: neither can be read, moved or tested without the other). A violation names
the file, the line and the kind of import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO_ROOT

ROOT = REPO_ROOT  # the repository root is the ``paged`` package
SKIP_DIRS = {"tests", "benchmarks", ".venv", "build", "paged.egg-info", ".git", "configs"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["paged", *parts])


def package_files() -> dict[str, Path]:
    files = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if rel[0] in SKIP_DIRS or any(p.startswith(".") for p in rel):
            continue
        files[module_name(path)] = path
    return files


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


MODULE_LEVEL, TYPE_ONLY, IN_FUNCTION = "module level", "type-only", "in a function"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_in(name: str, source: str, is_package: bool, filename: str = "<source>") -> list[tuple[str, int, str]]:
    """``(imported module, line, kind)`` for every import in ``source`` (module ``name``), kind
    one of MODULE_LEVEL, TYPE_ONLY (under ``if TYPE_CHECKING:``), IN_FUNCTION; ``from a import b``
    yields ``a.b`` (which may be a module or a name in ``a``; the rules below match prefixes, so
    both work)."""
    out: list[tuple[str, int, str]] = []

    def visit(nodes, kind: str) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend((alias.name, node.lineno, kind) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = _resolve_relative(name, is_package, node.level, node.module)
                out.extend((f"{base}.{alias.name}", node.lineno, kind) for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ast.iter_child_nodes(node), IN_FUNCTION)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, kind if kind == IN_FUNCTION else TYPE_ONLY)
                visit(node.orelse, kind)
            else:
                visit(ast.iter_child_nodes(node), kind)

    visit(ast.parse(source, filename=filename).body, MODULE_LEVEL)
    return out


def imports_of(name: str, path: Path) -> list[tuple[str, int, str]]:
    return imports_in(name, path.read_text(), path.name == "__init__.py", str(path))


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


CORE = "paged.core"
OUTSIDE_CORE = ("paged.models", "paged.backends", "paged.plugins")
ABOVE_ENGINE = tuple(f"paged.core.{p}" for p in ("frontend", "ipc", "server", "lab", "cli"))
LAB = "paged.core.lab"
CLI = "paged.core.cli"


def rule_violation(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported``, or None."""
    if _under(importer, CORE) and _under(imported, *OUTSIDE_CORE):
        return "paged.core never imports paged.models, paged.backends or paged.plugins"
    if importer == "paged.core.policy" and _under(imported, "paged.core.engine"):
        return "the policy contract depends on no engine class (the engine imports the contract)"
    if _under(importer, "paged.core.engine", "paged.core.loading") and _under(imported, *ABOVE_ENGINE):
        return "the engine and the loading machinery never import the layers above them"
    if _under(imported, LAB) and not _under(importer, LAB, CLI):
        return "only the lab itself and the CLI import paged.core.lab"
    if _under(imported, CLI) and not _under(importer, CLI):
        return "the CLI is on top: nothing imports paged.core.cli"
    if (
        _under(importer, CORE)
        and not _under(importer, *ABOVE_ENGINE, "paged.core.engine", "paged.core.loading")
        and _under(imported, *ABOVE_ENGINE)
    ):
        return "core/'s root modules (contracts, config) never import the layers above the engine"
    return None


def test_the_rules_catch_what_they_should():
    assert rule_violation("paged.core.engine.model_runner", "paged.models.llama.attention_shape")
    assert rule_violation("paged.core.loading.loader", "paged.core.frontend.llm.LLM")
    assert rule_violation("paged.core.server.app", "paged.core.lab.trace.TraceRecorder")
    assert rule_violation("paged.core.frontend.llm", "paged.core.cli.main")
    assert rule_violation("paged.core.config", "paged.core.ipc.wire")
    assert rule_violation("paged.core.policy", "paged.core.engine.request.Request")
    assert rule_violation("paged.core.engine.request", "paged.core.policy.RequestView") is None
    assert rule_violation("paged.core.cli.lab", "paged.core.lab.replay") is None
    assert rule_violation("paged.models.llama", "paged.core.loading.weights") is None
    assert rule_violation("paged.core.frontend.llm", "paged.core.engine.engine_core") is None


def test_imports_only_go_downward():
    files = package_files()
    assert "paged.core.engine.scheduler" in files and "paged.models.llama" in files
    problems = []
    for name, path in files.items():
        for imported, line, kind in imports_of(name, path):
            why = rule_violation(name, imported)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {imported} ({kind}): {why}")
    assert not problems, "layer violations:\n" + "\n".join(problems)


def _resolve_to_module(imported: str, modules: set[str]) -> str | None:
    """The package module ``imported`` names (``a.b.name`` -> ``a.b``), or None if outside."""
    while imported:
        if imported in modules:
            return imported
        imported = imported.rpartition(".")[0]
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (iterative DFS)."""
    color: dict[str, int] = {}
    for start in sorted(graph):
        if color.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = 2
                stack.pop()
                path.pop()
            elif color.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not color.get(child):
                color[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def import_graph(
    imports: dict[str, list[tuple[str, int, str]]],
) -> tuple[dict[str, set[str]], dict[tuple[str, str], tuple[int, str]]]:
    """The import graph among the modules of ``imports`` (module -> its ``imports_in``), every
    kind of import counted, and where each edge's first import is: ``(line, kind)``."""
    modules = set(imports)
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], tuple[int, str]] = {}
    for name, found in imports.items():
        graph[name] = set()
        for imported, line, kind in found:
            target = _resolve_to_module(imported, modules)
            # a package's own __init__ is imported by its children anyway: not a cycle edge
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
                where.setdefault((name, target), (line, kind))
    return graph, where


def test_cycles_count_type_only_and_in_function_imports():
    """Two cycles that counting module-level imports alone would miss, and two non-cycles."""
    sources = {
        # a -> b only under TYPE_CHECKING (for an annotation), b -> a at module level
        "paged.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paged.b import B\nA = 1\n",
        "paged.b": "from paged.a import A\nB = 2\n",
        # c -> d inside a function (a deferred import), d -> c at module level
        "paged.c": "def f():\n    import paged.d\n    return paged.d\n",
        "paged.d": "from paged import c\n",
        # the else branch of a TYPE_CHECKING test runs: a module-level import
        "paged.e": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from paged.f import F\n",
        "paged.f": "F = 3\n",
        # a package and its child importing each other: the child's import is no cycle
        "paged.pkg": "from paged.pkg.child import C\n",
        "paged.pkg.child": "import paged.pkg\nC = 4\n",
    }
    imports = {name: imports_in(name, source, name == "paged.pkg") for name, source in sources.items()}
    assert imports["paged.a"] == [("typing.TYPE_CHECKING", 1, MODULE_LEVEL), ("paged.b.B", 3, TYPE_ONLY)]
    assert imports["paged.c"] == [("paged.d", 2, IN_FUNCTION)]
    assert imports["paged.e"] == [("typing", 1, MODULE_LEVEL), ("paged.f.F", 5, MODULE_LEVEL)]
    graph, where = import_graph(imports)
    assert graph == {
        "paged.a": {"paged.b"}, "paged.b": {"paged.a"}, "paged.c": {"paged.d"}, "paged.d": {"paged.c"},
        "paged.e": {"paged.f"}, "paged.f": set(), "paged.pkg": {"paged.pkg.child"}, "paged.pkg.child": set(),
    }
    assert where[("paged.a", "paged.b")] == (3, TYPE_ONLY) and where[("paged.c", "paged.d")] == (2, IN_FUNCTION)
    assert find_cycle({n: graph[n] for n in ("paged.a", "paged.b")}) == ["paged.a", "paged.b", "paged.a"]
    assert find_cycle({n: graph[n] for n in ("paged.c", "paged.d")}) == ["paged.c", "paged.d", "paged.c"]
    assert find_cycle({n: graph[n] for n in ("paged.e", "paged.f", "paged.pkg", "paged.pkg.child")}) is None


def test_no_import_cycles():
    files = package_files()
    graph, where = import_graph({name: imports_of(name, path) for name, path in files.items()})
    reports = []
    # Each cycle found is reported, then cut at its closing edge to look for the next one.
    while (cycle := find_cycle(graph)) is not None:
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            line, kind = where[(a, b)]
            steps.append(f"  {files[a].relative_to(ROOT)}:{line}: imports {b} ({kind})")
        reports.append("\n".join(steps))
        graph[cycle[-2]].discard(cycle[-1])
    if reports:
        pytest.fail("import cycles:\n" + "\n\n".join(reports))
