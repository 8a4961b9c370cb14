"""Imports go only downward: the layer rules of the README's layout section, checked on the AST
of every module of the package (imports inside functions included), and no import cycle among
module-level imports. A violation names the file and the line."""

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


def imports_of(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)``; ``from a import b`` yields ``a.b`` (which
    may be a module or a name in ``a``; the rules below match prefixes, so both work). Imports
    under ``if TYPE_CHECKING:`` count for the layer rules but not for cycles."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_top = top
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_top = False
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                child_top = False
            if isinstance(child, ast.Import):
                out.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = _resolve_relative(name, path.name == "__init__.py", child.level, child.module)
                out.extend((f"{base}.{alias.name}", child.lineno, top) for alias in child.names)
            visit(child, child_top)

    visit(tree, True)
    return out


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
    assert rule_violation("paged.core.cli.lab", "paged.core.lab.replay") is None
    assert rule_violation("paged.models.llama", "paged.core.loading.weights") is None
    assert rule_violation("paged.core.frontend.llm", "paged.core.engine.engine_core") is None


def test_imports_only_go_downward():
    files = package_files()
    assert "paged.core.engine.scheduler" in files and "paged.models.llama" in files
    problems = []
    for name, path in files.items():
        for imported, line, _ in imports_of(name, path):
            why = rule_violation(name, imported)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {imported}: {why}")
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


def test_no_import_cycles_at_module_level():
    files = package_files()
    modules = set(files)
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], int] = {}
    for name, path in files.items():
        graph[name] = set()
        for imported, line, top in imports_of(name, path):
            target = _resolve_to_module(imported, modules)
            # a package's own __init__ is imported by its children anyway: not a cycle edge
            if top and target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
                where.setdefault((name, target), line)
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{files[a].relative_to(ROOT)}:{where[(a, b)]}: imports {b}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle:\n" + "\n".join(steps))
